"""The goodput maths against numbers worked out by hand from scripted event logs."""

import math
from pathlib import Path

import pytest

from resilient_training.gates.metrics import RunError, compute_metrics, episodes, percentiles, young_daly
from resilient_training.run import events as ev
from resilient_training.run import layout
from tests.support.gates import ScriptedLog


def faulted_run(run: Path, *, layer: str = "inprocess") -> ScriptedLog:
    log = ScriptedLog(run)
    log.start()
    log.wait(1.0)
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)  # t = 1.0 + 1.2 + 2 x 0.02 = 2.24
    log.wait(0.05)
    log.emit("fault_injected", 13, rank=1, fault="exception")  # t = 2.29
    log.wait(0.5)
    log.emit("failure_detected", 13, cause="exception", message="injected")
    log.emit("restart_begin", 13, layer=layer, cause="exception")
    if layer == "launcher":
        log.attempt += 1
    else:
        log.iteration += 1
    log.wait(1.0)
    log.emit("restart_done", layer=layer)
    log.wait(0.2)
    log.emit("load_done", 10, path="checkpoints/step_10", seconds=0.2)  # t = 3.99
    log.steps(11, 20, checkpoint_every=5)  # first step at 4.09, last at 5.03
    log.end()
    log.close()
    return log


def test_faulted_run_numbers(tmp_path: Path) -> None:
    faulted_run(tmp_path)
    m = compute_metrics(tmp_path)
    assert m["wall_seconds"] == pytest.approx(5.03)
    assert m["steps"] == {"completed": 20, "last": 20, "executed": 22, "replayed": 2}
    assert m["productive_step_seconds"] == pytest.approx(2.0)
    assert m["training_goodput"] == pytest.approx(2.0 / 5.03)
    assert m["downtime_seconds"] == pytest.approx(1.80)
    assert m["infrastructure_goodput"] == pytest.approx((5.03 - 1.80) / 5.03)
    (fault,) = m["faults"]
    assert fault["fault"] == "exception" and fault["cause"] == "exception" and fault["layer"] == "inprocess"
    assert fault["restored_step"] == 10 and fault["last_step_before"] == 12 and fault["rollback_steps"] == 2
    assert fault["recovery_seconds"] == pytest.approx(1.80)
    assert m["recovery_seconds"]["by_layer"]["inprocess"]["max"] == pytest.approx(1.80)
    assert m["restart_causes"] == {"exception": 1}
    assert m["checkpoints"]["committed"] == 4 and m["checkpoints"]["steps"] == [5, 10, 15, 20]
    assert m["checkpoints"]["stall_seconds"]["mean"] == pytest.approx(0.02)
    assert m["checkpoints"]["interval_steps"] == 5
    assert m["freshness_steps"]["max"] == 5  # at a save step, before its commit
    series = {step: f for _, step, f in m["freshness_steps"]["series"]}
    assert series[12] == 2 and series[15] == 5 and series[16] == 1
    interval = m["suggested_checkpoint_interval"]
    assert interval["mtbf_seconds"] == pytest.approx(5.03)
    assert interval["young_seconds"] == pytest.approx(math.sqrt(2 * 0.02 * 5.03))
    assert interval["young_steps"] == pytest.approx(round(math.sqrt(2 * 0.02 * 5.03) / 0.1, 1))
    assert [(s["attempt"], s["iteration"], s["first_step"], s["last_step"]) for s in m["timeline"]] == [
        (0, 0, 1, 12), (0, 1, 11, 20)]
    assert m["status"] == "completed"


def test_launcher_restart_is_classified_by_its_layer(tmp_path: Path) -> None:
    faulted_run(tmp_path, layer="launcher")
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["layer"] == "launcher"


def test_layer_is_inferred_when_no_restart_done_was_logged(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.steps(1, 5, checkpoint_every=5)
    log.emit("fault_injected", 6, rank=0, fault="sigkill")
    log.attempt += 1  # ft_launcher restarted the workers; the killed rank logged nothing more
    log.wait(3.0)
    log.emit("load_done", 5, path="checkpoints/step_5", seconds=0.1)
    log.steps(6, 8)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["layer"] == "launcher" and fault["recovery_seconds"] == pytest.approx(3.1)
    assert fault["rollback_steps"] == 0


def test_fault_absorbed_without_restart_costs_nothing(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.steps(1, 3)
    log.emit("fault_injected", 4, rank=0, fault="nan@4:0", type="nan")  # with --no-nan-guard: nothing stops
    log.steps(4, 6)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert [f["layer"] for f in m["faults"]] == ["none"]
    assert m["downtime_seconds"] == 0 and m["restart_causes"] == {}


def test_unrecovered_fault_counts_until_the_end(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.steps(1, 3)
    log.emit("fault_injected", 4, rank=1, fault="hang")
    log.emit("failure_detected", 4, rank=0, cause="timeout", message="")
    log.wait(2.0)
    log.end("failed", "max restarts")
    log.close()
    m = compute_metrics(tmp_path)
    assert m["unrecovered_faults"] == 1 and m["faults"][0]["layer"] == "unrecovered"
    assert m["downtime_seconds"] == pytest.approx(2.0)
    assert m["status"] == "failed"


def test_two_faults_in_one_recovery_are_one_episode(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.steps(1, 5, checkpoint_every=5)
    log.emit("fault_injected", 6, rank=1, fault="exception")
    log.emit("restart_begin", 6, layer="inprocess", cause="exception")
    log.wait(1.0)
    log.emit("fault_injected", 6, rank=0, fault="exception")  # fails again while restarting
    log.emit("restart_begin", 6, layer="launcher", cause="exception")
    log.wait(2.0)
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 5, path="checkpoints/step_5", seconds=0.1)
    log.steps(6, 7)
    log.close()
    m = compute_metrics(tmp_path)
    assert len(m["faults"]) == 1 and m["faults"][0]["layer"] == "launcher"
    assert m["faults"][0]["recovery_seconds"] == pytest.approx(3.1)


def test_percentiles_and_young_daly() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0, 10.0])
    assert (p["mean"], p["p50"], p["max"]) == (4.0, 3.0, 10.0)
    assert p["p95"] == pytest.approx(4.0 + 0.8 * 6.0)
    assert percentiles([])["mean"] is None
    yd = young_daly(10.0, 3600.0)
    assert yd["young_seconds"] == pytest.approx(math.sqrt(2 * 10 * 3600))
    r = 10.0 / 7200
    assert yd["daly_seconds"] == pytest.approx(math.sqrt(2 * 10 * 3600) * (1 + math.sqrt(r) / 3 + r / 9) - 10)
    assert young_daly(1.0, None)["young_seconds"] is None


@pytest.mark.parametrize("make", ["missing", "no-events", "empty-events"])
def test_not_a_run(tmp_path: Path, make: str) -> None:
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir()
    if make == "empty-events":
        layout.events_dir(run).mkdir()
    with pytest.raises(RunError, match="run"):
        compute_metrics(run)


def test_torn_last_line_of_a_killed_writer_is_skipped(tmp_path: Path) -> None:
    faulted_run(tmp_path)
    with open(layout.events_dir(tmp_path) / "rank1.jsonl", "a") as handle:
        handle.write('{"ts": 1700000009.0, "rank": 1, "attem')
    assert len(episodes(ev.read_events(tmp_path))) == 1


def test_a_second_launch_on_the_same_run_is_its_own_segment(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 5, checkpoint_every=5)
    log.end()
    log.wait(10.0)
    log.start()  # `train` again on the same run dir: attempt 0 again
    log.emit("load_done", 5, path="checkpoints/step_5", seconds=0.1)
    log.steps(6, 8)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert [(s["launch"], s["attempt"], s["first_step"], s["last_step"]) for s in m["timeline"]] == [
        (0, 0, 1, 5), (1, 0, 6, 8)]
    assert [launch for *_, launch in m["loss"]] == [0] * 5 + [1] * 3
    assert [step for _, step in m["restores"]] == [5]
    assert m["faults"] == [] and m["steps"]["completed"] == 8


def _peer_fault_run(run: Path, *, injected: str | None, victim_reports: str | None = None) -> None:
    """Rank 1 fails at step 13; rank 0 only sees a peer fail; ft_launcher restarts both."""
    log = ScriptedLog(run)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)
    if injected:
        log.emit("fault_injected", 13, rank=1, fault=f"{injected}@13:1", type=injected)
    log.wait(0.5)
    if victim_reports:
        log.emit("failure_detected", 13, rank=1, cause=victim_reports, message=f"{victim_reports} on rank 1")
    log.emit("failure_detected", 13, rank=0, cause="peer_failure", message="a peer failed")
    log.emit("restart_begin", 13, rank=0, layer="inprocess", cause="peer_failure")
    log.attempt += 1
    log.wait(2.0)
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 10, path="checkpoints/step_10", seconds=0.2)
    log.steps(11, 15)
    log.end()
    log.close()


