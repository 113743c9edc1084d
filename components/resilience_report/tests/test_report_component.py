"""The resilience_report component through the KFP local runner."""

import json
from pathlib import Path

from resilient_training.components.resilience_report import resilience_report


def test_component_writes_html_metrics_and_numbers(kfp_local: Path, trainer_runs: Path) -> None:
    task = resilience_report(run_dir=str(trainer_runs / "faulted"))
    assert 0 < task.outputs["Output"] < 1
    html = Path(task.outputs["report"].path).read_text()
    assert html.count("data:image/png;base64,") == 5
    metrics = task.outputs["metrics"].metadata
    assert metrics["steps_completed"] == 30 and metrics["faults"] == 1 and metrics["recovery_p50_seconds"] > 0
    numbers = json.loads(Path(task.outputs["numbers"].path).read_text())
    assert numbers["faults"][0]["layer"] == "inprocess"
    assert not (trainer_runs / "faulted" / "gates").exists()  # the report writes nothing into the run
