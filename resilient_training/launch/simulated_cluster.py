"""A PyTorchJob's worker pods simulated on one machine: one ft_launcher agent per node.

On Kubernetes every worker pod ``<job>-worker-<k>`` runs one ft_launcher agent, and the agents
meet through c10d rendezvous on ``<job>-worker-0:<port>``, told by the Training Operator's
``PET_*`` env. Here each simulated node is one agent started with exactly that command
(``nvrx_adapter.worker_command`` with nothing rendezvous-related on the command line) and
that env (``nvrx_adapter.rendezvous_env``), in its own session, and, where ``ip netns``
works, in its own network namespace with its own 10.x address and hostname, joined to the
others by a bridge, like pods on a cluster network. Without namespaces the agents share
loopback, and node 0 is told it hosts the store (``is_host``), because all of them would
otherwise claim ``127.0.0.1``.

Kubernetes' part is played here too, and only its part: a pod that was killed (exit by a
signal, or >= 128: ``restartPolicy: ExitCode``) is replaced after ``pod_restart_delay`` by a
new agent with ``RT_POD_RESTART=1`` on the same node (same hostname and address, like a
recreated pod behind its headless service), which joins the running job; a pod that exits
1-127 fails the job. A node loss (fault ``node-loss@STEP:NODE``) is announced in the event
log by that node's local rank 0, which then waits; this module reads the announcement and
kills every process of the pod at once (found by the ``RT_SIM_POD`` label each of them
inherits, since ft_launcher starts its workers in sessions of their own).

Each pod also has node-local memory of its own: its workers' node-local tier (and pid records,
host snapshots) lie in ``<tier base>/<POD_SHM_PREFIX><cluster>-<node>-<incarnation>``, given as
``--local-checkpoint-dir``, and removed when the pod dies. A recreated pod's ``/dev/shm`` (an
in-memory emptyDir) starts empty, and so does a node that replaces a lost one: with one shared
directory the replacement found the lost node's node-local steps and restored from them, which
no real node could (its recovery looked better than it is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from resilient_training.launch import local as launcher
from resilient_training.run import config as cfg
from resilient_training.run import events as ev
from resilient_training.run import faults as flt
from resilient_training.run import layout
from resilient_training.runtime.ft_launch import PARENT_ENV
from resilient_training.runtime.worker import POD_RESTART_ENV

# Every process of a simulated pod inherits this label: "<cluster>/<node>/<incarnation>".
POD_LABEL_ENV = "RT_SIM_POD"
POD_TMP_PREFIX = "rt-pod-"  # + cluster id, node, incarnation: each pod's TMPDIR
POD_SHM_PREFIX = "sim-pod-"  # + cluster id, node, incarnation: each pod's node-local tier directory
RDZV_PORT = 29400  # the Training Operator's default rendezvous port
NETWORK_KINDS = ("auto", "netns", "loopback")
SUBNET = "10.77.0"  # only inside namespaces this module creates; node k is SUBNET.(k+1)
POLL_SECONDS = 0.1
# After the job has failed, pods still running get this long to exit on their own.
FAILED_JOB_GRACE_SECONDS = 15.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """The simulated PyTorchJob: how many worker pods, how elastic, how pods come back."""

    nodes: int
    """Worker pods (one ft_launcher agent each); the maximum when ``min_nodes`` is set."""
    nproc_per_node: int = 1
    """Worker processes (ranks) per pod."""
    min_nodes: int = 0
    """Fewest nodes the job runs on (``--nnodes=min:max``); 0 = exactly ``nodes``."""
    pod_restart_delay: float = 2.0
    """Seconds between a pod's death and its replacement's start (scheduling + image pull)."""
    network: str = "auto"
    """``netns`` (a namespace, address and hostname per node), ``loopback``, or ``auto``."""
    job_name: str = "rt"
    """Pods are ``<job_name>-worker-<k>``; the rendezvous id is derived from it."""
    last_call_timeout: float = 5.0
    """Rendezvous wait for more nodes once ``min_nodes`` have joined (c10d ``last_call_timeout``)."""
    timeout: float = 1800.0
    """The whole job is killed after this many seconds (a bounded simulation)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {self.nodes}")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, got {self.nproc_per_node}")
        if self.min_nodes < 0 or self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes must be 0 (fixed size) or between 1 and nodes ({self.nodes}), "
                             f"got {self.min_nodes}")
        if not (math.isfinite(self.pod_restart_delay) and self.pod_restart_delay >= 0):
            raise ValueError(f"pod_restart_delay must be >= 0 and finite, got {self.pod_restart_delay}")
        if self.network not in NETWORK_KINDS:
            raise ValueError(f"network must be one of {', '.join(NETWORK_KINDS)}, got {self.network!r}")
        if not (math.isfinite(self.last_call_timeout) and self.last_call_timeout >= 1):  # NaN too
            raise ValueError(f"last_call_timeout must be at least 1 s (c10d takes whole seconds), "
                             f"got {self.last_call_timeout}")

    @property
    def nnodes(self) -> str:
        """ft_launcher's ``--nnodes`` value, as the operator writes it into ``PET_NNODES``."""
        return f"{self.min_nodes}:{self.nodes}" if self.min_nodes else str(self.nodes)

    def hostname(self, node: int) -> str:
        return f"{self.job_name}-worker-{node}"


