"""How long a SIGKILLed training process takes to be gone, and its GPU memory to be free. GPU only.

    python benchmarks/exit_teardown.py [--gpu-gb 40] [--pinned-gb 3.2] [--repeat 2]

ft_launcher starts no replacement until the killed worker's process group is gone and (0.6+)
NVML reports its GPU memory freed; on one H200 that took ~1.0 s of each launcher restart
(`agent: stop workers` + `agent: GPU memory wait` in report_gpu.py). A child holds ``--gpu-gb``
of GPU memory and ``--pinned-gb`` of page-locked host memory, three ways: registered in 64 MB
calls like the staging buffers (``checkpointing.page_lock``), the same with transparent huge
pages asked for (``MADV_HUGEPAGE``: fewer pages to unpin and unmap), and none. The parent
SIGKILLs it and times: the kill -> the child reaped (its memory unmapped), and -> NVML's used
memory back under the level before the child started. Prints one table.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import statistics
import subprocess
import sys
import time

CHILD = r"""
import mmap, sys, time, torch
from resilient_training.runtime.checkpointing import page_lock
gpu_gb, pinned_gb, huge = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
torch.cuda.set_device(0)
held = torch.empty(int(gpu_gb * 1e9), dtype=torch.uint8, device="cuda")
held.fill_(1)
if pinned_gb:
    n = int(pinned_gb * 1e9) // mmap.PAGESIZE * mmap.PAGESIZE
    buf = mmap.mmap(-1, n)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    host = torch.frombuffer(buf, dtype=torch.uint8)
    host.fill_(1)  # touched: resident, like staging buffers that have been written
    step = 64 << 20
    for off in range(0, n, step):
        page_lock(host.data_ptr() + off, min(step, n - off), device=torch.device("cuda", 0))
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(600)
"""


def used_mb() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[0])


def one(gpu_gb: float, pinned_gb: float, huge: bool) -> tuple[float, float]:
    baseline = used_mb()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gpu_gb), str(pinned_gb), "1" if huge else "0"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    killed = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    reaped = time.perf_counter() - killed
    while used_mb() > baseline + 256:
        time.sleep(0.01)
    freed = time.perf_counter() - killed
    return reaped, freed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-gb", type=float, default=40.0)
    parser.add_argument("--pinned-gb", type=float, default=3.2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    print(f"transparent huge pages: {open(thp).read().strip() if os.path.exists(thp) else 'n/a'}; page {mmap.PAGESIZE}")
    print(f"\n| host memory ({args.pinned_gb:g} GB) | GPU GB | kill -> reaped s (median) "
          "| kill -> GPU memory free s (median) | runs |")
    print("|---|---|---|---|---|")
    for label, pinned, huge in (("page-locked, 4 KB pages", args.pinned_gb, False),
                                ("page-locked, huge pages asked", args.pinned_gb, True),
                                ("none", 0.0, False)):
        runs = [one(args.gpu_gb, pinned, huge) for _ in range(args.repeat)]
        print(f"| {label} | {args.gpu_gb:g} | {statistics.median(r[0] for r in runs):.3f} | "
              f"{statistics.median(r[1] for r in runs):.3f} | "
              + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in runs) + " |", flush=True)


if __name__ == "__main__":
    main()