def test_the_root_cause_is_what_happened_not_what_the_peer_saw(tmp_path: Path) -> None:
    _peer_fault_run(tmp_path, injected="sigkill")
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    assert fault["root_cause"]["kind"] == "sigkill" and fault["root_cause"]["rank"] == 1
    assert fault["root_cause"]["injected"] is True and fault["layer"] == "launcher"
    assert {(s["rank"], s["cause"]) for s in fault["symptoms"]} == {(0, "peer_failure")}
    assert m["restart_causes"] == {"sigkill": 1}


def test_a_rank_that_died_silently_is_named(tmp_path: Path) -> None:
    _peer_fault_run(tmp_path, injected=None)
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["root_cause"]["kind"] == "died" and fault["root_cause"]["rank"] == 1
    assert "without reporting" in fault["root_cause"]["detail"]
    assert fault["cause"] == "died"


def test_the_failing_rank_s_own_report_beats_the_peer_s(tmp_path: Path) -> None:
    _peer_fault_run(tmp_path, injected="hang", victim_reports="timeout")
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["root_cause"]["kind"] == "hang" and fault["root_cause"]["rank"] == 1
    assert "timeout on rank 1" in fault["root_cause"]["detail"]
    _peer_fault_run(tmp_path / "b", injected=None, victim_reports="timeout")
    (fault,) = compute_metrics(tmp_path / "b")["faults"]
    assert (fault["root_cause"]["kind"], fault["root_cause"]["rank"]) == ("timeout", 1)
    assert [s["rank"] for s in fault["symptoms"] if s["event"] == "failure_detected"] == [0]


@pytest.mark.parametrize("waiting_first", [True, False])
def test_of_two_ranks_reporting_a_hang_the_one_stalled_outside_a_collective_is_named(tmp_path: Path,
                                                                                      waiting_first: bool) -> None:
    """A hang nobody injected: both ranks' guards ran out, rank 0 waiting in a collective for
    rank 1, stalled in its step. Rank 1 is the root cause whichever reported first (on 2 H200s
    the waiting rank was first in 2 of 5 such hangs); with both waiting, the first report is."""
    def run(path: Path, where: tuple[str, str]) -> dict:
        log = ScriptedLog(path)
        log.start()
        log.emit("load_done", 0, path="", seconds=0.0)
        log.steps(1, 12, checkpoint_every=5)
        log.wait(3.0)
        order = [0, 1] if waiting_first else [1, 0]
        for rank in order:
            log.emit("hang_detected", 13, rank=rank, reason=f"no progress for 3.0 s in {where[rank]}", where=where[rank])
            log.wait(0.01)
        for rank in order:
            log.emit("failure_detected", 13, rank=rank, cause="hang", message="soft timeout")
            log.emit("restart_begin", 13, rank=rank, layer="inprocess", cause="hang")
            log.wait(0.01)
        log.iteration += 1
        log.wait(1.0)
        log.emit("restart_done", layer="inprocess")
        log.emit("load_done", 10, path="checkpoints/step_10", seconds=0.2)
        log.steps(11, 15)
        log.end()
        log.close()
        (fault,) = compute_metrics(path)["faults"]
        return fault

    fault = run(tmp_path / "a", ("collective", "step"))
    assert (fault["root_cause"]["kind"], fault["root_cause"]["rank"], fault["layer"]) == ("hang", 1, "inprocess")
    assert [s["rank"] for s in fault["symptoms"] if s["event"] == "failure_detected"] == [0]
    fault = run(tmp_path / "b", ("collective", "collective"))
    assert fault["root_cause"]["rank"] == (0 if waiting_first else 1)


def test_a_writer_death_found_at_the_next_save_is_the_injected_fault_not_a_second_one(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)
    log.emit("fault_injected", 13, rank=0, fault="writer-kill@13:0", type="writer-kill")
    log.steps(13, 14)  # training goes on: nothing fails until the next save
    log.emit("failure_detected", 15, rank=0, cause="writer_died", message="CheckpointWriterDied: writer died")
    log.emit("failure_detected", 15, rank=1, cause="DistBackendError", message="peer went away")
    log.attempt += 1
    log.wait(3.0)
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 10, path="checkpoints/step_10", seconds=0.2)
    log.steps(11, 16)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    assert fault["root_cause"]["kind"] == "writer-kill" and fault["root_cause"]["rank"] == 0
    assert fault["root_cause"]["detected_seconds_after_fault"] == pytest.approx(0.2)
    assert fault["layer"] == "launcher" and m["restart_causes"] == {"writer-kill": 1}
    assert fault["fault_step"] == 13  # where it struck (the report showed the step it was found at: stranger trial)


