"""Fixtures shared by every test folder (tests/, components/*/tests/, pipelines/tests/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED_DIR = Path(__file__).resolve().parent.parent / "shared"

# `alone` tests with pytest-xdist workers
pytest_plugins = ["tests.support.alone"]


@pytest.fixture
def kfp_local(tmp_path: Path) -> Iterator[Path]:
    """Run components/pipelines for real with kfp.local's SubprocessRunner in this Python.

    Yields the pipeline root where outputs land; restores kfp.local's global config after.
    """
    from kfp import local
    from kfp.local import config as local_config

    root = tmp_path / "kfp_local_outputs"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    try:
        yield root
    finally:
        local_config.LocalExecutionConfig.instance = None


@pytest.fixture
def shared_schemas() -> Path:
    """../shared/schemas (Training Operator CRDs); skips when absent, as in a user's clone."""
    path = SHARED_DIR / "schemas"
    if not path.is_dir():
        pytest.skip("../shared/schemas is absent (a user's clone has no ../shared)")
    return path
