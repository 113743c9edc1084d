"""The one module that imports NVIDIA Resiliency Extension; it bridges 0.4.1 and 0.6+/0.7.0.

What differs between versions, and is handled here (see ../shared/NVRX_NOTES.md):
- ft_launcher flags: 0.6+ rejects ``--ft-restart-policy=min-healthy`` (only ``any-failed``),
  renamed ``--ignore-missing-fault-tol-cfg`` to ``--ft-ignore-missing-cfg``, leaves heartbeat
  timeouts unset by default (we always pass them), waits up to 50 s per restart for GPU memory
  (``--ft-gpu-memory-reclaim-timeout``) and stops no-progress restart loops only when fed
  ``--ft-checkpoint-iteration-file``. 0.4.1 turns the NIC monitor on by default (off on CPU).
- ``inprocess.Wrapper``: 0.7.0 adds GPU checks to the post-fault health check whenever
  ``LOCAL_RANK`` is set; on CPU we install our own check after construction.
- Rendezvous: 0.6+'s barrier rendezvous polls its store once a second while a round is closed
  or not yet open, a fixed wait in every launcher restart; :func:`quicken_rendezvous` (run in the
  launcher process by :mod:`resilient_training.runtime.ft_launch`) shortens that poll. Its
  worker teardown sleeps a fixed second between SIGTERM and SIGKILL of the workers' process
  groups; :func:`quicken_teardown` ends that wait as soon as no process of theirs can run code
  (gone, a zombie, or already exiting: a killed worker releasing its memory).
- Async checkpointing: a dead persistent writer makes NVRx's blocking wait spin forever and its
  ``close()`` block in ``queue.join()``; :class:`AsyncWriter` watches the process instead (and
  starts it off the caller's thread: the spawn blocks while the child imports torch).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import gc
import importlib.metadata
import os
import re
import signal
import sys
import threading
import time
import typing
from collections.abc import Callable
from typing import Any

NVRX_DISTRIBUTION = "nvidia-resiliency-ext"
# Exit code that tells ft_launcher (and our launchers) not to restart: the failure is deterministic.
EXIT_DO_NOT_RESTART = 93


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(NVRX_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(version: str) -> tuple[int, int, int]:
    parts = (version.split("+")[0].split(".") + ["0", "0"])[:3]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


# --------------------------------------------------------------------------- ft_launcher


def ft_launcher_flags(
    config: Any,
    *,
    version: str | None = None,
    nnodes: str | None = None,
    nproc_per_node: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    standalone: bool = False,
    on_gpu: bool = False,
    iteration_file: str | None = None,
) -> list[str]:
    """Flags for ``ft_launcher`` of NVRx ``version`` (default: the installed one).

    ``nnodes``/``nproc_per_node``/rendezvous left None are read by ft_launcher from the
    Training Operator's ``PET_*`` environment, like torchrun.
    """
    version = version or installed_version() or "0.7.0"
    v = version_tuple(version)
    flags: list[str] = []
    if standalone:
        flags.append("--standalone")
    if nnodes is not None:
        flags.append(f"--nnodes={nnodes}")
    if nproc_per_node is not None:
        flags.append(f"--nproc-per-node={nproc_per_node}")
    if rdzv_endpoint is not None:
        flags += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    if rdzv_id is not None:
        flags.append(f"--rdzv-id={rdzv_id}")
    flags += [
        f"--max-restarts={config.restart.max_restarts}",
        "--monitor-interval=0.2",  # how often the agent looks at its workers: detection latency
        # 0.6+ leaves these unset (no hang detection at all); 0.4.1 defaults to 3600/2700 s.
        f"--ft-initial-rank-heartbeat-timeout={config.timeouts.initial_heartbeat}",
        f"--ft-rank-heartbeat-timeout={config.timeouts.heartbeat}",
        "--ft-workload-check-interval=0.5",
        "--ft-restart-policy=any-failed",  # the only policy 0.6+ accepts
        "--ft-safety-factor=5.0",
        "--ft-log-level=WARNING",
    ]
    if v < (0, 6, 0):
        if not on_gpu:
            flags.append("--ft-enable-nic-monitor=false")  # default true in 0.4.1, fails on CPU
    else:
        # Before restarting, 0.6+ waits for the dead workers' GPU memory to drop under a
        # tolerance (defaults 50 s / 512 MB). An H200 VM reports ~3.9 GB in use when idle, so
        # with defaults every restart waited the full 50 s: both are calibrated per machine.
        # It samples every poll interval (a float; default 2 s): at 1 s a restart on one H200
        # waited ~1.0 s for a second sample though the memory was free within milliseconds.
        # With worker_gpu_reclaim each new worker waits for its own GPU's predecessor instead,
        # later (runtime/gpu_reclaim.py): 0 turns ft_launcher's wait off.
        reclaim = 0.0 if config.restart.worker_gpu_reclaim else config.restart.gpu_reclaim_timeout
        flags += [f"--ft-gpu-memory-reclaim-timeout={reclaim:g}",
                  f"--ft-gpu-memory-tolerance-mb={config.restart.gpu_reclaim_tolerance_mb}",
                  f"--ft-gpu-memory-poll-interval={GPU_MEMORY_POLL_SECONDS:g}"]
        if iteration_file is not None:
            flags.append(f"--ft-checkpoint-iteration-file={iteration_file}")
    return flags


# How often a waiting launcher looks at the rendezvous store (NVRx 0.6+: once a second). Each look
# is two store reads; a launcher waits there only around a restart (and a hot spare throughout).
RENDEZVOUS_POLL_SECONDS = 0.1
# How often 0.6+ samples GPU memory while it waits for a dead worker's to be freed (one NVML read).
GPU_MEMORY_POLL_SECONDS = 0.1
# ft_launcher with quicken_rendezvous applied: the launcher the workers run under.
FT_LAUNCHER_MODULE = "resilient_training.runtime.ft_launch"
FT_LAUNCHER_SCRIPT = "resilient-ft-launcher"


class _PollingClock:
    """The ``time`` module as NVRx's rendezvous sees it, with each sleep capped at ``poll``
    seconds: its waits are polling loops, so a shorter sleep only looks again sooner.
    """

    def __init__(self, clock: Any, poll: float) -> None:
        self._clock = clock
        self.poll = poll

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(min(seconds, self.poll))


def quicken_rendezvous(poll: float = RENDEZVOUS_POLL_SECONDS) -> bool:
    """Make NVRx's barrier rendezvous (0.6+) poll every ``poll`` seconds instead of every second,
    in this process; returns whether there was one to change (0.4/0.5 use torch's rendezvous).

    Measured on 2 H200s (NVRx 0.7.0): after a fault the agent finds round N closed, syncs to the
    new round, then sleeps a fixed 1.0 s before it looks again (``_wait_for_rendezvous_open``,
    not configurable), 1.0 s of a ~6 s launcher restart.
    """
    try:
        from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier
    except ImportError:
        return False
    clock = getattr(barrier, "time", None)
    if clock is None:  # a later NVRx that sleeps some other way: nothing to change
        return False
    if isinstance(clock, _PollingClock):
        clock.poll = poll
    else:
        barrier.time = _PollingClock(clock, poll)
    return True


def trace_launcher_phases(emit: Callable[..., Any]) -> bool:
    """Also send each of NVRx's restart profiling events (0.6+: ``record_profiling_event``, which
    the agent logs at INFO) to ``emit("launcher_phase", None, phase=, cycle=, node=)``, in this
    (the launcher's) process; returns whether there was a profiler to follow.

    Where the launcher's part of a restart goes (detection, stopping the workers, the GPU memory
    wait, rendezvous, starting workers) is otherwise invisible in the event log.
    """
    try:
        from nvidia_resiliency_ext.shared_utils import profiling
    except ImportError:
        return False
    profiler = getattr(profiling, "FaultToleranceProfiler", None)
    record = getattr(profiler, "record_event", None)
    if record is None:
        return False
    if getattr(record, "traced", False):
        return True

    def traced(self: Any, event: Any, node_id: Any = None, rank: int | None = None) -> Any:
        result = record(self, event, node_id, rank)
        try:
            emit("launcher_phase", None, phase=str(getattr(event, "value", event)),
                 cycle=getattr(self, "_current_cycle", None), node=None if node_id is None else str(node_id))
        except Exception:  # the profile must never stop a launcher
            pass
        return result

    traced.traced = True  # type: ignore[attr-defined]
    profiler.record_event = traced
    global _launcher_emit
    _launcher_emit = emit
    return True


# Set by trace_launcher_phases in a launcher process: where our own teardown reports its end.
_launcher_emit: Callable[..., Any] | None = None


# /proc/PID/stat flags: the kernel is tearing the process down (after SIGKILL: freeing its memory,
# unpinning page-locked host memory, closing the GPU driver's files). It runs no more user code.
_PF_EXITING = 0x4


def _still_running(stat: bytes) -> int | None:
    """The process group of a ``/proc/PID/stat`` line whose process can still run code, else None:
    a zombie keeps its group until reaped (which a container's init may never do), and a process
    already exiting can do nothing more. Measured on 1 H200: a killed 1.3B worker's exit (16 GB of
    page-locked staging) outlasted the 1 s grace, and the teardown waited all of it.
    """
    fields = stat.rsplit(b")", 1)[1].split()  # state, ppid, pgrp, session, tty_nr, tpgid, flags, ...
    if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
        return None
    return int(fields[2])


def _live_members(pgids: set[int]) -> dict[int, list[str]]:
    """Which of these process groups still hold a process that can run code, with those processes
    (``pid name``) for the launcher log.
    """
    live: dict[int, list[str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: whether the group exists at all
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                live[pgid] = []
            except ProcessLookupError:
                pass
            except OSError:
                live[pgid] = []
        return live
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            pgid = _still_running(stat)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if pgid in pgids:
            name = stat.split(b"(", 1)[1].rsplit(b")", 1)[0].decode(errors="replace")
            live.setdefault(pgid, []).append(f"{entry} {name}")
    return live


def terminate_process_groups(allowed_pgids: Any, grace: float = 1.0, poll: float = 0.05) -> None:
    """NVRx 0.7's ``terminate_mp_processes``, without its fixed wait: SIGTERM to each worker
    process group, then SIGKILL to those still there after ``grace`` seconds, returning as soon
    as no group holds a process that can still run code (an exiting one's memory and GPU memory
    are the next worker's wait, :mod:`.gpu_reclaim`, not the teardown's).
    """
    import logging

    pgids = set(allowed_pgids)
    if 1 in pgids:  # NVRx's own guard (rank monitors with PGID 1 in its simulated multi-node tests)
        return
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except OSError:
            logging.getLogger(__name__).warning("failed to send SIGTERM to process group %s", pgid, exc_info=True)
    deadline = time.monotonic() + grace
    alive = _live_members(pgids)
    while alive and time.monotonic() < deadline:
        time.sleep(poll)
        alive = _live_members(set(alive))
    if alive:  # which process held the restart up (the launcher log says)
        logging.getLogger(__name__).warning("still running %.1f s after SIGTERM, now SIGKILLed: %s", grace,
                                            "; ".join(p for members in alive.values() for p in members) or alive)
    for pgid in alive:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    if _launcher_emit is not None:  # splits NVRx's worker_terminated: our teardown, then its GPU memory wait
        try:
            _launcher_emit("launcher_phase", None, phase="workers_gone", cycle=None, node=None)
        except Exception:
            pass


def quicken_teardown() -> bool:
    """Put :func:`terminate_process_groups` in place of NVRx 0.6+'s ``terminate_mp_processes``
    (SIGTERM, a fixed ``time.sleep(1.0)``, SIGKILL) for the launcher run in this process; returns
    whether there was one to replace (0.4.1's takes other arguments and does not wait).

    Measured on 1 H200 (NVRx 0.7.0): 1.01 s of each launcher restart passed between "Stopping
    workers" and the GPU memory check, with the killed worker already gone.
    """
    import inspect

    try:
        from nvidia_resiliency_ext.fault_tolerance import utils
    except ImportError:
        return False
    current = getattr(utils, "terminate_mp_processes", None)
    if current is None:
        return False
    if current is terminate_process_groups:
        return True
    if list(inspect.signature(current).parameters) != ["allowed_pgids"]:
        return False
    utils.terminate_mp_processes = terminate_process_groups
    return True


def worker_command(
    config: Any,
    config_argv: list[str],
    *,
    python: str,
    **launcher_kwargs: Any,
) -> list[str]:
    """The whole command that starts the workers: ft_launcher, or torchrun when it is off."""
    if config.restart.ft_launcher:
        head = [python, "-m", FT_LAUNCHER_MODULE]
        head += ft_launcher_flags(config, **launcher_kwargs)
    else:
        head = [python, "-m", "torch.distributed.run", f"--max-restarts={config.restart.max_restarts}",
                "--monitor-interval=0.2"]
        for key in ("standalone", "nnodes", "nproc_per_node", "rdzv_endpoint", "rdzv_id"):
            value = launcher_kwargs.get(key)
            if key == "standalone" and value:
                head.append("--standalone")
            elif key == "rdzv_endpoint" and value:
                head += ["--rdzv-backend=c10d", f"--rdzv-endpoint={value}"]
            elif value is not None and key != "standalone":
                head.append(f"--{key.replace('_', '-')}={value}")
    return [*head, "-m", worker_module(config), *config_argv]


def worker_module(config: Any) -> str:
    """The module the launcher runs per worker: the trainer's, or the stub that hands the work to
    a warm spare (``--warm-spare``; :mod:`resilient_training.runtime.spare_stub`).
    """
    if config.restart.warm_spare:
        return "resilient_training.runtime.spare_stub"
    return "resilient_training.runtime.worker"


def preload() -> None:
    """Import the NVRx modules a worker uses (for a warm spare: paid before it is needed)."""
    if installed_version() is None:
        return
    import nvidia_resiliency_ext.checkpointing.async_ckpt.core
    import nvidia_resiliency_ext.fault_tolerance.data
    import nvidia_resiliency_ext.fault_tolerance.rank_monitor_client
    import nvidia_resiliency_ext.inprocess  # noqa: F401


def rendezvous_env(
    *,
    nnodes: str,
    nproc_per_node: int,
    rdzv_endpoint: str,
    rdzv_id: str,
    rdzv_conf: dict[str, str] | None = None,
) -> dict[str, str]:
    """The ``PET_*`` environment the Training Operator gives each pod of an elastic PyTorchJob.

    ft_launcher (0.4.1 and 0.7.0) and torchrun read every launcher flag from ``PET_<FLAG>``
    when the flag is not on the command line, so a command built with ``nnodes``,
    ``nproc_per_node`` and the rendezvous left None meets its peers through this env, on a
    cluster and in the simulated one alike. ``rdzv_conf`` becomes ``PET_RDZV_CONF``
    (``key=value,...``; the operator fills it from the elastic policy's ``rdzvConf``).
    """
    env = {
        "PET_NNODES": nnodes,
        "PET_NPROC_PER_NODE": str(nproc_per_node),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": rdzv_endpoint,
        "PET_RDZV_ID": rdzv_id,
    }
    if rdzv_conf:
        env["PET_RDZV_CONF"] = ",".join(f"{key}={value}" for key, value in rdzv_conf.items())
    return env


def under_ft_launcher() -> bool:
    from nvidia_resiliency_ext.fault_tolerance.data import FT_LAUNCHER_IPC_SOCKET_ENV_VAR

    return FT_LAUNCHER_IPC_SOCKET_ENV_VAR in os.environ


# Set by our ft_launcher entry (ft_launch) to the agent's pid, inherited by all it starts: its
# rank monitors and workers stop once it is gone (they run in sessions of their own).
AGENT_PID_ENV = "RT_FT_AGENT_PID"
# NVRx's own RankMonitorServer.run, once ft_launch replaced it with rank_monitor_run.
MONITOR_RUN: list[Callable[..., Any] | None] = [None]


def rank_monitor_run(*args: Any, **kwargs: Any) -> Any:
    """NVRx's rank monitor, in a process that ends once the agent that started it is gone."""
    original = MONITOR_RUN[0]
    if original is None:  # a "spawn" child: NVRx's class is its own again here
        from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer

        original = RankMonitorServer.__dict__["run"].__func__
    agent = os.environ.get(AGENT_PID_ENV, "")
    if agent.isdigit() and os.getppid() == int(agent):  # (else not the agent's child: left alone)
        exit_when_orphaned(int(agent))
    return original(*args, **kwargs)


def exit_when_orphaned(parent: int, interval: float = 0.5) -> None:
    """In a child of ``parent``: a daemon thread that ends this process once ``parent`` is gone.
    Polled, not ``PR_SET_PDEATHSIG``: that fires when the forking *thread* ends, not the process.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-agent", daemon=True).start()


class RankMonitorUnreachable(RuntimeError):
    """The launcher's rank monitor for this worker cannot be reached (killed): see Heartbeats."""


def agent_process() -> tuple[int, int | None] | None:
    """The agent that started this worker, as ``(agent pid, pid of the process it started)``:
    this process, or for a warm spare the stub the agent started (the spare is the pool's child).
    None if the agent is alive but not that process's parent: started some other way, not watched.
    """
    found = _agent_process()
    if agent_alive(*found):
        return found
    try:
        os.kill(found[0], 0)
    except ProcessLookupError:
        return found  # gone already: the first check ends this worker
    except OSError:
        pass
    return None


def _agent_process() -> tuple[int, int | None]:
    from resilient_training.runtime import spare_stub

    agent = os.environ.get(AGENT_PID_ENV, "")
    stub = os.environ.get(spare_stub.STUB_PID_ENV, "")
    launched = int(stub) if stub.isdigit() else None
    if agent.isdigit():  # (an agent gone before this check is then seen gone, not taken for the reaper)
        return int(agent), launched
    if launched is not None:
        try:
            return int(spare_stub.proc_stat(launched)[1]), launched
        except (OSError, IndexError, ValueError):
            pass
    return os.getppid(), None


def agent_alive(agent: int, launched: int | None) -> bool:
    """The agent is still the parent of the process it started (an orphan is handed to a reaper)."""
    if launched is None:
        return os.getppid() == agent
    from resilient_training.runtime import spare_stub

    try:
        return int(spare_stub.proc_stat(launched)[1]) == agent
    except (OSError, IndexError, ValueError):
        return True  # the stub is gone: the spare's own watch ends it (spare_pool.watch_stub)


# --------------------------------------------------------------------------- heartbeats


class Heartbeats:
    """ft_launcher rank heartbeats (``RankMonitorClient``); a no-op outside ft_launcher.

    While the in-process layer restarts the training function, :meth:`cover` keeps beating
    from a thread for a bounded time, so ft_launcher does not kill workers that are busy
    recovering; a restart that overruns the bound is then caught by ft_launcher.
    """

    def __init__(self, enabled: bool, events: Any = None) -> None:
        """``events``: the worker's event log, for what goes wrong here before training starts
        (the rank monitor refused) or outside it (the agent is gone).
        """
        self._client = None
        self._lock = threading.Lock()
        self._cover_until = 0.0
        self._thread: threading.Thread | None = None
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        self._events = events
        self._agent: tuple[int, int | None] | None = None  # (pid, pid of the process it started)
        if enabled and under_ft_launcher():
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            client = RankMonitorClient()
            try:
                client.init_workload_monitoring()
            except OSError as exc:
                self._monitor_unreachable(exc)
            self._client = client
            self._agent = agent_process()
            self._sender = self.start_sender()
            self._thread = threading.Thread(target=self._cover_loop, name="heartbeat-cover", daemon=True)
            self._thread.start()

    def _monitor_unreachable(self, exc: OSError) -> typing.NoReturn:
        """A stranger trial killed a rank's monitor (a child of the agent), then the rank: every
        new worker of that rank failed here with a bare ConnectionRefusedError in the launcher's
        log, the restarts ran out in 35 s and the run's summary guessed. NVRx does not start a
        monitor again: logged as this rank's failure, with what it means.
        """
        from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR

        local_rank = os.environ.get("LOCAL_RANK", "?")
        path = os.environ.get(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR, "?")
        how = ("refused the connection (killed?)" if isinstance(exc, ConnectionRefusedError)
               else f"is gone ({exc.strerror or exc})")
        message = (f"the launcher's rank monitor for local rank {local_rank} {how}: {path}. ft_launcher does not "
                   "start it again, so every restart of this rank fails the same way")
        if self._events is not None:
            self._events.emit("failure_detected", None, cause="rank_monitor_unreachable", message=message[:500])
        raise RankMonitorUnreachable(message) from exc

    @property
    def active(self) -> bool:
        return self._client is not None

    @staticmethod
    def start_sender() -> concurrent.futures.ThreadPoolExecutor:
        """The one thread that writes to the rank monitor, started before training runs.

        The executor starts its thread inside the first ``submit``; a restart raised into the
        training thread there could leave that thread unknown to the executor (it joins only
        threads it recorded), and the next message would start a second writer.
        """
        sender = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="heartbeat-send")
        sender.submit(lambda: None).result()
        return sender

    def _send(self, call: Callable[[], Any]) -> Any:
        """Run one message to the rank monitor on the sender thread and wait for it.

        NVRx's in-process layer raises its restart into the *training thread* asynchronously, at
        any bytecode. Raised inside a half-written message, it left the monitor's stream corrupt
        ("invalid load key"), and every later message of that process failed with a broken pipe:
        each in-process retry failed at once until the limit (seen on CPU under load). On another
        thread the message is always written whole; only the wait here is interrupted.
        """
        assert self._sender is not None

        def locked() -> Any:  # a heartbeat also updates the gaps that calibrate() reads
            with self._lock:
                return call()

        return self._sender.submit(locked).result()

    def beat(self) -> None:
        client = self._client
        if client is not None:
            self._send(client.send_heartbeat)

    def cover(self, seconds: float) -> None:
        """Keep beating for up to ``seconds`` (0 stops): an in-process restart is under way."""
        self._cover_until = time.monotonic() + seconds if seconds > 0 else 0.0

    def _cover_loop(self) -> None:
        while self._client is not None:
            if time.monotonic() < self._cover_until:
                try:
                    self.beat()
                except Exception:  # the monitor went away: the launcher is tearing us down
                    self._cover_until = 0.0
            if self._agent is not None and not agent_alive(*self._agent):
                self._agent_gone(self._agent[0])
            time.sleep(0.5)

    def _agent_gone(self, pid: int) -> typing.NoReturn:
        """The agent that started this worker died without stopping it (SIGKILL): nothing will
        restart or stop this worker now, and a stranger trial's trained on for 94 s with no
        parent, its rank monitors holding the run. Logged, and this process ends (its checkpoint
        writer follows it). Normally the local launcher stops every process of the run first; in
        a pod, the container's end does.
        """
        reason = (f"ft_launcher (pid {pid}), which started this worker, is gone: stopped with it (the same command "
                  "resumes from the last committed checkpoint)")
        try:
            if self._events is not None:
                self._events.emit("end", None, status="failed", reason=reason)
            print(f"resilient-training worker: {reason}", file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    def calibrate(self, floor: float) -> dict[str, float] | None:
        """Set timeouts from observed heartbeat gaps × safety factor, but never below ``floor``.

        NVRx's ``calculate_and_set_hb_timeouts``, split in two (the same steps in 0.4.1 and 0.7.0):
        the gaps are synchronized over the default process group on the training thread, a
        collective every rank makes at the same step; the result, floored, is sent in one message
        on the sender thread, like every other message. Returns the timeouts set.
        """
        client = self._client
        if client is None:
            return None
        calc = client.timeouts_calc
        with self._lock:  # released before the send below, which takes it on the sender thread
            calc.synchronize_all()
            if not calc.can_get_hb_timeouts():
                return None
            hb = calc.get_hb_timeouts(current=client.hb_timeouts)
        hb = dataclasses.replace(hb, initial=max(hb.initial or 0.0, floor), subsequent=max(hb.subsequent or 0.0, floor))
        self._send(lambda: client._set_calculated_timeouts(new_hb_timeouts=hb, new_section_timeouts=None))
        return {"initial": hb.initial, "subsequent": hb.subsequent}

    def stop_workload(self, reason: str) -> None:
        """Ask ft_launcher not to restart the workers (NVRx's ShutdownWorkload request).

        0.7.0 also honours worker exit code 93; 0.4.1 does not know that code, but both
        versions act on this request.
        """
        client = self._client
        if client is None:
            return
        from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

        request = WorkloadControlRequest(WorkloadAction.ShutdownWorkload, reason)
        self._send(lambda: client.send_workload_control_request(request))

    def state_dict(self) -> dict[str, Any]:
        if self._client is None:
            return {}
        return dict(self._client.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        client = self._client
        if client is not None and state:
            self._send(lambda: client.load_state_dict(state))

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.shutdown_workload_monitoring()
            except Exception:
                pass
        if self._sender is not None:
            self._sender.shutdown(wait=False)


# --------------------------------------------------------------------------- in-process restart


class RestartTimeline:
    """Where an in-process restart's time goes inside NVRx, between this rank's failure and the
    wrapped function's next entry. NVRx logs none of it, so our hooks mark it: the abort (run by
    NVRx's monitor thread), the post-fault health check (0.7.0 adds GPU, NVLink and NIC checks),
    ``initialize`` and the pre-iteration health check; the garbage collections NVRx runs between
    iterations (``while gc.collect()``) are timed through ``gc.callbacks``.

    :meth:`enter` returns the phases, in order, as seconds; each is named after the mark that
    ends it (``nvrx_wait``: failure to abort, ``nvrx_unwind``: abort to the post-fault check,
    ``nvrx_barrier``: that check to ``initialize``, less ``nvrx_gc``).
    """

    LABELS: typing.ClassVar[dict[str, str]] = {
        "failed": "fn_unwind", "abort_begin": "nvrx_wait", "backends_aborted": "nvrx_abort_nccl",
        "abort_end": "nvrx_abort",
        "check_begin": "nvrx_unwind", "check_end": "nvrx_restart_check", "init_begin": "nvrx_barrier",
        "init_end": "nvrx_initialize", "ready_begin": "nvrx_initialize", "ready_end": "nvrx_health_check",
        "enter": "nvrx_health_check",
    }

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        # Reentrant: a collection can start on any allocation, inside a locked section too, and
        # its callback (on_gc) takes the lock on the same thread.
        self._lock = threading.RLock()
        self._marks: list[tuple[str, float]] = []
        self._gc: dict[int, float] = {}  # seconds of garbage collection within segment i
        self._gc_began: float | None = None

    def mark(self, name: str) -> None:
        entry = (name, self._clock())
        with self._lock:
            self._marks.append(entry)

    @property
    def restarting(self) -> bool:
        """Whether a failure was marked and ``initialize`` has not run yet (0.4.1 calls the same
        health check after the fault and before the next iteration).
        """
        names = [n for n, _ in self._marks]
        return bool(names) and "init_begin" not in names

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:  # a gc.callbacks entry
        if phase == "start":
            self._gc_began = self._clock()
        elif self._gc_began is not None:
            with self._lock:
                if self._marks:  # only between a failure and the next entry
                    segment = len(self._marks)
                    self._gc[segment] = self._gc.get(segment, 0.0) + self._clock() - self._gc_began
            self._gc_began = None

    def enter(self) -> dict[str, float]:
        """The phases of the restart that ends now (empty on the first entry), and a fresh start."""
        self.mark("enter")
        with self._lock:
            marks, gcs = self._marks, self._gc
            self._marks, self._gc = [], {}
        phases: dict[str, float] = {}
        for i in range(1, len(marks)):
            label = self.LABELS.get(marks[i][0], marks[i][0])
            seconds = marks[i][1] - marks[i - 1][1] - gcs.get(i, 0.0)
            phases[label] = round(phases.get(label, 0.0) + seconds, 3)
        if sum(gcs.values()):
            phases["nvrx_gc"] = round(sum(gcs.values()), 3)
        # The first entry (and one after a failure NVRx never saw) has nothing to report.
        return phases if {"failed", "abort_begin"} & {n for n, _ in marks} else {}


class _Timed:
    """Calls ``inner`` between two marks of a :class:`RestartTimeline` (an NVRx hook: abort,
    health check or initialize, all called with the frozen state and returning it).
    """

    def __init__(self, inner: Any, timeline: RestartTimeline, name: str | Callable[[], str]) -> None:
        self.inner, self.timeline, self.name = inner, timeline, name

    def __call__(self, state: Any) -> Any:
        name = self.name() if callable(self.name) else self.name
        self.timeline.mark(f"{name}_begin")
        try:
            return self.inner(state)
        finally:
            self.timeline.mark(f"{name}_end")


def restart_phases(call_wrapper: Any) -> dict[str, float]:
    """The NVRx phases of the in-process restart that led to this call (see :class:`RestartTimeline`)."""
    return dict(getattr(call_wrapper, "restart_phases", None) or {})


def inprocess_wrap(
    fn: Callable[..., Any],
    *,
    config: Any,
    on_gpu: bool,
    store_port: int,
    health_check: Callable[[], None],
) -> Callable[..., Any]:
    """Wrap ``fn(call_wrapper)`` in ``inprocess.Wrapper`` with a retry limit and a minimum world size."""
    from nvidia_resiliency_ext import inprocess

    seconds = datetime.timedelta
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    min_world_size = config.restart.min_world_size or world_size

    class _HealthCheck(inprocess.health_check.HealthCheck):
        def __call__(self, state: Any) -> Any:
            health_check()
            return state

    class _AbortDistributed(inprocess.abort.Abort):
        """NCCL: NVRx's abort. gloo: a blocked collective cannot be interrupted from this thread
        (torch 2.13: abort() and shutdown() of a gloo group do not release a peer's pending
        receive), so the short collective timeout (``pg_timeout``) releases blocked ranks.
        """

        def __call__(self, state: Any) -> Any:
            if not on_gpu:
                return state
            nvrx_abort = inprocess.abort.AbortTorchDistributed()
            shutdown = getattr(nvrx_abort, "shutdown_all_process_group_backends", None)
            import torch

            if shutdown is None or not torch.distributed.is_initialized():
                return nvrx_abort(state)
            # NVRx's steps, with a mark between NCCL's aborts and the groups' destruction
            # (where an abort's time goes). Flight recorder traces: only where NVRx collects them.
            nvrx_abort.collect_fr_trace(state)
            shutdown()
            timeline.mark("backends_aborted")
            torch.distributed.destroy_process_group()
            return state

    timeline = RestartTimeline()
    checks: list[Any] = [_HealthCheck()]
    if on_gpu:
        checks.insert(0, inprocess.health_check.CudaHealthCheck(timeout=seconds(seconds=10)))
    health = inprocess.Compose(*checks) if len(checks) > 1 else checks[0]
    # NVRx checks each hook's type: the timed hooks are of the kinds they wrap.
    class _TimedInitialize(_Timed, inprocess.initialize.Initialize):
        pass

    class _TimedAbort(_Timed, inprocess.abort.Abort):
        pass

    class _TimedHealthCheck(_Timed, inprocess.health_check.HealthCheck):
        pass

    wrapper = inprocess.Wrapper(
        store_kwargs={"port": store_port, "timeout": seconds(seconds=60)},
        initialize=_TimedInitialize(inprocess.initialize.RetryController(
            max_iterations=config.restart.max_inprocess_restarts + 1,
            min_world_size=min_world_size,
        ), timeline, "init"),
        abort=_TimedAbort(_AbortDistributed(), timeline, "abort"),
        # 0.4.1 runs this check after the fault too (0.7.0 runs restart_health_check there).
        health_check=_TimedHealthCheck(health, timeline, lambda: "check" if timeline.restarting else "ready"),
        monitor_thread_interval=seconds(seconds=0.2),
        monitor_process_interval=seconds(seconds=0.2),
        heartbeat_interval=seconds(seconds=0.5),
        progress_watchdog_interval=seconds(seconds=0.2),
        soft_timeout=seconds(seconds=config.timeouts.soft),
        hard_timeout=seconds(seconds=config.timeouts.hard),
        heartbeat_timeout=seconds(seconds=max(3.0, config.timeouts.pg + 1.0)),
        barrier_timeout=seconds(seconds=config.timeouts.hard + 30.0),
        completion_timeout=seconds(seconds=config.timeouts.hard + 30.0),
        # How long the monitor thread waits, after the first failure report, for peers' reports
        # before it aborts: a fixed part of every in-process restart (`nvrx_wait`). Root causes
        # come from our event log, not from NVRx's interruption records.
        last_call_wait=seconds(seconds=0.05),
        termination_grace_time=seconds(seconds=2),
    )
    # 0.7.0 composes GPU/NVLink/NIC checks into the post-fault check when LOCAL_RANK is set;
    # on CPU they fail (no NVML). Ours already covers what applies.
    if hasattr(wrapper, "restart_health_check") and not on_gpu:
        wrapper.restart_health_check = health
    if getattr(wrapper, "restart_health_check", None) is not None:
        wrapper.restart_health_check = _TimedHealthCheck(wrapper.restart_health_check, timeline, "check")

    def entry(call_wrapper: Any = None) -> Any:
        if call_wrapper is not None:  # read by restart_phases
            call_wrapper.restart_phases = timeline.enter()
        try:
            return fn(call_wrapper)
        except BaseException:
            timeline.mark("failed")
            raise

    # The wrapper injects itself only into a parameter annotated Optional[CallWrapper]; this
    # module uses postponed (string) annotations, so set the real one explicitly.
    entry.__annotations__ = {"call_wrapper": typing.Optional[inprocess.CallWrapper]}  # noqa: UP045
    wrapped = wrapper(entry)

    def run(*args: Any, **kwargs: Any) -> Any:
        gc.callbacks.append(timeline.on_gc)
        try:
            return wrapped(*args, **kwargs)
        finally:
            gc.callbacks.remove(timeline.on_gc)

    return run


# What the in-process layer wants from NCCL; a value the user set is kept. Read by torch and NCCL
# when the first communicator is made, so set before it.
INPROCESS_NCCL_ENV = {
    # NVRx's usage guide: a watchdog that rethrows CUDA/NCCL errors kills the process the
    # in-process layer is about to restart.
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # Every in-process restart aborts the communicators (NVRx's abort releases peers blocked on a
    # failed rank). NCCL 2.28 with cuMem buffers took 1.0 s per abort of a one-GPU group on an
    # H200, 0.5 s without (benchmarks/nccl_abort.py): one proxy thread fewer, each waking every
    # 0.5 s to see the abort. cuMem is needed for NVLink SHARP and multi-node NVLink only.
    "NCCL_CUMEM_ENABLE": "0",
}


def set_inprocess_nccl_env(environ: Any) -> None:
    for key, value in INPROCESS_NCCL_ENV.items():
        environ.setdefault(key, value)


def report_hang(call_wrapper: Any, rank: int) -> None:
    """Record a soft timeout for ``rank`` now, as NVRx's monitor process does when its own
    ``soft_timeout`` expires (0.4.1 and 0.7.0): every rank's monitor thread then aborts the
    distributed backend and restarts the wrapped function. Raising into the training thread from
    another thread instead collides with NVRx's progress watchdog, whose pending calls swallow it.
    """
    from nvidia_resiliency_ext.inprocess.attribution import Interruption, InterruptionRecord

    state = getattr(call_wrapper, "state", None)
    rank = getattr(state, "rank", rank)
    call_wrapper.monitor_process.record_interrupted(InterruptionRecord(rank, Interruption.SOFT_TIMEOUT))


def wrapper_store(call_wrapper: Any) -> Any:
    """The in-process wrapper's TCP store (a torch TCPStore), hosted by rank 0 for this worker
    group: the process group meets through it too, namespaced per restart iteration.
    """
    return call_wrapper.base_store


def restart_abort_cause(exc: BaseException) -> str | None:
    """Why the in-process layer gave up, if it did: ``retry_limit`` or ``world_too_small``.

    ``world_too_small``: ranks are gone for good (a node was lost), which the in-process
    layer cannot repair but ft_launcher's re-rendezvous and the pod layer can. The
    ``RestartAbort`` may be the context of another error: 0.4.1's wrapper shutdown then fails
    in its termination barrier (``int("b'1'")``) and raises a ValueError over it.
    """
    from nvidia_resiliency_ext.inprocess.exception import RestartAbort

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, RestartAbort):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    # RetryController's message (0.4.1 and 0.7.0): "state.iteration=1 self.max_iterations=9
    # state.world_size=2 self.min_world_size=3 state.active_world_size=2 ..."
    values = dict(re.findall(r"(\w+(?:\.\w+)?)=(\d+|None)", str(seen)))
    world, needed = values.get("state.world_size"), values.get("self.min_world_size")
    if world is not None and needed is not None and int(world) < int(needed):
        return "world_too_small"
    return "retry_limit"


# --------------------------------------------------------------------------- async checkpointing


class CheckpointWriterDied(RuntimeError):
    """The persistent background checkpoint writer process died (with writes, or too often)."""


@dataclasses.dataclass(frozen=True, slots=True)
class WriterDeath:
    """A writer process that exited without being asked to."""

    noticed: float  # time.time() when its exit was seen (the watcher thread wakes on it at once)
    pid: int | None
    exitcode: int | None  # negative: killed by that signal; None: not known
    detail: str = ""  # e.g. why it could not be started

    @property
    def signal(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        if self.detail:
            how = self.detail
        elif self.signal:
            how = f"killed by {self.signal}"
        else:
            how = "exit code unknown" if self.exitcode is None else f"exited with code {self.exitcode}"
        process = "the async checkpoint writer process" + (f" (pid {self.pid})" if self.pid is not None else "")
        return f"{process} died: {how}"


def _warm_up_job() -> None:
    """Runs in the writer process: importing this module there is the warm-up."""


def _new_calls_queue() -> Any:
    import inspect

    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    options: dict[str, Any] = {}
    if "cpu_shm_mode" in inspect.signature(AsyncCallsQueue.__init__).parameters:
        # 0.7+: shards arrive in shared host memory, so the writer needs no CUDA context
        # (which would cost GPU memory and compete with the trainer's own CUDA start-up).
        options["cpu_shm_mode"] = True
    return AsyncCallsQueue(persistent=True, **options)


def _schedule(queue: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    # async_fn_kwargs explicitly: 0.7.0 defaults it to None and then calls fn(**None).
    queue.schedule_async_request(AsyncRequest(async_fn=fn, async_fn_args=args, finalize_fns=[], async_fn_kwargs={}))


class _WriterProcess:
    """One writer process (NVRx's persistent caller), started and watched by threads of its own.

    The start-up thread spawns it (the child imports torch: seconds, during which the spawn
    may block) and runs the warm-up job there; :attr:`ready` is set once that job is done. From
    then on only the training thread touches the queue. The watch thread blocks on the
    process's ``sentinel`` and records its death the moment it exits.
    """

    def __init__(self, job: Callable[[], None], on_ready: Callable[[_WriterProcess], None],
                 on_died: Callable[[_WriterProcess, WriterDeath], None] | None, *, replacement: int = 0) -> None:
        self.replacement = replacement  # n: the n-th writer started in place of a dead one; 0: a first start
        self.requested = time.monotonic()
        self.ready_seconds: float | None = None  # start requested -> warm-up job done
        self.queue: Any = None
        self.process: Any = None
        self.pending = 0  # writes submitted and not yet known durable
        self.ready = threading.Event()
        self.reported = False  # its readiness passed on to the owner (AsyncWriter._ready)
        self.death: WriterDeath | None = None
        self._retired = False  # closed or killed on purpose: its exit is no death
        self._lock = threading.Lock()
        self._on_ready, self._on_died = on_ready, on_died
        threading.Thread(target=self._start, args=(job,), name="ckpt-writer-start", daemon=True).start()

    def _start(self, job: Callable[[], None]) -> None:
        try:
            queue = _new_calls_queue()
            _schedule(queue, job, ())
        except Exception as exc:  # noqa: BLE001 - reported as a death, replaced like one
            self._record_death(detail=f"could not be started ({type(exc).__name__}: {exc})"[:300])
            return
        with self._lock:
            self.queue, self.process = queue, queue.persistent_caller.process
            retired = self._retired
        if retired:
            self._stop_process(kill=True)
            return
        threading.Thread(target=self._watch, name="ckpt-writer-watch", daemon=True).start()
        while not queue.maybe_finalize_async_calls(blocking=False, no_dist=True):
            if self._retired or self.death is not None:
                return
            time.sleep(0.01)
        self.ready_seconds = time.monotonic() - self.requested
        self.ready.set()
        self._on_ready(self)

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        wait([self.process.sentinel])
        self._record_death(reap=0.5)  # without /proc: the exit code (the signal) if it is reaped soon

    def exited(self) -> bool:
        """The process is gone (never reaps it: :meth:`_record_death` does, once)."""
        from multiprocessing.connection import wait

        process = self.process
        return process is not None and bool(wait([process.sentinel], timeout=0))

    def _record_death(self, detail: str = "", *, reap: float = 0.0) -> WriterDeath | None:
        """Record the death once (whoever sees it first), with its exit code (:func:`_exit_code`).
        ``reap``: where that is not known, seconds to wait to reap it, never under the lock and
        never on the training thread: a killed writer's pipe closes at once but the kernel can
        take seconds to tear down its mappings before it can be reaped (on 2 H200s the training
        thread waited here, past the hang allowance).
        """
        process = self.process
        exitcode = _exit_code(process) if process is not None else None
        if exitcode is None and reap and process is not None:
            process.join(timeout=reap)
            exitcode = process.exitcode
        with self._lock:
            if self._retired or self.death is not None:
                return self.death
            self.death = WriterDeath(time.time(), getattr(process, "pid", None), exitcode, detail)
        if self._on_died is not None:
            self._on_died(self, self.death)
        return self.death

    def finalize(self) -> bool:
        """Count the writes that became durable; True if one did. Raises if the writer died with
        writes pending (they are lost).
        """
        if self.pending == 0:
            return False
        # Dead before or during NVRx's check: NVRx counts a call of a dead process as finished
        # (seen with 0.4.1: a write killed halfway was reported done, and its step's commit then
        # found no shard). A write that did finish just before is lost with the rest: its save
        # is abandoned, never committed half-written.
        if not (self.death is not None or self.exited()):
            done = len(self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True))
            if not (self.death is not None or self.exited()):
                self.pending -= done
                return done > 0
        lost, self.pending = self.pending, 0
        death = self._record_death() or self.death
        raise CheckpointWriterDied(f"{death.describe() if death else 'the writer died'} with {lost} "
                                   "write(s) not known durable")

    def retire(self, *, kill: bool) -> None:
        """Stop it on purpose: kill it (``kill``) or let it finish its queue and exit."""
        with self._lock:
            self._retired = True
        self._stop_process(kill=kill)

    def _stop_process(self, *, kill: bool) -> None:
        caller = getattr(self.queue, "persistent_caller", None)
        process = getattr(caller, "process", None)
        if process is None:
            _forget_calls(self.queue)
            return
        if not kill and self.death is None and process.is_alive():
            self.queue.close()  # NVRx: sends DONE, waits for the queue and the process
            return
        if process.is_alive():
            process.kill()
        process.join(timeout=5)
        caller.process = None  # its __del__ would otherwise wait on queue.join() forever
        _forget_calls(self.queue)


def _exit_code(process: Any) -> int | None:
    """The exit code (negative: the killing signal) of a process whose exit was seen, as
    ``multiprocessing`` gives it, also while it cannot be reaped yet: its pipe closes before the
    kernel has made it a zombie (a writer killed on a loaded CPU machine: its death was logged
    "exit code unknown"; on GPUs that takes seconds), but the kernel sets the wait status that
    ``/proc/<pid>/stat`` ends with at the start of the exit. ``None`` where neither says.
    """
    if process.exitcode is not None or process.pid is None:
        return process.exitcode
    try:
        with open(f"/proc/{process.pid}/stat", "rb") as stat:
            status = int(stat.read().rsplit(b")", 1)[1].split()[-1])  # the name in () may hold spaces
        code = os.waitstatus_to_exitcode(status)
    except (OSError, ValueError, IndexError):  # reaped meanwhile, or no /proc
        return process.exitcode
    # Reaped (and its pid perhaps taken) while the file was read: what the reaping said.
    return process.exitcode if process.exitcode is not None else code


def _retire_later(writer: _WriterProcess) -> None:
    """Kill a writer process and reap it on a thread of its own (never on the training thread)."""
    threading.Thread(target=writer.retire, kwargs={"kill": True}, name="ckpt-writer-retire", daemon=True).start()


def _forget_calls(queue: Any) -> None:
    """Disarm a dropped NVRx queue. Its ``close()``, which its ``__del__`` runs on whatever thread
    collects it, finalizes the calls still listed with an all-reduce on the default process
    group: issued by one rank alone, from a background thread, that all-reduce pairs with a
    peer's training collective and both ranks hang (2 x H200: the stall after each writer death,
    which the progress guard then took for a hang). A dead writer's calls are lost anyway.
    """
    if queue is None:
        return
    calls = getattr(queue, "async_calls", None)
    if calls is not None:
        calls.clear()
    queue.persistent_caller = None


class AsyncWriter:
    """Checkpoint writes through NVRx's persistent async checkpoint process, kept alive.

    :meth:`start` returns at once: the process starts in a background thread, and :attr:`ready`
    tells when it takes writes. Writes run in submission order; :meth:`poll` reports whether all
    are durable. A watch thread notices the process's death the moment it happens (in flight or
    idle) and reports it through ``on_died``; the owner then calls :meth:`replace` from its own
    thread. ``max_deaths`` deaths with no durable write in between, or within ``death_window``
    seconds, make :meth:`replace` raise :class:`CheckpointWriterDied` instead: a writer that
    keeps dying is for the restart layers. ``on_ready(seconds, pid, replacement)`` is called on
    the start-up thread once a writer takes writes (``replacement``: 0 for a first start, n for
    the n-th writer started in place of a dead one).

    ``spare``: keep a second process started and warmed up, idle, once the first is ready; a
    dead writer's place is then taken by it at once (the writer layer's recovery was the new
    process's start, 4.9-6.6 s on one H200, most of it importing torch), and another spare is
    started once it is ready. A spare's own death is no writer death: it is started again.
    """

    def __init__(self, *, on_ready: Callable[[float, int | None, int], None] | None = None,
                 on_died: Callable[[WriterDeath], None] | None = None, max_deaths: int = 3,
                 death_window: float = 300.0, spare: bool = False) -> None:
        self._writer: _WriterProcess | None = None
        self._spare: _WriterProcess | None = None
        self._keep_spare = spare
        self._spare_deaths = 0
        self._spare_lock = threading.Lock()  # the start-up threads and the owner's thread both start spares
        self._job: Callable[[], None] = _warm_up_job
        self._on_ready, self._on_died = on_ready, on_died
        self._max_deaths, self._death_window = max_deaths, death_window
        self._deaths: list[float] = []  # monotonic times of recent deaths (within death_window)
        self._since_durable = 0  # deaths since the last durable write
        self.replacements = 0  # writers started in place of dead ones

    @property
    def started(self) -> bool:
        return self._writer is not None

    @property
    def ready(self) -> bool:
        writer = self._writer
        return writer is not None and writer.ready.is_set() and writer.death is None

    @property
    def death(self) -> WriterDeath | None:
        return None if self._writer is None else self._writer.death

    @property
    def in_flight(self) -> bool:
        return self._writer is not None and self._writer.pending > 0

    @property
    def pid(self) -> int | None:
        return getattr(getattr(self._writer, "process", None), "pid", None)

    def start(self, job: Callable[[], None] = _warm_up_job) -> None:
        """Start the writer process without waiting for it; ``job`` (module-level) runs there
        first, e.g. to import what the writes will need. No-op when one is already started.
        """
        if self._writer is None:
            self._job = job
            self._writer = self._take_spare(replacement=0) or _WriterProcess(job, self._ready, self._died)

    def _restart(self) -> None:
        self.replacements += 1
        self._writer = (self._take_spare(replacement=self.replacements)
                        or _WriterProcess(self._job, self._ready, self._died, replacement=self.replacements))

    @property
    def spare_pid(self) -> int | None:
        return getattr(getattr(self._spare, "process", None), "pid", None)

    @property
    def spare_ready(self) -> bool:
        spare = self._spare
        return spare is not None and spare.ready.is_set() and spare.death is None

    def _take_spare(self, *, replacement: int) -> _WriterProcess | None:
        """The spare, alive, as the writer now (its readiness reported as if just started)."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is None or spare.death is not None:
            return None
        spare.replacement, spare.requested = replacement, time.monotonic()
        self._writer = spare
        if spare.ready.is_set():  # already took its warm-up job: ready now (else reported once it is)
            spare.ready_seconds = time.monotonic() - spare.requested
            self._ready(spare)
        return spare

    def _start_spare(self) -> None:
        with self._spare_lock:
            if self._keep_spare and self._spare is None and self._writer is not None:
                self._spare = _WriterProcess(self._job, self._ready, self._died, replacement=-1)

    def _died(self, writer: _WriterProcess, death: WriterDeath) -> None:
        if writer.replacement < 0:  # a spare (never took a write): started again
            with self._spare_lock:
                if writer is self._spare:
                    self._spare = None
                self._spare_deaths += 1
                if self._spare_deaths >= self._max_deaths:  # spares that keep dying: none any more
                    self._keep_spare = False
            _retire_later(writer)
            if self._writer is not None and self._writer.ready.is_set():
                self._start_spare()
            return
        if self._on_died is not None:
            self._on_died(death)

    def warm_up(self, job: Callable[[], None] = _warm_up_job, timeout: float = 300.0) -> None:
        """Start the writer and wait until it is ready (raises if it dies first)."""
        self.start(job)
        deadline = time.monotonic() + timeout
        while not self.ready:
            if self.death is not None:
                raise CheckpointWriterDied(self.death.describe())
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint writer not ready after {timeout:.0f} s")
            time.sleep(0.01)

    def _ready(self, writer: _WriterProcess) -> None:
        with self._spare_lock:  # once per writer: a spare taken just as it became ready is seen twice
            if writer is not self._writer or writer.reported:
                return  # a spare, warmed up and idle (or already reported)
            writer.reported = True
        if self._on_ready is not None:
            self._on_ready(writer.ready_seconds or 0.0, getattr(writer.process, "pid", None), writer.replacement)
        self._start_spare()  # after the writer: the two never import torch at the same time

    def replace(self) -> WriterDeath | None:
        """Start a new writer (without waiting) in place of a dead one; returns the death.

        Raises :class:`CheckpointWriterDied` when writers keep dying (see the class).
        """
        death = self.death
        if death is None:
            return None
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < self._death_window] + [now]
        self._since_durable += 1
        self.abandon()  # reaped off the training thread
        if self._since_durable >= self._max_deaths or len(self._deaths) >= self._max_deaths:
            why = (f"{self._since_durable} writer deaths without a durable write in between"
                   if self._since_durable >= self._max_deaths
                   else f"{len(self._deaths)} writer deaths within {self._death_window:g} s")
            self._deaths, self._since_durable = [], 0  # the restart layers start a new writer afresh
            raise CheckpointWriterDied(f"{death.describe()}; {why}: giving up on restarting it")
        self._restart()
        return death

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not self.ready:
            raise RuntimeError("the checkpoint writer is not ready: check AsyncWriter.ready before submitting")
        _schedule(self._writer.queue, fn, args)
        self._writer.pending += 1

    def poll(self) -> bool:
        """True once every submitted write is durable. Raises :class:`CheckpointWriterDied` if
        the writer died with writes not yet durable (they are lost; :attr:`death` tells how).
        """
        writer = self._writer
        if writer is None or writer.pending == 0:
            return True
        if writer.finalize():
            self._since_durable = 0  # a durable write: the writer works
        return writer.pending == 0

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint write still in flight after {timeout:.0f} s")
            time.sleep(0.01)

    def abandon(self, *, spare: bool = False) -> None:
        """Forget the writer (killing it if alive) without NVRx's close(), which blocks on a dead
        one; reaped on a thread of its own (see :meth:`_WriterProcess._record_death`). The spare
        is kept for the next :meth:`start`, unless ``spare`` (the worker is failing: no next start).
        """
        writer, self._writer = self._writer, None
        for process in (writer, self._drop_spare() if spare else None):
            if process is not None:
                _retire_later(process)

    def _drop_spare(self) -> _WriterProcess | None:
        """No spare from now on; the one there was, to be stopped by the caller."""
        self._keep_spare = False
        with self._spare_lock:
            spare, self._spare = self._spare, None
        return spare

    def close(self, timeout: float = 120.0) -> None:
        """Wait for the writes in flight, then stop the writer.

        Stopped with SIGKILL, not NVRx's ``close()``: once every write is durable the writer
        holds nothing, and a graceful exit tore its torch down for ~0.5 s that its worker
        waited for at the end of every run (CPU machine).
        """
        spare = self._drop_spare()
        if spare is not None:
            spare.retire(kill=True)
        writer = self._writer
        if writer is None:
            return
        try:
            self.wait(timeout)
        finally:
            self._writer = None
            writer.retire(kill=True)