def test_a_peer_s_collective_error_is_a_symptom_when_the_failing_rank_says_more(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)
    log.emit("failure_detected", 13, rank=0, cause="DistBackendError", message="NCCL communicator aborted")
    log.emit("failure_detected", 13, rank=1, cause="RuntimeError", message="CUDA error: an illegal memory access")
    log.emit("restart_begin", 13, layer="inprocess", cause="RuntimeError")
    log.iteration += 1
    log.wait(1.0)
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 10, path="checkpoints/step_10", seconds=0.2)
    log.steps(11, 14)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert (fault["root_cause"]["kind"], fault["root_cause"]["rank"]) == ("RuntimeError", 1)
    assert (0, "DistBackendError") in {(s["rank"], s["cause"]) for s in fault["symptoms"]}


def test_a_fault_at_a_save_logged_before_the_peer_s_step_is_not_absorbed(tmp_path: Path) -> None:
    """Rank 1 kills itself at the save after step 6 before rank 0 has logged step 6 (seen on GPUs)."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 5, checkpoint_every=5)
    log.wait(0.1)
    log.emit("step", 6, rank=1, loss=1.0, seconds=0.1)
    log.emit("fault_injected", 6, rank=1, fault="ckpt-kill@6:1", type="ckpt-kill")
    log.emit("step", 6, rank=0, loss=1.0, seconds=0.1)
    log.attempt += 1
    log.wait(3.0)
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 5, path="checkpoints/step_5", seconds=0.2)
    log.steps(6, 8)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["layer"] == "launcher" and fault["root_cause"]["kind"] == "ckpt-kill"
    assert fault["recovery_seconds"] == pytest.approx(3.1)
    assert fault["lost_seconds"] == pytest.approx(3.1 + 0.1)  # step 6 was trained twice


@pytest.mark.parametrize("kind", ["ckpt-kill", "sigkill"])
def test_a_killed_reference_rank_that_logged_a_step_before_dying_is_a_launcher_restart(tmp_path: Path, kind: str) -> None:
    """One GPU: rank 0 submits its shard, logs one more step, then dies (an async ckpt-kill on an
    H200, 2026-12-02). The report said layer none, 0 s, and the downtime left the restart out.
    """
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 5, checkpoint_every=5)
    log.emit("fault_injected", 5, rank=0, fault=f"{kind}@5:0", type=kind)
    log.steps(6, 6)  # t = 0.6: logged before the SIGKILL took effect
    log.attempt += 1
    log.wait(3.0)
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 5, path="checkpoints/step_5", seconds=0.2)
    log.steps(6, 8)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    assert fault["layer"] == "launcher" and fault["root_cause"]["kind"] == kind
    assert fault["recovery_seconds"] == pytest.approx(3.2)  # from the injection (t = 0.5) to step 6 again (t = 3.7)
    assert fault["rollback_steps"] == 1
    assert m["downtime_seconds"] > 3.0 and m["restart_causes"] == {kind: 1}


def test_a_scheduled_fault_that_never_fired_is_named_in_the_metrics_and_the_report(tmp_path: Path) -> None:
    """A load-hang fires only in a restore read from storage; with memory snapshots an in-process
    restore never reads one, and the fault matrix on one H200 completed without it (2026-12-02).
    """
    import json

    from resilient_training.gates.report import render_html

    layout.config_path(tmp_path).write_text(json.dumps({"faults": "exception@4:0,load-hang@5:0,nan@6:0x2"}))
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 3)
    log.emit("fault_injected", 4, rank=0, fault="exception@4:0", type="exception")
    log.emit("fault_injected", 6, rank=0, fault="nan@6:0", type="nan")  # once of twice
    log.steps(4, 8)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert m["faults_not_injected"] == ["load-hang@5:0", "nan@6:0x2 (fired 1 of 2 times)"]
    assert "never fired" in render_html(m, "run")
    assert "load-hang@5:0, nan@6:0x2 (fired 1 of 2 times)" in render_html(m, "run")
    layout.config_path(tmp_path).write_text(json.dumps({"faults": "exception@4:0,nan@6:0"}))
    assert compute_metrics(tmp_path)["faults_not_injected"] == []
    layout.config_path(tmp_path).write_text("{not json")  # unreadable: nothing claimed either way
    assert compute_metrics(tmp_path)["faults_not_injected"] == []
    layout.config_path(tmp_path).write_text("[" * 100_000)  # nested past the parser's depth: no traceback
    assert compute_metrics(tmp_path)["faults_not_injected"] == []


def test_a_fault_that_strikes_during_another_s_recovery_is_named_with_it(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 5, checkpoint_every=5)
    log.emit("fault_injected", 6, rank=0, fault="exception@6:0", type="exception")
    log.emit("failure_detected", 6, rank=0, cause="exception", message="InjectedFault")
    log.iteration += 1
    log.wait(0.5)
    log.emit("fault_injected", 5, rank=1, fault="load-hang@5:1", type="load-hang")
    log.wait(4.0)
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 5, path="checkpoints/step_5", seconds=0.2)
    log.steps(6, 8)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["root_cause"]["kind"] == "exception"
    assert fault["root_cause"]["also_injected"] == ["load-hang@5:1"]


def test_a_writer_death_that_surfaces_during_another_fault_s_recovery_is_named_with_it(tmp_path: Path) -> None:
    """H200, 1.3B matrix (call72): a writer-kill armed at a save killed the writer ~10 s later,
    while an exception's in-process restart was under way; it was reported as its own fault,
    absorbed (layer none, 0 s), and the recovery that dealt with it did not name it.
    """
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 10, checkpoint_every=5)
    log.emit("fault_injected", 10, rank=0, fault="writer-kill@8:0", type="writer-kill")
    log.steps(11, 12)  # training goes on: the writer is still alive
    log.emit("fault_injected", 13, rank=0, fault="exception@13:0", type="exception")
    log.emit("failure_detected", 13, rank=0, cause="exception", message="InjectedFault")
    log.emit("restart_begin", 13, rank=0, layer="inprocess", cause="exception")
    log.iteration += 1
    log.wait(2.0)  # the writer dies now, inside the restart
    log.emit("failure_detected", None, rank=0, cause="writer_died", message="the writer process died: killed by SIGKILL",
             signal="SIGKILL")
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 10, path="memory", seconds=0.2)
    log.steps(11, 16)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]  # one recovery, naming both faults
    assert fault["root_cause"]["kind"] == "exception" and fault["layer"] == "inprocess"
    assert fault["root_cause"]["also_injected"] == ["writer-kill@8:0"]
    surfaced = fault["root_cause"]["surfaced"]
    assert surfaced.startswith("writer-kill@8:0: the writer process died: killed by SIGKILL, found 2.") \
        and "after the fault was logged, during this recovery" in surfaced
    from resilient_training.gates.report import render_html

    assert "also injected meanwhile: writer-kill@8:0" in render_html(m, "run")


def test_checkpoint_faults_a_deferred_save_put_later_say_so_and_the_row_names_the_root_one(tmp_path: Path) -> None:
    """A fourth stranger trial: saves 10-25 deferred, ckpt-kill@10:1 and writer-kill@20:0 both
    fired at the save of step 30 (the writer-kill logged first); the row said "writer-kill@20:0"
    beside a ckpt-kill cause, and nothing said either was moved."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 30, checkpoint_every=5)
    log.emit("fault_injected", 30, rank=0, fault="writer-kill@20:0", type="writer-kill")
    log.emit("fault_injected", 30, rank=1, fault="ckpt-kill@10:1", type="ckpt-kill")
    log.emit("restart_begin", 30, rank=0, layer="launcher", cause="peer_failure")
    log.attempt += 1
    log.wait(3.0)
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 25, path="checkpoints/step_25", seconds=0.1)
    log.steps(26, 30)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    root = fault["root_cause"]
    assert fault["fault"] == "ckpt-kill@10:1" and root["kind"] == "ckpt-kill" and root["rank"] == 1
    assert root["scheduled_step"] == 10 and root["step"] == 30
    assert root["detail"] == ("ckpt-kill@10:1 (scheduled at step 10; a checkpoint fault acts at the first save at or "
                              "after it: step 30)")
    assert root["also_injected"] == ["writer-kill@20:0"]


