"""How long aborting an NCCL process group takes (the in-process restart's `nvrx_abort_nccl`). GPU only.

    python benchmarks/nccl_abort.py [--repeat 3]

NVRx's ``AbortTorchDistributed`` (what the in-process layer calls after every fault) aborts each
NCCL backend (``ProcessGroupNCCL.abort()``: ``ncclCommAbort``) and destroys the groups. On one
H200 that took 0.6-1.0 s of each in-process restart. One rank, one GPU: a group after one small
all-reduce, after 50 all-reduces of 256 MB, and the same with a clean ``destroy_process_group``
instead of an abort, for comparison. Prints one table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist


def one(store: dist.Store, tag: str, rounds: int, mb: int, abort: bool) -> float:
    dist.init_process_group("nccl", store=dist.PrefixStore(tag, store), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    x = torch.ones(mb * (1 << 20) // 4, device="cuda")
    for _ in range(rounds):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    started = time.perf_counter()
    if abort:
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))
        backend.abort()
    dist.destroy_process_group()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    os.environ.setdefault("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0")
    print(f"torch {torch.__version__} nccl {'.'.join(map(str, torch.cuda.nccl.version()))}\n")
    print("| group | end | seconds (median) | runs |\n|---|---|---|---|")
    n = 0
    for label, rounds, mb in (("1 all-reduce of 4 MB", 1, 4), ("50 all-reduces of 256 MB", 50, 256)):
        for end, abort in (("abort + destroy (NVRx)", True), ("destroy only", False)):
            runs = []
            for _ in range(args.repeat):
                n += 1
                runs.append(one(store, f"g{n}", rounds, mb, abort))
            print(f"| {label} | {end} | {statistics.median(runs):.3f} | {', '.join(f'{r:.3f}' for r in runs)} |",
                  flush=True)


if __name__ == "__main__":
    main()
