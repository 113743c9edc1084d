"""The convergence gate against a stranger's attacks: deleted restores, lax thresholds, skipped checks
recorded as passed, and a final window that runs past the judged checkpoint.
"""

import json
import math
import statistics
from pathlib import Path

import pytest

from resilient_training.cli.main import main
from resilient_training.components.check_convergence import check_convergence as component
from resilient_training.gates.convergence import ConvergenceConfig, check_convergence, write_convergence_record
from resilient_training.run import checkpoint_format as cf
from resilient_training.run import gate_records, layout
from resilient_training.run.events import read_events
from tests.support.gates import ScriptedLog, copy_run, rewrite_manifest, scripted_loss, write_checkpoint

GATE = ConvergenceConfig(max_final_loss=2.0)


def fake_checkpoint(run: Path, step: int) -> Path:
    """A committed step directory with a bare manifest, named by ``latest`` (what the gate reads of it)."""
    ckpt = layout.checkpoints_dir(run) / cf.step_dirname(step)
    ckpt.mkdir(parents=True)
    (ckpt / cf.MANIFEST_NAME).write_text(json.dumps({"step": step}))
    (layout.checkpoints_dir(run) / cf.LATEST_NAME).write_text(cf.step_dirname(step))
    return ckpt


def drop_events(run: Path, keep) -> int:
    """Delete the lines of every writer's log for which ``keep(record)`` is false; how many went."""
    dropped = 0
    for path in sorted(layout.events_dir(run).glob("*.jsonl")):
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if keep(json.loads(line))]
        dropped += len(lines) - len(kept)
        path.write_text("".join(kept))
    return dropped


# --------------------------------------------------------------------------- 1. deleted restores


def resumed_without_its_restore(run: Path) -> None:
    """A finished run resumed by a new process whose load_done was deleted (same attempt and iteration)."""
    log = ScriptedLog(run)
    log.start()
    log.emit("load_done", 0, path=None, seconds=0.0)
    log.steps(1, 30, checkpoint_every=5)
    log.end()
    log.wait(60.0)
    log.start()  # a new `train` of the same run: attempt 0, iteration 0 again
    log.steps(31, 34, loss=lambda s: scripted_loss(0))  # restored the wrong state; nobody can tell
    log.end()
    log.close()


def test_new_process_without_load_done_fails_continuity(tmp_path: Path) -> None:
    resumed_without_its_restore(tmp_path)
    verdict = check_convergence(tmp_path, ConvergenceConfig(max_final_loss=10.0, min_improvement=0.0))
    c = verdict.check("continuity")
    assert not verdict.passed and not c.passed and c.values["not_logged"] == 2 and c.values["failed"] == 2
    assert ("rank 0 attempt 0 iteration 0: the steps from step 31 on follow no load_done: its restore is not in "
            "the event log: it cannot be checked") in c.reason
    assert [(r["rank"], r["first_step"], r["basis"]) for r in verdict.recoveries] == [(0, 31, "missing"),
                                                                                       (1, 31, "missing")]


def test_inprocess_iteration_without_load_done_fails_continuity(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path=None, seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)
    log.emit("fault_injected", 13, rank=1, fault="exception")
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.steps(11, 30)  # its load_done deleted
    log.end()
    log.close()
    c = check_convergence(tmp_path, GATE).check("continuity")
    assert not c.passed and "rank 0 attempt 0 iteration 1: the steps from step 11 on follow no load_done" in c.reason


def test_first_steps_need_a_load_done_unless_they_start_at_step_1(tmp_path: Path) -> None:
    fresh, late = ScriptedLog(tmp_path / "fresh"), ScriptedLog(tmp_path / "late")
    fresh.steps(1, 30)  # nothing was restored before step 1 (scripted logs omit the fresh start's load_done)
    late.steps(6, 30)  # something was
    for log in (fresh, late):
        log.end()
        log.close()
    assert check_convergence(tmp_path / "fresh", GATE).passed
    c = check_convergence(tmp_path / "late", GATE).check("continuity")
    assert not c.passed and "the steps from step 6 on follow no load_done" in c.reason


def test_trainer_run_with_its_restore_deleted_fails(trainer_runs: Path, tmp_path: Path) -> None:
    # The attack as it was made: the resume from the swapped-in step 30 failed continuity until
    # its two load_done events were deleted; then "all checked restores" passed.
    run = copy_run(trainer_runs / "tampered-restore", tmp_path / "run")
    assert drop_events(run, lambda r: not (r["event"] == "load_done" and r["step"] == 30)) == 2
    verdict = check_convergence(run)
    c = verdict.check("continuity")
    assert not verdict.passed and not c.passed and c.values["not_logged"] == 2
    resumed = next(e for e in read_events(run) if e.event == "step" and e.step == 31 and e.rank == 0)
    # Either rank's may be named first (the two ranks' events are ordered by their timestamps).
    assert any(f"rank {rank} attempt {resumed.attempt} iteration {resumed.iteration}: the steps from step 31 on "
               "follow no load_done: its restore is not in the event log" in c.reason for rank in (0, 1))