@pytest.mark.parametrize("found", ["before-the-next-step", "after-the-next-step", "not-injected"])
def test_a_writer_replaced_while_training_goes_on_is_one_fault_of_the_writer_layer(tmp_path: Path, found: str) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 8, checkpoint_every=4)  # t = 0.84
    if found != "not-injected":
        log.emit("fault_injected", 8, rank=0, fault="writer-kill@8:0", type="writer-kill")
    if found == "after-the-next-step":
        log.steps(9, 9)  # t = 0.94: training went on before the death was seen
    log.wait(0.05)
    died = log.t
    log.emit("failure_detected", 9, rank=0, cause="writer_died", pid=11, exitcode=-9, signal="SIGKILL",
             message="the async checkpoint writer process (pid 11) died: killed by SIGKILL")
    log.steps(10, 10)
    log.emit("ckpt_abandoned", 8, reason="writer died")
    log.wait(1.5)
    log.emit("writer_restarted", 10, rank=0, seconds=1.6, pid=12, restarts=1)
    ready = log.t
    log.steps(11, 16, checkpoint_every=4)  # no restore, no restart: the same iteration throughout
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    assert fault["layer"] == "writer" and fault["recovered"]
    assert fault["restored_step"] is None and fault["rollback_steps"] is None
    # Steady state: the first step after the new writer is ready, counted from the death.
    assert fault["recovery_seconds"] == pytest.approx(ready + 0.1 - died)
    root = fault["root_cause"]
    assert root["rank"] == 0 and root["signal"] == "SIGKILL"
    assert root["kind"] == ("writer_died" if found == "not-injected" else "writer-kill")
    assert root["injected"] is (found != "not-injected")
    assert "killed by SIGKILL" in root["detail"]
    assert m["restarts_by_layer"] == {"writer": 1} and m["recovery_seconds"]["by_layer"]["writer"]["count"] == 1
    # Training never stopped: no downtime, no rollback, no failure for the interval advice.
    assert m["downtime_seconds"] == 0 and m["infrastructure_goodput"] == 1.0
    assert m["steps"]["replayed"] == 0 and m["suggested_checkpoint_interval"]["mtbf_seconds"] is None


def test_a_writer_replaced_at_the_last_step_recovers_at_the_end(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 8, checkpoint_every=4)
    log.emit("failure_detected", 8, rank=0, cause="writer_died", message="killed by SIGKILL", signal="SIGKILL")
    log.wait(2.0)
    log.emit("writer_restarted", 8, rank=0, seconds=2.0, pid=12, restarts=1)
    log.wait(0.3)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["layer"] == "writer" and fault["recovery_seconds"] == pytest.approx(2.3)


def test_the_report_shows_the_writer_layer(tmp_path: Path) -> None:
    from resilient_training.gates.report import write_report

    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 8, checkpoint_every=4)
    log.emit("fault_injected", 8, rank=0, fault="writer-kill@8:0", type="writer-kill")
    log.emit("failure_detected", 8, rank=0, cause="writer_died", signal="SIGKILL",
             message="the async checkpoint writer process (pid 11) died: killed by SIGKILL")
    log.wait(1.0)
    log.emit("writer_restarted", 8, rank=0, seconds=1.0, pid=12, restarts=1)
    log.steps(9, 12, checkpoint_every=4)
    log.end()
    log.close()
    page = write_report(tmp_path, tmp_path / "report.html").read_text()
    assert "<td>writer-kill@8:0</td><td>writer-kill on rank 0: writer-kill@8:0: the async checkpoint writer process " \
           "(pid 11) died: killed by SIGKILL</td><td>writer</td>" in page
    assert "<tr><td>writer</td><td>1</td>" in page  # the recovery table's row for the layer


def test_a_fault_while_the_writer_is_replaced_is_an_episode_of_its_own(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 8, checkpoint_every=4)
    log.emit("fault_injected", 8, rank=0, fault="writer-kill@8:0", type="writer-kill")
    log.wait(0.05)
    log.emit("failure_detected", 9, rank=0, cause="writer_died", message="killed by SIGKILL", signal="SIGKILL")
    log.steps(9, 11)
    log.emit("fault_injected", 12, rank=1, fault="exception@12:1", type="exception")
    log.emit("failure_detected", 12, rank=1, cause="exception", message="InjectedFault")
    log.iteration += 1
    log.wait(1.0)
    log.emit("restart_done", layer="inprocess")
    log.emit("writer_restarted", 12, rank=0, seconds=2.0, pid=12, restarts=1)
    log.emit("load_done", 11, path="memory", seconds=0.2)
    log.steps(12, 14)
    log.end()
    log.close()
    faults = compute_metrics(tmp_path)["faults"]
    assert [(f["fault"], f["layer"]) for f in faults] == [("writer-kill@8:0", "writer"), ("exception@12:1", "inprocess")]
    assert "also_injected" not in faults[0]["root_cause"]
    # Measured to its new writer's readiness, not cut at the next fault (0.3 s: a stranger trial's
    # writer-kill x3 said 0.02 s for a 1.46 s replacement).
    assert faults[0]["recovery_seconds"] == pytest.approx(1.3)


