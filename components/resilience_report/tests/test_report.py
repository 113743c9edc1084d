"""The resilience report from real trainer runs and from scripted logs."""

import json
import re
from pathlib import Path

import pytest

from resilient_training.gates.metrics import compute_metrics
from resilient_training.gates.report import write_report
from tests.support.gates import ScriptedLog


@pytest.mark.parametrize(("name", "layer", "restored"), [("faulted", "inprocess", 10), ("killed-mid-save", "launcher", 5)])
def test_real_runs_recoveries_are_measured(trainer_runs: Path, name: str, layer: str, restored: int) -> None:
    m = compute_metrics(trainer_runs / name)
    assert m["status"] == "completed" and m["steps"]["completed"] == 30
    (fault,) = [f for f in m["faults"] if f["layer"] != "none"]
    assert fault["layer"] == layer and fault["restored_step"] == restored and fault["recovered"]
    assert fault["rollback_steps"] == fault["last_step_before"] - restored >= 0
    assert m["steps"]["replayed"] == m["steps"]["executed"] - 30 == fault["last_step_before"] - restored
    assert 0 < fault["recovery_seconds"] < m["wall_seconds"]
    assert m["recovery_seconds"]["by_layer"][layer]["count"] == 1
    assert 0 < m["training_goodput"] < m["infrastructure_goodput"] < 1
    assert m["checkpoints"]["committed"] >= 6 and m["checkpoints"]["stall_seconds"]["count"] >= 6
    assert m["suggested_checkpoint_interval"]["young_seconds"] > 0
    assert m["restart_causes"] == {"exception": 1} if name == "faulted" else True


def test_html_report_is_self_contained(trainer_runs: Path, tmp_path: Path) -> None:
    out = write_report(trainer_runs / "killed-mid-save", tmp_path / "out" / "report.html")
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', text)
    assert len(images) == 5 and any("loss" in a for a in images) and any("timeline" in a for a in images)
    assert not re.search(r"(src|href)=\"(https?:)?//", text) and "<script" not in text and "@import" not in text
    assert "launcher" in text and "ckpt-kill@10:1" in text and "Suggested checkpoint interval" in text


def test_report_of_a_run_without_faults(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.steps(1, 10, checkpoint_every=5)
    log.end()
    log.close()
    text = write_report(tmp_path, tmp_path / "r.html").read_text()
    assert "no fault" in text and "no interval can be derived" in text


def test_cli_writes_html_and_json(trainer_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from resilient_training.cli.main import main

    assert main(["report", str(trainer_runs / "faulted"), "-o", str(tmp_path / "r.html"),
                 "--json", str(tmp_path / "m.json")]) == 0
    assert (tmp_path / "r.html").stat().st_size > 10_000
    assert json.loads((tmp_path / "m.json").read_text())["steps"]["completed"] == 30
    capsys.readouterr()
    assert main(["report", str(trainer_runs / "faulted"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"


@pytest.mark.parametrize("argv", [["report", "{tmp}/missing", "--json"], ["report", "{tmp}", "--json"], ["report", "{tmp}"]])
def test_cli_usage_errors(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from resilient_training.cli.main import main

    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []
