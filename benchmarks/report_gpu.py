"""Tables from the GPU suite's event logs (benchmarks/gpu_suite.sh writes them as tarballs).

    python benchmarks/report_gpu.py benchmarks/results/h200/*.tar.gz

Every number is computed by resilient_training.gates.metrics from the runs' event logs; efficiency is
the no-checkpoint run's training span divided by each run's (first step to last step); runs named
``old_*``/``dcp_*`` (the format-compare suite) are compared with their own ``*_no_ckpt``.
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
from pathlib import Path

from resilient_training.gates import metrics
from resilient_training.run import events


def training_span(run_dir: Path) -> float:
    runs = metrics.step_runs(metrics.load_events(run_dir))
    return max(r.ts for r in runs) - min(r.ts - r.seconds for r in runs)


def restart_profiles(run_dir: Path) -> list[dict[str, object]]:
    """Where each recovery's time went (``metrics.recovery_phases``: ft_launcher's own phases, the
    new process's start-up, NVRx's in-process steps, each phase its restore reports, the first
    step), one row per fault that restored something.
    """
    every = metrics.load_events(run_dir)
    m = metrics.compute_metrics(run_dir, every)
    t0 = next(e.ts for e in every if not metrics.is_agent_diagnostic(e))
    rows = []
    for fault in m["faults"]:
        if not fault["phases"]:
            continue  # restored nothing (e.g. the writer layer replaced a writer)
        start = next((e for e in every if e.event == "start" and e.rank == m["reference_rank"]
                      and e.ts > t0 + fault["start"]), None) if fault["layer"] != "inprocess" else None
        rows.append({"run": run_dir.name, "fault": fault["fault"], "layer": fault["layer"],
                     "spare": None if start is None else ("yes" if start.get("spare") else "no"),
                     **fault["phases"], "total": fault["recovery_seconds"]})
    return rows


def print_profiles(rows: list[dict[str, object]]) -> None:
    if not rows:
        return
    seen: list[str] = []
    for row in rows:
        seen += [k for k in row if k not in seen]
    head = ["run", "fault", "layer", "spare", *(name for name, _ in metrics.AGENT_PHASES), "new_process", "imports",
            "other", *(k for k in seen if k.startswith("nvrx_"))]
    columns = head + [k for k in seen if k not in head and k not in ("first_step", "total")] + ["first_step", "total"]
    columns = [c for c in columns if any(row.get(c) is not None for row in rows)]  # older logs lack some
    print("\nRecovery profile (seconds, reference rank; metrics.recovery_phases, `other`: what no event accounts for)\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else ("–" if v is None else str(v))
                 for v in (row.get(c) for c in columns)]
        print("| " + " | ".join(cells) + " |")


def print_restore_checks(runs: list[Path]) -> None:
    """Each restore's check behind it (``restore_checked``): how long this rank's share took to
    hash, and the steps that overlapped the hashing against the run's median step (what it cost).
    The hashing ran ``seconds`` up to the event, which is logged at the first poll after it ended
    (within a step): the window may hold one step after it, never the first step before it began.
    """
    import statistics

    rows = []
    for run in runs:
        log = events.read_events(run)
        for e in (e for e in log if e.event == "restore_checked"):
            began = e.ts - (e["seconds"] or 0.0)
            steps = [s for s in log if s.event == "step" and s.rank == e.rank]
            # Overlapping the hashing, not every step since the restore: the first step (slow after a
            # launcher restart) is over before the hashing begins.
            during = [s["seconds"] for s in steps if s.ts > began and s.ts - s["seconds"] < e.ts]
            median = statistics.median(s["seconds"] for s in steps) if steps else None
            mean = statistics.mean(during) if during else None
            rows.append(f"| {run.name} | {e.rank} | {e.attempt}.{e.iteration} | {e.step} | {(e['bytes'] or 0) / 1e9:.2f} "
                        f"| {e['seconds']:.2f} | {len(during)} | {fmt(mean, '{:.3f}')} "
                        f"| {fmt(median, '{:.3f}')} | {'; '.join(e['problems']) or 'none'} |")
    if rows:
        print("\nRestore checks (RestoreCheck: the restored share hashed behind the restore)\n")
        print("| run | rank | attempt.iteration | step | GB | seconds | steps meanwhile | their mean s | median step s "
              "| problems |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))


def print_restores(runs: list[Path]) -> None:
    """Where each restart restored from (rank 0's ``load_done``) and the saves in flight at an
    in-process restart that were kept (``ckpt_carried``) and whether each was then committed.
    """
    rows = []
    for run in runs:
        log = [e for e in events.read_events(run) if e.rank == 0]
        for e in log:
            if e.event == "load_done" and (e.attempt, e.iteration) != (0, 0):
                rows.append(f"| {run.name} | {e.attempt}.{e.iteration} | restored {e.step} | {e['source'] or 'fresh'} |")
            elif e.event == "ckpt_carried":
                # Its fate: the first commit or abandonment of that step and tier after it.
                fate = next((f for f in log if f.ts >= e.ts and f.step == e.step and f.get("tier") == e["tier"]
                             and f.event in ("ckpt_committed", "ckpt_abandoned")), None)
                done = ("not committed" if fate is None else "committed" if fate.event == "ckpt_committed"
                        else f"abandoned ({fate['reason']})")
                rows.append(f"| {run.name} | {e.attempt}.{e.iteration} | carried save of {e.step} ({e['tier']}) "
                            f"| restore at {e['restored']}; {done} |")
    if rows:
        print("\nRestores and carried saves (rank 0)\n\n| run | attempt.iteration | what | source / outcome |")
        print("|---|---|---|---|")
        print("\n".join(rows))


def fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "–" if value is None else pattern.format(value)


def main(paths: list[str]) -> None:
    work = Path(tempfile.mkdtemp(prefix="gpu-report-"))
    for path in paths:
        label = Path(path).name.removesuffix(".tar.gz")
        target = work / label
        with tarfile.open(path) as tar:
            tar.extractall(target, filter="data")
        suite_dir = next(p for p in target.iterdir() if p.is_dir())
        machine = (suite_dir / "machine.txt").read_text().strip().splitlines()
        print(f"\n### {label}\n\n{machine[0]}; {machine[1]}; {machine[2]}\n")
        runs = sorted(p for p in suite_dir.iterdir() if (p / "events").is_dir())
        spans = {p.name: training_span(p) for p in runs if p.name.endswith("no_ckpt")}
        print("| run | args | status | train goodput | infra goodput | recoveries (layer: s) | rollback steps "
              "| lost s/fault (mean) | stall/save s | saves (deferred) | efficiency | interval (steps) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for run in runs:
            m = metrics.compute_metrics(run)
            recoveries = ", ".join(f"{f['layer']}: {f['recovery_seconds']:.1f}" for f in m["faults"]
                                   if f.get("recovery_seconds") is not None) or "–"
            ck = m["checkpoints"]
            span = training_span(run)
            # The baseline of "old_async_tight" is "old_no_ckpt"; of "async_tight", "no_ckpt".
            prefix = run.name.split("_", 1)[0] + "_" if run.name.split("_", 1)[0] in ("old", "dcp") else ""
            baseline = spans.get(f"{prefix}no_ckpt")
            efficiency = f"{baseline / span:.1%}" if baseline else "–"
            args = (run / "args.txt").read_text().strip() if (run / "args.txt").exists() else ""
            status = m["status"] + (f" (never injected: {', '.join(m['faults_not_injected'])})"
                                    if m.get("faults_not_injected") else "")
            print(f"| {run.name} | `{args}` | {status} | {m['training_goodput']:.1%} | "
                  f"{m['infrastructure_goodput']:.1%} | {recoveries} | {fmt(m['rollback_steps']['mean'], '{:.0f}')} | "
                  f"{fmt(m['lost_seconds_per_fault']['mean'])} | "
                  f"{fmt(ck['stall_seconds']['mean'])} | {ck['committed']}+{ck.get('committed_local_tier', 0)} local "
                  f"({ck['deferred']}) | {efficiency} | {fmt(ck['interval_steps'], '{:.0f}')} |")
        print_profiles([row for run in runs for row in restart_profiles(run)])
        print_restore_checks(runs)
        print_restores(runs)
        locked = [(run.name, e) for run in runs for e in events.read_events(run)
                  if e.event == "host_memory_locked" and e.rank == 0]
        if locked:  # memory CUDA refused to page-lock makes its copies synchronous
            print("\nPage-locked host memory (rank 0)\n\n| run | attempt | what | GB locked | GB refused | seconds |")
            print("|---|---|---|---|---|---|")
            for name, e in locked:
                print(f"| {name} | {e.attempt} | {e['what']} | {e['bytes'] / 1e9:.2f} | {e['failed_bytes'] / 1e9:.2f} "
                      f"| {e['seconds']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
