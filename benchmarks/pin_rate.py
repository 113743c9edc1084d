"""How fast can a new process get a save's host memory ready, and can a save go without it? GPU only.

    python benchmarks/pin_rate.py [--gb 16] [--tensor-mb 80]

On the 1.3B model each new process page-locks 16 GB of staging buffers (18-21 s on one H200,
paced so training runs meanwhile) and defers its first save until they are locked: a fault in
that window rolls back 100+ steps (docs/benchmarks.md, fourteenth round). This measures what a
fix could use, on buffers made as the trainer makes them (``torch.empty(...).share_memory_()``,
``--tensor-mb`` each):

1. ``cudaHostRegister`` back to back from one thread, and split over 2 and 4 threads: GB/s;
2. a device-to-host copy into those buffers unlocked (pageable) and locked: GB/s, no training;
3. the same pageable copy from a second thread while a training-like loop runs (48 linear
   layers, AdamW, synchronized each step): the copy's GB/s and the steps' median and slowest.

Prints one table; each row as it is measured.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch
from pin_contention import training_step  # beside this script (on sys.path when run as a script)

from resilient_training.runtime.checkpointing import page_lock, page_unlock


def _buffers(total: int, each: int, how: str = "share_memory_") -> list[torch.Tensor]:
    """``share_memory_``: as the trainer made them (a private tensor copied into new shared memory);
    ``new_shared``: shared memory made directly (``UntypedStorage._new_shared``), nothing copied;
    ``new_shared+zero``: the same, every page then written."""
    out = []
    for start in range(0, total, each):
        n = min(each, total - start)
        if how == "share_memory_":
            out.append(torch.empty(n, dtype=torch.uint8).share_memory_())
            continue
        buffer = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n))
        if how == "new_shared+zero":
            buffer.zero_()
        out.append(buffer)
    return out


def _lock(buffers: list[torch.Tensor], threads: int) -> tuple[float, list[int]]:
    locked: list[int] = []
    guard = threading.Lock()

    def work(part: list[torch.Tensor]) -> None:
        for b in part:
            if page_lock(b.data_ptr(), b.numel()):
                with guard:
                    locked.append(b.data_ptr())

    parts = [buffers[i::threads] for i in range(threads)]
    start = time.perf_counter()
    pool = [threading.Thread(target=work, args=(p,)) for p in parts]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - start, locked


def _unlock(locked: list[int]) -> None:
    for ptr in locked:
        page_unlock(ptr)


def _copy(sources: list[torch.Tensor], buffers: list[torch.Tensor], stream: torch.cuda.Stream) -> float:
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        for src, dst in zip(sources, buffers, strict=True):
            dst.copy_(src, non_blocking=True)
    stream.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=16.0)
    parser.add_argument("--tensor-mb", type=int, default=80)
    args = parser.parse_args()
    total = int(args.gb * 1e9)
    each = args.tensor_mb << 20
    gb = total / 1e9
    print(f"{gb:.1f} GB in {args.tensor_mb} MB shared-memory buffers; {torch.cuda.get_device_name()}", flush=True)
    print("| what | seconds | GB/s | steps meanwhile | median step s | slowest step s |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)

    def row(what: str, seconds: float, steps: list[float] | None = None) -> None:
        extra = (f"{len(steps)} | {statistics.median(steps):.4f} | {max(steps):.3f}" if steps else "– | – | –")
        print(f"| {what} | {seconds:.2f} | {gb / seconds:.2f} | {extra} |", flush=True)

    def attempt(what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 (one failed measurement must not lose the others)
            print(f"| {what} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | | |", flush=True)

    for how in ("new_shared", "new_shared+zero"):  # each way made, then page-locked from one thread
        def made(how: str = how) -> None:
            start = time.perf_counter()
            made = _buffers(total, each, how)
            row(f"allocate ({how})", time.perf_counter() - start)
            seconds, locked = _lock(made, 1)
            row(f"cudaHostRegister of those, 1 thread ({len(locked)}/{len(made)} ok)", seconds)
            _unlock(locked)
        attempt(how, made)
    start = time.perf_counter()
    buffers = _buffers(total, each)
    row("allocate (share_memory_, pages written)", time.perf_counter() - start)
    for threads in (1, 2, 4):
        def lock(threads: int = threads) -> None:
            seconds, locked = _lock(buffers, threads)
            row(f"cudaHostRegister, {threads} thread(s) ({len(locked)}/{len(buffers)} ok)", seconds)
            _unlock(locked)
        attempt(f"register x{threads}", lock)

    sources = [torch.randn(b.numel() // 4, device="cuda").view(torch.uint8) for b in buffers]
    stream = torch.cuda.Stream()
    attempt("pageable copy", lambda: row("device-to-host copy, pageable buffers", _copy(sources, buffers, stream)))

    def locked_copy() -> None:
        _, locked = _lock(buffers, 1)
        row("device-to-host copy, page-locked buffers", _copy(sources, buffers, stream))
        _unlock(locked)
    attempt("locked copy", locked_copy)

    step = training_step()
    alone = [step() for _ in range(50)]
    print(f"| training alone (50 steps) | – | – | 50 | {statistics.median(alone):.4f} | {max(alone):.3f} |", flush=True)

    def during(what: str, work: Callable[[], float]) -> None:
        took: list[float] = []
        thread = threading.Thread(target=lambda: took.append(work()))
        steps: list[float] = []
        thread.start()
        while thread.is_alive():
            steps.append(step())
        thread.join()
        row(what, took[0] if took else float("nan"), steps or [0.0])

    side = torch.cuda.Stream()
    attempt("pageable copy while training",
            lambda: during("pageable copy from a second thread, while training", lambda: _copy(sources, buffers, side)))
    attempt("register while training",
            lambda: during("cudaHostRegister x1 (unpaced), while training", lambda: _lock_and_release(buffers)))
    buffers.clear()  # the next rows make their own
    for how in ("share_memory_", "new_shared"):  # what a new process does while it trains: make, then lock
        attempt(f"{how} while training", lambda how=how: during(
            f"allocate ({how}) then cudaHostRegister x1, while training", lambda: _make_and_lock(total, each, how)))


def _make_and_lock(total: int, each: int, how: str) -> float:
    start = time.perf_counter()
    made = _buffers(total, each, how)
    allocated = time.perf_counter() - start
    _, locked = _lock(made, 1)
    seconds = time.perf_counter() - start
    print(f"|   (of which allocating {allocated:.2f} s) | | | | | |", flush=True)
    _unlock(locked)
    return seconds


def _lock_and_release(buffers: list[torch.Tensor]) -> float:
    seconds, locked = _lock(buffers, 1)
    _unlock(locked)
    return seconds


if __name__ == "__main__":
    main()