# --------------------------------------------------------------------------- networks


class LoopbackNetwork:
    """All agents on this machine's loopback; node 0 hosts the rendezvous store."""

    kind = "loopback"

    def __init__(self, spec: ClusterSpec) -> None:
        self.endpoint = f"127.0.0.1:{_free_port()}"

    namespaces: list[str] = []

    def rdzv_conf(self, node: int) -> dict[str, str]:
        # Every agent matches 127.0.0.1, so each would try to host the store: say who does.
        return {"is_host": "1" if node == 0 else "0"}

    def wrap(self, node: int, command: list[str]) -> list[str]:
        return command

    def address(self, node: int) -> str:
        return "127.0.0.1"

    def close(self) -> None:
        pass


class NamespaceNetwork:
    """A network namespace per node (10.77.0.k+1, hostname ``<job>-worker-<k>``), bridged.

    The bridge lives in a namespace of its own, so nothing is added to this machine's own
    network and no packet can leave the simulated cluster. Each agent runs in its node's
    namespace with its own hostname (UTS namespace) and an ``/etc/hosts`` that names every
    pod (bind-mounted in a private mount namespace), so the rendezvous endpoint is
    ``<job>-worker-0:29400`` and node 0 finds it hosts the store by hostname, as on a cluster.
    """

    kind = "netns"

    def __init__(self, spec: ClusterSpec, workdir: Path) -> None:
        self._spec = spec
        self._prefix = f"rt{os.getpid()}"
        self._created: list[str] = []
        self.endpoint = f"{spec.hostname(0)}:{RDZV_PORT}"
        self.hosts_file = workdir / "hosts"
        workdir.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{self.address(k)} {spec.hostname(k)}" for k in range(spec.nodes)]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    @property
    def namespaces(self) -> list[str]:
        return list(self._created)

    def namespace(self, node: int) -> str:
        return f"{self._prefix}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def _create(self) -> None:
        switch = f"{self._prefix}-sw"
        _ip("netns", "add", switch)
        self._created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for node in range(self._spec.nodes):
            ns = self.namespace(node)
            _ip("netns", "add", ns)
            self._created.append(ns)
            # Both ends are created inside namespaces of ours: nothing touches the host's links.
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{node}", "netns", switch)
            _ip("-n", switch, "link", "set", f"p{node}", "master", "br0")
            _ip("-n", switch, "link", "set", f"p{node}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def rdzv_conf(self, node: int) -> dict[str, str]:
        return {}  # node 0 recognises its own hostname in the endpoint

    def wrap(self, node: int, command: list[str]) -> list[str]:
        shim = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return ["ip", "netns", "exec", self.namespace(node), "unshare", "--uts", "--mount", "--",
                "sh", "-c", shim, "pod", self._spec.hostname(node), str(self.hosts_file), *command]

    def close(self) -> None:
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self._created.clear()


Network = LoopbackNetwork | NamespaceNetwork


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_network(spec: ClusterSpec, workdir: Path) -> tuple[Network, str]:
    """The network the spec asks for; ``auto`` falls back to loopback, saying why."""
    if spec.network == "loopback":
        return LoopbackNetwork(spec), "loopback requested"
    try:
        return NamespaceNetwork(spec, workdir), "a network namespace per node"
    except (OSError, subprocess.SubprocessError) as exc:
        if spec.network == "netns":
            raise
        return LoopbackNetwork(spec), f"loopback: network namespaces unavailable ({exc})"


# --------------------------------------------------------------------------- pods


@dataclasses.dataclass(slots=True)
class Pod:
    """One incarnation of a node: an ft_launcher agent and everything it started."""

    node: int
    incarnation: int
    label: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    killed_at: float | None = None
    exit_code: int | None = None

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def poll(self) -> int | None:
        if self.exit_code is None:
            code = self.proc.poll()
            if code is not None:
                self.exit_code = code
        return self.exit_code


def pids_labelled(prefix: str) -> list[int]:
    """Processes whose environment carries a pod label starting with ``prefix``."""
    return launcher.pids_with_env(POD_LABEL_ENV, prefix)


def kill_labelled(prefix: str) -> int:
    """SIGKILL every process labelled ``prefix``, frozen first so none can fork away. Returns the count."""
    return launcher.kill_with_env(POD_LABEL_ENV, prefix)


class _EventTail:
    """New events since the last call, read incrementally from every writer's file."""

    def __init__(self, run_dir: Path, since: float) -> None:
        self._dir = layout.events_dir(run_dir)
        self._since = since
        self._offsets: dict[Path, int] = {}

    def read(self) -> list[ev.Event]:
        new: list[ev.Event] = []
        for path in sorted(self._dir.glob("*.jsonl")) if self._dir.is_dir() else []:
            if ev.log_owner(path.name) is None or not path.is_file():  # only the writers' logs, as the gates read
                continue
            with open(path, "rb") as handle:
                handle.seek(self._offsets.get(path, 0))
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]  # a torn last line is read next time
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    event = ev.Event.from_json(line)
                    if event.ts >= self._since:
                        new.append(event)
        return new


