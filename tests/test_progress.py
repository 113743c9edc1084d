"""The progress guard: the allowance, its calibration, and what the keeper thread does with it.

Real threads and the real clock, with short allowances (tenths of a second).
"""

from __future__ import annotations

import threading
import time

import pytest

from resilient_training.runtime.progress import WARM_UP_STEPS, ProgressGuard


class Recorder:
    def __init__(self) -> None:
        self.pings = 0
        self.beats = 0
        self.expired: list[tuple[float, str]] = []
        self.event = threading.Event()

    def ping(self) -> None:
        self.pings += 1

    def beat(self) -> None:
        self.beats += 1

    def expire(self, reason: str) -> None:
        self.expired.append((time.monotonic(), reason))
        self.event.set()


@pytest.fixture
def guard_and_recorder():
    recorder = Recorder()
    guard = ProgressGuard(initial=0.6, phase_default=1.5, floor=0.3, margin=5.0, beat=recorder.beat, tick=0.02)
    yield guard, recorder
    guard.close()


def _steps(guard: ProgressGuard, count: int, seconds: float) -> float:
    """Returns when the last step began reporting: the guard's deadline counts from no earlier."""
    last = time.monotonic()
    for _ in range(count):
        time.sleep(seconds)
        last = time.monotonic()
        guard.progress()
    return last


def test_a_rank_waiting_in_a_collective_reports_after_the_rank_stalled_outside_one():
    """Two ranks with the same allowance and the same last progress: the one stalled in its own
    step reports first, the one waiting for it in a collective a grace later (on 2 H200s the
    waiting rank had reported first, and was named, in 2 of 5 such hangs)."""
    from resilient_training.runtime.progress import COLLECTIVE_GRACE

    stalled, waiting = Recorder(), Recorder()
    guards = [ProgressGuard(initial=0.6, phase_default=1.5, floor=0.3, margin=5.0, tick=0.02) for _ in range(2)]
    try:
        started = time.monotonic()
        guards[0].arm(ping=stalled.ping, on_expire=stalled.expire)
        guards[1].arm(ping=waiting.ping, on_expire=waiting.expire)
        guards[1].in_collective = True
        assert stalled.event.wait(3) and waiting.event.wait(3)
        (first, reason), (second, waited_reason) = stalled.expired[0], waiting.expired[0]
        assert 0.6 <= first - started < 1.0 and "in step" in reason, (first - started, reason)
        assert second - first >= COLLECTIVE_GRACE - 0.05, second - first
        assert f"in collective; allowance 0.6 s (soft_timeout; not calibrated yet) + {COLLECTIVE_GRACE:g} s waiting" \
            in waited_reason, waited_reason
    finally:
        for guard in guards:
            guard.close()


def test_before_calibration_the_allowance_is_the_soft_timeout(guard_and_recorder):
    guard, recorder = guard_and_recorder
    started = time.monotonic()  # before arming: the deadline counts from no earlier
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    assert recorder.event.wait(3)
    waited = recorder.expired[0][0] - started
    assert 0.6 <= waited < 1.0, waited
    assert "not calibrated" in recorder.expired[0][1]


def test_steady_steps_calibrate_the_allowance_and_a_stall_expires_it_once(guard_and_recorder):
    guard, recorder = guard_and_recorder
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    # Measured from before the last step's report (not after these asserts): the deadline counts
    # from the report, and a loaded machine may take a while to get back here.
    stalled = _steps(guard, WARM_UP_STEPS + 5, 0.02)
    assert guard.slowest_gap is not None and guard.slowest_gap < 0.1
    assert guard.step_allowance == pytest.approx(max(0.3, 5 * guard.slowest_gap))
    pings = recorder.pings
    assert recorder.event.wait(3)
    waited = recorder.expired[0][0] - stalled
    assert guard.step_allowance <= waited < guard.step_allowance + 0.3, waited
    assert recorder.pings > pings  # the keeper kept reporting until the allowance ran out
    after = recorder.pings, recorder.beats
    time.sleep(0.2)
    assert (recorder.pings, recorder.beats) == after  # and stopped after it
    assert len(recorder.expired) == 1
    assert "slowest step" in recorder.expired[0][1]
    assert guard.expiry == recorder.expired[0][1]


