"""The built-in GPT task, except that each worker's ``build_data`` first waits until its node's
warm-spare pool listens for every local rank and this worker's checkpoint writer is ready.

For the warm-spare tests: a fault then meets spares and writers that are up, however slowly this
machine imports torch beside other tests (step padding made that a race on two busy cores).
"""

from __future__ import annotations

import time
from typing import Any

from resilient_training.run import events as ev
from resilient_training.runtime import spare_stub as stub
from resilient_training.tasks import gpt

TIMEOUT = 120.0  # then train on: the test's own checks say what was not ready


class ReadyTask:
    def __init__(self, inner: gpt.GPTTask, run_dir: str, nproc: int) -> None:
        self.inner, self.run_dir, self.nproc = inner, run_dir, nproc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def build_data(self, rank: int, world_size: int, seed: int) -> Any:
        import torch.distributed

        # Only in a training worker: the CLI's and the pool's preflights build data too.
        deadline = time.monotonic() + TIMEOUT if torch.distributed.is_initialized() else 0.0
        while time.monotonic() < deadline and not self._ready(rank):
            time.sleep(0.1)
        return self.inner.build_data(rank, world_size, seed)

    def _ready(self, rank: int) -> bool:
        events = ev.read_events(self.run_dir)
        starts = [e for e in events if e.event == "start" and e.rank == rank]
        if not starts:
            return False
        writer = any(e.event == "writer_ready" and e.rank == rank and e.ts >= starts[-1].ts for e in events)
        # A spare's worker is not the agent's child: the start event names the agent.
        key = stub.pool_key(self.run_dir, starts[-1]["agent"])
        names = {stub.address(key, stub.rank_suffix(r)).replace(b"\0", b"@").decode() for r in range(self.nproc)}
        with open("/proc/net/unix") as handle:
            listening = {fields[-1] for fields in map(str.split, handle) if len(fields) >= 8}
        return writer and names <= listening


def task(*, run_dir: str, nproc: str = "2", **gpt_args: str) -> ReadyTask:
    return ReadyTask(gpt.task(**gpt_args), run_dir, int(nproc))
