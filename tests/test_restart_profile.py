"""Where a restart's time goes inside NVRx: the in-process wrapper's phases (our hooks around its
abort, health checks and initialize, and the garbage collections it runs between iterations) and
ft_launcher's own profiling events, both written to the event log.
"""

from __future__ import annotations

import sys
import types

from resilient_training.run import events as ev
from resilient_training.runtime import ft_launch, nvrx_adapter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_the_phases_of_an_in_process_restart_add_up_to_its_time_with_garbage_collection_apart() -> None:
    clock = Clock()
    timeline = nvrx_adapter.RestartTimeline(clock=clock)
    timeline.on_gc("start", {})  # before any failure: not part of a restart
    clock.advance(5.0)
    timeline.on_gc("stop", {})
    assert timeline.enter() == {}, "the first entry follows no restart"
    steps = [("failed", 0.0), ("abort_begin", 0.05), ("backends_aborted", 0.5), ("abort_end", 0.1),
             ("check_begin", 0.01), ("check_end", 0.3)]
    for name, seconds in steps:
        clock.advance(seconds)
        timeline.mark(name)
    assert timeline.restarting
    clock.advance(0.1)  # the iteration barrier, then NVRx's `while gc.collect()`
    timeline.on_gc("start", {})
    clock.advance(0.7)
    timeline.on_gc("stop", {})
    clock.advance(0.02)
    timeline.mark("init_begin")
    assert not timeline.restarting
    for name, seconds in [("init_end", 0.01), ("ready_begin", 0.0), ("ready_end", 0.2)]:
        clock.advance(seconds)
        timeline.mark(name)
    clock.advance(0.03)
    phases = timeline.enter()
    assert phases == {"nvrx_wait": 0.05, "nvrx_abort_nccl": 0.5, "nvrx_abort": 0.1, "nvrx_unwind": 0.01,
                      "nvrx_restart_check": 0.3, "nvrx_barrier": 0.12, "nvrx_initialize": 0.01,
                      "nvrx_health_check": 0.23, "nvrx_gc": 0.7}
    assert abs(sum(phases.values()) - 2.02) < 1e-6
    assert timeline.enter() == {}, "each restart is reported once"


def test_a_hang_is_aborted_before_the_training_function_returns() -> None:
    clock = Clock()
    timeline = nvrx_adapter.RestartTimeline(clock=clock)
    for name, seconds in [("abort_begin", 0.0), ("abort_end", 0.4), ("failed", 0.2), ("check_begin", 0.0),
                          ("check_end", 0.1), ("init_begin", 0.1)]:
        clock.advance(seconds)
        timeline.mark(name)
    phases = timeline.enter()
    assert phases == {"nvrx_abort": 0.4, "fn_unwind": 0.2, "nvrx_unwind": 0.0, "nvrx_restart_check": 0.1,
                      "nvrx_barrier": 0.1, "nvrx_health_check": 0.0}


def test_each_of_nvrx_launcher_profiling_events_reaches_the_event_log(tmp_path, monkeypatch) -> None:
    """NVRx 0.6+ records its restart profile (``record_profiling_event``) only as INFO log lines;
    the launcher process follows it into the run's event log. 0.4.1 (this machine) has no
    profiler, so the module is stood in for with the same shape.
    """
    class Phase:
        def __init__(self, value: str) -> None:
            self.value = value

    class FaultToleranceProfiler:
        def __init__(self) -> None:
            self._current_cycle = 0
            self.logged: list[str] = []

        def record_event(self, event, node_id=None, rank=None):
            if event.value == "failure_detected":
                self._current_cycle += 1
            self.logged.append(event.value)
            return f"{event.value}_{node_id}_{rank}"

    profiling = types.ModuleType("nvidia_resiliency_ext.shared_utils.profiling")
    profiling.FaultToleranceProfiler = FaultToleranceProfiler
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.shared_utils.profiling", profiling)
    import nvidia_resiliency_ext.shared_utils as shared

    monkeypatch.setattr(shared, "profiling", profiling, raising=False)
    monkeypatch.setattr(nvrx_adapter, "_launcher_emit", None)  # set by the trace; put back after
    argv = ["--monitor-interval=0.2", "-m", "resilient_training.runtime.worker", "--run-dir", str(tmp_path), "--steps", "3"]
    ft_launch._trace_phases(argv)
    ft_launch._trace_phases(argv)  # a second call does not log twice
    profiler = FaultToleranceProfiler()
    for phase in ("failure_detected", "worker_terminated", "rendezvous_completed"):
        assert profiler.record_event(Phase(phase), "node-a", 0) == f"{phase}_node-a_0"  # NVRx's own result
    assert profiler.logged == ["failure_detected", "worker_terminated", "rendezvous_completed"]
    nvrx_adapter.terminate_process_groups(set())  # our teardown (no workers left) says when it ended
    logged = [e for e in ev.read_events(tmp_path) if e.event == "launcher_phase"]
    assert [(e.rank, e["phase"], e["cycle"], e["node"]) for e in logged] == [
        (-1, "failure_detected", 1, "node-a"), (-1, "worker_terminated", 1, "node-a"),
        (-1, "rendezvous_completed", 1, "node-a"), (-1, "workers_gone", None, None)]


