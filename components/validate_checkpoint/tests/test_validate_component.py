"""The validate_checkpoint component through the KFP local runner."""

import json
from pathlib import Path

from resilient_training.components.validate_checkpoint import validate_checkpoint
from resilient_training.run import gate_records
from tests.support.gates import copy_run


def test_component_validates_and_records(kfp_local: Path, trainer_runs: Path, tmp_path: Path) -> None:
    run = copy_run(trainer_runs / "killed-mid-save", tmp_path / "run")
    (run / "checkpoints" / ".tmp-step_10-0badcafei0").mkdir()  # a killed save's leftover: ignored, named
    task = validate_checkpoint(run_dir=str(run))
    assert task.outputs["Output"] is True
    metrics = task.outputs["metrics"].metadata
    assert metrics["valid"] == 1.0 and metrics["findings"] == 0.0 and metrics["bytes"] > 1e6 and metrics["step"] == 30
    summary = Path(task.outputs["summary"].path).read_text()
    assert "VALID checkpoints/step_30" in summary and "ignored checkpoints/.tmp-step_10-" in summary
    report = json.loads(Path(task.outputs["findings"].path).read_text())
    assert report["valid"] is True and report["checkpoints"][0]["step"] == 30
    assert gate_records.read_record(run, gate_records.VALIDATION)["passed"] is True


def test_component_reports_invalid_without_failing_the_task(kfp_local: Path, synthetic_run: Path,
                                                            tmp_path: Path) -> None:
    run = copy_run(synthetic_run, tmp_path / "run")
    (run / "checkpoints/step_4/__1_0.distcp").unlink()
    task = validate_checkpoint(run_dir=str(run))
    assert task.outputs["Output"] is False
    assert task.outputs["metrics"].metadata["findings"] == 1.0
    assert "shard_missing: checkpoints/step_4/__1_0.distcp" in Path(task.outputs["summary"].path).read_text()
