"""CPU benchmark: seconds from fault to first step after recovery, per restart layer, and the
checkpoint stall per save for sync vs async, on this machine (2 gloo workers under ft_launcher).

    python benchmarks/recovery_cpu.py [--out DIR] [--repeat N] [--only TEXT ...]

Prints Markdown tables. Every number comes from resilient_training.gates.metrics over the runs'
event logs. Not a test: timings depend on the machine and its load (say which when you quote).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from resilient_training.gates import metrics

BASE = ["--nproc", "2", "--steps", "40", "--checkpoint-every", "5"]
SLOW_COLLECTIVES = ["--pg-timeout", "30", "--soft-timeout", "31", "--hard-timeout", "32", "--heartbeat-timeout", "35"]
RECOVERY = [
    ("exception, in-process restart", ["--faults", "exception@22:0"]),
    ("nan, in-process restart (NaN guard)", ["--faults", "nan@22:0"]),
    ("hang, in-process (gloo collective timeout 3 s)", ["--faults", "hang@22:1"]),
    ("sigkill, ft_launcher", ["--faults", "sigkill@22:1"]),
    ("sigkill, ft_launcher + warm spare", ["--faults", "sigkill@22:1", "--warm-spare"]),
    ("exception, ft_launcher only", ["--faults", "exception@22:1", "--no-inprocess"]),
    ("hang, ft_launcher heartbeat", ["--faults", "hang@22:1", "--no-inprocess", *SLOW_COLLECTIVES]),
    ("sigkill, torchrun (no NVRx)", ["--faults", "sigkill@22:1", "--no-ft-launcher", "--no-inprocess"]),
    ("sigkill, torchrun + warm spare", ["--faults", "sigkill@22:1", "--no-ft-launcher", "--no-inprocess",
                                        "--warm-spare"]),
]
# A larger model so that a save is measurable: ~3.4M parameters, ~41 MB per checkpoint.
STALL_MODEL = ["--model-d-model", "256", "--model-n-layers", "4", "--model-n-heads", "8"]
STALL = [("async (NVRx persistent writer)", []), ("sync", ["--no-async-checkpoint"])]


def train(run_dir: Path, args: list[str], reuse: bool = False) -> Path:
    if reuse and (run_dir / "events").is_dir():
        return run_dir  # --reuse: recompute the tables from runs already made
    command = [sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir), *args]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="", help="keep run directories here (default: a temporary one)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration")
    parser.add_argument("--reuse", action="store_true", help="reuse run directories already under --out")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="only the recovery rows whose label contains TEXT (repeatable); no stall table")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="recovery-cpu-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f} at start, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| fault, layer that recovered | recovery s (fault → first step after restore), each run | restored step "
          "| restarted workers: process start → start event s (spare) |")
    print("|---|---|---|---|")
    uninjected: list[str] = []
    for i, (label, extra) in enumerate(RECOVERY):
        if args.only and not any(text in label for text in args.only):
            continue
        seconds, restored, starts = [], [], []
        for r in range(args.repeat):
            run_dir = train(out / f"recovery{i}-{r}", BASE + extra, args.reuse)
            m = metrics.compute_metrics(run_dir)
            starts += [e for e in metrics.load_events(run_dir) if e.event == "start" and e.attempt > 0]
            for fault in m["faults"]:
                if "@" not in str(fault.get("fault")):
                    uninjected.append(f"{label} run {r + 1}: {fault.get('cause')}, {fault['recovery_seconds']:.1f} s")
                    continue  # a failure nobody injected (e.g. a port taken at start): listed at the end
                seconds.append(fault["recovery_seconds"])
                restored.append(fault["restored_step"])
        ages = ", ".join(f"{e['process_seconds']:.2f}{' (spare)' if e.get('spare') else ''}" for e in starts
                         if e.get("process_seconds") is not None)
        print(f"| {label} | {', '.join(f'{s:.2f}' for s in seconds)} (mean {statistics.fmean(seconds):.2f}) "
              f"| {', '.join(map(str, restored))} | {ages or '–'} |")
    if not args.only:
        print("\n| checkpointing | stall per save s (training blocked), mean / max | saves | deferred | "
              "steps/s | checkpoint MB |")
        print("|---|---|---|---|---|---|")
    for i, (label, extra) in enumerate([] if args.only else STALL):
        for r in range(args.repeat):
            run = train(out / f"stall{i}-{r}", BASE + STALL_MODEL + extra, args.reuse)
            m = metrics.compute_metrics(run)
            ck = m["checkpoints"]
            events = metrics.load_events(run)
            size = max((e["bytes"] for e in events if e.event == "ckpt_committed"), default=0) / 1e6
            runs = metrics.step_runs(events)
            span = max(x.ts for x in runs) - min(x.ts - x.seconds for x in runs)
            print(f"| {label} | {ck['stall_seconds']['mean']:.3f} / {ck['stall_seconds']['max']:.3f} | "
                  f"{ck['committed']} | {ck['deferred']} | {len(runs) / span:.1f} | {size:.1f} |")
    if uninjected:
        print("\nFailures nobody injected (recovered all the same): " + "; ".join(uninjected))
    print(f"\nrun directories: {out}")


if __name__ == "__main__":
    main()