def test_where_a_recovery_went_adds_up_to_it_and_the_report_names_the_largest_parts(tmp_path: Path) -> None:
    from resilient_training.gates.report import write_report

    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 6, checkpoint_every=5)
    log.emit("fault_injected", 7, rank=0, fault="exception@7:0", type="exception")
    log.emit("failure_detected", 7, rank=0, cause="exception", message="injected")
    log.emit("restart_begin", 7, layer="inprocess", cause="exception")
    log.iteration += 1
    log.wait(0.1)  # our failure handling, before NVRx's first mark
    phases = {"nvrx_wait": 0.05, "nvrx_abort_nccl": 0.5, "nvrx_gc": 0.02, "find_checkpoint": 0.2, "load_checkpoint": 0.03}
    log.emit("restart_done", layer="inprocess")
    log.wait(sum(phases.values()))
    log.emit("load_done", 5, path="checkpoints/step_5", source="storage", seconds=0.23, phases=phases)
    log.wait(0.05)  # the trainer's own work before the first step (a loaded CI machine: 11 ms once)
    log.steps(6, 8, seconds=0.1)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    assert fault["layer"] == "inprocess"
    assert list(fault["phases"]) == ["other", *phases, "first_step"]
    assert fault["phases"]["other"] == pytest.approx(0.1, abs=1e-3)
    assert fault["phases"]["first_step"] == pytest.approx(0.15, abs=1e-3)
    assert sum(fault["phases"].values()) == pytest.approx(fault["recovery_seconds"], abs=2e-3)
    page = write_report(tmp_path, tmp_path / "report.html").read_text()
    assert "<td>nvrx_abort_nccl 0.50 s, find_checkpoint 0.20 s, first_step 0.15 s</td>" in page


def _restored_at_the_final_step(run: Path, status: str) -> None:
    log = ScriptedLog(run)
    log.start()
    log.steps(1, 8, checkpoint_every=4)
    log.emit("fault_injected", 8, rank=1, fault="ckpt-hang@8:1")
    log.wait(1.0)
    log.emit("failure_detected", 8, cause="hang", message="save")
    log.emit("restart_begin", 8, layer="inprocess", cause="hang")
    log.iteration += 1
    log.wait(0.5)
    log.emit("restart_done", layer="inprocess")
    log.wait(0.2)
    log.emit("load_done", 8, path="memory", source="memory (snapshot)", seconds=0.1)
    log.wait(1.5)  # the final checkpoint written again
    log.end(status, "target step reached" if status == "completed" else "commit failed")
    log.close()


def test_a_restore_at_the_final_step_recovers_when_the_run_completes(tmp_path: Path) -> None:
    _restored_at_the_final_step(tmp_path, "completed")
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert (fault["layer"], fault["recovered"], fault["rollback_steps"]) == ("inprocess", True, 0)
    # To the restore (t = 1.7): the final save after it is one that a run without the fault makes too.
    assert fault["recovery_seconds"] == pytest.approx(1.7)
    assert sum(fault["phases"].values()) == pytest.approx(1.7)


def test_a_restore_at_the_final_step_then_a_failed_end_is_not_a_recovery(tmp_path: Path) -> None:
    _restored_at_the_final_step(tmp_path, "failed")
    m = compute_metrics(tmp_path)
    assert m["unrecovered_faults"] == 1 and not m["faults"][0]["recovered"]


def test_a_fault_repeated_on_rank_1_right_after_its_restore_is_a_fault_of_its_own(tmp_path: Path) -> None:
    """A stranger trial's ``exception@6:1x3``: rank 1 restored, completed step 5 and failed again
    at step 6 a millisecond before rank 0 logged that same step 5. The injection was taken into the
    second fault's episode (``also_injected``), and the third recovery was reported as rank 1
    having died without a word. A step completed by any rank after its restore ends the recovery
    (training steps are collective); a fault injected after it is one of its own.
    """
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 5, checkpoint_every=4)
    for _ in range(2):
        log.wait(0.05)
        log.emit("fault_injected", 6, rank=1, fault="exception@6:1x3")
        log.emit("failure_detected", 6, rank=1, cause="exception", message="InjectedFault: exception@6:1x3")
        log.emit("failure_detected", 6, rank=0, cause="peer_failure", message="rank 1 failed")
        log.emit("restart_begin", 6, layer="inprocess", cause="exception")
        log.iteration += 1
        log.wait(1.0)
        log.emit("restart_done", layer="inprocess")
        log.emit("load_done", 4, path="checkpoints/step_4", seconds=0.2)
        log.wait(0.1)
        log.emit("step", 5, rank=1, loss=2.0, seconds=0.1)  # rank 1 first, then its next fault, then rank 0
    log.wait(0.001)
    log.emit("step", 5, rank=0, loss=2.0, seconds=0.1)
    log.steps(6, 8)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert [f["root_cause"]["kind"] for f in m["faults"]] == ["exception"] * 2, m["faults"]
    assert [f["root_cause"]["rank"] for f in m["faults"]] == [1, 1]
    assert all("also_injected" not in f["root_cause"] for f in m["faults"]), m["faults"]
    assert [f["layer"] for f in m["faults"]] == ["inprocess", "inprocess"]
    assert m["restart_causes"] == {"exception": 2}
    assert [f["recovery_seconds"] for f in m["faults"]] == pytest.approx([1.1, 1.101])


def test_null_and_negative_durations_count_as_none(tmp_path: Path) -> None:
    """A second stranger trial: a null ``seconds`` or ``bytes`` (the schema allows null) was a
    TypeError in the report, and a negative save stall (the wall clock stepped back during a
    save) a math domain error in the interval suggestion."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 4)
    log.emit("ckpt_begin", 4, mode="async")
    log.emit("ckpt_staged", 4, seconds=-3.0)
    log.emit("ckpt_committed", 4, rank=0, bytes=None, seconds=None, path="checkpoints/step_4")
    log.steps(5, 8, checkpoint_every=8)
    log.emit("step", 9, rank=0, loss=1.0, seconds=None)
    log.emit("step", 9, rank=1, loss=1.0, seconds=-1.0)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert m["checkpoints"]["stall_seconds"]["max"] == pytest.approx(0.02)
    stalls = m["checkpoints"]["stall_seconds"]
    assert stalls["count"] == 2 and stalls["p50"] == pytest.approx(0.01)
    assert m["checkpoints"]["bytes"]["count"] == 2
    assert 0 <= m["training_goodput"] <= 1


@pytest.mark.parametrize("then", ["end", "steps"])
def test_a_peers_late_report_without_a_restart_is_no_fault(tmp_path: Path, then: str) -> None:
    """A second stranger trial: rank 1's peer_failure logged after rank 0's last step (a rank that
    finished first is seen as gone by its peer) was an unrecovered fault, blamed on rank 0 having
    died without a word, in a run that completed; with rank 1's clock a little ahead, its
    restart_requested of an in-process restart did the same. Training went on, nothing restarted."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 8, checkpoint_every=4)
    log.wait(0.01)
    log.emit("failure_detected", 8, rank=1, cause="peer_failure", message="Connection closed by peer")
    if then == "steps":
        log.steps(9, 12, checkpoint_every=4)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert m["faults"] == [] and m["unrecovered_faults"] == 0, m["faults"]
    assert m["status"] == "completed" and m["infrastructure_goodput"] == pytest.approx(1.0)


