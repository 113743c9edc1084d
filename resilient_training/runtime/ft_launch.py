"""``python -m resilient_training.runtime.ft_launch ARGS`` (or ``resilient-ft-launcher ARGS``):
NVRx's ``ft_launcher`` with the same arguments, after :func:`nvrx_adapter.quicken_rendezvous`
and :func:`nvrx_adapter.quicken_teardown`.

A wrapper, not a fork: the launcher is NVRx's own module, run as ``__main__`` in this process
(it imports the replaced function by name then), so the two changes apply to it: how often a
waiting agent polls the rendezvous store, and a worker teardown that ends once the workers are
gone instead of after a fixed second. Its rank monitors (and, through ``AGENT_PID_ENV``, its
workers) end once this agent is gone (:func:`monitors_exit_with_agent`).
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import signal
import sys
from collections.abc import Callable
from typing import Any

from resilient_training.runtime import nvrx_adapter, spare_stub

LAUNCHER = "nvidia_resiliency_ext.fault_tolerance.launcher"
# Set by the local launchers to their own pid: this launcher then stops its workers when that
# process dies (a SIGKILLed `resilient-training train` left them training on, found by a
# stranger trial). Unset in pods, where the container's end takes the whole tree. Popped here:
# the workers watch this agent instead (nvrx_adapter.AGENT_PID_ENV).
PARENT_ENV = "RT_LAUNCHER_PARENT_PID"


def die_with_parent() -> None:
    """SIGTERM to this process (ft_launcher's orderly stop of its workers) once the process named
    in :data:`PARENT_ENV` is gone: Linux's parent-death signal, plus a check for a parent that
    died before it was set.
    """
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def monitors_exit_with_agent() -> None:
    """NVRx's rank monitors (one per local rank, started by this agent) exit once this agent is
    gone: :func:`nvrx_adapter.rank_monitor_run` in place of NVRx's ``RankMonitorServer.run``. A
    stranger trial SIGKILLed the agent: both monitors lived on indefinitely, holding the run
    directory's lock (inherited), and the gates refused the run as still training.
    """
    os.environ[nvrx_adapter.AGENT_PID_ENV] = str(os.getpid())  # for them and the workers alike
    try:
        from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer
    except ImportError:
        return
    original = RankMonitorServer.__dict__.get("run")
    if not isinstance(original, staticmethod):  # another NVRx: left as it is
        return
    nvrx_adapter.MONITOR_RUN[0] = original.__func__
    # A function of an importable module: a monitor started with "spawn" (some NVRx releases)
    # pickles its target by name.
    RankMonitorServer.run = staticmethod(nvrx_adapter.rank_monitor_run)


def _agent_log(argv: list[str]) -> Any:
    """The event log of this agent (rank -1) in the run directory, or None without one."""
    run_dir = spare_stub.run_dir_of(argv)
    if not run_dir:
        return None
    from resilient_training.run import events as ev

    try:
        return ev.EventLog(run_dir, rank=-1, writer=f"agent-{os.uname().nodename}-{os.getpid()}")
    except OSError:  # the workers will name the problem with the run directory
        return None


def _trace_phases(argv: list[str]) -> None:
    """NVRx's restart profile of this agent into the run's event log (``launcher_phase``)."""
    log = _agent_log(argv)
    if log is not None:
        nvrx_adapter.trace_launcher_phases(log.emit)


def _exit_signal(exitcode: Any) -> str | None:
    """``SIGKILL`` for exit code -9 (a process killed by that signal), else None."""
    if not isinstance(exitcode, int) or isinstance(exitcode, bool) or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"SIG{-exitcode}"


def log_worker_exits(result: Any, emit: Callable[..., Any], seen: set[tuple[Any, ...]]) -> None:
    """One ``worker_exit`` event per failed worker of a monitoring result (a torch elastic
    ``RunResult``: ``failures`` maps a global rank to a ``ProcessFailure``), each once: NVRx
    returns the same failure at every poll while the other workers still run. Never raises.
    """
    try:
        failures = getattr(result, "failures", None)
        if not isinstance(failures, dict):
            return
        for rank, failure in list(failures.items()):
            pid, exitcode = getattr(failure, "pid", None), getattr(failure, "exitcode", None)
            local_rank = getattr(failure, "local_rank", None)
            ints = [v if isinstance(v, int) and not isinstance(v, bool) else None
                    for v in (rank, local_rank, pid, exitcode)]
            key = tuple(ints)
            if key in seen:
                continue
            seen.add(key)
            state = getattr(getattr(result, "state", None), "name", None)
            emit("worker_exit", None, global_rank=ints[0], local_rank=ints[1], pid=ints[2], exitcode=ints[3],
                 signal=_exit_signal(ints[3]), state=state if isinstance(state, str) else None)
    except Exception:  # the report's detail must never stop a launcher
        pass


def _logging_exits(monitor: Callable[..., Any], emit: Callable[..., Any]) -> Callable[..., Any]:
    """``monitor`` (an agent's ``_monitor_workers``), also logging its failed workers' exits:
    the same result, returned as it came; whatever the logging meets, it does not raise.
    """
    seen: set[tuple[Any, ...]] = set()

    @functools.wraps(monitor)
    def monitored(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = monitor(self, *args, **kwargs)
        log_worker_exits(result, emit, seen)
        return result

    monitored.logs_worker_exits = True  # type: ignore[attr-defined]
    return monitored


def _agent_bases() -> list[type]:
    """The ``SimpleElasticAgent`` classes NVRx's launcher may derive its ``LocalElasticAgent``
    from: torch's (NVRx 0.7) and NVRx's own copy of it (0.4).
    """
    bases = []
    for module in ("torch.distributed.elastic.agent.server.api",
                   "nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api"):
        try:
            base = getattr(importlib.import_module(module), "SimpleElasticAgent", None)
        except Exception:
            continue
        if isinstance(base, type) and base not in bases:
            bases.append(base)
    return bases


def report_worker_exits(emit: Callable[..., Any]) -> bool:
    """Each worker that NVRx's agent finds failed is logged (:func:`log_worker_exits`): its exit
    code, and the signal that killed it (a ``kill -9`` of a worker was "died, killed by a signal or
    crashed" in the report, its ``exitcode: -9`` in the launcher log's free text only).

    The launcher module runs as ``__main__`` (:func:`main`), defining its agent class anew: the
    class is wrapped as it is defined, through its base's ``__init_subclass__``, and only a
    ``LocalElasticAgent`` of the launcher with a ``_monitor_workers`` of its own. A base that has an
    ``__init_subclass__`` of its own is left as it is; so is NVRx, where anything is unexpected.
    Returns whether a base was hooked.
    """
    hooked = False
    for base in _agent_bases():
        if "__init_subclass__" in base.__dict__:
            continue

        def hook(cls: type, base: type = base, **kwargs: Any) -> None:
            super(base, cls).__init_subclass__(**kwargs)
            try:
                monitor = cls.__dict__.get("_monitor_workers")
                if (cls.__name__ == "LocalElasticAgent" and cls.__module__ in ("__main__", LAUNCHER)
                        and callable(monitor) and not getattr(monitor, "logs_worker_exits", False)):
                    cls._monitor_workers = _logging_exits(monitor, emit)  # type: ignore[attr-defined]
            except Exception:  # NVRx as it is
                pass

        base.__init_subclass__ = classmethod(hook)  # type: ignore[assignment,method-assign]
        hooked = True
    return hooked


def _report_worker_exits(argv: list[str]) -> None:
    log = _agent_log(argv)
    if log is not None:
        report_worker_exits(log.emit)


def main() -> None:
    die_with_parent()
    nvrx_adapter.quicken_rendezvous()
    nvrx_adapter.quicken_teardown()
    monitors_exit_with_agent()
    _trace_phases(sys.argv[1:])
    _report_worker_exits(sys.argv[1:])
    sys.argv[0] = "ft_launcher"
    runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
