"""What the ranks agree on before a restore goes through the store, and the process group's first
collective (on NCCL: building the communicator, 0.4-0.9 s on H200s) runs on a thread of its own
while the checkpoint loads (runtime/checkpointing.py StoreGather, CollectiveWarmUp).

Real parts: a real TCPStore shared by two threads, real gloo process groups, and two real worker
processes resuming a real checkpoint, whose collectives are recorded in order.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient_training.runtime.checkpointing import CollectiveWarmUp, PeersDidNotAgree, StoreGather


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stores(n: int = 2) -> list[dist.Store]:
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, n, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    return [master] + [dist.TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=30))
                       for _ in range(n - 1)]


def test_every_rank_gets_every_rank_s_value_call_after_call() -> None:
    stores = _stores()
    gathers = [StoreGather(dist.PrefixStore("ckpt", s), rank, 2, timeout=10) for rank, s in enumerate(stores)]
    results: dict[int, list] = {}

    def rank(r: int) -> None:
        first = gathers[r]([r, "a"], "first")
        time.sleep(0.1 * r)  # rank 1 arrives late at the second: rank 0 must wait, not read stale keys
        results[r] = [first, gathers[r]({"step": 10 + r}, "second")]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    expected = [[[0, "a"], [1, "a"]], [{"step": 10}, {"step": 11}]]
    assert results == {0: expected, 1: expected}


def test_a_world_of_one_agrees_with_itself_without_the_store() -> None:
    store = _stores(1)[0]
    keys = store.num_keys()
    assert StoreGather(store, 0, 1, timeout=1)({"step": 3}, "alone") == [{"step": 3}]
    assert store.num_keys() == keys


def test_a_rank_that_never_arrives_is_named_and_counts_as_a_timeout() -> None:
    store = _stores(1)[0]
    gather = StoreGather(store, 0, 3, timeout=0.3)
    store.set("agree/1/2", json.dumps(None))  # rank 2 came; rank 1 did not
    started = time.monotonic()
    with pytest.raises(PeersDidNotAgree, match=r"finding the checkpoint: rank\(s\) \[1\] did not arrive; timed out"):
        gather(None, "finding the checkpoint")
    assert time.monotonic() - started < 5
    assert isinstance(PeersDidNotAgree("x"), TimeoutError)


def test_the_wait_is_sliced_so_an_in_process_restart_s_exception_gets_through() -> None:
    """NVRx's in-process layer raises into the training thread; a C++ wait on the store would hold it
    until the peers came (never, if one is dead). ``on_wait`` stands for that exception here."""
    class Restart(Exception):
        pass

    pings: list[float] = []

    def on_wait() -> None:
        pings.append(time.monotonic())
        if len(pings) == 3:
            raise Restart

    gather = StoreGather(_stores(1)[0], 0, 2, timeout=60, on_wait=on_wait)
    started = time.monotonic()
    with pytest.raises(Restart):
        gather(None, "waiting")
    assert time.monotonic() - started < 2  # three slices of 0.05 s, not the 60 s timeout


def test_the_warm_up_raises_its_failure_on_the_thread_that_joins_it() -> None:
    warm_up = CollectiveWarmUp(torch.device("cpu"))  # no process group here
    with pytest.raises((ValueError, RuntimeError), match="process group|init_process_group"):
        warm_up.join()
    assert warm_up.thread.name == "collective-warm-up"


# Each worker records the collectives it makes, with the thread that made them.
_RECORDER = """
import sys, threading, json, torch.distributed as d
log = open(sys.argv[1], "w")
def wrap(name):
    real = getattr(d, name)
    def recorded(*args, **kwargs):
        log.write(json.dumps([name, threading.current_thread().name]) + "\\n"); log.flush()
        return real(*args, **kwargs)
    setattr(d, name, recorded)
for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
             "all_gather_into_tensor", "reduce_scatter_tensor"):
    wrap(name)
from resilient_training.runtime import worker
sys.exit(worker.main(sys.argv[2:]))
"""


def _run_world(run_dir: Path, record: Path, steps: int) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _RECORDER, str(record.with_suffix(f".rank{rank}")), "--run-dir", str(run_dir),
             "--steps", str(steps), "--checkpoint-every", "2", "--local-checkpoint-every", "1",
             "--no-inprocess", "--no-ft-launcher", "--no-async-checkpoint"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_a_restore_makes_no_collective_before_the_warm_up(tmp_path: Path) -> None:
    from resilient_training.run import events as ev

    run_dir = tmp_path / "run"
    _run_world(run_dir, tmp_path / "first", steps=3)
    _run_world(run_dir, tmp_path / "second", steps=5)  # resumes: node-local step 3 on both ranks
    loads = [e for e in ev.read_events(run_dir) if e.event == "load_done" and e.step]
    assert sorted((e.rank, e.step) for e in loads) == [(0, 3), (1, 3)]
    for rank in range(2):
        calls = [json.loads(line) for line in (tmp_path / f"second.rank{rank}").read_text().splitlines()]
        assert calls[0] == ["all_reduce", "collective-warm-up"], calls[:5]
        # the step agreement after it, on the training thread; nothing else on the warm-up's
        assert calls[1] == ["all_reduce", "MainThread"], calls[:5]
        assert sum(1 for _, thread in calls if thread == "collective-warm-up") == 1
