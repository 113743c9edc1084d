"""What does ``--spare-writer`` cost a rank while no writer dies? Host memory (GPU or CPU).

    python benchmarks/spare_writer_cost.py [--repeat 3]

``AsyncWriter(spare=True)`` keeps a second NVRx writer process warmed up (torch imported) and
idle. This starts a writer the way a rank does (``warm_up_writer``), then its spare, and prints
each process's memory from ``/proc/PID/smaps_rollup``: RSS, PSS (shared pages split among their
users: what the node pays) and USS (private: what killing it frees), and the spare's start-up
seconds after the writer was ready. With NVRx 0.7+ a writer makes no CUDA context
(``cpu_shm_mode``), so this is its whole cost on a GPU machine too (the GPU wheel's libraries
are larger mappings, mostly shared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from resilient_training.runtime.checkpointing import warm_up_writer
from resilient_training.runtime.nvrx_adapter import AsyncWriter


def memory(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of a process in MB."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        fields[name] = int(rest.split()[0]) / 1024
    uss = fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0)
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": uss}


def one(repeat: int) -> list[tuple[str, dict[str, float], float]]:
    writer = AsyncWriter(spare=True)
    started = time.monotonic()
    writer.warm_up(warm_up_writer)
    ready = time.monotonic()
    while writer._spare is None or not writer._spare.ready.is_set():  # noqa: SLF001 - the benchmark looks inside
        if time.monotonic() - ready > 120:
            raise SystemExit("the spare was not ready within 120 s")
        time.sleep(0.01)
    spare_ready = time.monotonic()
    time.sleep(1.0)  # settled: the warm-up's transient allocations are freed
    rows = [(f"writer #{repeat}", memory(writer.pid), ready - started),
            (f"spare #{repeat}", memory(writer._spare.process.pid), spare_ready - ready)]  # noqa: SLF001
    writer.close(timeout=60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # NVRx's queue asks torch.distributed for the rank when it starts its process.
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        rows = [row for i in range(args.repeat) for row in one(i + 1)]
        torch.distributed.destroy_process_group()
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}; MB from /proc/PID/smaps_rollup, "
          "seconds: writer from its start, spare from the writer being ready")
    print("| process | RSS MB | PSS MB | USS MB | ready after s |")
    print("|---|---|---|---|---|")
    for name, mem, seconds in rows:
        print(f"| {name} | {mem['rss']:.0f} | {mem['pss']:.0f} | {mem['uss']:.0f} | {seconds:.2f} |")
    spares = [mem for name, mem, _ in rows if name.startswith("spare")]
    print(f"\nspare, median: PSS {statistics.median(m['pss'] for m in spares):.0f} MB, "
          f"USS {statistics.median(m['uss'] for m in spares):.0f} MB")


if __name__ == "__main__":
    main()
