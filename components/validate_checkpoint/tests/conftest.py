from pathlib import Path

import pytest

from tests.support.gates import build_once, build_trainer_runs, copy_run, write_checkpoint


def _two_checkpoints(path: Path) -> None:
    write_checkpoint(path, step=2)
    write_checkpoint(path, step=4)


@pytest.fixture(scope="session")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir with committed step_2 and step_4 (real trained GPT + AdamW, 2 ranks); read-only."""
    return build_once(tmp_path_factory.getbasetemp(), "synthetic-run", _two_checkpoints)


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real `resilient-training train` runs (gates_testing.TRAINER_RUNS), built once per session; read-only."""
    return build_once(tmp_path_factory.getbasetemp(), "trainer-runs", build_trainer_runs)


@pytest.fixture
def run_copy(synthetic_run: Path, tmp_path: Path) -> Path:
    return copy_run(synthetic_run, tmp_path / "run")