def test_trainer_run_with_an_inprocess_restore_deleted_fails(trainer_runs: Path, tmp_path: Path) -> None:
    run = copy_run(trainer_runs / "faulted", tmp_path / "run")
    assert drop_events(run, lambda r: not (r["event"] == "load_done" and r["iteration"] > 0)) == 2
    c = check_convergence(run).check("continuity")
    assert not c.passed and c.values["not_logged"] == 2 and "iteration 1: the steps from step 11 on" in c.reason


# --------------------------------------------------------------------------- 2. thresholds


@pytest.mark.parametrize(("field", "value"), [
    ("min_improvement", -1.0), ("min_improvement", 1.0), ("min_improvement", 2.5), ("min_improvement", math.nan),
    ("min_improvement", "0.1"), ("max_final_loss", 0.0), ("max_final_loss", -3.0), ("max_final_loss", math.inf),
    ("max_final_loss", math.nan), ("continuity_rtol", -1e-3), ("continuity_rtol", math.inf), ("jump_rtol", math.nan),
    ("jump_rtol", -0.1), ("reference_rtol", math.inf), ("reference_rtol", -1.0), ("window", 0), ("window", True),
    ("window", 2.5),
])
def test_nonsense_thresholds_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ConvergenceConfig(**{field: value})


def test_edge_thresholds_are_accepted() -> None:
    ConvergenceConfig(min_improvement=0.0, continuity_rtol=0.0, jump_rtol=0, reference_rtol=0.0, window=1,
                      max_final_loss=1e-9)
    ConvergenceConfig(min_improvement=0.999, max_final_loss=1e9)


