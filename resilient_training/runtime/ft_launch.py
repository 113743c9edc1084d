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

import os
import runpy
import signal
import sys

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


def _trace_phases(argv: list[str]) -> None:
    """NVRx's restart profile of this agent into the run's event log (``launcher_phase``)."""
    run_dir = spare_stub.run_dir_of(argv)
    if not run_dir:
        return
    from resilient_training.run import events as ev

    try:
        log = ev.EventLog(run_dir, rank=-1, writer=f"agent-{os.uname().nodename}-{os.getpid()}")
    except OSError:  # the workers will name the problem with the run directory
        return
    nvrx_adapter.trace_launcher_phases(log.emit)


def main() -> None:
    die_with_parent()
    nvrx_adapter.quicken_rendezvous()
    nvrx_adapter.quicken_teardown()
    monitors_exit_with_agent()
    _trace_phases(sys.argv[1:])
    sys.argv[0] = "ft_launcher"
    runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
