"""Faults nobody's schedule injected (a stranger's kill -STOP, kill -9 of a worker or of its NVRx
monitor process): what the report names and from when it counts, from scripted event logs shaped
like the real ones of those trials (2 ranks on CPU, 0.2 s steps, gloo's 3 s collective timeout).
"""

from pathlib import Path

import pytest

from resilient_training.gates.metrics import compute_metrics
from tests.support.gates import ScriptedLog

GLOO_TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
                "Timed out waiting 3000ms for send operation to complete")
GUARD = "no progress for {:.1f} s in step; allowance 3.0 s (5 \u00d7 slowest step 0.221 s)"


def _started(run: Path) -> ScriptedLog:
    log = ScriptedLog(run)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    return log


def _launcher_restart(log: ScriptedLog, restored: int, first: int, last: int) -> None:
    log.attempt += 1
    log.start()
    log.emit("restart_done", layer="launcher")
    log.wait(1.5)
    log.emit("load_done", restored, path=f"checkpoints/step_{restored}", source="storage", seconds=1.0)
    log.steps(first, last, seconds=0.2)
    log.end()
    log.close()


def test_a_stopped_rank_whose_guard_ran_out_is_the_hang_from_its_last_step(tmp_path: Path) -> None:
    """kill -STOP of rank 0 after its step 47 (trial r3): rank 1 finished step 48, timed out in
    step 49's collective 3 s later; rank 0's guard said "no progress for 9.5 s" when the launcher's
    heartbeat released it, and it logged step 48. The report said peer_failure, rank null, from
    rank 1's timeout."""
    log = _started(tmp_path)
    log.steps(1, 47, seconds=0.2, checkpoint_every=20)
    stopped = log.t  # rank 0's step 47: its last progress
    log.wait(0.2)
    log.emit("step", 48, rank=1, loss=3.0, seconds=0.2)
    log.wait(3.0)
    log.emit("failure_detected", 49, rank=1, cause="peer_failure", message=GLOO_TIMEOUT)
    log.emit("restart_begin", 49, rank=1, layer="inprocess", cause="peer_failure")
    log.wait(9.5 - 3.2)
    log.emit("hang_detected", 48, rank=0, reason=GUARD.format(9.5), where="step")
    log.emit("step", 48, rank=0, loss=3.0, seconds=9.45)
    log.wait(5.0)
    _launcher_restart(log, 40, 41, 60)
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    root = fault["root_cause"]
    assert (root["kind"], root["rank"], root["step"], root["injected"]) == ("hang", 0, 48, False), root
    assert root["where"] == "step" and "no progress for 9.5 s in step" in root["detail"]
    assert root["detected_by"].startswith("rank 1 at step 49: peer_failure")
    assert [(s["rank"], s["event"]) for s in fault["symptoms"]] == [(1, "failure_detected"), (1, "restart_begin")]
    assert fault["layer"] == "launcher" and m["restart_causes"] == {"hang": 1}
    # From rank 0's last step, as an injected hang counts from its injection (not 3.2 s later).
    assert fault["start"] == pytest.approx(stopped)
    first_step = next(t for t, step, _, attempt, *_ in m["loss"] if (step, attempt) == (41, 1))
    assert fault["recovery_seconds"] == pytest.approx(first_step - stopped, abs=1e-3)


def test_a_hang_whose_guard_ran_out_before_the_failure_counts_from_the_stall(tmp_path: Path) -> None:
    """The hung rank's guard runs out first and its hang is reported at once: the episode opens at
    that report, 3 s after the rank stopped making progress; it counts from the stall."""
    log = _started(tmp_path)
    log.steps(1, 12, seconds=0.2, checkpoint_every=5)
    stalled = log.t
    log.wait(3.1)
    log.emit("hang_detected", 13, rank=1, reason=GUARD.format(3.1), where="step")
    log.wait(0.05)
    log.emit("failure_detected", 13, rank=1, cause="hang", message="RankShouldRestart: Interruption.SOFT_TIMEOUT "
             "affecting ranks {1}")
    log.emit("failure_detected", 13, rank=0, cause="peer_failure", message=GLOO_TIMEOUT)
    log.emit("restart_begin", 13, layer="inprocess", cause="hang")
    log.iteration += 1
    log.wait(0.5)
    log.emit("restart_done", layer="inprocess")
    log.emit("load_done", 10, path="memory", source="memory", seconds=0.1)
    log.steps(11, 20, seconds=0.2)
    log.end()
    log.close()
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert (fault["root_cause"]["kind"], fault["root_cause"]["rank"], fault["layer"]) == ("hang", 1, "inprocess")
    assert fault["start"] == pytest.approx(stalled)
    assert [s["rank"] for s in fault["symptoms"] if s["event"] == "failure_detected"] == [0]


