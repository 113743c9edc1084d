"""The local launcher: ``resilient-training train`` starts ft_launcher with gloo workers here.

Checks everything it can before starting (fault schedule, run directory), writes the run's
config, runs ft_launcher (or torchrun with ``--no-ft-launcher``) in its own process group,
prints progress from the event log while it runs, and exits non-zero with the cause taken
from the event log when recovery gave up.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from resilient_training import checkpoint_format as fmt
from resilient_training import config as cfg
from resilient_training import events as ev
from resilient_training import faults as flt

LOGS_DIRNAME = "logs"
# Causes a rank reports when a peer failed or a restart was requested of it: never a root cause.
SECONDARY_CAUSES = ("peer_failure", "restart_requested")


class LaunchError(ValueError):
    """Bad input found before anything started."""


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchResult:
    exit_code: int
    reason: str
    run_dir: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def preflight(config: cfg.TrainConfig, *, world_size: int, nodes: int = 0) -> list[flt.Fault]:
    """Everything that can be wrong before a worker starts, as one clear LaunchError."""
    if world_size < 1:
        raise LaunchError(f"world size must be at least 1, got {world_size}")
    try:
        schedule = flt.parse(config.faults)
        flt.validate(schedule, world_size=world_size, steps=config.steps,
                     async_checkpoint=config.async_checkpoint, checkpoint_every=config.checkpoint_every,
                     nodes=nodes)
    except flt.FaultSpecError as exc:
        raise LaunchError(str(exc)) from None
    if config.min_world_size > world_size:
        raise LaunchError(f"min world size {config.min_world_size} exceeds the world size {world_size}")
    run_dir = Path(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise LaunchError(f"run directory {run_dir} exists and is not a directory")
    try:
        latest = fmt.read_latest(fmt.checkpoints_dir(run_dir))
        if latest is not None:
            from resilient_training.checkpointing import check_compatible

            check_compatible(fmt.read_manifest(latest), config)
    except fmt.CheckpointError as exc:
        raise LaunchError(str(exc)) from None
    return schedule


def run_local(
    config: cfg.TrainConfig,
    *,
    nproc: int = 2,
    progress: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run the workers on this machine under ft_launcher until done; never raises on failure."""
    preflight(config, world_size=nproc)
    run_dir = Path(config.run_dir)
    (run_dir / LOGS_DIRNAME).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.dumps(config))
    from resilient_training import nvrx_adapter
    command = nvrx_adapter.worker_command(
        config, cfg.to_argv(config), python=sys.executable, standalone=True, nnodes="1",
        nproc_per_node=nproc, iteration_file=fmt.iteration_file(config.run_dir),
    )
    worker_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path = run_dir / LOGS_DIRNAME / "launcher.log"
    started = time.time()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env,
                                start_new_session=True)
        watcher = ProgressPrinter(run_dir, config.steps, since=started, emit=progress)
        watcher.start()
        try:
            with _terminate_raises():
                exit_code = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            watcher.stop()
    return LaunchResult(exit_code, outcome(run_dir, config.steps, exit_code, since=started, log=log_path), str(run_dir))


class Terminated(SystemExit):
    """SIGTERM arrived (a cancelled pipeline step, a pod being deleted)."""


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """Turn SIGTERM into an exception while we wait, so the workers' process group is stopped
    instead of left running when we are (KFP cancels a step with SIGTERM).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def outcome(run_dir: Path, steps: int, exit_code: int, *, since: float, log: Path) -> str:
    events = [e for e in ev.read_events(run_dir) if e.ts >= since]
    if exit_code == 0:
        done = [e for e in events if e.event == "end" and e.get("status") == "completed"]
        return f"completed: reached step {steps}" if done else "launcher exited 0 without a completed worker"
    ends = [e for e in events if e.event == "end" and e.get("status") == "failed"]
    # The root cause is the failure a rank had itself, not a peer noticing it.
    failures = [e for e in events if e.event == "failure_detected" and e.get("cause") not in SECONDARY_CAUSES]
    root = ""
    if failures:
        last = failures[-1]
        root = f"last failure on rank {last.rank} at step {last.step}: {last['cause']} ({last.get('message', '')})"
    gave_up = [e for e in ends if "gave up" in e.get("reason", "")]
    if gave_up:
        return f"{gave_up[-1]['reason']}; {root}" if root else gave_up[-1]["reason"]
    if root:
        restarts = len({e.attempt for e in events}) - 1
        return f"recovery gave up after {restarts} launcher restart(s); {root}"
    if ends:
        return ends[-1]["reason"]
    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
    return f"launcher exited {exit_code} before any worker reported a failure; log tail: {' | '.join(tail)}"


class ProgressPrinter(threading.Thread):
    """Prints rank 0's progress and every fault, failure and restart as they are logged."""

    def __init__(self, run_dir: Path, steps: int, *, since: float, emit: Callable[[str], None] | None) -> None:
        super().__init__(name="progress", daemon=True)
        self._run_dir, self._steps, self._since, self._emit = run_dir, steps, since, emit
        self._done = threading.Event()
        self._seen = 0

    def run(self) -> None:
        while not self._done.wait(0.5):
            self._flush()
        self._flush()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def _flush(self) -> None:
        if self._emit is None:
            return
        events = [e for e in ev.read_events(self._run_dir) if e.ts >= self._since]
        for event in events[self._seen:]:
            line = describe(event, self._steps)
            if line:
                self._emit(line)
        self._seen = len(events)