def test_the_launcher_finds_the_workers_run_directory_in_either_spelling() -> None:
    from resilient_training.runtime.spare_stub import run_dir_of

    assert run_dir_of(["-m", "w", "--run-dir", "/r"]) == "/r"
    assert run_dir_of(["-m", "w", "--run-dir=/r2"]) == "/r2"
    assert run_dir_of(["-m", "w", "--steps", "3"]) is None


def test_an_agent_profile_logged_before_the_workers_start_does_not_stretch_the_run(tmp_path) -> None:
    from resilient_training.gates import metrics
    from resilient_training.run import layout

    def line(ts: float, rank: int, event: str, step: int | None = None, **fields) -> str:
        return ev.Event(ts=ts, rank=rank, attempt=0, iteration=0, event=event, step=step, fields=fields).to_json() + "\n"

    directory = layout.events_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / "agent-a-1.jsonl").write_text(
        line(100.0, -1, "launcher_phase", phase="rendezvous_completed", cycle=0, node="a")
        + line(130.0, -1, "launcher_phase", phase="worker_start_completed", cycle=0, node="a"))
    (directory / "rank0.jsonl").write_text(
        line(115.0, 0, "start", world_size=1) + line(116.0, 0, "step", 1, loss=2.0, seconds=0.5)
        + line(117.0, 0, "step", 2, loss=1.9, seconds=0.5) + line(118.0, 0, "end", 2, status="completed", reason="done"))
    found = metrics.compute_metrics(tmp_path)
    assert found["wall_seconds"] == 3.0
    assert found["training_goodput"] == 1.0 / 3.0
    # Only an agent's own events are left out: a rank's event of that name (a forged log
    # shortening its wall to raise its goodput) still counts.
    with open(directory / "rank0.jsonl", "a") as handle:
        handle.write(line(121.0, 0, "launcher_phase", phase="worker_terminated", cycle=0, node="a"))
    assert metrics.compute_metrics(tmp_path)["wall_seconds"] == 6.0