def rising_run(run: Path) -> None:
    log = ScriptedLog(run)
    log.steps(1, 30, loss=lambda s: 2.0 + 0.05 * s)  # got worse throughout
    log.end()
    log.close()


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--min-improvement", "-1", "min_improvement must be a finite number in [0, 1)"),
    ("--min-improvement", "1", "min_improvement must be a finite number in [0, 1)"),
    ("--max-final-loss", "0", "max_final_loss must be finite and > 0"),
    ("--max-final-loss", "-5", "max_final_loss must be finite and > 0"),
    ("--jump-rtol", "-0.5", "jump_rtol must be a finite number >= 0"),
    ("--reference-rtol", "inf", "reference_rtol must be a finite number >= 0"),
    ("--continuity-rtol", "-1", "continuity_rtol must be a finite number >= 0"),
])
def test_cli_rejects_nonsense_thresholds(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str,
                                         says: str) -> None:
    rising_run(tmp_path)
    assert main(["check-convergence", str(tmp_path), "--max-final-loss", "100", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1
    assert not layout.gates_dir(tmp_path).exists()


def test_component_rejects_nonsense_thresholds(tmp_path: Path) -> None:
    rising_run(tmp_path)
    with pytest.raises(ValueError, match="min_improvement"):
        component.python_func(run_dir=str(tmp_path), metrics=None, summary=None, verdict=None, min_improvement=-1.0)
    with pytest.raises(ValueError, match="max_final_loss"):
        component.python_func(run_dir=str(tmp_path), metrics=None, summary=None, verdict=None, max_final_loss=0.0)
    assert not layout.gates_dir(tmp_path).exists()


def test_record_shows_the_thresholds_applied(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, step=30, train_steps=1)  # vocab 64
    log = ScriptedLog(tmp_path)
    log.steps(1, 30)
    log.end()
    log.close()
    write_convergence_record(tmp_path, check_convergence(tmp_path, ConvergenceConfig(min_improvement=0.25, window=3)))
    thresholds = gate_records.read_record(tmp_path, gate_records.CONVERGENCE)["thresholds"]
    assert thresholds["min_improvement"] == 0.25 and thresholds["window"] == 3
    assert thresholds["max_final_loss"] == pytest.approx(0.8 * math.log(64))  # derived: the value used is recorded
    assert "vocab_size 64" in thresholds["max_final_loss_from"]
    assert {"continuity_rtol", "continuity_atol", "jump_rtol", "reference_rtol"} <= thresholds.keys()
    write_convergence_record(tmp_path, check_convergence(tmp_path, ConvergenceConfig(max_final_loss=3.0)))
    thresholds = gate_records.read_record(tmp_path, gate_records.CONVERGENCE)["thresholds"]
    assert thresholds["max_final_loss"] == 3.0 and thresholds["max_final_loss_from"] == "given"


# --------------------------------------------------------------------------- 4. skipped checks


def test_final_loss_skipped_for_a_task_without_vocab_says_why_and_is_recorded_as_skipped(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, step=30, train_steps=1)
    rewrite_manifest(ckpt, lambda m: m.pop("model_config"))  # a task other than the built-in GPT records none
    log = ScriptedLog(tmp_path)
    log.steps(1, 30)
    log.end()
    log.close()
    verdict = check_convergence(tmp_path)
    final = verdict.check("final_loss")
    assert verdict.passed and final.skipped  # a skipped check fails nothing
    assert final.reason == ("skipped: the run's task records no vocab_size to derive a default threshold from; "
                            "pass --max-final-loss")
    write_convergence_record(tmp_path, verdict)
    record = gate_records.read_record(tmp_path, gate_records.CONVERGENCE)
    assert record["checks"]["final_loss"]["skipped"] is True and record["checks"]["improvement"]["skipped"] is False
    assert record["thresholds"]["max_final_loss"] is None


def test_final_loss_skipped_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.steps(1, 30)
    log.end()
    log.close()
    final = check_convergence(tmp_path).check("final_loss")
    assert final.skipped and "no committed checkpoint" in final.reason


@pytest.mark.parametrize("damage", ["directory", "names-nothing", "not-utf8", "huge"])
def test_a_latest_pointer_that_names_no_checkpoint_fails_the_gate(tmp_path: Path, damage: str) -> None:
    # Found by a stranger trial: with `latest` a directory the gate judged the whole curve and passed.
    log = ScriptedLog(tmp_path)
    log.steps(1, 30, loss=lambda s: 5.5 - 0.15 * s)
    log.end()
    log.close()
    fake_checkpoint(tmp_path, 30)
    assert check_convergence(tmp_path, GATE).passed
    pointer = layout.checkpoints_dir(tmp_path) / cf.LATEST_NAME
    if damage == "directory":
        pointer.unlink()
        pointer.mkdir()
    elif damage == "huge":  # a stranger trial's 20 MB pointer was quoted whole: 80 MB of "one line"
        pointer.write_bytes(b"\0" * 20_000_000)
    else:
        pointer.write_bytes(b"step_99\n" if damage == "names-nothing" else b"step_\xff\n")
    verdict = check_convergence(tmp_path, GATE)
    assert not verdict.passed and verdict.checkpoint is None
    failed = [c.name for c in verdict.checks if not c.passed and not c.skipped]
    assert failed == ["latest_checkpoint"], verdict.format()
    assert len(verdict.format()) < 5000


# --------------------------------------------------------------------------- 5. the judged window


def sprint_after(step: int):
    """Slow learning up to ``step``, then a loss far below anything before (what a rewound checkpoint never saw)."""
    return lambda s: 5.5 - 0.05 * s if s <= step else 1.0


def test_final_window_ends_at_the_judged_checkpoint(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.steps(1, 30, loss=sprint_after(25))
    log.end()
    log.close()
    assert check_convergence(tmp_path, GATE).passed  # no checkpoint: the whole curve, steps 26-30 at loss 1.0
    fake_checkpoint(tmp_path, 25)  # `latest` rewound to step_25
    verdict = check_convergence(tmp_path, GATE)
    final = verdict.check("final_loss")
    assert not verdict.passed and not final.passed
    assert final.values["final_mean"] == pytest.approx(statistics.fmean(5.5 - 0.05 * s for s in range(21, 26)))
    assert final.values["final_steps"] == [21, 25] and final.values["judged_step"] == 25
    assert "(steps 21-25)" in final.reason
    write_convergence_record(tmp_path, verdict)
    assert gate_records.read_record(tmp_path, gate_records.CONVERGENCE)["step"] == 25


def test_judged_window_is_the_history_that_led_to_the_checkpoint(tmp_path: Path) -> None:
    # step_25 was committed; later a rollback to step 20 replayed 21-30 on another branch (here:
    # much lower losses). The checkpoint holds the first branch's model: judge that one.
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path=None, seconds=0.0)
    log.steps(1, 28, checkpoint_every=5, loss=lambda s: 5.5 - 0.05 * s)
    log.emit("fault_injected", 29, rank=0, fault="exception")
    log.iteration += 1
    log.emit("load_done", 20, path="checkpoints/step_20", seconds=0.1)
    log.steps(21, 30, loss=lambda s: 5.5 - 0.05 * s if s == 21 else 1.0)
    log.end()
    log.close()
    fake_checkpoint(tmp_path, 25)
    final = check_convergence(tmp_path, GATE).check("final_loss")
    assert final.values["final_mean"] == pytest.approx(statistics.fmean(5.5 - 0.05 * s for s in range(21, 26)))
    assert not final.passed


def test_rewound_trainer_run_is_judged_at_its_checkpoint(trainer_runs: Path, tmp_path: Path) -> None:
    run = copy_run(trainer_runs / "faulted", tmp_path / "run")
    (layout.checkpoints_dir(run) / cf.LATEST_NAME).write_text("step_25")
    losses = {e.step: e["loss"] for e in read_events(run) if e.event == "step" and e.rank == 0}  # last execution
    verdict = check_convergence(run)
    learned = verdict.check("improvement").values
    assert learned["final_mean"] == pytest.approx(statistics.fmean(losses[s] for s in range(21, 26)))
    assert learned["final_mean"] != pytest.approx(statistics.fmean(losses[s] for s in range(26, 31)))
    assert learned["final_steps"] == [21, 25] and learned["judged_step"] == 25
    write_convergence_record(run, verdict)
    assert gate_records.read_record(run, gate_records.CONVERGENCE)["checkpoint"] == "checkpoints/step_25"


def test_a_planted_step_directory_cannot_lift_the_default_threshold(tmp_path: Path) -> None:
    """Stranger trial: a step_999/manifest.json with a huge vocab_size, newer than `latest`, made the
    threshold 60.8 and passed a run whose loss failed its own (0.8 x ln 64)."""
    write_checkpoint(tmp_path, step=30, train_steps=1)  # latest: vocab 64
    planted = layout.checkpoints_dir(tmp_path) / "step_999"
    planted.mkdir()
    (planted / "manifest.json").write_text(json.dumps({"model_config": {"vocab_size": 10**33}}))
    log = ScriptedLog(tmp_path)
    log.steps(1, 30, loss=lambda step: 9.0 - step * 0.1)  # learns, but ends above 0.8 ln 64 = 3.33
    log.end()
    log.close()
    verdict = check_convergence(tmp_path)
    final = verdict.check("final_loss")
    assert final.values["threshold"] == pytest.approx(0.8 * math.log(64)) and not final.passed and not verdict.passed
    assert verdict.thresholds["max_final_loss_from"] == "0.8 x ln(vocab_size 64) from step_30's manifest"


@pytest.mark.parametrize("damage", ["nested", "not-json"])
def test_a_gate_that_can_no_longer_judge_the_run_withdraws_its_earlier_pass(tmp_path: Path, damage: str,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Stranger trial: a line of 200000 '[' in an event log crashed the gate (a traceback) and left
    its earlier PASS in place, and promotion went on from it."""
    write_checkpoint(tmp_path, step=30, train_steps=1)
    log = ScriptedLog(tmp_path)
    log.steps(1, 30)
    log.end()
    log.close()
    assert main(["check-convergence", str(tmp_path)]) == 0
    assert gate_records.read_record(tmp_path, gate_records.CONVERGENCE)["passed"] is True
    log_file = sorted(layout.events_dir(tmp_path).glob("*.jsonl"))[0]
    with open(log_file, "a", encoding="utf-8") as handle:
        handle.write(("[" * 200000 + "]" * 200000 if damage == "nested" else "{oops") + "\n")
    capsys.readouterr()
    assert main(["check-convergence", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not JSON" in err, err
    assert gate_records.read_record(tmp_path, gate_records.CONVERGENCE) is None
    assert main(["promote", str(tmp_path), str(tmp_path.parent / f"{tmp_path.name}-promoted")]) != 0


def test_a_log_cut_after_an_earlier_step_with_its_completed_end_kept_fails(tmp_path: Path) -> None:
    """A second stranger trial cut the event log after step 16 of a 24-step run and kept rank 0's
    ``end`` (completed, at the target step 24): the report and the gate said completed."""
    run = tmp_path / "run"
    log = ScriptedLog(run)
    log.start()
    log.emit("load_done", 0, path=None, seconds=0.0)
    log.steps(1, 16, checkpoint_every=8)
    log.emit("end", 24, status="completed", reason="target step reached")
    log.close()
    fake_checkpoint(run, 16)
    result = check_convergence(run, GATE)
    completed = next(c for c in result.checks if c.name == "completed")
    assert not completed.passed and "end says completed at step 24, but its last logged step is 16" in completed.reason
    assert not result.passed
