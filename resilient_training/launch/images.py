"""Container images the pipelines run (built from images/; override at compile time by env)."""

from __future__ import annotations

import os

from resilient_training import __version__

# Lightweight KFP components run in this image: Python, kfp, kubernetes, boto3, this package.
COMPONENTS_IMAGE = os.environ.get(
    "RT_COMPONENTS_IMAGE", f"ghcr.io/resilient-training/components:{__version__}"
)
# Training workers (PyTorchJob pods) run in this image: CUDA PyTorch, NVRx 0.7.0, this package.
TRAINER_IMAGE = os.environ.get("RT_TRAINER_IMAGE", f"ghcr.io/resilient-training/trainer:{__version__}")
