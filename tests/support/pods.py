"""Run a rendered PyTorchJob's worker pods (or a TrainJob's trainer pods) as processes on this
host, with the env the Training Operator (or the Trainer) gives them.

The Training Operator starts each Worker pod's ``pytorch`` container with the job's command and
adds ``PET_*`` variables derived from the job (``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``, ``PET_RDZV_ID``, ``PET_MAX_RESTARTS``). This does
the same for each replica, with the rendezvous endpoint on 127.0.0.1 instead of the
``<job>-worker-0`` service, so the exact container command is exercised by real ft_launcher
agents (torch's c10d rendezvous lets the agents of one host share the store). No container
isolation: the job's run directory must be a path on this host.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PodResult:
    name: str
    exit_code: int
    log: Path


def operator_env(job: dict[str, Any], *, rdzv_port: int) -> dict[str, str]:
    """The ``PET_*`` variables the operator (v1.9) gives every worker of an elastic job."""
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    workers = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
    env = {
        "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"),
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{rdzv_port}",
        "PET_NNODES": (f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
                       if "minReplicas" in elastic else str(workers)),
        "PET_NPROC_PER_NODE": str(spec["nprocPerNode"]),
    }
    if "rdzvId" in elastic:
        env["PET_RDZV_ID"] = elastic["rdzvId"]
    if "maxRestarts" in elastic:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    return env


def run_pods(job: dict[str, Any], *, log_dir: Path, rdzv_port: int, timeout_s: float,
             extra_env: dict[str, str] | None = None, pods: int | None = None,
             pod_env: Callable[[int], dict[str, str]] | None = None) -> list[PodResult]:
    """Start every worker "pod" of ``job`` and wait for all (killing them all at ``timeout_s``).

    ``pod_env(index)`` adds per-pod variables, e.g. ``CUDA_VISIBLE_DEVICES`` so each "pod" sees
    only its own GPUs, as it would on its own node.
    """
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    count = pods or job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    base = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", [])},
            **operator_env(job, rdzv_port=rdzv_port), **(extra_env or {})}
    argvs = {index: [*container["command"], *container["args"]] for index in range(count)}
    envs = {index: {**base, **(pod_env(index) if pod_env else {})} for index in range(count)}
    return _run(job["metadata"]["name"] + "-worker-", argvs, envs, log_dir, timeout_s)


def trainer_env(job: dict[str, Any], runtime: dict[str, Any], index: int, *, master_addr: str,
                master_port: int) -> dict[str, str]:
    """The ``PET_*`` variables Kubeflow Trainer v2.3's Torch plugin gives trainer pod ``index``.

    ``PET_NNODES``: the TrainJob's ``numNodes`` (else the runtime's); ``PET_NPROC_PER_NODE``: its
    ``numProcPerNode`` (else ``auto``); ``PET_NODE_RANK``: the pod's Job completion index;
    ``PET_MASTER_ADDR``/``PET_MASTER_PORT``: ``<job>-node-0-0.<job>`` and 29500, here the given
    address and port on this host.
    """
    trainer = job["spec"].get("trainer") or {}
    nodes = trainer.get("numNodes") or runtime["spec"]["mlPolicy"].get("numNodes", 1)
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
            "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": master_addr, "PET_MASTER_PORT": str(master_port)}


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of a container's command and args (``$$`` escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def run_trainjob_pods(job: dict[str, Any], runtime: dict[str, Any], *, log_dir: Path, master_port: int,
                      timeout_s: float, extra_env: dict[str, str] | None = None) -> list[PodResult]:
    """Start the trainer "pods" of a TrainJob as the Trainer would build them from ``runtime``.

    The node container of the runtime's trainer job, with the TrainJob's image/command/args
    overrides, its env on top of the runtime's, then the Torch plugin's ``PET_*``; command and
    args are ``$(VAR)``-expanded against that env like the kubelet does.
    """
    trainer = job["spec"].get("trainer") or {}
    (rjob,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
               if r["template"]["metadata"]["labels"].get("trainer.kubeflow.org/trainjob-ancestor-step") == "trainer"]
    (container,) = [c for c in rjob["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "node"]
    command = trainer.get("command") or container.get("command") or []
    args = trainer.get("args") if "args" in trainer else container.get("args") or []
    count = trainer.get("numNodes") or runtime["spec"]["mlPolicy"].get("numNodes", 1)
    argvs, envs = {}, {}
    for index in range(count):
        pod_env = {**{e["name"]: e["value"] for e in container.get("env", [])},
                   **{e["name"]: e["value"] for e in trainer.get("env", [])},
                   **trainer_env(job, runtime, index, master_addr="127.0.0.1", master_port=master_port)}
        argvs[index] = [expand(part, pod_env) for part in [*command, *args]]
        envs[index] = {**os.environ, **pod_env, **(extra_env or {})}
    return _run(f"{job['metadata']['name']}-node-0-", argvs, envs, log_dir, timeout_s)


def _run(prefix: str, argvs: dict[int, list[str]], envs: dict[int, dict[str, str]], log_dir: Path,
         timeout_s: float) -> list[PodResult]:
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for index, argv in argvs.items():
        name = f"{prefix}{index}"
        log = log_dir / f"{name}.log"
        with open(log, "wb") as out:
            procs.append((name, log, subprocess.Popen(
                argv, env=envs[index], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)))
    deadline = time.monotonic() + timeout_s
    results = []
    for name, log, proc in procs:
        try:
            code = proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, _, other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            code = proc.wait()
        results.append(PodResult(name, code, log))
    return results
