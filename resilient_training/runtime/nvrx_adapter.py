"""The one module that imports NVIDIA Resiliency Extension; it bridges 0.4.1 and 0.6+/0.7.0.

What differs between versions, and is handled here (see ../shared/NVRX_NOTES.md):
- ft_launcher flags: 0.6+ rejects ``--ft-restart-policy=min-healthy`` (only ``any-failed``),
  renamed ``--ignore-missing-fault-tol-cfg`` to ``--ft-ignore-missing-cfg``, leaves heartbeat
  timeouts unset by default (we always pass them), waits up to 50 s per restart for GPU memory
  (``--ft-gpu-memory-reclaim-timeout``) and stops no-progress restart loops only when fed
  ``--ft-checkpoint-iteration-file``. 0.4.1 turns the NIC monitor on by default (off on CPU).
- ``inprocess.Wrapper``: 0.7.0 adds GPU checks to the post-fault health check whenever
  ``LOCAL_RANK`` is set; on CPU we install our own check after construction.
- Async checkpointing: a dead persistent writer makes NVRx's blocking wait spin forever and its
  ``close()`` block in ``queue.join()``; :class:`AsyncWriter` checks liveness instead.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import re
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
        flags += [f"--ft-gpu-memory-reclaim-timeout={config.restart.gpu_reclaim_timeout:g}",
                  f"--ft-gpu-memory-tolerance-mb={config.restart.gpu_reclaim_tolerance_mb}",
                  "--ft-gpu-memory-poll-interval=1"]  # read as an int by 0.7.0
        if iteration_file is not None:
            flags.append(f"--ft-checkpoint-iteration-file={iteration_file}")
    return flags


def worker_command(
    config: Any,
    config_argv: list[str],
    *,
    python: str,
    **launcher_kwargs: Any,
) -> list[str]:
    """The whole command that starts the workers: ft_launcher, or torchrun when it is off."""
    if config.restart.ft_launcher:
        head = [python, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"]
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


# --------------------------------------------------------------------------- heartbeats


class Heartbeats:
    """ft_launcher rank heartbeats (``RankMonitorClient``); a no-op outside ft_launcher.

    While the in-process layer restarts the training function, :meth:`cover` keeps beating
    from a thread for a bounded time, so ft_launcher does not kill workers that are busy
    recovering; a restart that overruns the bound is then caught by ft_launcher.
    """

    def __init__(self, enabled: bool) -> None:
        self._client = None
        self._lock = threading.Lock()
        self._cover_until = 0.0
        self._thread: threading.Thread | None = None
        if enabled and under_ft_launcher():
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self._client = RankMonitorClient()
            self._client.init_workload_monitoring()
            self._thread = threading.Thread(target=self._cover_loop, name="heartbeat-cover", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        return self._client is not None

    def beat(self) -> None:
        if self._client is not None:
            with self._lock:
                self._client.send_heartbeat()

    def cover(self, seconds: float) -> None:
        """Keep beating for up to ``seconds`` (0 stops): an in-process restart is under way."""
        self._cover_until = time.monotonic() + seconds if seconds > 0 else 0.0

    def _cover_loop(self) -> None:
        while self._client is not None:
            if time.monotonic() < self._cover_until:
                try:
                    self.beat()
                except Exception:  # the monitor went away: the launcher is tearing us down
                    return
            time.sleep(0.5)

    def calibrate(self, floor: float) -> dict[str, float] | None:
        """Set timeouts from observed heartbeat gaps × safety factor, but never below ``floor``.

        Collective over the default process group (gloo or nccl). Returns the timeouts set.
        """
        if self._client is None:
            return None
        with self._lock:
            if not self._client.calculate_and_set_hb_timeouts(skip_if_not_ready=True):
                return None
            state = self._client.state_dict()
            hb = state.get("current_timeouts", {}).get("heartbeat")
            if hb is None:
                return None
            hb["initial"] = max(hb["initial"] or 0.0, floor)
            hb["subsequent"] = max(hb["subsequent"] or 0.0, floor)
            self._client.load_state_dict(state)
            return {"initial": hb["initial"], "subsequent": hb["subsequent"]}

    def stop_workload(self, reason: str) -> None:
        """Ask ft_launcher not to restart the workers (NVRx's ShutdownWorkload request).

        0.7.0 also honours worker exit code 93; 0.4.1 does not know that code, but both
        versions act on this request.
        """
        if self._client is None:
            return
        from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

        with self._lock:
            self._client.send_workload_control_request(
                WorkloadControlRequest(WorkloadAction.ShutdownWorkload, reason)
            )

    def state_dict(self) -> dict[str, Any]:
        if self._client is None:
            return {}
        return dict(self._client.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._client is not None and state:
            with self._lock:
                self._client.load_state_dict(state)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.shutdown_workload_monitoring()
            except Exception:
                pass


# --------------------------------------------------------------------------- in-process restart


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
            if on_gpu:
                return inprocess.abort.AbortTorchDistributed()(state)
            return state

    checks: list[Any] = [_HealthCheck()]
    if on_gpu:
        checks.insert(0, inprocess.health_check.CudaHealthCheck(timeout=seconds(seconds=10)))
    health = inprocess.Compose(*checks) if len(checks) > 1 else checks[0]
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": store_port, "timeout": seconds(seconds=60)},
        initialize=inprocess.initialize.RetryController(
            max_iterations=config.restart.max_inprocess_restarts + 1,
            min_world_size=min_world_size,
        ),
        abort=_AbortDistributed(),
        health_check=health,
        monitor_thread_interval=seconds(seconds=0.2),
        monitor_process_interval=seconds(seconds=0.2),
        heartbeat_interval=seconds(seconds=0.5),
        progress_watchdog_interval=seconds(seconds=0.2),
        soft_timeout=seconds(seconds=config.timeouts.soft),
        hard_timeout=seconds(seconds=config.timeouts.hard),
        heartbeat_timeout=seconds(seconds=max(3.0, config.timeouts.pg + 1.0)),
        barrier_timeout=seconds(seconds=config.timeouts.hard + 30.0),
        completion_timeout=seconds(seconds=config.timeouts.hard + 30.0),
        last_call_wait=seconds(seconds=0.2),
        termination_grace_time=seconds(seconds=2),
    )
    # 0.7.0 composes GPU/NVLink/NIC checks into the post-fault check when LOCAL_RANK is set;
    # on CPU they fail (no NVML). Ours already covers what applies.
    if hasattr(wrapper, "restart_health_check") and not on_gpu:
        wrapper.restart_health_check = health

    def entry(call_wrapper: Any = None) -> Any:
        return fn(call_wrapper)

    # The wrapper injects itself only into a parameter annotated Optional[CallWrapper]; this
    # module uses postponed (string) annotations, so set the real one explicitly.
    entry.__annotations__ = {"call_wrapper": typing.Optional[inprocess.CallWrapper]}  # noqa: UP045
    return wrapper(entry)


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
    """The persistent background checkpoint writer process exited mid-write."""


def _warm_up_job() -> None:
    """Runs in the writer process: importing this module there is the warm-up."""


class AsyncWriter:
    """Checkpoint writes through NVRx's persistent async checkpoint process.

    Writes run in submission order; :meth:`poll` reports whether all of them are durable.
    """

    def __init__(self) -> None:
        self._queue: Any = None
        self._pending = 0

    def _calls(self) -> Any:
        if self._queue is None:
            import inspect

            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

            options: dict[str, Any] = {}
            if "cpu_shm_mode" in inspect.signature(AsyncCallsQueue.__init__).parameters:
                # 0.7+: shards arrive in shared host memory, so the writer needs no CUDA context
                # (which would cost GPU memory and compete with the trainer's own CUDA start-up).
                options["cpu_shm_mode"] = True
            self._queue = AsyncCallsQueue(persistent=True, **options)
        return self._queue

    @property
    def started(self) -> bool:
        return self._queue is not None

    @property
    def in_flight(self) -> bool:
        return self._pending > 0

    def warm_up(self, job: Callable[[], None] = _warm_up_job) -> None:
        """Start the writer process now (it imports torch: seconds), not at the first save;
        ``job`` (module-level) runs there first, e.g. to import what the writes will need.
        """
        self.submit(job, ())

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

        # async_fn_kwargs explicitly: 0.7.0 defaults it to None and then calls fn(**None).
        request = AsyncRequest(async_fn=fn, async_fn_args=args, finalize_fns=[], async_fn_kwargs={})
        self._calls().schedule_async_request(request)
        self._pending += 1

    def _writer_alive(self) -> bool:
        caller = getattr(self._queue, "persistent_caller", None)
        process = getattr(caller, "process", None)
        return process is not None and process.is_alive()

    def _finalize_ready(self) -> None:
        self._pending -= len(self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True))

    def poll(self) -> bool:
        """True once every submitted write is durable. Raises if the writer died."""
        if self._pending == 0:
            return True
        self._finalize_ready()
        if self._pending == 0:
            return True
        if not self._writer_alive():
            self._finalize_ready()  # it may have finished just before dying
            if self._pending == 0:
                return True
            self.abandon()
            raise CheckpointWriterDied("the async checkpoint writer process died mid-write")
        return False

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint write still in flight after {timeout:.0f} s")
            time.sleep(0.01)

    def abandon(self) -> None:
        """Forget a dead or unwanted writer without NVRx's close(), which blocks on a dead one."""
        caller = getattr(self._queue, "persistent_caller", None)
        process = getattr(caller, "process", None)
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
            caller.process = None  # its __del__ would otherwise wait on queue.join() forever
        self._queue = None
        self._pending = 0

    def close(self, timeout: float = 120.0) -> None:
        if self._queue is None:
            return
        try:
            self.wait(timeout)
        finally:
            if self._writer_alive():
                self._queue.close()
                self._queue = None
            else:
                self.abandon()