class SimulatedCluster:
    """Starts the pods, plays Kubernetes' pod-restart layer, and tears everything down."""

    def __init__(self, config: cfg.TrainConfig, spec: ClusterSpec, *, env: dict[str, str] | None = None,
                 progress: Callable[[str], None] | None = print, lock_fd: int | None = None) -> None:
        from resilient_training.run.checkpoint_format import iteration_file
        from resilient_training.runtime import nvrx_adapter

        self.config = config
        self.spec = spec
        self.run_dir = Path(config.run_dir)
        self.logs_dir = layout.logs_dir(self.run_dir)
        self.cluster_id = f"{os.getpid()}-{int(time.time() * 1000)}"
        self.pods: dict[int, Pod] = {}
        self.history: list[Pod] = []
        self._pending: dict[int, float] = {}  # node -> when its replacement starts
        self._progress = progress
        self._base_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        if lock_fd is not None:
            # The pods are this machine's processes: they stop when this process dies (a SIGKILLed
            # `train --nodes` left them training, and a resume trained beside them: a stranger
            # trial), and hold the run directory's lock until they have (as the one-node launcher's do).
            self._base_env[PARENT_ENV] = str(os.getpid())
        self._lock_fds = () if lock_fd is None else (lock_fd,)
        # Exactly the PyTorchJob's command: no nnodes, nproc or rendezvous flags (they come from PET_*).
        self.command = nvrx_adapter.worker_command(
            config, cfg.to_argv(config), python=sys.executable, iteration_file=iteration_file(config.run_dir),
        )
        self._pod_command = lambda pod_config: nvrx_adapter.worker_command(
            pod_config, cfg.to_argv(pod_config), python=sys.executable, iteration_file=iteration_file(config.run_dir))
        self.shm_base = layout.local_tier_base(config)
        self._rendezvous_env = nvrx_adapter.rendezvous_env
        self.network: Network | None = None
        self.network_note = ""
        self.failure = ""  # why the job failed, when the event log cannot tell
        self.events: ev.EventLog | None = None
        # Each pod gets a temporary directory of its own, as a container would: NVRx's agent keeps
        # its IPC socket there, and an agent killed with its node cannot remove it.
        self.tmp_base = tempfile.gettempdir()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.events = ev.EventLog(self.run_dir, rank=-1, writer="cluster")
        self.network, self.network_note = make_network(self.spec, self.run_dir / "cluster")
        self._say(f"simulated cluster: {self.spec.nodes} node(s) x {self.spec.nproc_per_node} proc(s), "
                  f"nnodes {self.spec.nnodes}, rendezvous {self.network.endpoint} ({self.network_note})")
        # What clean_up() needs if this process dies without closing (SIGKILL).
        (self.run_dir / "cluster").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "cluster" / "cluster.json").write_text(json.dumps(
            {"cluster_id": self.cluster_id, "spec": dataclasses.asdict(self.spec), "network": self.network.kind,
             "note": self.network_note, "endpoint": self.network.endpoint,
             "namespaces": self.network.namespaces, "command": self.command, "tmp_base": self.tmp_base,
             "shm_base": str(self.shm_base)},
            indent=1))
        for node in range(self.spec.nodes):
            self._start_pod(node, incarnation=0)

    def _start_pod(self, node: int, incarnation: int) -> Pod:
        assert self.network is not None
        label = f"{self.cluster_id}/{node}/{incarnation}"
        pod_tmp = Path(self.tmp_base) / f"{POD_TMP_PREFIX}{self.cluster_id}-{node}-{incarnation}"
        pod_tmp.mkdir(mode=0o700, exist_ok=True)
        # The pod's own node-local memory (its /dev/shm), empty at its start: see the module's doc.
        pod_shm = self.pod_shm(node, incarnation)
        pod_shm.mkdir(mode=0o700, parents=True, exist_ok=True)
        command = self._pod_command(dataclasses.replace(
            self.config, checkpoint=dataclasses.replace(self.config.checkpoint, local_dir=str(pod_shm))))
        env = {
            **self._base_env,
            **self._rendezvous_env(
                nnodes=self.spec.nnodes, nproc_per_node=self.spec.nproc_per_node,
                rdzv_endpoint=self.network.endpoint, rdzv_id=f"{self.spec.job_name}-{self.cluster_id}",
                rdzv_conf={"last_call_timeout": str(int(self.spec.last_call_timeout)),
                           **self.network.rdzv_conf(node)},
            ),
            flt.NODE_ENV: str(node),
            POD_LABEL_ENV: label,
            "TMPDIR": str(pod_tmp),
        }
        env.pop(POD_RESTART_ENV, None)
        if incarnation > 0:
            env[POD_RESTART_ENV] = "1"
        log_path = self.logs_dir / f"node{node}.{incarnation}.log"
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.write(("# " + " ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("PET_")) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(self.network.wrap(node, command), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, pass_fds=self._lock_fds)
        pod = Pod(node, incarnation, label, proc, log_path, time.time())
        self.pods[node] = pod
        self.history.append(pod)
        return pod

    def pod_shm(self, node: int, incarnation: int) -> Path:
        """The node-local tier's directory of one pod (its /dev/shm)."""
        return self.shm_base / f"{POD_SHM_PREFIX}{self.cluster_id}-{node}-{incarnation}"

    def _forget_memory(self, pod: Pod) -> None:
        """A dead pod's memory goes with it (its processes are gone: nothing writes there any more)."""
        shutil.rmtree(self.pod_shm(pod.node, pod.incarnation), ignore_errors=True)

    def kill_node(self, node: int, *, step: int | None, cause: str) -> None:
        """What Kubernetes sees as a pod gone: the agent and all its processes, at once."""
        pod = self.pods[node]
        # Logged before it acts, like every fault.
        assert self.events is not None
        self.events.emit("restart_begin", step, layer="pod", cause=cause, node=node)
        killed = kill_labelled(pod.label)
        pod.killed_at = time.time()
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.proc.wait(timeout=10)
        pod.poll()
        self._forget_memory(pod)
        self._say(f"  ✗ node {node} lost at step {step} ({killed} processes killed); "
                  f"replacement in {self.spec.pod_restart_delay:g} s")
        self._pending[node] = time.time() + self.spec.pod_restart_delay

    def run(self) -> int:
        """Until every pod has succeeded (0) or the job failed (1); the job's exit code."""
        tail = _EventTail(self.run_dir, since=time.time() - 1)
        acted: set[str] = set()
        deadline = time.monotonic() + self.spec.timeout
        failed_at: float | None = None
        while time.monotonic() < deadline:
            for event in tail.read():
                if (event.event == "fault_injected" and event.get("type") in flt.NODE_FAULTS
                        and event["fault"] not in acted):
                    acted.add(event["fault"])
                    node = flt.parse(event["fault"])[0].rank
                    if node in self.pods and self.pods[node].running:
                        self.kill_node(node, step=event.step, cause="node-loss")
            now = time.time()
            for node, when in list(self._pending.items()):
                if now >= when and failed_at is None:
                    del self._pending[node]
                    self._start_pod(node, incarnation=self.pods[node].incarnation + 1)
            for pod in list(self.pods.values()):
                if pod.exit_code is not None or pod.poll() is None or pod.killed_at is not None:
                    continue
                if pod.exit_code < 0 or pod.exit_code >= 128:
                    # restartPolicy ExitCode: a killed pod is recreated.
                    assert self.events is not None
                    self.events.emit("restart_begin", None, layer="pod", cause=f"agent exit {pod.exit_code}",
                                     node=pod.node)
                    pod.killed_at = now
                    kill_labelled(pod.label)  # what the agent left (a recreated pod keeps none of it)
                    self._forget_memory(pod)
                    self._pending[pod.node] = now + self.spec.pod_restart_delay
                elif pod.exit_code != 0 and failed_at is None:
                    failed_at = time.monotonic()
                    self.failure = self._explain(pod)
                    self._say(f"  ✗ node {pod.node} failed (agent exit {pod.exit_code}): the job fails")
            live = [p for p in self.pods.values() if p.killed_at is None]
            if live and failed_at is None and all(p.exit_code == 0 for p in live):
                # Elastic jobs can finish on fewer nodes: a replacement still due is not started.
                if self._pending:
                    self._say(f"  job succeeded without node(s) {sorted(self._pending)}: replacement not started")
                return 0
            if not self._pending and all(p.exit_code is not None for p in live):
                return 1
            if failed_at is not None and time.monotonic() - failed_at > FAILED_JOB_GRACE_SECONDS:
                return 1
            time.sleep(POLL_SECONDS)
        self._say(f"  ✗ simulated job timed out after {self.spec.timeout:g} s")
        return 1

    def _explain(self, pod: Pod) -> str:
        """Why a pod failed, when its agent's log says something the event log cannot."""
        tail = pod.log_path.read_bytes()[-20000:].decode(errors="replace")
        if "RendezvousConnectionError" in tail:
            lost = sorted(p.node for p in self.history if p.killed_at is not None)
            return (f"node {pod.node}'s ft_launcher lost the c10d rendezvous store (hosted by node 0; lost nodes: "
                    f"{lost}) and exited {pod.exit_code}: NVRx cannot re-form the job without it; "
                    f"run the same command again to resume from the last committed checkpoint")
        return ""

    def close(self) -> None:
        """Kill whatever is left of every pod, then remove the namespaces."""
        kill_labelled(f"{self.cluster_id}/")
        for pod in self.history:
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.proc.wait(timeout=10)
        if self.network is not None:
            self.network.close()
        remove_pod_tmp(self.tmp_base, self.cluster_id)
        remove_pod_tmp(self.shm_base, self.cluster_id, prefix=POD_SHM_PREFIX)
        if self.events is not None:
            self.events.close()

    def _say(self, line: str) -> None:
        with open(self.logs_dir / "cluster.log", "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        if self._progress is not None:
            self._progress(line)


def clean_up(run_dir: str | os.PathLike[str]) -> int:
    """Kill what is left of a simulated cluster whose launcher died without closing it.

    Reads ``cluster/cluster.json`` of ``run_dir``; returns the number of processes killed.
    """
    path = Path(run_dir) / "cluster" / "cluster.json"
    if not path.is_file():
        return 0
    try:
        record = json.loads(path.read_text())
        record["cluster_id"]
    except (OSError, ValueError, KeyError, TypeError):  # not ours to act on
        return 0
    killed = kill_labelled(f"{record['cluster_id']}/")
    for ns in record.get("namespaces", []):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
    if record.get("tmp_base"):
        remove_pod_tmp(record["tmp_base"], record["cluster_id"])
    if record.get("shm_base"):
        remove_pod_tmp(record["shm_base"], record["cluster_id"], prefix=POD_SHM_PREFIX)
    return killed


def remove_pod_tmp(base: str | os.PathLike[str], cluster_id: str, *, prefix: str = POD_TMP_PREFIX) -> None:
    """Remove the pods' temporary (or node-local) directories, after their processes are gone."""
    for path in Path(base).glob(f"{prefix}{cluster_id}-*"):
        shutil.rmtree(path, ignore_errors=True)


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_cluster(
    config: cfg.TrainConfig,
    spec: ClusterSpec,
    *,
    progress: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
) -> launcher.LaunchResult:
    """Run the job on simulated nodes until it succeeds or fails; never raises on failure."""
    launcher.preflight(config, world_size=spec.nodes * spec.nproc_per_node, nodes=spec.nodes)
    with launcher.claim_run_dir(config) as claim:
        clean_up(claim.path)  # what a SIGKILLed launcher of this run left (network namespaces, pods)
        return _run_cluster(config, spec, claim.path, progress=progress, env=env, lock_fd=claim.lock_fd)


def _run_cluster(config: cfg.TrainConfig, spec: ClusterSpec, run_dir: Path, *,
                 progress: Callable[[str], None] | None, env: dict[str, str] | None,
                 lock_fd: int | None = None) -> launcher.LaunchResult:
    started = time.time()
    cluster = SimulatedCluster(config, spec, env=env, progress=progress, lock_fd=lock_fd)
    watcher = launcher.ProgressPrinter(run_dir, config.steps, since=started, emit=progress)
    watcher.start()
    # SIGTERM (a cancelled step, a timeout) must still tear the pods down: exit via finally.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if main_thread else None
    stopped: BaseException | None = None
    try:
        cluster.start()
        exit_code = cluster.run()
    except BaseException as exc:
        stopped = exc
        raise
    finally:
        cluster.close()
        watcher.stop()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if stopped is not None:  # after the pods: the end is the run's last event
            launcher.record_stopped(run_dir, stopped)
    log = layout.logs_dir(run_dir) / "cluster.log"
    reason = cluster.failure or launcher.outcome(run_dir, config.steps, exit_code, since=started, log=log)
    if exit_code != 0:
        launcher.record_failure(run_dir, reason)
    return launcher.LaunchResult(exit_code, reason, str(run_dir))

