"""Validation read rate vs a plain sequential read of the same checkpoint files.

Writes real checkpoints (a GPT + AdamW after one step, 2 ranks) of a few sizes, then for
each measures, best of --repeat:

- plain read: every shard file read once, sequentially, 8 MiB reads, one thread, discarded;
- validation read: the read + xxh3_128 stage of validate-checkpoint (parallel threads, 16 MiB
  reads into a reused buffer), the stage the >= 0.8x goal is about;
- full validation: every check, including loading into a fresh model and re-hashing tensors.

Page cache: "warm" reads the files once before each measurement; "cold" evicts exactly these
files first with posix_fadvise(POSIX_FADV_DONTNEED) (no global drop_caches: it would disturb
other work on the machine).

    python benchmarks/validation_throughput.py [--sizes small,large] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from resilient_training.gates.validate import hash_files, validate_checkpoint_dir
from resilient_training.run import checkpoint_format as cf
from resilient_training.run.config import ModelConfig
from tests.support.gates import write_checkpoint

SIZES = {
    "small": ModelConfig(vocab_size=8192, d_model=512, n_layers=2, n_heads=8, seq_len=16),
    "large": ModelConfig(vocab_size=32768, d_model=1024, n_layers=4, n_heads=8, seq_len=16),
}


def evict(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.read(8 << 20):
                pass


def plain_read(paths: list[Path]) -> float:
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.read(8 << 20):
                pass
    return time.perf_counter() - start


def validation_read(paths: list[Path]) -> float:
    start = time.perf_counter()
    results = hash_files(paths)
    elapsed = time.perf_counter() - start
    assert not any(isinstance(r, OSError) for r in results.values())
    return elapsed


def full_validation(ckpt: Path) -> float:
    start = time.perf_counter()
    result = validate_checkpoint_dir(ckpt)
    elapsed = time.perf_counter() - start
    assert result.valid, [str(f) for f in result.findings]
    return elapsed


def measure(fn, paths: list[Path], cache: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        (evict if cache == "cold" else warm)(paths)
        best = min(best, fn())
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large", help=f"comma-separated of {sorted(SIZES)}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="rt-bench-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}; files under {root}")
    print("| checkpoint | bytes | cache | plain read GB/s | validation read GB/s | ratio | full validation GB/s |")
    print("|---|---|---|---|---|---|---|")
    try:
        for name in args.sizes.split(","):
            run = root / name
            ckpt = write_checkpoint(run, step=1, cfg=SIZES[name])
            paths = [ckpt / cf.shard_name(r) for r in range(2)]
            size = sum(p.stat().st_size for p in paths)
            for cache in ("warm", "cold"):
                plain = measure(lambda p=paths: plain_read(p), paths, cache, args.repeat)
                hashed = measure(lambda p=paths: validation_read(p), paths, cache, args.repeat)
                full = measure(lambda c=ckpt: full_validation(c), paths, cache, args.repeat)
                print(f"| {name} | {size / 1e6:.0f} MB | {cache} | {size / plain / 1e9:.2f} | {size / hashed / 1e9:.2f} "
                      f"| {plain / hashed:.2f}x | {size / full / 1e9:.2f} |", flush=True)
            shutil.rmtree(run)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
