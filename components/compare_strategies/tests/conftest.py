from pathlib import Path

import pytest

from tests.support.gates import build_once, build_trainer_runs


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real `resilient-training train` runs (gates_testing.build_trainer_runs), built once per session; read-only."""
    return build_once(tmp_path_factory.getbasetemp(), "trainer-runs", build_trainer_runs)
