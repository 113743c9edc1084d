"""How fast can one rank's shard reach storage? Times the pieces of a checkpoint write.

    python benchmarks/probe_io.py [--gb 1.6] [--dirs /dev/shm /tmp]

For each directory: the trainer's own write (``checkpoint_format.write_rank``: DCP's
``FileSystemWriter`` with fsync, then the files checksummed and every chunk hashed; as 1, 2, 4
and 8 files written in parallel), a plain
``torch.save`` to a path, and a raw write of the same bytes; plus the checksum rate in memory and
the read-back rate through ``torch.distributed.checkpoint.load``. Prints one table (GB/s). Used
by benchmarks/gpu_suite.sh to explain the checkpoint rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash

from resilient_training.run import checkpoint_format as fmt


def shard_of(gb: float) -> dict[str, object]:
    """One rank's write job like the trainer's: many fp32 tensors in shared memory."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    n_tensors = 96
    per = int(gb * 1e9 / 4 / n_tensors)
    tensors = {f"t{i}": torch.rand(per).share_memory_() for i in range(n_tensors)}
    items = [item for name, t in tensors.items() for item in _create_write_items(name, t)]
    return {"items": items, "tensors": tensors, "blobs": {}, "paths": {name: (name,) for name in tensors},
            "data_state": {}, "meta": {"step": 1, "optimizer_step": 1, "data_position": 1}}


def timed(fn) -> float:  # noqa: ANN001 - any callable
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.6)
    parser.add_argument("--dirs", nargs="+", default=["/dev/shm", tempfile.gettempdir()])
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
    shard = shard_of(args.gb)
    size = sum(t.numel() * 4 for t in shard["tensors"].values())
    gb = size / 1e9
    hashed = timed(lambda: [xxhash.xxh3_128(t.numpy()).digest() for t in shard["tensors"].values()])
    print(f"| what | GB/s ({gb:.2f} GB) |\n|---|---|\n| xxh3_128 over the tensors in memory | {gb / hashed:.2f} |")
    for base in args.dirs:
        top = work = Path(tempfile.mkdtemp(dir=base, prefix="probe-io-"))
        try:
            for threads in (1, 2, 4, 8):  # --checkpoint-write-threads: files written in parallel per rank
                into = work / f"threads-{threads}"
                into.mkdir()
                t = timed(lambda: fmt.write_rank(into, 0, {**shard, "threads": threads}))  # noqa: B023
                print(f"| {base}: write_rank, {threads} thread(s) (DCP write + fsync + checksums) | {gb / t:.2f} |")
                if threads > 1:
                    shutil.rmtree(into)
            work = work / "threads-1"

            def plain(work: Path = work) -> None:
                with open(work / "plain.pt", "wb") as handle:
                    torch.save(dict(shard), handle)
                    handle.flush()
                    os.fsync(handle.fileno())

            print(f"| {base}: torch.save to a file + fsync | {gb / timed(plain):.2f} |")

            def raw(work: Path = work) -> None:
                with open(work / "raw.bin", "wb") as handle:
                    for tensor in shard["tensors"].values():
                        handle.write(memoryview(tensor.numpy()).cast("B"))
                    handle.flush()
                    os.fsync(handle.fileno())

            print(f"| {base}: raw bytes + fsync | {gb / timed(raw):.2f} |")
            fmt.write_metadata(work, [json.loads((work / fmt.sidecar_name(0)).read_text())])
            target = {name: torch.empty_like(t) for name, t in shard["tensors"].items()}
            t = timed(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(str(work)), no_dist=True))  # noqa: B023
            print(f"| {base}: dcp.load, every tensor read (page cache) | {gb / t:.2f} |")
        finally:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
