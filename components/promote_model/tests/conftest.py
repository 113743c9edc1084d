from pathlib import Path

import pytest

from resilient_training.gates.convergence import ConvergenceConfig, check_convergence, write_convergence_record
from resilient_training.gates.validate import validate, write_validation_record
from resilient_training.run.config import ModelConfig
from tests.support.gates import ScriptedLog, build_once, build_trainer_runs, copy_run, write_checkpoint


def _gated(path: Path, *, run_id: str = "test-run", cfg: ModelConfig | None = None, step: int = 4) -> None:
    write_checkpoint(path, step=step, run_id=run_id, **({"cfg": cfg} if cfg else {}))
    log = ScriptedLog(path)
    log.steps(1, 30, checkpoint_every=4)
    log.end()
    log.close()
    write_validation_record(path, validate(path))
    # The gate judges the losses up to the checkpoint's step: a loose final-loss threshold lets an
    # early checkpoint of this scripted curve pass (improvement is still required).
    write_convergence_record(path, check_convergence(path, ConvergenceConfig(max_final_loss=10.0)))


@pytest.fixture(scope="session")
def gated_run_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose latest checkpoint (step 4) passed validation and the convergence gate."""
    return build_once(tmp_path_factory.getbasetemp(), "gated-run", _gated)


@pytest.fixture
def gated_run(gated_run_shared: Path, tmp_path: Path) -> Path:
    return copy_run(gated_run_shared, tmp_path / "run")


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real `resilient-training train` runs (gates_testing.build_trainer_runs), built once per session; read-only."""
    return build_once(tmp_path_factory.getbasetemp(), "trainer-runs", build_trainer_runs)


@pytest.fixture(scope="session")
def other_gated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another gated run whose checkpoint differs from gated_run's (another run id in its manifest); read-only."""
    return build_once(tmp_path_factory.getbasetemp(), "other-gated-run", lambda p: _gated(p, run_id="other-run"))


@pytest.fixture(scope="session")
def big_gated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gated run with ~70 MB shards: copying it takes long enough to be caught midway; read-only."""
    big = ModelConfig(vocab_size=8192, d_model=512, n_layers=1, n_heads=8, seq_len=16)
    return build_once(tmp_path_factory.getbasetemp(), "big-gated-run", lambda p: _gated(p, cfg=big, step=4))
