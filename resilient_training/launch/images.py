"""Container images the pipelines run (built from images/; override at compile time by env)."""

from __future__ import annotations

import os

from resilient_training import __version__

COMPONENTS_ENV = "RT_COMPONENTS_IMAGE"
TRAINER_ENV = "RT_TRAINER_IMAGE"
# As read at import: the components are decorated with the image then, so later changes to the
# environment would not reach what is compiled.
_FROM_ENV = {name: os.environ[name] for name in (COMPONENTS_ENV, TRAINER_ENV) if name in os.environ}

# Lightweight KFP components run in this image: Python, kfp, kubernetes, boto3, this package.
RELEASE_COMPONENTS_REPOSITORY = "ghcr.io/resilient-training/components"
COMPONENTS_IMAGE = _FROM_ENV.get(COMPONENTS_ENV, f"{RELEASE_COMPONENTS_REPOSITORY}:{__version__}")
# Training workers (PyTorchJob pods) run in this image: CUDA PyTorch, NVRx 0.7.0, this package.
TRAINER_IMAGE = _FROM_ENV.get(TRAINER_ENV, f"ghcr.io/resilient-training/trainer:{__version__}")
# The pipelines' trainer_image default: $RT_TRAINER_IMAGE compiled in when set, else "" (launch_training
# then uses TRAINER_IMAGE where it runs, where nothing sets the variable). Unset, the IR stays byte-identical.
COMPILED_TRAINER_IMAGE = _FROM_ENV.get(TRAINER_ENV, "")


def from_environment() -> dict[str, str]:
    """The image variables that were set at import (an empty one too), by name: what a compile bakes in."""
    return dict(_FROM_ENV)


def repository(image: str) -> str:
    """``image`` without its digest and tag (a registry's ``:PORT`` stays)."""
    name = image.split("@", 1)[0]
    return name.rsplit(":", 1)[0] if ":" in name.rpartition("/")[2] else name


def components_image_is_the_users() -> bool:
    """$RT_COMPONENTS_IMAGE named an image of the user's (which may hold torch and NVRx), not a tag
    or digest of the release's components image (which does not).
    """
    image = _FROM_ENV.get(COMPONENTS_ENV, "")
    return bool(image) and repository(image) != RELEASE_COMPONENTS_REPOSITORY
