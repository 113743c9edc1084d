"""How fast does a new process read a host snapshot (``--host-snapshot``) back? CPU only.

    python benchmarks/host_snapshot_read.py [--gb 1.6] [--dir /dev/shm] [--repeat 3] [--device cuda]

Writes one slot with the real ``HostSnapshot`` from a model and AdamW state of about ``--gb``
GB (800 parameters: 3,200 tensors with AdamW's), then restores it into a freshly built model and
optimizer, as a process started by the launcher does, two ways:

- ``mapped``: the slot's file mapped (``torch.from_file``) and each tensor copied from the
  mapping (the code before ``tensor_read.read_into``; on a GPU, pageable host-to-device copies);
- ``read``: ``tensor_read.read_into`` on one thread: ``os.preadv`` into each CPU tensor, or on a GPU into two
  page-locked buffers in turn;
- ``read x4``: ``HostSnapshot.restore`` (``tensor_read.read_into`` on four threads, each with its own
  buffers and CUDA stream).

Prints one table of seconds and GB/s (the page cache is warm: the file is in shared memory).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from resilient_training.run.tensor_read import read_into
from resilient_training.runtime.checkpointing import HostSnapshot, MemorySnapshot, _live_state, state_dict


def build(gb: float, seed: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """800 parameter tensors whose weights and two AdamW moments add up to ``gb`` GB."""
    torch.manual_seed(seed)
    width = max(8, int((gb * 1e9 / 4 / 3 / 400) ** 0.5))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(400)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


def mapped_restore(host: HostSnapshot, slot: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    meta = torch.load(host._meta_path(slot), weights_only=True)
    size = host._data_path(slot).stat().st_size
    data = torch.from_file(str(host._data_path(slot)), shared=False, size=size, dtype=torch.uint8)
    state_dict(model, optimizer)
    live = _live_state(model, optimizer)
    offsets = {key: offset for key, offset, _, _ in meta["layout"]}
    with torch.no_grad():
        for key, target in live.items():
            n = target.numel() * target.element_size()
            target.copy_(data[offsets[key]:offsets[key] + n].view(target.dtype).view(target.shape))


def one_thread_restore(host: HostSnapshot, slot: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    meta = torch.load(host._meta_path(slot), weights_only=True)
    state_dict(model, optimizer)
    live = _live_state(model, optimizer)
    offsets = {key: offset for key, offset, _, _ in meta["layout"]}
    with torch.no_grad():
        read_into(host._data_path(slot), sorted(((t, offsets[k]) for k, t in live.items()), key=lambda p: p[1]),
                   threads=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.6)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the model lives: cpu or cuda")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="host-snapshot-read-", dir=args.dir))
    try:
        model, optimizer = build(args.gb, seed=1, device=args.device)
        snapshot = MemorySnapshot()
        snapshot.take(1, model, optimizer, None, {}, world=(0, 1))
        host = HostSnapshot(root)
        host.write(snapshot, 1)
        while host._preparing is not None and host._preparing.is_alive():
            time.sleep(0.01)
        host.write(snapshot, 1)
        host.wait()
        ((slot, _),) = host.held((0, 1)).values()
        nbytes = sum(t.numel() * t.element_size() for t in _live_state(model, optimizer).values())
        tensors = len(_live_state(model, optimizer))
        host.close()  # page-unlocked before its mappings go (see checkpointing.page_unlock)
        del snapshot, host

        fresh, fresh_optimizer = build(args.gb, seed=2, device=args.device)
        rows = []
        for i in range(args.repeat):
            ways = ("mapped", "read", "read x4")
            for name in (ways if i % 2 else ways[::-1]):
                start = time.perf_counter()
                if name == "mapped":
                    mapped_restore(HostSnapshot(root), slot, fresh, fresh_optimizer)
                elif name == "read":
                    one_thread_restore(HostSnapshot(root), slot, fresh, fresh_optimizer)
                else:
                    HostSnapshot(root).restore(slot, fresh, fresh_optimizer, None)
                if args.device != "cpu":
                    torch.cuda.synchronize()
                rows.append((name, time.perf_counter() - start))
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)
        print(f"state: {nbytes / 1e9:.2f} GB in {tensors} tensors on {args.device}, slot file in {args.dir}")
        print("| way | seconds (each run) | GB/s (best) |")
        print("|---|---|---|")
        for name in ("mapped", "read", "read x4"):
            times = [t for n, t in rows if n == name]
            print(f"| {name} | {', '.join(f'{t:.3f}' for t in times)} | {nbytes / 1e9 / min(times):.1f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