@pytest.mark.parametrize("later", ["nan", "finite"])
def test_a_nan_the_training_went_on_with_is_never_recovered(tmp_path: Path, later: str) -> None:
    """A stranger trial's ``nan@6:0 --no-nan-guard``: every later loss NaN, and the report said the
    fault was absorbed, 0 s, none unrecovered, infrastructure goodput 100 %. A NaN injected and
    followed by finite losses (a task whose loss does not carry it) is still absorbed."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 5)
    log.emit("fault_injected", 6, rank=0, fault="nan@6:0")
    log.steps(6, 10, loss=(lambda step: 5.0 - step * 0.1) if later == "finite" else (lambda step: math.nan))
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    if later == "finite":
        assert fault["layer"] == "none" and m["unrecovered_faults"] == 0
    else:
        assert fault["layer"] == "unrecovered" and fault["recovery_seconds"] is None, fault
        assert m["unrecovered_faults"] == 1 and m["infrastructure_goodput"] < 0.6


def test_an_injected_hang_says_what_found_it_and_a_second_injection_is_not_a_symptom(tmp_path: Path) -> None:
    """A stranger trial: a hang's detail named only the schedule entry, not the timeout that found
    it; and of two faults injected at one step, the second rank's own exception was listed as a
    symptom report from another rank."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 8, checkpoint_every=4)
    log.emit("fault_injected", 9, rank=1, fault="hang@9:1")
    log.wait(3.0)
    log.emit("failure_detected", 9, rank=0, cause="DistBackendError", message="gloo timeout after 3000 ms")
    log.wait(0.1)
    log.emit("hang_detected", 9, rank=1, reason="no progress for 3.1 s in step (allowance 3.0 s)", where="step")
    log.emit("failure_detected", 9, rank=1, cause="hang", message="soft timeout")
    log.emit("restart_begin", 9, layer="inprocess", cause="hang")
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 8, path="checkpoints/step_8", seconds=0.1)
    log.steps(9, 10)
    log.emit("fault_injected", 11, rank=0, fault="exception@11:0")
    log.emit("fault_injected", 11, rank=1, fault="exception@11:1")
    log.emit("failure_detected", 11, rank=0, cause="exception", message="InjectedFault: exception@11:0")
    log.emit("failure_detected", 11, rank=1, cause="exception", message="InjectedFault: exception@11:1")
    log.emit("restart_begin", 11, layer="inprocess", cause="exception")
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 8, path="checkpoints/step_8", seconds=0.1)
    log.steps(9, 12)
    log.end()
    log.close()
    hang, both = compute_metrics(tmp_path)["faults"]
    assert hang["root_cause"]["rank"] == 1
    assert hang["root_cause"]["detected_by"] == ("rank 0 at step 9: DistBackendError (gloo timeout after 3000 ms)")
    assert "detected by rank 0 at step 9" in hang["root_cause"]["detail"]
    assert both["root_cause"]["also_injected"] == ["exception@11:1"]
    assert [s for s in both["symptoms"] if s["event"] == "failure_detected"] == []


def test_a_lost_node_is_named_with_its_ranks(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path, world_size=4)
    for rank in range(4):
        log.emit("start", rank=rank, world_size=4, pid=1, host="test", layers=[], nvrx_version="0",
                 torch_version="0", node=rank // 2)
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 6, checkpoint_every=4)
    log.emit("fault_injected", 7, rank=2, fault="node-loss@7:1")
    log.emit("restart_begin", 7, rank=-1, layer="pod", cause="node-loss", node=1)
    log.wait(5.0)
    log.emit("restart_done", rank=-1, layer="pod", node=1)
    log.attempt += 1
    log.emit("load_done", 4, path="checkpoints/step_4", seconds=0.1)
    log.steps(5, 8)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["root_cause"]["node"] == 1 and fault["root_cause"]["ranks"] == [2, 3]
    assert fault["root_cause"]["detail"] == "node-loss@7:1: node 1 (ranks 2, 3) lost"


def test_a_step_logged_between_the_fault_and_the_restore_is_replayed_time_too(tmp_path: Path) -> None:
    """A second stranger trial: rank 0's step 9 logged just after rank 1's fault_injected counted in
    the rollback (9 - 4 = 5 steps) but not in the replayed seconds (4 steps' worth)."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 8, checkpoint_every=4)
    log.emit("fault_injected", 9, rank=1, fault="sigkill@9:1")
    log.wait(0.03)
    log.emit("step", 9, rank=0, loss=1.0, seconds=0.1)  # its collective done before rank 1 died
    log.wait(0.5)
    log.emit("failure_detected", 9, rank=0, cause="peer_failure", message="rank 1 went away")
    log.attempt += 1
    log.wait(2.0)
    log.emit("load_done", 4, path="checkpoints/step_4", seconds=0.2)
    log.steps(5, 12)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert fault["rollback_steps"] == 5
    assert fault["replayed_seconds"] == pytest.approx(0.5)


def test_steps_that_took_longer_than_the_run_are_an_inconsistent_log(tmp_path: Path) -> None:
    """A second stranger trial: one step's seconds edited to 100 gave a training goodput of 838 %."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 4)
    log.emit("step", 5, loss=1.0, seconds=100.0)
    log.end()
    log.close()
    with pytest.raises(RunError, match=r"the event log does not add up: its steps took 100\.4 s, more than the 0\.4 s"):
        compute_metrics(tmp_path)


