"""The check_convergence component through the KFP local runner."""

import json
from pathlib import Path

from resilient_training.components.check_convergence import check_convergence
from resilient_training.run import gate_records
from tests.support.gates import copy_run


def test_component_passes_a_clean_faulted_run(kfp_local: Path, trainer_runs: Path, tmp_path: Path) -> None:
    run = copy_run(trainer_runs / "faulted", tmp_path / "run")
    task = check_convergence(run_dir=str(run))
    assert task.outputs["Output"] is True
    metrics = task.outputs["metrics"].metadata
    assert 3.5 < metrics["final_mean"] < 4.4 and metrics["passed"] == 1.0
    assert metrics["restores_checked"] == 2.0 and metrics["restores_failed"] == 0.0
    summary = Path(task.outputs["summary"].path).read_text()
    assert "| continuity | passed |" in summary
    verdict = json.loads(Path(task.outputs["verdict"].path).read_text())
    assert verdict["passed"] and len(verdict["recoveries"]) == 2
    record = gate_records.read_record(run, gate_records.CONVERGENCE)
    assert record["passed"] and record["step"] == 30


def test_component_fails_a_tampered_restore(kfp_local: Path, trainer_runs: Path, tmp_path: Path) -> None:
    run = copy_run(trainer_runs / "tampered-restore", tmp_path / "run")
    task = check_convergence(run_dir=str(run), max_final_loss=10.0, min_improvement=0.0)
    assert task.outputs["Output"] is False
    assert "| continuity | **FAILED** |" in Path(task.outputs["summary"].path).read_text()
    assert gate_records.read_record(run, gate_records.CONVERGENCE)["passed"] is False
