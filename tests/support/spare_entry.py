"""What a warm spare runs in the stub/spare tests instead of the trainer: ``main(argv)`` acts out
``--run-dir DIR ACTION [ARG]`` (the stub needs ``--run-dir`` to find its pool).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

# What this spare prepared (spare_pool's ``--prepare tests.support.spare_entry:prepare``), before it got work.
PREPARED: dict[str, object] = {}


def prepare(local_rank: int) -> str:
    """Stands in for making the local rank's CUDA context."""
    PREPARED.update(local_rank=local_rank, pid=os.getpid())
    return f"test device {local_rank}"


def prepare_slowly(local_rank: int) -> str:
    time.sleep(1.5)
    return prepare(local_rank)


def prepare_fails(local_rank: int) -> str:
    raise RuntimeError(f"no device {local_rank} here")


def main(argv: list[str]) -> int:
    action, *rest = argv[2:]
    if action == "exit":
        return int(rest[0])
    if action == "report":  # what the spare adopted, on the stub's stdout; stdin echoed
        import torch

        line = sys.stdin.readline().strip()
        print("to stderr", file=sys.stderr)
        print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv,
                          "stdin": line, "threads": torch.get_num_threads(), "umask": os.umask(0o22),
                          "prepared": PREPARED}))
        return 0
    if action == "thread-masks":  # the signals each thread but this one blocks (/proc's SigBlk)
        masks = {}
        for task in os.listdir("/proc/self/task"):
            if int(task) != threading.get_native_id():
                with open(f"/proc/self/task/{task}/status") as status:
                    masks[task] = next(int(line.split()[1], 16) for line in status if line.startswith("SigBlk:"))
        print(json.dumps(masks), flush=True)
        return 0
    if action == "wait-for-term":  # a handler, like a trainer that shuts down cleanly
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), os._exit(7)))
        print("waiting", flush=True)
        time.sleep(60)
        return 1
    if action == "sleep":  # no handler: SIGTERM kills, as it does a worker without one
        print("sleeping", flush=True)
        time.sleep(60)
        return 1
    if action == "kill-self":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "child-and-sleep":  # a grandchild in this worker's group, like NVRx's writer
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(json.dumps({"pid": os.getpid(), "child": child.pid}), flush=True)
        time.sleep(60)
        return 1
    raise SystemExit(f"unknown action {action}")
