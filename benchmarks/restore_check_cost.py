"""What does hashing a restored checkpoint behind training cost the steps meanwhile? GPU (or CPU).

    python benchmarks/restore_check_cost.py [--gb 3.2] [--files 10] [--repeat 2] [--ways none,check,...]

A launcher restart restores from storage, then ``RestoreCheck`` hashes that checkpoint's files
(from the page cache the restore filled) on 4 threads behind training, and the staging buffers
are made (``StagingBuffers.prepare``) at the same time. On one H200 the 268M model's steps
meanwhile took 0.16-0.18 s against 0.096 s (benchmarks call70); the 1.3B's, 0.18-0.19 s against
0.18 s. This trains a training-like loop (``pin_contention.training_step``; a small CPU loop
without a GPU) while ``--gb`` GB in ``--files`` files, just written (cached), are hashed as the
product does (``checkpoint_format.damaged_files``), and ways around it:

- ``none``: nothing beside training;
- ``check``: as the product (memory-mapped, ``MAP_POPULATE``, 4 threads);
- ``read``: read into a buffer instead of mapping (the product's fallback);
- ``one``: one thread instead of 4;
- ``nice``: the hashing threads at nice 19;
- ``prepare``: the staging buffers made for as many bytes (no check);
- ``both``: ``prepare`` and ``check`` at once, as after a launcher restart.

Prints one table: the check's and the preparation's seconds, the steps taken meanwhile, their
median and slowest, and their seconds over the undisturbed median.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time
import types
from pathlib import Path

import torch

from resilient_training.run import checkpoint_format as fmt
from resilient_training.runtime.checkpointing import StagingBuffers, page_unlock

WAYS = ("none", "check", "read", "one", "nice", "prepare", "both")
product_read_and_hash = fmt._read_and_hash


def cpu_step():
    """A CPU stand-in for ``pin_contention.training_step`` (where there is no GPU)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 256)

    def step() -> float:
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(10):
        step()
    return step


def make_checkpoint(root: Path, gb: float, files: int) -> dict:
    """``files`` files of ``gb`` GB in all (written now, so in the page cache) and their manifest."""
    each = int(gb * 1e9) // files // 4096 * 4096
    block = os.urandom(16 << 20)
    listed = {}
    for i in range(files):
        path = root / f"__{i}_0.distcp"
        with open(path, "wb") as handle:
            for offset in range(0, each, len(block)):
                handle.write(block[: min(len(block), each - offset)])
        size, digest = fmt.checksum_file(path)
        listed[path.name] = {"bytes": size, "checksum": digest}
    return {"files": listed}


def hashing(way: str):
    """The per-file hash for ``way`` (patched into the format module for the trial)."""
    if way == "nice":
        def niced(path: Path):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            return product_read_and_hash(path)
        return niced
    return product_read_and_hash


def _refuse(*args, **kwargs):
    raise OSError("not mapped (benchmark)")


# ``read``: the format module's ``mmap`` for the whole trial (it falls back to readinto when a map
# is refused); not the mmap module's own function per call, which the hashing threads raced on.
_NO_MAP = types.SimpleNamespace(mmap=_refuse, MAP_SHARED=mmap.MAP_SHARED,
                                MAP_POPULATE=getattr(mmap, "MAP_POPULATE", 0), PROT_READ=mmap.PROT_READ)


def trial(way: str, step, root: Path, manifest: dict, sources: list[tuple[str, torch.Tensor]]) -> dict:
    spans: dict[str, tuple[float, float]] = {}
    start = time.perf_counter()
    threads = []
    if way in ("check", "read", "one", "nice", "both"):
        fmt._read_and_hash = hashing(way)
        fmt.mmap = _NO_MAP if way == "read" else mmap

        def check() -> None:
            began = time.perf_counter()
            problems = fmt.damaged_files(root, manifest, 1 if way == "one" else 4)
            assert not problems, problems
            spans["check"] = (began, time.perf_counter())

        threads.append(threading.Thread(target=check, daemon=True))
    staging = StagingBuffers()
    if way in ("prepare", "both"):
        staging.prepare(sources)
    for thread in threads:
        thread.start()
    times: list[float] = []

    def busy() -> bool:
        preparing = staging._preparing
        return any(t.is_alive() for t in threads) or (preparing is not None and preparing.is_alive())

    while busy() or time.perf_counter() - start < 2.0:
        times.append(step())
    for thread in threads:
        thread.join()
    fmt._read_and_hash, fmt.mmap = product_read_and_hash, mmap
    report = staging.pin_report.take() or {}
    for ptr, device in list(staging._pinned.items()):
        page_unlock(ptr, device=device)
    check_s = spans["check"][1] - spans["check"][0] if "check" in spans else 0.0
    return {"way": way, "times": times, "check_s": check_s, "prepare_s": report.get("seconds", 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=3.2)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--tensors", type=int, default=200, help="staging buffers for `prepare`")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    ways = args.ways.split(",")
    if unknown := set(ways) - set(WAYS):
        parser.error(f"unknown ways {sorted(unknown)}; known: {', '.join(WAYS)}")
    gpu = torch.cuda.is_available()
    if gpu:
        from pin_contention import training_step
        step = training_step()
    else:
        step = cpu_step()
    device = "cuda" if gpu else "cpu"
    each = int(args.gb * 1e9) // args.tensors // 4
    sources = [(f"t{i}", torch.empty(each, dtype=torch.float32, device=device)) for i in range(args.tensors)]
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        manifest = make_checkpoint(root, args.gb, args.files)
        rows = [trial(way, step, root, manifest, sources) for _ in range(args.repeat) for way in ways]
    base = statistics.median(t for row in rows if row["way"] == "none" for t in row["times"]) if "none" in ways \
        else statistics.median(t for row in rows for t in row["times"])
    name = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"{args.gb:.1f} GB in {args.files} files hashed behind training; {name}; {os.cpu_count()} CPUs; "
          f"undisturbed median step {base:.4f} s")
    print("| way | check s | prepare s | steps meanwhile | median step s | slowest step s "
          "| steps' seconds over the undisturbed median |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        times = row["times"]
        print(f"| {row['way']} | {row['check_s']:.2f} | {row['prepare_s']:.2f} | {len(times)} "
              f"| {statistics.median(times):.4f} | {max(times):.3f} | {sum(times) - base * len(times):.2f} |")


if __name__ == "__main__":
    main()