def test_warm_up_steps_do_not_calibrate(guard_and_recorder):
    guard, recorder = guard_and_recorder
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    _steps(guard, WARM_UP_STEPS, 0.25)  # slow first steps (lazy initialisation)
    assert guard.slowest_gap is None
    _steps(guard, 3, 0.01)
    assert guard.slowest_gap is not None and guard.slowest_gap < 0.2


def test_the_first_steps_after_a_start_get_the_soft_timeout_not_the_calibrated_allowance(guard_and_recorder):
    """A restarted 1.3B rank (its calibration persisted: 5 x 0.28 s steps) was reported hung at its
    second step, 3.1 s long while its new staging buffers were being made and its writer started
    (call43): the calibration is of steady steps, and those are not steady yet."""
    guard, recorder = guard_and_recorder
    guard.load_state_dict({"slowest_gap": 0.02})  # a restarted process: calibrated from the start
    assert guard.step_allowance == pytest.approx(0.3)
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    guard.end_phase(guard.begin_phase("start"), warm_up=True)
    _steps(guard, 1, 0.45)  # past the calibrated 0.3 s, within the soft timeout (0.6 s)
    _steps(guard, WARM_UP_STEPS, 0.01)
    assert not recorder.expired
    stalled = _steps(guard, 1, 0.01)  # steady now: the calibrated allowance again
    assert recorder.event.wait(3)
    assert 0.3 <= recorder.expired[0][0] - stalled < 0.55
    assert "slowest step" in recorder.expired[0][1]


def test_a_hang_in_the_first_steps_after_a_start_is_caught_at_the_soft_timeout(guard_and_recorder):
    guard, recorder = guard_and_recorder
    guard.load_state_dict({"slowest_gap": 0.02})
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    guard.end_phase(guard.begin_phase("start"), warm_up=True)
    stalled = _steps(guard, 1, 0.01)
    assert recorder.event.wait(3)
    assert 0.6 <= recorder.expired[0][0] - stalled < 0.9
    assert "first steps after a start" in recorder.expired[0][1]


def test_a_phase_gets_its_own_budget_and_is_measured_only_when_it_completes(guard_and_recorder):
    guard, recorder = guard_and_recorder
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    outer = guard.begin_phase("load")
    time.sleep(1.0)  # longer than the step allowance (0.6), within the default phase budget (1.5)
    assert not recorder.expired
    guard.end_phase(outer)
    assert guard.slowest_phase["load"] == pytest.approx(1.0, abs=0.1)
    # Calibrated: margin x measured, never below the soft timeout.
    assert guard.phase_allowance("load") == pytest.approx(5 * guard.slowest_phase["load"])
    outer = guard.begin_phase("save")
    guard.end_phase(outer, measure=False)
    assert "save" not in guard.slowest_phase


def test_a_hang_inside_a_phase_expires_at_the_phase_budget(guard_and_recorder):
    guard, recorder = guard_and_recorder
    guard.observe("load", 0.1)  # e.g. a save's write time
    assert guard.phase_allowance("load") == pytest.approx(0.6)  # 5 x 0.1 = 0.5 < soft timeout 0.6
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    started = time.monotonic()
    guard.begin_phase("load")
    assert recorder.event.wait(3)
    assert 0.6 <= recorder.expired[0][0] - started < 0.9
    assert "phase load" in recorder.expired[0][1]


def test_disarmed_guard_never_expires_and_rearming_resets(guard_and_recorder):
    guard, recorder = guard_and_recorder
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    guard.disarm()
    time.sleep(0.9)
    assert not recorder.expired
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    assert guard.expiry is None
    assert recorder.event.wait(3)


def test_calibration_round_trips_and_only_grows(guard_and_recorder):
    guard, _ = guard_and_recorder
    guard.slowest_gap = 0.2
    guard.observe("load", 2.0)
    state = guard.state_dict()
    fresh = ProgressGuard(initial=0.6, phase_default=1.5, floor=0.3, margin=5.0)
    try:
        fresh.slowest_gap = 0.5
        fresh.load_state_dict(state)
        assert fresh.slowest_gap == 0.5  # never lowered by an older measurement
        assert fresh.slowest_phase == {"load": 2.0}
        fresh.load_state_dict({"slowest_gap": "x", "slowest_phase": {"save": -1}})  # junk is ignored
        assert fresh.slowest_phase == {"load": 2.0}
        # JSON reads Infinity and NaN: a manifest carrying them must not disarm a phase's deadline.
        import json

        fresh.load_state_dict(json.loads('{"slowest_gap": Infinity, "slowest_phase": {"load": Infinity, "save": NaN, '
                                         '"start": true}}'))
        assert fresh.slowest_gap == 0.5 and fresh.slowest_phase == {"load": 2.0}
    finally:
        fresh.close()


