"""Does page-locking host memory in a background thread hold the training thread? GPU only.

    python benchmarks/pin_contention.py [--gb 6.4] [--dir /dev/shm] [--run-mb 64]

The host snapshot (``--host-snapshot``) page-locks two slot files (2 x 3.2 GB for the 268M model)
in a background thread while training runs. On one H200 (call9), one step then took more than
3 s and the progress guard called it a hang. This runs a training-like loop (a stack of linear
layers, forward, backward, AdamW; ~hundreds of kernel launches per step, synchronized each step)
while another thread page-locks ``--gb`` GB of a mapped shared-memory file in ``--run-mb`` MB
calls, three ways: not at all, back to back (the code before), and with a pause as long as each
call took (``checkpointing.page_lock(pause=True)``). Prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from resilient_training.runtime.checkpointing import page_lock, page_unlock


def training_step() -> Callable[[], float]:
    """A training-like step (48 linear layers, AdamW, synchronized), warmed up; returns its seconds."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(48)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 2048, device="cuda")

    def step() -> float:
        start = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(10):  # warm-up: kernels chosen, optimizer state created
        step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=6.4)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--run-mb", type=int, default=64)
    args = parser.parse_args()
    step = training_step()
    size = int(args.gb * 1e9) // 4096 * 4096
    run = args.run_mb << 20
    rows = []
    for mode in ("none", "back to back", "paused"):
        path = Path(tempfile.mkdtemp(dir=args.dir)) / "slot.bin"
        with open(path, "wb") as f:
            f.truncate(size)
        data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        pinned: list[int] = []
        took: list[float] = []

        def pin(data: torch.Tensor, pinned: list[int], took: list[float], pause: bool) -> None:
            start = time.perf_counter()
            for offset in range(0, size, run):
                ptr = data.data_ptr() + offset
                if page_lock(ptr, min(run, size - offset), pause=pause):
                    pinned.append(ptr)
            took.append(time.perf_counter() - start)

        thread = threading.Thread(target=pin, args=(data, pinned, took, mode == "paused")) if mode != "none" else None
        times = []
        start = time.perf_counter()
        if thread is not None:
            thread.start()
        while (thread is not None and thread.is_alive()) or time.perf_counter() - start < 2.0:
            times.append(step())
        if thread is not None:
            thread.join()
        for ptr in pinned:
            page_unlock(ptr)
        del data
        path.unlink()
        path.parent.rmdir()
        rows.append((mode, took[0] if took else 0.0, len(pinned), times))
    print(
        f"{args.gb:.1f} GB page-locked in {args.run_mb} MB calls from a second thread while training; "
        f"{torch.cuda.get_device_name()}"
    )
    print("| way | seconds to page-lock (calls ok) | steps meanwhile | median step s | slowest step s |")
    print("|---|---|---|---|---|")
    for mode, took_s, calls, times in rows:
        print(f"| {mode} | {took_s:.2f} ({calls}) | {len(times)} | {statistics.median(times):.4f} | {max(times):.3f} |")


if __name__ == "__main__":
    main()
