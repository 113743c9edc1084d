"""The model's parameter count formula, used to size the build without building it."""

from __future__ import annotations

import pytest

from resilient_training.run.config import ModelConfig
from resilient_training.runtime.model import GPT, parameter_count


@pytest.mark.parametrize(
    "cfg",
    [ModelConfig(), ModelConfig(vocab_size=1000, d_model=96, n_layers=3, n_heads=6, seq_len=17)],
)
def test_parameter_count_matches_the_built_model(cfg: ModelConfig) -> None:
    assert parameter_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())
