"""Does making a save's staging buffers hold the training thread? GPU only.

    python benchmarks/staging_prepare.py [--gb 16] [--tensors 879] [--repeat 2]

A process's first step ends by making its staging buffers in the background
(``StagingBuffers.prepare``: shared memory, every page written, then page-locked). On one H200 the
step after a killed 1.3B rank's first step took 2.1-3.1 s (0.18 s otherwise) while its 16 GB were
being written. This trains a training-like loop (``pin_contention.training_step``) while the
product's ``prepare`` makes ``--gb`` GB in ``--tensors`` buffers, its pages written two ways: each
piece by ``Tensor.zero_`` (before: PyTorch spreads each over its intra-op threads, eight pieces at
once) and by one ``memset`` a piece, the memory allocated by torch's ``_new_shared`` (which holds
the GIL: before); ``nolock``: as memset, not page-locked; ``product``: ``shared_empty`` now
(allocated outside the GIL); and no preparation at all. Prints one table (the steps taken while the buffers were
made, against the undisturbed median), then each slow step and the preparation's parts it overlapped.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from pin_contention import training_step

from resilient_training.runtime import checkpointing
from resilient_training.runtime.checkpointing import StagingBuffers, page_unlock

product_populate = checkpointing.populate
product_shared_empty = checkpointing.shared_empty


def gil_shared_empty(shape, dtype):
    """``shared_empty`` before: torch's ``_new_shared``, which allocates the memory holding the GIL."""
    numel = math.prod(shape)
    if not numel:
        return torch.empty(shape, dtype=dtype).share_memory_()
    storage = torch.UntypedStorage._new_shared(numel * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))
product_page_lock = checkpointing.page_lock


def zero_populate(buffers: list[torch.Tensor], threads: int | None = None, piece_bytes: int = 256 << 20) -> None:
    """``populate`` before: ``Tensor.zero_`` on each piece (ThreadPoolExecutor of eight)."""
    pieces = [piece for buffer in buffers if buffer.numel()
              for piece in buffer.view(-1).split(max(1, piece_bytes // buffer.element_size()))]
    count = threads or max(1, min(8, (os.cpu_count() or 2) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    with ThreadPoolExecutor(max_workers=min(count, len(pieces))) as pool:
        list(pool.map(torch.Tensor.zero_, pieces))


class Timeline:
    """When each part of a preparation ran (perf_counter spans), by wrapping the module's functions."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.setdefault(name, []).append((start, time.perf_counter()))
        return timed

    def overlaps(self, start: float, end: float) -> str:
        parts = []
        for name, spans in self.spans.items():
            inside = [(a, b) for a, b in spans if a < end and b > start]
            if inside:
                parts.append(f"{name} x{len(inside)} ({sum(min(b, end) - max(a, start) for a, b in inside):.2f} s)")
        return ", ".join(parts) or "nothing"


def trial(way: str, step, sources: list[tuple[str, torch.Tensor]]) -> dict:
    """``way``: none; zero_ and memset (memory allocated under the GIL, pages written by zero_ or
    memset: before); nolock (as memset, no page-locking); product (allocated outside the GIL)."""
    timeline = Timeline()
    populate = zero_populate if way == "zero_" else product_populate
    checkpointing.populate = timeline.wrap("write pages", populate)
    checkpointing.shared_empty = timeline.wrap(
        "shared_empty", product_shared_empty if way == "product" else gil_shared_empty)
    lock = (lambda ptr, nbytes, **kwargs: True) if way == "nolock" else product_page_lock
    checkpointing.page_lock = timeline.wrap("page_lock", lock)
    staging = StagingBuffers()
    times: list[tuple[float, float]] = []
    start = time.perf_counter()
    if way != "none":
        staging.prepare(sources)
    thread = staging._preparing
    while (thread is not None and thread.is_alive()) or time.perf_counter() - start < 2.0:
        began = time.perf_counter()
        step()
        times.append((began, time.perf_counter()))
    if thread is not None:
        thread.join()
    report = staging.pin_report.take() or {}
    if way != "nolock":
        for ptr, device in list(staging._pinned.items()):
            page_unlock(ptr, device=device)
    return {"way": way, "times": [b - a for a, b in times], "spans": times, "timeline": timeline, "start": start,
            **report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=16.0)
    parser.add_argument("--tensors", type=int, default=879)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ways", default="none,memset,product")
    args = parser.parse_args()
    step = training_step()
    each = int(args.gb * 1e9) // args.tensors // 4
    sources = [(f"t{i}", torch.empty(each, dtype=torch.float32, device="cuda")) for i in range(args.tensors)]
    rows = [trial(way, step, sources) for _ in range(args.repeat) for way in args.ways.split(",")]
    base = statistics.median(t for row in rows if row["way"] == "none" for t in row["times"]) if any(
        row["way"] == "none" for row in rows) else statistics.median(t for row in rows for t in row["times"])
    print(f"{args.gb:.1f} GB of staging in {args.tensors} buffers made while training; {torch.cuda.get_device_name()}; "
          f"torch intra-op threads {torch.get_num_threads()}, {os.cpu_count()} CPUs; undisturbed median step {base:.4f} s")
    print("| way | pages written s | whole preparation s | steps meanwhile | median step s | slowest step s "
          "| steps' seconds over the undisturbed median |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        times = row["times"]
        print(f"| {row['way']} | {row.get('allocate_seconds', 0):.2f} | {row.get('seconds', 0):.2f} | {len(times)} "
              f"| {statistics.median(times):.4f} | {max(times):.3f} | {sum(times) - base * len(times):.2f} |")
    print("\nSteps over 5 x the undisturbed median, and what ran meanwhile (seconds from the preparation's start)")
    for number, row in enumerate(rows):
        timeline, zero = row["timeline"], row["start"]
        phases = "; ".join(f"{name} {min(a for a, _ in spans) - zero:.2f}-{max(b for _, b in spans) - zero:.2f}"
                           for name, spans in timeline.spans.items())
        print(f"- {row['way']} (trial {number}): {phases or 'no preparation'}")
        for a, b in row["spans"]:
            if b - a > 5 * base:
                print(f"  - step {a - zero:.2f}-{b - zero:.2f} ({b - a:.3f} s): {timeline.overlaps(a, b)}")


if __name__ == "__main__":
    main()
