"""The signal that killed a worker, in the event log and the report.

A worker killed from outside (kill -9, a segfault, an abort) was "died, killed by a signal or
crashed": its exit code reached only the launcher log's free text (``exitcode: -9``). The
ft_launcher agent now logs each failed worker it finds (``worker_exit``), and the report names
the signal of the rank that died.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from resilient_training.gates import metrics
from resilient_training.run import events as ev
from resilient_training.runtime import ft_launch
from tests.test_launcher_killed import Runs, _marked, _start
from tests.test_launcher_killed import started as started  # noqa: F401 (the fixture)

# --------------------------------------------------------------------------- the wrapper


def _failure(local_rank: int, pid: int, exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(local_rank=local_rank, pid=pid, exitcode=exitcode)


def _failed(**failures: Any) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(name="UNHEALTHY"), failures=failures)


def test_the_wrapper_logs_each_failed_worker_once_and_returns_the_result_as_it_came() -> None:
    logged: list[tuple[str, dict[str, Any]]] = []
    results = iter([SimpleNamespace(state=SimpleNamespace(name="HEALTHY"), failures={}),
                    SimpleNamespace(state=SimpleNamespace(name="UNHEALTHY"), failures={1: _failure(1, 42, -11)}),
                    SimpleNamespace(state=SimpleNamespace(name="FAILED"),  # the same one again, and rank 0's
                                    failures={1: _failure(1, 42, -11), 0: _failure(0, 41, 1)})])
    returned: list[Any] = []

    def monitor(self: Any, group: Any) -> Any:
        returned.append(next(results))
        return returned[-1]

    wrapped = ft_launch._logging_exits(monitor, lambda name, step, **fields: logged.append((name, fields)))
    for _ in range(3):
        assert wrapped(object(), "group") is returned[-1]
    assert logged == [
        ("worker_exit", {"global_rank": 1, "local_rank": 1, "pid": 42, "exitcode": -11, "signal": "SIGSEGV",
                         "state": "UNHEALTHY"}),
        ("worker_exit", {"global_rank": 0, "local_rank": 0, "pid": 41, "exitcode": 1, "signal": None,
                         "state": "FAILED"})]


class _Hostile:
    """A result whose every attribute raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(name)


@pytest.mark.parametrize("result", [None, _Hostile(), SimpleNamespace(failures=None),
                                    SimpleNamespace(failures=[1, 2]), SimpleNamespace(failures={"x": object()}),
                                    _failed(**{"1": _Hostile()}), _failed(**{"1": _failure(1, 42, -200)})],
                         ids=["none", "hostile", "no-failures", "a-list", "odd-failure", "hostile-failure",
                              "unknown-signal"])
def test_the_wrapper_never_raises_nor_changes_the_result(result: Any) -> None:
    def emit(name: str, step: Any, **fields: Any) -> None:
        raise OSError("disk full")

    wrapped = ft_launch._logging_exits(lambda self, group: result, emit)
    assert wrapped(object(), "group") is result
    # ... and with an event log that takes anything: unusual values logged as null, not raised on
    ft_launch.log_worker_exits(result, lambda *a, **k: None, set())


def test_the_agent_class_is_wrapped_as_it_is_defined(monkeypatch: pytest.MonkeyPatch) -> None:
    class Base:
        pass

    class Owned:  # a base with a hook of its own: left as it is
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)

    monkeypatch.setattr(ft_launch, "_agent_bases", lambda: [Base, Owned])
    logged: list[dict[str, Any]] = []
    assert ft_launch.report_worker_exits(lambda name, step, **fields: logged.append(fields))
    assert Owned.__dict__["__init_subclass__"] is not Base.__dict__["__init_subclass__"]
    result = _failed(**{"3": _failure(1, 7, -9)})
    namespace = {"__module__": "__main__", "_monitor_workers": lambda self, group: result}
    agent = type("LocalElasticAgent", (Base,), dict(namespace))
    other = type("OtherAgent", (Base,), dict(namespace))  # not the launcher's agent: untouched
    assert agent()._monitor_workers("group") is result
    assert other()._monitor_workers("group") is result
    assert [f["signal"] for f in logged] == ["SIGKILL"]


# --------------------------------------------------------------------------- a real run


def _worker(run_dir: Path, marker: str, rank: int) -> psutil.Process:
    """The training process of ``rank``: the pid its ``start`` event names (NVRx's in-process
    monitor, a fork of it, has the same command line), a worker of this run's ft_launcher.
    """
    (start,) = [e for e in ev.read_events(run_dir) if e.event == "start" and e.rank == rank]
    proc = psutil.Process(int(start["pid"]))
    assert proc in _marked(marker) and "resilient_training.runtime.worker" in " ".join(proc.cmdline())
    assert proc.environ().get("RANK") == str(rank)
    return proc


def _stepped(run_dir: Path, rank: int, step: int) -> bool:
    try:
        return any(e.event == "step" and e.rank == rank and e.step >= step for e in ev.read_events(run_dir))
    except (OSError, ev.EventLogError):
        return False


@pytest.mark.slow
def test_a_worker_killed_by_sigsegv_is_said_to_be(tmp_path: Path, started: Runs) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    proc, marker, out = _start(started, run_dir, "--nproc", "2", "--steps", "60", "--step-seconds", "0.2",
                               "--checkpoint-every", "20", "--faults", "")
    deadline = time.monotonic() + 180
    while not _stepped(run_dir, 1, 25):
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)
    victim = _worker(run_dir, marker, 1)
    victim.send_signal(signal.SIGSEGV)
    assert proc.wait(timeout=300) == 0, out.read_text()[-3000:]
    exits = [e for e in ev.read_events(run_dir) if e.event == "worker_exit"]
    assert [(e.rank, e["global_rank"], e["pid"], e["exitcode"], e["signal"]) for e in exits
            if e["pid"] == victim.pid] == [(-1, 1, victim.pid, -signal.SIGSEGV, "SIGSEGV")], exits
    (fault,) = metrics.compute_metrics(run_dir)["faults"]
    root = fault["root_cause"]
    assert (root["kind"], root["rank"], root["signal"]) == ("died", 1, "SIGSEGV"), root
    assert "killed by SIGSEGV" in root["detail"], root
