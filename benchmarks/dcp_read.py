"""How fast does a new process read a DCP checkpoint into its (GPU) state? The restore of a killed rank.

    python benchmarks/dcp_read.py [--gb 16] [--files 16] [--dir /tmp] [--repeat 2] [--device cuda]

Saves one DCP checkpoint with DCP's own ``FileSystemWriter`` (one rank, ``--files`` files, as
the trainer's write threads do) of a 1.3B-GPT-shaped state: 24 layers of d_model 2048 and a
32000-token vocabulary (``--gb`` scales the layer count), each weight with two AdamW moments,
fp32. Then each way of reading it runs in a fresh process (imports, CUDA and the targets first,
not timed), as the launcher's new worker or warm spare does, page cache warm (just written):

- ``dcp``: DCP's own ``FileSystemReader`` (files one after another; ``torch.load`` of each
  chunk, then a copy from pageable memory);
- ``per-file xN``: the reader before this one: DCP's ``read_data`` on N files at once;
- ``direct xN``: ``checkpoint_format.reader``: each chunk's place from its layout, its bytes read
  straight into the target through page-locked buffers, N threads, each file's bytes as soon as
  its layout is known (since 2026-12-04);
- ``layout-first xN``: the same, every file's layout worked out before any byte is read (the
  reader before 2026-12-04);
- ``layout only``: ``direct x8`` with no bytes read (what finding the chunks' places costs).

Every load is checked against the saved tensors' sums. Prints one table: seconds, GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VOCAB, WIDTH = 32000, 2048


def shapes(gb: float) -> dict[str, tuple[int, ...]]:
    layers = max(1, round((gb * 1e9 / 12 - 2 * VOCAB * WIDTH) / (12 * WIDTH * WIDTH)))
    out: dict[str, tuple[int, ...]] = {"tok": (VOCAB, WIDTH), "head": (VOCAB, WIDTH)}
    for i in range(layers):
        out |= {f"l{i}.qkv": (3 * WIDTH, WIDTH), f"l{i}.proj": (WIDTH, WIDTH), f"l{i}.up": (4 * WIDTH, WIDTH),
                f"l{i}.down": (WIDTH, 4 * WIDTH), f"l{i}.norm1": (WIDTH,), f"l{i}.norm2": (WIDTH,)}
    return {f"{kind}.{name}": shape for name, shape in out.items() for kind in ("model", "exp_avg", "exp_avg_sq")}


def save(root: Path, gb: float, files: int, device: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state, sums = {}, {}
    for name, shape in shapes(gb).items():
        t = torch.randn(shape, device=device)
        sums[name] = float(t.double().sum())
        state[name] = t.cpu()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root), single_file_per_rank=True, thread_count=files),
             no_dist=True)
    (root / "sums.json").write_text(json.dumps(sums))


def child(root: Path, way: str, threads: int, device: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from resilient_training.run import checkpoint_format as fmt
    from resilient_training.run import tensor_read

    sums = json.loads((root / "sums.json").read_text())
    state = {name: torch.empty(shape, device=device) for name, shape in shapes_of(sums, root).items()}
    if device == "cuda":
        torch.cuda.synchronize()
    if way == "dcp":
        storage = FileSystemReader(str(root))
    elif way == "per-file":
        storage = per_file_reader(root, threads)
    else:
        if way == "layout":
            tensor_read.read_files = lambda jobs, **kwargs: None
        storage = fmt.reader(root, threads, pipelined=way == "direct")
    start = time.perf_counter()
    dcp.load(state, storage_reader=storage, no_dist=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    wrong = [] if way == "layout" else [n for n, t in state.items() if abs(float(t.double().sum()) - sums[n]) > 1e-3]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {"way": way, "threads": threads, "seconds": seconds, "gb": nbytes / 1e9, "wrong": wrong[:3]}


def shapes_of(sums: dict[str, float], root: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(root)).read_metadata().state_dict_metadata
    return {name: tuple(md[name].size) for name in sums}


def per_file_reader(root: Path, threads: int) -> Any:
    """The reader before 2026-12-03: DCP's own read_data, on up to ``threads`` files at once."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            read = super().read_data
            with ThreadPoolExecutor(min(threads, len(per_file))) as pool:
                done = [pool.submit(read, dataclasses.replace(plan, items=items), planner) for items in per_file.values()]
                for future in done:
                    future.result().wait()
            return done[-1].result()

    return _Reader(str(root))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=16)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ways", default="dcp:1,per-file:8,direct:4,direct:8,direct:16,layout-first:8,layout:8")
    parser.add_argument("--child", nargs=3, metavar=("ROOT", "WAY", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], int(args.child[2]), args.device)))
        return

    root = Path(args.dir) / "dcp-read-bench"
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    save(root, args.gb, args.files, args.device)
    print(f"saved {sum(f.stat().st_size for f in root.iterdir()) / 1e9:.1f} GB in "
          f"{len(list(root.glob('*.distcp')))} files to {root} in {time.perf_counter() - start:.1f} s", flush=True)
    print("| way | threads | seconds | GB/s | checked |\n|---|---|---|---|---|", flush=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        for _ in range(args.repeat):
            for spec in args.ways.split(","):
                way, threads = spec.split(":")
                done = subprocess.run([sys.executable, __file__, "--device", args.device, "--child", str(root), way,
                                       threads], capture_output=True, text=True, env=env)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                if done.returncode or not lines:
                    print(f"| {way} | {threads} | failed: {done.stderr.strip().splitlines()[-1:]} | | |", flush=True)
                    continue
                r = json.loads(lines[-1])
                checked = "–" if way == "layout" else ("ok" if not r["wrong"] else f"WRONG {r['wrong']}")
                print(f"| {way} | {threads} | {r['seconds']:.2f} | {r['gb'] / r['seconds']:.1f} | {checked} |",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
