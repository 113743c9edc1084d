"""A worker that the launcher restarted waits for its GPU's previous worker itself, after its own set-up.

ft_launcher (0.6+) waits before each restart's rendezvous until the memory in use on every
local GPU is under a tolerance. On one H200 that wait was 0.6-1.2 s of each launcher restart
(docs/benchmarks.md#eleventh-round): the killed worker's exit unpins gigabytes of page-locked
host memory before the driver frees its GPU memory, and nothing else went on meanwhile.

With ``worker_gpu_reclaim`` (the default) the launcher does not wait. Each worker records its
pid in a node-local file per device when it starts (:func:`claim`), and a worker that finds a
predecessor there still alive waits for it to be gone (:func:`wait_gone`: a zombie holds no GPU
memory) just before it allocates its model. Its start-up, CUDA context and NCCL set-up run while
the old process exits. Other processes on the GPU are not waited for (neither does
ft_launcher's best-effort wait guarantee it: it goes on after its timeout). On CPU the same wait
keeps two copies of a rank's model out of host memory at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from resilient_training.runtime.spare_stub import proc_stat


@dataclass(frozen=True, slots=True)
class Predecessor:
    """The process recorded for a GPU before this one."""

    pid: int
    start: str  # /proc/<pid>/stat's start time: a reused pid is another process


def _stat(pid: int | str) -> list[str] | None:
    try:
        return proc_stat(pid)
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def alive(predecessor: Predecessor) -> bool:
    """Still running: some thread of it is not a zombie (and the pid is not another process's).

    Every thread, not the process's own state: a SIGKILLed worker's main thread shows ``Z`` at
    once while another thread still tears down its memory and its GPU context (on one H200 the
    new worker went on ~0.5 s early, its CUDA context creation waiting on that exit instead).
    """
    fields = _stat(predecessor.pid)
    if not fields or len(fields) <= 19 or fields[19] != predecessor.start:
        return False
    if fields[0] not in ("Z", "X"):
        return True
    try:
        threads = os.listdir(f"/proc/{predecessor.pid}/task")
    except OSError:
        return False
    return any((_stat(f"{predecessor.pid}/task/{tid}") or ["Z"])[0] not in ("Z", "X") for tid in threads)


def claim(path: Path) -> Predecessor | None:
    """Record this process as the GPU's worker in ``path``; return the one recorded before if it
    is still alive (the worker this one replaces, still exiting), else None.
    """
    previous: Predecessor | None = None
    with contextlib.suppress(OSError, ValueError):
        pid, start = path.read_text().split()
        previous = Predecessor(int(pid), start)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        os.replace(tmp, path)  # atomic: a reader sees the old record or this one
    except OSError as exc:  # best effort, like the wait itself: the next worker just will not wait
        print(f"resilient-training: could not record this worker in {path}: {exc}", file=sys.stderr)
    if previous is not None and previous.pid != os.getpid() and alive(previous):
        return previous
    return None


def wait_gone(predecessor: Predecessor, timeout: float, poll: float = 0.005,
              on_wait: Callable[[], None] | None = None, every: float = 0.5) -> bool:
    """Wait until ``predecessor`` is gone (True) or ``timeout`` seconds pass (False: the caller
    goes on anyway, as ft_launcher does after its own timeout). ``on_wait`` is called every
    ``every`` seconds meanwhile (the progress guard: a bounded wait is no hang).
    """
    now = time.monotonic()
    deadline, ping = now + timeout, now + every
    while alive(predecessor):
        now = time.monotonic()
        if now >= deadline:
            return False
        if on_wait is not None and now >= ping:
            on_wait()
            ping = now + every
        time.sleep(poll)
    return True


def record_path(run_folder: Path, agent: str, local_rank: int) -> Path:
    """Where the worker of local device ``local_rank`` started by ``agent`` (the launcher agent's
    host, pid and start time: the one that restarts it) records itself, in a folder of the run's
    in the node-local tier's directory. Per agent: two agents on one machine (simulated pods, two
    runs) never take each other's workers for predecessors; a new pod's agent finds no record.
    """
    return run_folder / f"agent-{hashlib.sha1(agent.encode()).hexdigest()[:12]}-{local_rank}.pid"


def release(path: Path) -> None:
    """At the end of a completed run: drop the record if it is this process's, and the run's folder once empty."""
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text().split()[0]) == os.getpid():
            path.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # the run's folder of records, once no worker of it is recorded