def test_the_nccl_watchdog_outlasts_the_in_process_and_heartbeat_timeouts():
    from resilient_training.run.config import TimeoutConfig
    from resilient_training.runtime.trainer import collective_timeout

    defaults = TimeoutConfig()
    assert collective_timeout(defaults, nccl=False) == defaults.pg  # gloo: the short timeout releases peers
    nccl = collective_timeout(defaults, nccl=True)
    assert nccl > defaults.hard and nccl > defaults.heartbeat
    suite = TimeoutConfig(pg=60.0, soft=90.0, hard=120.0, heartbeat=150.0)  # the old GPU suite's
    assert collective_timeout(suite, nccl=True) > suite.hard


def test_the_step_allowance_never_exceeds_the_soft_timeout(guard_and_recorder):
    guard, recorder = guard_and_recorder
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    _steps(guard, WARM_UP_STEPS + 1, 0.01)
    guard.slowest_gap = 0.5  # one slow step: 5 x 0.5 = 2.5 s > soft_timeout 0.6 s
    assert guard.step_allowance == 0.6
    assert "would be longer" in guard.describe()


def test_a_phase_never_measured_can_have_a_shorter_default_than_a_restart_s_set_up():
    guard = ProgressGuard(initial=0.6, phase_default=30.0, floor=0.3, margin=5.0)
    try:
        guard.begin_phase("restore_memory", default=0.6)
        assert guard.describe() == "phase restore_memory: allowance 0.6 s (default)"
        assert guard.phase_allowance("load") == 30.0  # the others keep phase_default
        assert guard.phase_allowance("restore_memory", default=0.1) == 0.3  # never below the floor
    finally:
        guard.close()


class _WindDown:
    """A checkpointer whose last commit takes ``seconds`` (the 1.3B run's wind-down: over 6 s)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def finish(self) -> None:
        time.sleep(self.seconds)

    def drop_local_tier(self) -> None:
        pass


def _trainer_after_the_last_save(guard: ProgressGuard):
    from types import SimpleNamespace

    guard.observe("save", 0.01)  # the save phase's allowance: the soft timeout, 0.6 s
    return SimpleNamespace(guard=guard, _save_phase=(guard.begin_phase("save"), 10),
                           remover=SimpleNamespace(wait=lambda: None), _worker_record=lambda: None)


def test_the_wind_down_after_the_last_step_is_not_held_to_the_last_save_s_allowance(guard_and_recorder):
    """On one H200 a 1.3B run's guard reported a hang "in save" after its last commit (call42): the
    save phase begun at the last step had no next step to end it."""
    from resilient_training.runtime.trainer import Trainer

    guard, recorder = guard_and_recorder
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    _steps(guard, WARM_UP_STEPS + 2, 0.01)
    trainer = _trainer_after_the_last_save(guard)
    Trainer._wind_down(trainer, _WindDown(1.0))  # past the save's 0.6 s, within a phase's default 1.5 s
    assert recorder.expired == []
    assert trainer._save_phase is None and guard.slowest_phase["save"] == 0.01  # not measured
    assert 1.0 <= guard.slowest_phase["finish"] < 1.5


def test_a_wind_down_that_hangs_is_still_caught_and_said_to_be_there(guard_and_recorder):
    from resilient_training.runtime.trainer import Trainer

    guard, recorder = guard_and_recorder
    guard.arm(ping=recorder.ping, on_expire=recorder.expire)
    _steps(guard, WARM_UP_STEPS + 2, 0.01)
    Trainer._wind_down(_trainer_after_the_last_save(guard), _WindDown(2.0))
    assert len(recorder.expired) == 1 and "in finish" in recorder.expired[0][1]
