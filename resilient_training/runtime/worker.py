"""Entry point of one training worker process: ``python -m resilient_training.runtime.worker FLAGS``.

Started by ft_launcher (or torchrun), never by hand. Exit codes: 0 the target step was
reached; 93 (NVRx's "do not restart") when retrying cannot help: the in-process layer
exhausted its retry limit or the run directory holds an incompatible model; anything else
lets the launcher restart the workers.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

from resilient_training.run import config as cfg
from resilient_training.run import events as ev
from resilient_training.run import faults as flt
from resilient_training.runtime import nvrx_adapter, spare_stub

# Set by the simulated pod-restart layer (a replacement agent): restarts are reported as "pod".
POD_RESTART_ENV = "RT_POD_RESTART"


def main(argv: list[str] | None = None) -> int:
    config = cfg.from_argv(sys.argv[1:] if argv is None else argv)
    prefix = f"[rank{os.environ.get('RANK', '?')}]"
    logging.basicConfig(level=logging.WARNING, format=f"{prefix} %(levelname)s %(name)s: %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = ev.EventLog(config.run_dir, rank=rank, attempt=attempt)
    # Before torch loads: NVRx's monitors wait on store keys with short timeouts, and c10d logs a
    # warning for every one (thousands of lines per run); errors still show.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # torch imports dynamo (and inductor) lazily, the first time a model is built: inside the
    # in-process wrapper, where a restart can interrupt it. The module it leaves half-imported
    # failed every later iteration (seen in CI: 4 ranks on 2 cores, a start-up stall taken for
    # a hang). Imported here, before anything can restart this process's training.
    import torch
    import torch._dynamo  # noqa: F401

    # (imported after argument errors surface: they import torch)
    from resilient_training.runtime.task import TaskError, check_export
    from resilient_training.runtime.trainer import Trainer, retrying_cannot_help, worker_store_port

    failed_for_launcher = False
    heartbeats = nvrx_adapter.Heartbeats(config.restart.ft_launcher, events=events)
    try:
        trainer = Trainer(config, events=events, heartbeats=heartbeats)
        if attempt == 0:  # (a restart's task is the one checked: nothing added to its critical path)
            check_export(config, trainer.task)
    except TaskError as exc:  # the task cannot be loaded here (e.g. missing from the image): retrying cannot help
        code = _do_not_restart(events, heartbeats, rank, str(exc))
        heartbeats.close()
        events.close()
        return code
    node = flt.this_node()
    agent, local_rank = _agent_identity(), int(os.environ.get("LOCAL_RANK", "0"))
    trainer.agent = agent
    # Restarted by its own agent? TORCHELASTIC_RESTART_COUNT alone cannot tell: an agent that
    # restarts its workers because a node joined (a membership change) does not count it.
    restarted = attempt > 0 or any(
        e.event == "start" and e.get("agent") == agent and e.get("local_rank") == local_rank
        for e in ev.read_events(config.run_dir)
    )
    events.emit(
        "start", None, world_size=trainer.world_size, pid=os.getpid(), host=os.uname().nodename, node=node,
        agent=agent, local_rank=local_rank,
        layers={"inprocess": config.restart.inprocess, "async_checkpoint": config.checkpoint.async_save,
                "ft_launcher": heartbeats.active},
        nvrx_version=nvrx_adapter.installed_version(), torch_version=torch.__version__,
        process_seconds=_process_age(), spare=_launched_pid() != "self",
    )
    # A replacement pod's first workers report the pod layer; its agent's later restarts of
    # them are launcher restarts like any other node's.
    if restarted:
        events.emit("restart_done", None, layer="launcher", node=node)
    elif os.environ.get(POD_RESTART_ENV):
        events.emit("restart_done", None, layer="pod", node=node)
    # What exists now (torch, the task's modules, the trainer) lives as long as the process: out
    # of the cyclic collector's reach it is not traversed again by every full collection, such as
    # the ones NVRx runs between in-process restart iterations (measured in `nvrx_gc`).
    gc.freeze()
    try:
        if config.restart.inprocess:
            wrapped = nvrx_adapter.inprocess_wrap(
                trainer.run, config=config, on_gpu=trainer.on_gpu,
                store_port=worker_store_port(),
                health_check=lambda: None,
            )
            wrapped()
        else:
            trainer.run()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every way out is logged with its reason
        abort = nvrx_adapter.restart_abort_cause(exc)
        if abort == "retry_limit" and trainer.iteration >= config.restart.max_inprocess_restarts:
            reason = (f"in-process restart gave up after {config.restart.max_inprocess_restarts} restarts; "
                      f"this rank's last failure: {trainer.last_cause}")
            return _do_not_restart(events, heartbeats, rank, reason)
        if abort is not None:
            # Too few ranks left for the in-process layer (a peer process or node is gone): that
            # is the launcher's job, so fail normally and let it restart the workers.
            reason = f"in-process restart lost a peer rank; handing over to the launcher ({trainer.last_cause})"
            events.emit("end", None, status="failed", reason=reason)
            print(f"resilient-training worker rank {rank}: {reason}", file=sys.stderr)
            failed_for_launcher = True
            return 1
        if retrying_cannot_help(exc):
            return _do_not_restart(events, heartbeats, rank, str(exc))
        events.emit("end", None, status="failed", reason=f"{trainer.last_cause or type(exc).__name__}")
        raise
    finally:
        trainer.close()
        events.close()
        if failed_for_launcher:
            # Measured on 0.4.1: after this abort the interpreter's shutdown blocked for 20+ s,
            # and ft_launcher restarts nothing until its worker has exited.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def _launched_pid() -> str:
    """The process the launcher started for this worker: this one ("self"), or the
    :mod:`.spare_stub` that handed its work to this warm spare (its pid).
    """
    return os.environ.get(spare_stub.STUB_PID_ENV) or "self"


def _start_ticks(pid: int | str) -> str:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    return spare_stub.proc_stat(pid)[19]


def _process_age() -> float | None:
    """Seconds since the launcher started this worker's process: interpreter start-up and
    imports, before any work (for a warm spare: since its stub started, milliseconds of hand-over).
    """
    try:
        started_ticks = int(_start_ticks(_launched_pid()))
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return round(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 3)


def _agent_identity() -> str:
    """The agent (ft_launcher or torchrun) that started this worker: host, pid and start time.

    Workers (or their spare stubs) are the agent's children; the start time keeps a pid reused by
    a later agent (a recreated pod numbers its processes from 1 again) from passing for the same agent.
    """
    launched = _launched_pid()
    if launched == "self":
        return spare_stub.process_identity(os.getppid())
    try:
        return spare_stub.process_identity(int(spare_stub.proc_stat(launched)[1]))
    except (OSError, IndexError, ValueError):
        return f"{os.uname().nodename}:?:?"


def _do_not_restart(events: ev.EventLog, heartbeats: nvrx_adapter.Heartbeats, rank: int, reason: str) -> int:
    """Retrying cannot help: say why, and stop the launcher from restarting us."""
    events.emit("end", None, status="failed", reason=reason)
    print(f"resilient-training worker rank {rank}: {reason}", file=sys.stderr)
    heartbeats.stop_workload(reason)
    return nvrx_adapter.EXIT_DO_NOT_RESTART


def exit_after_success() -> None:
    """End a worker that reached its target step the way the interpreter would (other threads
    joined, exit handlers run, streams flushed) but without finalizing the interpreter: tearing
    torch's modules down took ~0.8 s after every finished worker on the CPU machine, and its
    agent saw the worker alive all that time. A failed worker exits normally.
    """
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    code = main()
    if code == 0:
        exit_after_success()
    sys.exit(code)
