"""The gates and the report against a stranger's attack trial (runs of 2 ranks, 30 steps):
finite-but-absurd values, a crash inside the gate, a forged rank00.jsonl, a FIFO for a config, and
a log cut with its end's step nulled out."""

import json
import math
import os
import shutil
import signal
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from resilient_training.cli.main import main
from resilient_training.gates import convergence
from resilient_training.gates.convergence import ConvergenceConfig, check_convergence
from resilient_training.gates.metrics import RunError, compute_metrics
from resilient_training.gates.report import write_report
from resilient_training.run import gate_records, layout
from tests.support.gates import ScriptedLog, write_checkpoint

HUGE = 1.7e308


def edit_log(run: Path, edit: Callable[[dict[str, Any]], None], name: str = "rank0.jsonl") -> None:
    """Apply ``edit`` to every record of one writer's log, in place."""
    path = layout.events_dir(run) / name
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        edit(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def huge_first_losses(record: dict[str, Any]) -> None:
    if record["event"] == "step" and record["step"] in (1, 2):
        record["loss"] = HUGE


def trained(run: Path, *, fault: bool = True) -> None:
    """2 ranks, 30 steps, saves every 5, an exception on rank 1 at step 13 restored from step 10."""
    log = ScriptedLog(run)
    log.start()
    log.emit("load_done", 0, path=None, seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)
    if fault:
        log.emit("fault_injected", 13, rank=1, fault="exception@13:1")
        log.wait(0.3)
        log.emit("failure_detected", 13, cause="exception", message="injected")
        log.iteration += 1
        log.emit("restart_done", layer="inprocess")
        log.emit("load_done", 10, path="checkpoints/step_10", seconds=0.1)
        log.steps(11, 30, checkpoint_every=5)
    else:
        log.steps(13, 30, checkpoint_every=5)
    log.end()
    log.close()


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- bug 2: the convergence gate


def test_means_of_huge_finite_values_do_not_overflow() -> None:
    from resilient_training.gates.metrics import mean, percentiles

    with pytest.raises(OverflowError):  # what the gate and the report used
        statistics.fmean([HUGE, HUGE])
    assert mean([HUGE, HUGE, 1.0]) == pytest.approx(HUGE / 3 * 2)
    assert mean([HUGE, -HUGE]) == 0.0 and mean([1.0, 2.0]) == 1.5
    assert math.isnan(mean([])) and math.isnan(mean([math.nan, 1.0])) and math.isnan(mean([math.inf, -math.inf]))
    assert mean([math.inf, 1.0]) == math.inf
    stats = percentiles([1e308, 1e308, -1e308])
    assert stats["mean"] == pytest.approx(1e308 / 3) and stats["p50"] == 1e308 and stats["max"] == 1e308
    assert math.isfinite(percentiles([-HUGE, HUGE])["p50"])


def test_huge_finite_losses_get_a_clear_verdict_not_an_improvement(tmp_path: Path) -> None:
    """Stranger trial: losses of 1.7e308 at steps 1 and 2 were an OverflowError in statistics.fmean.
    No float32 training step logs a loss beyond 3.4e38: such a loss is not finite, and no window
    holding one shows learning (its first-window mean of 6.8e307 would have been a 100 % fall)."""
    trained(tmp_path)
    edit_log(tmp_path, huge_first_losses)
    verdict = check_convergence(tmp_path, ConvergenceConfig(max_final_loss=10.0))
    assert not verdict.passed
    finite, improvement = verdict.check("finite"), verdict.check("improvement")
    assert not finite.passed and finite.values["beyond_float32"] == 2 and finite.values["first_bad_step"] == 1
    assert "2 of 30 steps end non-finite or out of range" in finite.reason and "3.403e+38" in finite.reason
    assert not improvement.passed and "no improvement can be judged" in improvement.reason
    assert verdict.check("final_loss").passed  # the final window (steps 26-30) is as trained
    edit_log(tmp_path, lambda r: r.update(loss=3e38) if r["event"] == "step" and r["step"] == 28 else None)
    final = check_convergence(tmp_path, ConvergenceConfig(max_final_loss=10.0)).check("final_loss")
    assert final.passed is False  # within float32, but the window's mean is far above the threshold
    edit_log(tmp_path, lambda r: r.update(loss=1e300) if r["event"] == "step" and r["step"] == 28 else None)
    final = check_convergence(tmp_path, ConvergenceConfig(max_final_loss=10.0)).check("final_loss")
    assert not final.passed and "holds a loss beyond 3.403e+38" in final.reason


def test_the_attack_ends_in_a_failed_verdict_and_promotion_is_refused(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The attack as the stranger ran it: a run with a passing convergence record, two losses set to
    1.7e308; the gate crashed (rc 1, traceback) leaving its PASS, and `promote` went ahead (rc 0)."""
    run = tmp_path / "c2"
    write_checkpoint(run, step=30, train_steps=1)
    trained(run)
    assert main(["validate-checkpoint", str(run)]) == 0
    assert main(["check-convergence", str(run)]) == 0
    assert gate_records.read_record(run, gate_records.CONVERGENCE)["passed"] is True
    edit_log(run, huge_first_losses)
    capsys.readouterr()
    assert main(["check-convergence", str(run)]) == 1
    out = capsys.readouterr().out
    assert "FAIL finite: 2 of 30 steps end non-finite or out of range" in out and "FAIL improvement" in out, out
    assert gate_records.read_record(run, gate_records.CONVERGENCE)["passed"] is False
    assert main(["promote", str(run), str(tmp_path / "dest_c2")]) == 1
    assert not (tmp_path / "dest_c2").exists()


@pytest.mark.parametrize("error", [OverflowError("intermediate overflow in fsum"), ZeroDivisionError("x"),
                                   KeyError("loss")])
def test_any_error_inside_the_gate_withdraws_its_earlier_pass(tmp_path: Path, error: Exception,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """docs/gates.md: a run the gate can no longer judge exits 2 and withdraws its record. Only
    RunError and EventLogError did: any other error left the earlier PASS for promotion."""
    write_checkpoint(tmp_path, step=30, train_steps=1)
    trained(tmp_path)
    assert main(["check-convergence", str(tmp_path)]) == 0
    assert gate_records.read_record(tmp_path, gate_records.CONVERGENCE)["passed"] is True

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(convergence, "_continuity", broken)
    capsys.readouterr()
    assert main(["check-convergence", str(tmp_path)]) == 2
    err = one_error_line(capsys)
    assert f"internal error {type(error).__name__}" in err and "its earlier record is withdrawn" in err, err
    assert gate_records.read_record(tmp_path, gate_records.CONVERGENCE) is None
    with pytest.raises(RunError) as raised:
        convergence.check_and_record(tmp_path)
    assert raised.value.__cause__ is error
    assert main(["promote", str(tmp_path), str(tmp_path.parent / "dest")]) != 0


def test_an_interrupted_gate_withdraws_its_earlier_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_checkpoint(tmp_path, step=30, train_steps=1)
    trained(tmp_path)
    convergence.check_and_record(tmp_path)
    assert gate_records.read_record(tmp_path, gate_records.CONVERGENCE) is not None

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(convergence, "write_convergence_record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convergence.check_and_record(tmp_path)
    assert gate_records.read_record(tmp_path, gate_records.CONVERGENCE) is None


# --------------------------------------------------------------------------- bug 3: the report


def test_the_report_of_huge_losses_is_written_and_says_what_it_left_out(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Stranger trial: `report -o x.html` of that log was numpy's LinAlgError (Singular matrix) from
    matplotlib, at the fault marker's axvline."""
    run = tmp_path / "run"
    trained(run)
    edit_log(run, huge_first_losses)
    assert main(["report", str(run), "-o", str(tmp_path / "x.html"), "--json", str(tmp_path / "x.json")]) == 0
    text = (tmp_path / "x.html").read_text()
    assert text.count('src="data:image/png;base64,') == 5, "a chart was not drawn"
    assert "2 loss value(s) not plotted" in text and "step 1: 1.7e+308, step 2: 1.7e+308" in text
    m = json.loads((tmp_path / "x.json").read_text())
    assert [row[2] for row in m["loss"][:2]] == [HUGE, HUGE]  # the numbers themselves, as logged


def test_commits_of_1e308_bytes_are_reported_not_an_overflow(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Stranger trial: `"bytes": 1e308` in the commits made `report --json` and the HTML report an
    OverflowError (intermediate overflow in fsum)."""
    run = tmp_path / "run"
    trained(run)
    edit_log(run, lambda r: r.update(bytes=1e308) if r["event"] == "ckpt_committed" else None)
    assert main(["report", str(run), "--json", str(tmp_path / "x.json")]) == 0
    assert json.loads((tmp_path / "x.json").read_text())["checkpoints"]["bytes"]["mean"] == 1e308
    assert main(["report", str(run), "-o", str(tmp_path / "x.html")]) == 0
    text = (tmp_path / "x.html").read_text()
    assert "<th>size</th><td>1e+302 MB</td>" in text  # not a number of 300 digits
    edit_log(run, lambda r: r.update(seconds=1e308) if r["event"] == "ckpt_staged" else None)
    m = compute_metrics(run)  # a save stall past any wall time: summed to inf, averaged without overflow
    assert m["checkpoints"]["stall_total_seconds"] == math.inf and m["checkpoints"]["stall_seconds"]["mean"] == 1e308


def test_a_chart_matplotlib_cannot_draw_is_named_not_a_traceback(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy

    from resilient_training.gates import report

    trained(tmp_path)

    def singular(m: dict[str, Any]) -> str:
        raise numpy.linalg.LinAlgError("Singular matrix")

    monkeypatch.setattr(report, "timeline_chart", singular)
    text = write_report(tmp_path, tmp_path / "r.html").read_text()
    assert "[timeline of attempts and iterations: not drawn, matplotlib could not plot the values (LinAlgError: " \
           "Singular matrix)]" in text
    assert text.count('src="data:image/png;base64,') == 4


# --------------------------------------------------------------------------- bug 5: events/rank00.jsonl


def test_a_foreign_checkpoint_witnessed_by_a_rank00_log_is_not_accepted(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Stranger trial: another run's step_30 copied in, and a new events/rank00.jsonl holding a rank-0
    `ckpt_committed` of step 30 with that checkpoint's manifest digest: read as rank 0's own log
    (`rank(\\d+)` took `rank00`), its commit was the witness, and validate, check-convergence and
    promote accepted the foreign checkpoint."""
    import time

    from resilient_training.run import checkpoint_format as cf

    run, foreign = tmp_path / "run", tmp_path / "foreign"
    write_checkpoint(run, step=30, train_steps=1)
    trained(run)
    foreign.mkdir()
    shutil.copy(run / cf.RUN_UID_FILENAME, foreign / cf.RUN_UID_FILENAME)  # other weights, the run's uid
    write_checkpoint(foreign, step=30, train_steps=2, seed=99)
    step_30 = layout.checkpoints_dir(run) / "step_30"
    shutil.rmtree(step_30)
    shutil.copytree(layout.checkpoints_dir(foreign) / "step_30", step_30)
    # rank 0's commit, the latest of step 30 (the trainer's own was logged at the time: see log_commit)
    forged = {"ts": time.time(), "rank": 0, "attempt": 0, "iteration": 0, "event": "ckpt_committed",
              "step": 30, "bytes": 0, "seconds": 0.0, "path": "checkpoints/step_30", "tier": "persistent",
              "world_size": 2, "manifest_checksum": gate_records.manifest_digest(step_30)}
    (layout.events_dir(run) / "rank00.jsonl").write_text(json.dumps(forged) + "\n")
    capsys.readouterr()
    assert main(["validate-checkpoint", str(run)]) == 1  # (was VALID: the forged commit its witness)
    assert "rank00.jsonl: no writer's event log" in capsys.readouterr().out
    assert main(["check-convergence", str(run)]) == 2  # (was PASSED)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank00.jsonl: no writer's event log" in err, err
    assert gate_records.read_record(run, gate_records.CONVERGENCE) is None
    assert main(["promote", str(run), str(tmp_path / "dest")]) == 1  # (was promoted)
    assert not (tmp_path / "dest").exists()


# --------------------------------------------------------------------------- bug 10: a FIFO as config.json


class Hung(Exception):
    """Still running at the deadline (no OSError: the code under test must not swallow it)."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Hung if the block takes longer (a read of a FIFO waits for a writer forever)."""
    def expired(*_: Any) -> None:
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_config_that_is_no_regular_file_is_refused_not_waited_on(tmp_path: Path, kind: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Stranger trial: a FIFO as RUN/config.json made `report` hang forever."""
    trained(tmp_path / "run")
    config = layout.config_path(tmp_path / "run")
    os.mkfifo(config) if kind == "fifo" else config.mkdir()
    with deadline(20):
        assert main(["report", str(tmp_path / "run"), "--json", str(tmp_path / "x.json")]) == 2
    err = one_error_line(capsys)
    assert f"{config} is not a regular file ({'a FIFO' if kind == 'fifo' else 'a directory'})" in err, err
    assert not (tmp_path / "x.json").exists()


def test_a_config_that_reads_is_still_read(tmp_path: Path) -> None:
    trained(tmp_path)
    layout.config_path(tmp_path).write_text(json.dumps({"steps": 30, "faults": "exception@13:1,sigkill@20:0"}))
    assert compute_metrics(tmp_path)["faults_not_injected"] == ["sigkill@20:0"]
    layout.config_path(tmp_path).write_text("{not json")
    assert compute_metrics(tmp_path)["faults_not_injected"] == []


# --------------------------------------------------------------------------- a log cut, its end's step nulled


def cut_at_22(run: Path) -> None:
    """The log of a 30-step run cut after step 22, rank 0's end kept with its step set to null."""
    log = ScriptedLog(run)
    log.start()
    log.emit("load_done", 0, path=None, seconds=0.0)
    log.steps(1, 22, checkpoint_every=5)
    log.emit("end", None, status="completed", reason="target step reached")
    log.close()
    layout.config_path(run).write_text(json.dumps({"steps": 30}))


def test_a_completed_end_without_its_step_must_reach_the_configured_steps(tmp_path: Path) -> None:
    """Stranger trial: cut after step 22 of 30, `end` step null: the gate said `completed: ok`."""
    cut_at_22(tmp_path)
    completed = check_convergence(tmp_path, ConvergenceConfig(max_final_loss=10.0)).check("completed")
    assert not completed.passed, completed.reason
    assert completed.reason == ("the run's end says completed at step 30 (the target step of the run's config.json: "
                                "its end names none), but its last logged step is 22 (the event log was cut or edited)")
    m = compute_metrics(tmp_path)
    assert m["status"] == "unknown" and "completed at step 30, but its last logged step is 22" in m["end_reason"]
    layout.config_path(tmp_path).write_text(json.dumps({"steps": 22}))  # a 22-step run: completed
    assert check_convergence(tmp_path, ConvergenceConfig(max_final_loss=10.0)).check("completed").passed
    assert compute_metrics(tmp_path)["status"] == "completed"
