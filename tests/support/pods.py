"""Run a rendered PyTorchJob's worker pods as processes on this host, with the operator's env.

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
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for index in range(count):
        name = f"{job['metadata']['name']}-worker-{index}"
        log = log_dir / f"{name}.log"
        with open(log, "wb") as out:
            env = {**base, **(pod_env(index) if pod_env else {})}
            procs.append((name, log, subprocess.Popen(
                [*container["command"], *container["args"]], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)))
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