def test_a_guard_that_ran_out_and_went_on_or_waited_in_a_collective_is_not_blamed(tmp_path: Path) -> None:
    """A hang_detected followed by steps of its rank is over; one in a collective waits for a peer:
    neither is the root cause of a later failure (rank 1 killed without a word)."""
    log = _started(tmp_path)
    log.steps(1, 20, seconds=0.2, checkpoint_every=10)
    log.emit("hang_detected", 21, rank=0, reason=GUARD.format(3.1), where="step")
    log.steps(21, 25, seconds=0.2)
    killed = log.t
    log.wait(3.0)
    log.emit("hang_detected", 26, rank=0, reason=GUARD.format(3.0) + " + 10 s waiting in a collective",
             where="collective")
    log.emit("failure_detected", 26, rank=0, cause="peer_failure", message=GLOO_TIMEOUT)
    log.emit("restart_begin", 26, rank=0, layer="inprocess", cause="peer_failure")
    log.wait(3.0)
    _launcher_restart(log, 20, 21, 30)
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert (fault["root_cause"]["kind"], fault["root_cause"]["rank"]) == ("died", 1), fault["root_cause"]
    assert fault["start"] == pytest.approx(killed)  # its last sign of life, not rank 0's timeout 3 s later


def test_a_silent_death_counts_from_the_dead_rank_s_last_sign_of_life(tmp_path: Path) -> None:
    """kill -STOP of rank 0, then the launcher's heartbeat kills it (trial r2's last fault): rank 0
    logs nothing more; rank 1 reports its collective timing out 3 s later."""
    log = _started(tmp_path)
    log.steps(1, 33, seconds=0.2, checkpoint_every=20)
    last = log.t
    log.wait(0.2)
    log.emit("step", 34, rank=1, loss=1.0, seconds=0.2)
    log.wait(3.0)
    log.emit("failure_detected", 35, rank=1, cause="peer_failure", message=GLOO_TIMEOUT)
    log.emit("restart_begin", 35, rank=1, layer="inprocess", cause="peer_failure")
    log.wait(6.0)
    _launcher_restart(log, 20, 21, 40)
    (fault,) = compute_metrics(tmp_path)["faults"]
    assert (fault["root_cause"]["kind"], fault["root_cause"]["rank"]) == ("died", 0)
    assert fault["start"] == pytest.approx(last)
    assert "signal" not in fault["root_cause"]  # no event says which (see docs/gates.md)


@pytest.mark.parametrize(("message", "kind", "rank", "ranks", "says"), [
    ("RankShouldRestart: Interruption.UNRESPONSIVE on ranks={0}", "unresponsive", 0, [0],
     "rank 0 unresponsive (NVRx in-process monitor)"),
    ("RankShouldRestart: Interruption.SOFT_TIMEOUT affecting ranks {0, 1}", "hang", None, [0, 1],
     "ranks 0, 1 made no progress"),
])
def test_the_ranks_nvrx_names_in_a_restart_request_are_the_root_cause(
        tmp_path: Path, message: str, kind: str, rank: int | None, ranks: list[int], says: str) -> None:
    """kill -9 of rank 0's NVRx in-process monitor process (trial r2): both ranks logged
    restart_requested naming rank 0, and the launcher restarted them; the report said
    restart_requested, rank null."""
    log = _started(tmp_path)
    log.steps(1, 46, seconds=0.2, checkpoint_every=20)
    for r in (1, 0):
        log.emit("failure_detected", 47, rank=r, cause="restart_requested", message=message)
        log.emit("restart_begin", 47, rank=r, layer="inprocess", cause="restart_requested")
    log.end("failed", reason=f"restart_requested: {message.split(': ', 1)[1]}")
    log.wait(7.0)
    _launcher_restart(log, 40, 41, 60)
    m = compute_metrics(tmp_path)
    (fault,) = m["faults"]
    root = fault["root_cause"]
    assert (root["kind"], root["rank"], root["ranks"], root["injected"]) == (kind, rank, ranks, False), root
    assert root["detail"].startswith(says) and message in root["detail"]
    assert "died" not in root["detail"] and "monitor process" not in root["detail"]  # nothing logged says so
    assert fault["layer"] == "launcher" and m["restart_causes"] == {kind: 1}
    if rank is not None:  # the named rank's own report of the request is not a symptom of another rank
        assert {s["rank"] for s in fault["symptoms"]} == {1}


def test_launcher_restarts_a_rank_never_came_back_from_are_counted(tmp_path: Path) -> None:
    """Trial r2: after rank 0 was stopped, ft_launcher restarted the workers until it gave up and
    rank 0's new processes failed before logging anything: 6 launcher restarts were counted as 2
    (the reference rank's). restarts_by_layer counts the faults' recoveries, not the restarts."""
    log = _started(tmp_path)
    log.steps(1, 12, seconds=0.2, checkpoint_every=5)
    log.emit("failure_detected", 13, rank=1, cause="peer_failure", message=GLOO_TIMEOUT)
    log.emit("restart_begin", 13, rank=1, layer="inprocess", cause="peer_failure")
    for _ in range(4):  # rank 0's processes exit 1 before logging anything
        log.attempt += 1
        log.wait(4.0)
        log.emit("start", rank=1, world_size=2, pid=1, host="test", layers=[], nvrx_version="0", torch_version="0")
        log.emit("restart_done", rank=1, layer="launcher")
    log.emit("end", rank=-1, status="failed", reason="recovery gave up after 4 launcher restart(s)")
    log.close()
    m = compute_metrics(tmp_path)
    assert m["restarts"] == {"launcher": 4}
    assert m["restarts_by_layer"] == {"launcher": 1} and m["unrecovered_faults"] == 1
    (fault,) = m["faults"]
    assert (fault["root_cause"]["kind"], fault["root_cause"]["rank"]) == ("died", 0)