def test_an_exception_just_after_a_writer_kill_is_the_restart_s_root_cause(tmp_path: Path) -> None:
    """A third stranger trial: ``writer-kill@20:1,exception@21:0`` logged 5 ms apart; the in-process
    restart was rank 0's exception, yet the report blamed the writer-kill (injected first), listed
    rank 0's own restart as a symptom and counted restart causes {"writer-kill": 1}."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 20, checkpoint_every=10)
    log.emit("fault_injected", 20, rank=1, fault="writer-kill@20:1")
    log.wait(0.005)
    log.emit("fault_injected", 21, rank=0, fault="exception@21:0")
    log.emit("failure_detected", 21, rank=0, cause="exception", message="InjectedFault: exception@21:0")
    log.emit("restart_begin", 21, layer="inprocess", cause="exception")
    log.wait(0.15)
    log.emit("failure_detected", 21, rank=1, cause="writer_died", message="killed by SIGKILL", signal="SIGKILL")
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 20, path="memory", seconds=0.1)
    log.steps(21, 24)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    root = fault["root_cause"]
    assert (root["kind"], root["rank"], fault["layer"]) == ("exception", 0, "inprocess"), root
    assert root["also_injected"] == ["writer-kill@20:1"]
    assert m["restart_causes"] == {"exception": 1}
    assert {(s["rank"], s["event"]) for s in fault["symptoms"]} == {(1, "restart_begin")}, fault["symptoms"]


def test_a_fault_on_every_rank_at_once_lists_no_rank_s_own_failure_as_a_symptom(tmp_path: Path) -> None:
    log = ScriptedLog(tmp_path, world_size=3)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 5, checkpoint_every=4)
    for rank in range(3):
        log.emit("fault_injected", 6, rank=rank, fault=f"exception@6:{rank}")
    log.emit("failure_detected", 6, cause="exception", message="InjectedFault")
    log.emit("restart_begin", 6, layer="inprocess", cause="exception")
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 4, path="checkpoints/step_4", seconds=0.1)
    log.steps(5, 8)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert sorted(fault["root_cause"]["also_injected"]) == ["exception@6:1", "exception@6:2"]
    assert fault["symptoms"] == []


def test_a_resume_is_a_new_launch_its_gap_no_time_and_its_restore_no_recovery(tmp_path: Path) -> None:
    """A third stranger trial: a run whose in-process layer gave up (exit 1) was resumed with
    `train`; the report then called the fault recovered in-process (16.3 s, with 13 s of "new
    process"), and a resume 226 s later counted that idle time as uptime (goodput 96.8 %)."""
    log = ScriptedLog(tmp_path)

    def start(agent: str) -> None:  # each `train` runs its ranks under agents of its own
        log.emit("start", world_size=2, pid=1, host="test", layers=[], nvrx_version="0", torch_version="0",
                 agent=agent)

    start("test:100:1")
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 9, checkpoint_every=4)
    log.emit("fault_injected", 10, rank=1, fault="exception@10:1x20")
    log.emit("failure_detected", 10, rank=1, cause="exception", message="InjectedFault")
    log.emit("restart_begin", 10, layer="inprocess", cause="exception")
    log.iteration += 1
    log.wait(0.5)
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 8, path="checkpoints/step_8", seconds=0.1)
    log.steps(9, 9)
    log.emit("fault_injected", 10, rank=1, fault="exception@10:1x20")
    log.emit("failure_detected", 10, rank=1, cause="exception", message="InjectedFault")
    log.wait(0.1)
    log.end(status="failed", reason="in-process restart gave up after 1 restarts")
    log.wait(200.0)  # nothing runs
    log.attempt = log.iteration = 0
    start("test:200:9")
    log.emit("load_done", 8, path="checkpoints/step_8", seconds=0.1)
    log.steps(9, 20, checkpoint_every=4)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    first, second = m["faults"]
    assert first["layer"] == "inprocess" and first["recovered"]
    assert second["layer"] == "unrecovered" and not second["recovered"], second
    assert m["launches"] == 2
    assert m["wall_seconds"] < 10, m["wall_seconds"]
    assert m["downtime_seconds"] == pytest.approx(first["recovery_seconds"] + 0.1, abs=0.02)


def test_a_fault_in_another_s_restore_is_one_recovery_of_two_restarts(tmp_path: Path) -> None:
    """A third stranger trial: a load-hang in an exception's restore made a second in-process
    restart, and the report's restarts_by_layer (which counts recoveries) said 1. ``restarts``
    counts the restarts themselves."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 8, checkpoint_every=4)
    log.emit("fault_injected", 9, rank=0, fault="exception@9:0")
    log.emit("failure_detected", 9, rank=0, cause="exception", message="InjectedFault")
    log.emit("restart_begin", 9, layer="inprocess", cause="exception")
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.emit("fault_injected", 8, rank=1, fault="load-hang@8:1")
    log.wait(3.0)
    log.emit("failure_detected", 8, rank=0, cause="DistBackendError", message="timeout")
    log.emit("restart_begin", 8, layer="inprocess", cause="DistBackendError")
    log.iteration += 1
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 8, path="checkpoints/step_8", seconds=0.1)
    log.steps(9, 12)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert m["restarts_by_layer"] == {"inprocess": 1} and m["restarts"] == {"inprocess": 2}
    (fault,) = m["faults"]
    assert fault["root_cause"]["also_injected"] == ["load-hang@8:1"]


def test_a_restart_nobody_logged_a_failure_for_is_a_fault_and_a_rejoining_node_no_new_launch(tmp_path: Path) -> None:
    """A stranger trial's kill -9 of a worker: the launcher stopped the survivor before it logged
    anything, and the report showed no fault, no downtime, goodput 100 %. On two nodes the healthy
    node's agent restarted its rank at attempt 0 again (a re-rendezvous), which was taken for a
    new `train`, and the recovered fault called unrecovered."""
    log = ScriptedLog(tmp_path)

    def start(rank: int, agent: str) -> None:
        log.emit("start", rank=rank, world_size=2, pid=1, host="test", layers=[], nvrx_version="0",
                 torch_version="0", agent=agent, node=rank)

    for rank in (0, 1):
        start(rank, f"node{rank}:100:1")
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 10, checkpoint_every=4)
    log.wait(2.0)  # rank 0's worker killed; rank 1 stopped by its agent, nothing logged
    log.attempt = 1
    start(0, "node0:100:1")
    log.emit("restart_done", 0, rank=0, layer="launcher")
    log.attempt = 0
    start(1, "node1:100:1")  # the same agent, attempt 0 again
    log.attempt = 1
    log.emit("load_done", 8, rank=0, path="checkpoints/step_8", seconds=0.2)
    log.attempt = 0
    log.emit("load_done", 8, rank=1, path="checkpoints/step_8", seconds=0.2)
    log.attempt = 1
    log.steps(9, 16)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert m["launches"] == 1
    (fault,) = m["faults"]
    assert (fault["layer"], fault["root_cause"]["kind"], fault["recovered"]) == ("launcher", "died", True), fault
    assert fault["rollback_steps"] == 2 and fault["recovery_seconds"] == pytest.approx(2.1, abs=0.01)
    assert m["downtime_seconds"] == pytest.approx(fault["recovery_seconds"])


def test_the_status_of_an_earlier_launch_is_not_a_later_killed_one_s(tmp_path: Path) -> None:
    """A stranger trial: a completed run resumed with a further target and killed at step 70: the
    report still said completed (the convergence gate said the last session logged no end)."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 8)
    log.end()
    log.wait(5.0)
    log.start()
    log.steps(9, 12)
    log.close()
    m = compute_metrics(tmp_path)
    assert m["status"] == "unknown" and "an earlier one ended completed" in m["end_reason"]


def test_a_fault_spec_in_the_log_naming_a_file_is_never_read(tmp_path: Path) -> None:
    """The report reads a checkpoint fault's scheduled step from its spec in the event log, which is
    input: a spec naming a YAML file (what `--faults` may) must not make the report open it."""
    (tmp_path / "sched.yaml").write_text("faults: [{type: ckpt-kill, step: 2, rank: 0}]\n")
    log = ScriptedLog(tmp_path / "run")
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 10, checkpoint_every=5)
    log.emit("fault_injected", 10, rank=1, fault=str(tmp_path / "sched.yaml"), type="ckpt-kill")
    log.emit("restart_begin", 10, rank=0, layer="launcher", cause="peer_failure")
    log.attempt += 1
    log.wait(3.0)
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 5, path="checkpoints/step_5", seconds=0.1)
    log.steps(6, 10)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path / "run")["faults"]
    assert "scheduled_step" not in fault["root_cause"]


# --- a stranger trial audited the report against its own sums --------------------------------------