def test_the_nccl_settings_for_in_process_restart_keep_what_the_user_set() -> None:
    environ = {"NCCL_CUMEM_ENABLE": "1"}  # e.g. multi-node NVLink, which needs cuMem
    nvrx_adapter.set_inprocess_nccl_env(environ)
    assert environ == {"NCCL_CUMEM_ENABLE": "1", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
    environ = {}
    nvrx_adapter.set_inprocess_nccl_env(environ)
    assert environ == {"NCCL_CUMEM_ENABLE": "0", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}


def test_a_collection_that_starts_inside_a_mark_does_not_deadlock() -> None:
    """A garbage collection can start on any allocation, on the thread that holds the timeline's
    lock; the callback then takes that lock again.
    """
    import gc
    import threading

    timeline = nvrx_adapter.RestartTimeline()
    timeline.mark("failed")
    done = threading.Event()

    def marks_under_collections() -> None:
        with timeline._lock:  # what mark() holds while it appends
            timeline.on_gc("start", {})
            timeline.on_gc("stop", {})
            timeline.mark("abort_begin")
        done.set()

    gc.callbacks.append(timeline.on_gc)
    try:
        worker = threading.Thread(target=marks_under_collections, daemon=True)
        worker.start()
        assert done.wait(5), "the timeline deadlocked on its own lock"
        gc.collect()
    finally:
        gc.callbacks.remove(timeline.on_gc)
    assert "nvrx_gc" in timeline.enter()


def test_a_restart_raised_into_the_training_thread_never_cuts_a_heartbeat_in_two() -> None:
    """NVRx raises its in-process restart into the training thread asynchronously. Raised inside a
    heartbeat being written, it corrupted the rank monitor's stream, and every retry then failed
    with a broken pipe. The message is written on a thread of its own: the raise interrupts only
    the wait. The client stands in for NVRx's RankMonitorClient (a socket to another process).
    """
    import ctypes
    import threading
    import time

    written: list[str] = []
    writing = threading.Event()

    class Client:
        def send_heartbeat(self) -> None:
            written.append("head")
            writing.set()
            time.sleep(0.3)  # the rest of the message, while the raise arrives
            written.append("tail")

    class Restart(Exception):
        pass

    beats = nvrx_adapter.Heartbeats(enabled=False)
    beats._client = Client()
    beats._sender = nvrx_adapter.Heartbeats.start_sender()
    raised: list[BaseException] = []

    def training() -> None:
        try:
            beats.beat()
        except Restart as exc:
            raised.append(exc)

    thread = threading.Thread(target=training)
    thread.start()
    assert writing.wait(5)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Restart))
    thread.join(5)
    beats._sender.shutdown(wait=True)
    assert raised, "the restart reached the training thread"
    assert written == ["head", "tail"], "the heartbeat was cut in two"


def test_calibration_synchronizes_on_the_training_thread_and_sends_one_floored_message_on_the_sender() -> None:
    """The collective stays on the training thread (every rank makes it at the same step); the
    message to the rank monitor goes through the sender thread, already floored, so the monitor
    never holds a timeout below the floor and no restart can cut that message in two either.
    The stand-in keeps the names of NVRx's private API that the adapter calls, checked below.
    """
    import inspect
    import threading

    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient
    from nvidia_resiliency_ext.fault_tolerance.timeouts_calc import TimeoutsCalc

    assert list(inspect.signature(RankMonitorClient._set_calculated_timeouts).parameters) == \
        ["self", "new_hb_timeouts", "new_section_timeouts"]
    assert all(callable(getattr(TimeoutsCalc, name)) for name in
               ("synchronize_all", "can_get_hb_timeouts", "get_hb_timeouts"))
    calls: list[tuple] = []

    class Calc:
        def synchronize_all(self) -> None:
            calls.append(("synchronize_all", threading.current_thread().name))

        def can_get_hb_timeouts(self) -> bool:
            return True

        def get_hb_timeouts(self, current: HeartbeatTimeouts) -> HeartbeatTimeouts:
            return HeartbeatTimeouts(initial=1.5, subsequent=20.0, were_calculated=True)

    class Client:
        timeouts_calc = Calc()
        hb_timeouts = HeartbeatTimeouts()

        def _set_calculated_timeouts(self, new_hb_timeouts, new_section_timeouts) -> None:
            calls.append(("set", threading.current_thread().name, new_hb_timeouts, new_section_timeouts))

    beats = nvrx_adapter.Heartbeats(enabled=False)
    beats._client = Client()
    beats._sender = nvrx_adapter.Heartbeats.start_sender()
    try:
        assert beats.calibrate(floor=10.0) == {"initial": 10.0, "subsequent": 20.0}
    finally:
        beats._sender.shutdown(wait=True)
    assert calls[0] == ("synchronize_all", threading.current_thread().name)
    ((what, thread, hb, sections),) = calls[1:]
    assert (what, sections) == ("set", None) and thread.startswith("heartbeat-send")
    assert (hb.initial, hb.subsequent, hb.were_calculated) == (10.0, 20.0, True)
