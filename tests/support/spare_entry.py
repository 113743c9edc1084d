"""What a warm spare runs in the stub/spare tests instead of the trainer: ``main(argv)`` acts out
``--run-dir DIR ACTION [ARG]`` (the stub needs ``--run-dir`` to find its pool).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    action, *rest = argv[2:]
    if action == "exit":
        return int(rest[0])
    if action == "report":  # what the spare adopted, on the stub's stdout; stdin echoed
        import torch

        line = sys.stdin.readline().strip()
        print("to stderr", file=sys.stderr)
        print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv,
                          "stdin": line, "threads": torch.get_num_threads(), "umask": os.umask(0o22)}))
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