def describe(event: ev.Event, steps: int) -> str | None:
    """One progress line for an event worth showing, else None."""
    who = f"rank {event.rank}"
    if event.event == "step" and event.rank == 0 and (event.step % 5 == 0 or event.step == steps):
        return f"step {event.step:>5}/{steps}  loss {event['loss']:.4f}  ({event['seconds'] * 1000:.0f} ms)"
    if event.event == "fault_injected":
        return f"  ! fault {event['fault']} injected ({who}, step {event.step})"
    if event.event == "failure_detected" and event.get("cause") != "peer_failure":
        return f"  ! failure on {who}: {event['cause']}"
    if event.event == "restart_begin" and event.get("layer") == "pod" and event.get("cause") != "node-loss":
        return f"  ✗ node {event['node']} pod died ({event['cause']}): Kubernetes replaces it"
    if event.event == "restart_done" and event.get("layer") == "pod":
        return f"  ↻ node {event['node']} replaced (pod layer): rank {event.rank} rejoined"
    if event.event == "restart_done" and event.rank == 0:
        return f"  ↻ restarted ({event['layer']} layer, attempt {event.attempt}, iteration {event.iteration})"
    if event.event == "load_done" and event.rank == 0:
        return f"  ⤓ restored step {event.step}" if event.step else None
    if event.event == "ckpt_committed":
        tier = " (node-local)" if event.get("tier") == "local" else ""
        return (f"  ✓ checkpoint step {event.step} committed{tier} "
                f"({event['bytes'] / 1e6:.2f} MB, {event['seconds']:.2f} s)")
    if event.event == "ckpt_deferred" and event.rank == 0:
        return f"  … checkpoint at step {event.step} deferred: {event['reason']}"
    return None


# --------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train locally under ft_launcher with injected faults",
        description="Run NVRx-wrapped FSDP training on this machine (gloo on CPU) under ft_launcher.",
    )
    parser.add_argument("--nproc", type=int, default=2, help="worker processes (ranks) per node")
    nodes = parser.add_argument_group("simulated cluster (one ft_launcher agent per node, as in a PyTorchJob)")
    nodes.add_argument("--nodes", type=int, default=None,
                       help="simulate N worker pods on this machine (node faults need it); default: one agent")
    nodes.add_argument("--min-nodes", type=int, default=0, help="elastic: fewest nodes to run on (0 = --nodes)")
    nodes.add_argument("--pod-restart-delay", type=float, default=2.0,
                       help="seconds before a lost pod's replacement starts (default: 2.0)")
    nodes.add_argument("--network", choices=("auto", "netns", "loopback"), default="auto",
                       help="a network namespace per node, or loopback (auto: namespaces when possible)")
    nodes.add_argument("--rdzv-last-call", type=float, default=5.0,
                       help="rendezvous wait for more nodes once --min-nodes joined (default: 5)")
    cfg.add_arguments(parser)
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        config = cfg.from_namespace(args)
        if args.nodes is None:
            result = run_local(config, nproc=args.nproc)
        else:
            from resilient_training import simulated_cluster as sim

            spec = sim.ClusterSpec(nodes=args.nodes, nproc_per_node=args.nproc, min_nodes=args.min_nodes,
                                   pod_restart_delay=args.pod_restart_delay, network=args.network,
                                   last_call_timeout=args.rdzv_last_call)
            result = sim.run_cluster(config, spec)
    except (LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stream = sys.stdout if result.ok else sys.stderr
    print(("done: " if result.ok else "FAILED: ") + result.reason, file=stream)
    print(f"run directory: {result.run_dir}", file=stream)
    return 0 if result.ok else 1