def _start(log: ScriptedLog, agent: str) -> None:
    log.emit("start", world_size=log.world_size, pid=1, host="test", agent=agent, layers=[], nvrx_version="0",
             torch_version="0")


def test_a_fault_the_run_gave_up_on_gets_nothing_of_the_resume_s_restore(tmp_path: Path) -> None:
    """The next `train`'s restore gave the unrecovered fault a rollback of 6 steps and phases that
    ran through the 106 s between the two launches."""
    log = ScriptedLog(tmp_path)
    _start(log, "agent-1")
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)
    log.emit("fault_injected", 13, rank=1, fault="exception@13:1", type="exception")
    log.emit("failure_detected", 13, rank=1, cause="exception", message="InjectedFault")
    log.emit("end", 13, status="failed", reason="in-process restart gave up")
    log.wait(100.0)
    _start(log, "agent-2")
    log.emit("load_done", 10, path="checkpoints/step_10", source="storage", seconds=0.2)
    log.steps(11, 20)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    assert (fault["layer"], fault["recovered"]) == ("unrecovered", False)
    assert (fault["restored_step"], fault["rollback_steps"], fault["phases"]) == (None, None, {})
    assert m["rollback_steps"]["count"] == 0
    assert m["launches"] == 2 and m["attempts"] == 2  # attempt 0 of each launch


def _writer_death_then_launcher_restart(log: ScriptedLog, *, new_writer: bool) -> None:
    _start(log, "agent-1")
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 20, checkpoint_every=10)
    log.emit("fault_injected", 20, rank=1, fault="writer-kill@20:1", type="writer-kill")
    log.emit("failure_detected", 21, rank=1, cause="writer_died", message="killed by SIGKILL", signal="SIGKILL")
    log.steps(21, 24)
    log.emit("fault_injected", 25, rank=0, fault="ckpt-kill@25:0", type="ckpt-kill")
    log.attempt += 1
    log.wait(3.0)
    _start(log, "agent-1")
    log.emit("restart_done", layer="launcher")
    log.emit("load_done", 20, path="checkpoints/step_20", source="storage", seconds=0.2)
    log.steps(21, 30)
    if new_writer:
        log.emit("writer_ready", 30, rank=1, seconds=5.0, pid=7)
    log.steps(31, 33)
    log.end()
    log.close()


@pytest.mark.parametrize("new_writer", [True, False])
def test_a_writer_death_cut_by_a_launcher_restart_runs_to_the_new_process_s_writer(
        tmp_path: Path, new_writer: bool) -> None:
    """It said "writer, recovered, 0.97 s" when no writer was ready for 11 s (a new process's
    writer logs writer_ready, not writer_restarted); one never replaced is not recovered."""
    log = ScriptedLog(tmp_path)
    _writer_death_then_launcher_restart(log, new_writer=new_writer)
    m = compute_metrics(tmp_path)
    writer, killed = m["faults"]
    assert (writer["fault"], writer["layer"], killed["layer"]) == ("writer-kill@20:1", "writer", "launcher")
    assert writer["recovered"] is new_writer
    if new_writer:
        assert writer["recovery_seconds"] == pytest.approx(0.4 + 3.0 + 1.0, abs=0.01)  # death to readiness
    # Training went on while it was replaced: no time lost to it, whatever its recovery took.
    assert writer["lost_seconds"] in (0.0, None)
    assert m["lost_seconds_per_fault"]["count"] == 1 + new_writer
    if new_writer:
        assert m["lost_seconds_per_fault"]["mean"] == pytest.approx(killed["lost_seconds"] / 2)


def test_saves_begun_and_never_committed_are_failed_and_the_interval_is_the_mean_gap(tmp_path: Path) -> None:
    """"failed" counted an event nothing logs (always 0), and the interval was the median gap,
    which hid the deferred saves (commits at 10, 20, 50, 60 said "every 10")."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    for step in range(1, 61):
        log.steps(step, step)
        if step % 10 == 0:
            log.emit("ckpt_begin", step, mode="async", tier="persistent")
            if step in (30, 40):
                log.emit("ckpt_abandoned", step, reason="carried save dropped", tier="persistent")
            else:
                log.emit("ckpt_committed", step, rank=0, bytes=1000, seconds=0.2, path=f"checkpoints/step_{step}")
    log.end()
    log.close()
    ck = compute_metrics(tmp_path)["checkpoints"]
    assert ck["steps"] == [10, 20, 50, 60] and ck["failed"] == 2
    assert ck["interval_steps"] == pytest.approx(50 / 3) and ck["interval_steps_max"] == 30


def test_steps_on_non_finite_weights_are_not_productive(tmp_path: Path) -> None:
    """With --no-nan-guard the steps after a NaN trained nothing, and were counted productive."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 10, seconds=1.0, loss=lambda step: float("nan") if step > 5 else 5.0 - step * 0.1)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert m["productive_step_seconds"] == pytest.approx(5.0)
    assert m["steps"]["completed"] == 10


def test_a_hung_rank_s_interruption_is_not_quoted_as_its_root_cause(tmp_path: Path) -> None:
    """The hung rank logs what NVRx raised in it to end the hang ("Interruption.EXCEPTION on
    ranks={0}"): quoted, it read as if rank 0 had raised an exception."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 12, checkpoint_every=5)
    log.emit("fault_injected", 13, rank=1, fault="hang@13:1", type="hang")
    log.wait(3.0)
    log.emit("failure_detected", 13, rank=1, cause="hang", message="RankShouldRestart: Interruption.EXCEPTION on ranks={0}")
    log.emit("failure_detected", 13, rank=0, cause="peer_failure", message="DistBackendError: a peer failed")
    log.emit("restart_begin", 13, layer="inprocess", cause="hang")
    log.iteration += 1
    log.wait(1.0)
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 10, path="memory", seconds=0.1)
    log.steps(11, 15)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    root = fault["root_cause"]
    assert (root["kind"], root["rank"], fault["layer"]) == ("hang", 1, "inprocess")
    assert "ranks={0}" not in root["detail"] and root["detail"].startswith("hang@13:1"), root["detail"]


def test_a_run_resumed_at_another_world_size_reports_the_last_and_every_one(tmp_path: Path) -> None:
    """A stranger trial's run went from 1 rank to 3 at a resume: the report said "world size 1"."""
    from resilient_training.gates.report import write_report

    log = ScriptedLog(tmp_path, world_size=1)
    _start(log, "agent-1")
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 10, checkpoint_every=5)
    log.end()
    log.world_size = 3
    log.wait(50.0)
    _start(log, "agent-2")
    log.emit("load_done", 10, path="checkpoints/step_10", seconds=0.1)
    log.steps(11, 20, checkpoint_every=5)
    log.end()
    log.close()
    m = compute_metrics(tmp_path)
    assert (m["world_size"], m["world_sizes"], m["launches"]) == (3, [1, 3], 2)
    assert "world size 1 → 3 · 2 launch(es)" in write_report(tmp_path, tmp_path / "r.html").read_text()
