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
    """Where each recovery's time went, on rank 0: fault -> new process (launcher restarts) ->
    imports -> set-up -> each phase that ``load_done`` reports -> the first step.
    """
    every = metrics.load_events(run_dir)
    events = [e for e in every if e.rank == 0]
    # A fault that restarted nothing (the writer layer replaced a writer) has no restart to profile.
    layers = {f.get("fault"): f.get("layer") for f in metrics.compute_metrics(run_dir)["faults"]}
    rows = []
    for fault in (e for e in every if e.event == "fault_injected"):
        if layers.get(fault.get("fault")) in metrics.NON_STOPPING:
            continue
        later = [e for e in events if e.ts > fault.ts]
        load = next((e for e in later if e.event == "load_done"), None)
        if load is None:
            continue
        first = next((e for e in later if e.event == "step" and e.ts > load.ts), None)
        start = next((e for e in later if e.event == "start" and e.ts <= load.ts), None)
        phases = dict(load.get("phases") or {})
        row: dict[str, object] = {"run": run_dir.name, "fault": fault.get("fault"),
                                  "layer": "launcher" if start else "inprocess"}
        setup_begin = fault.ts
        if start is not None and start.get("process_seconds") is not None:
            process_start = start.ts - start["process_seconds"]
            row["to new process"] = process_start - fault.ts
            row.update(agent_phases(every, fault.ts, process_start))
            row["imports"] = start["process_seconds"]
            row["spare"] = "yes" if start.get("spare") else "no"
            setup_begin = start.ts
        row["set-up"] = load.ts - sum(phases.values()) - setup_begin
        row.update(phases)
        row["first step"] = first.get("seconds") if first else None
        row["total"] = (first.ts - fault.ts) if first else None
        rows.append(row)
    return rows


# ft_launcher's own restart profile (NVRx 0.6+, event launcher_phase): column -> the phase that ends it.
AGENT_PHASES = {"agent: detect": "failure_detected", "agent: stop workers": "workers_gone",
                "agent: GPU memory wait": "worker_terminated",
                "agent: rendezvous": "rendezvous_completed", "agent: start workers": "worker_start_completed"}


def agent_phases(every: list[events.Event], since: float, until: float) -> dict[str, float]:
    """Seconds between the fault and each phase of the first agent that logged them (the
    launcher's detection, teardown with its GPU memory wait, rendezvous, worker start).
    """
    phases = [e for e in every if e.event == "launcher_phase" and since < e.ts <= until + 1.0]
    if not phases:
        return {}
    at: dict[str, float] = {}
    for e in phases:  # one agent on one node (the benchmarks' case)
        at.setdefault(str(e.get("phase")), e.ts)
    row, mark = {}, since
    for column, phase in AGENT_PHASES.items():
        if phase in at:
            row[column] = at[phase] - mark
            mark = at[phase]
    return row


def print_profiles(rows: list[dict[str, object]]) -> None:
    if not rows:
        return
    columns = ["run", "fault", "layer", "spare", "to new process", *AGENT_PHASES, "imports", "set-up"]
    for row in rows:
        columns += [k for k in row if k not in columns and k not in ("first step", "total")]
    columns += ["first step", "total"]
    columns = [c for c in columns if any(row.get(c) is not None for row in rows)]  # older logs lack some
    print("\nRecovery profile (seconds, rank 0; set-up: from the fault or the start event to the first phase)\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else ("–" if v is None else str(v))
                 for v in (row.get(c) for c in columns)]
        print("| " + " | ".join(cells) + " |")


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
            print(f"| {run.name} | `{args}` | {m['status']} | {m['training_goodput']:.1%} | "
                  f"{m['infrastructure_goodput']:.1%} | {recoveries} | {fmt(m['rollback_steps']['mean'], '{:.0f}')} | "
                  f"{fmt(m['lost_seconds_per_fault']['mean'])} | "
                  f"{fmt(ck['stall_seconds']['mean'])} | {ck['committed']}+{ck.get('committed_local_tier', 0)} local "
                  f"({ck['deferred']}) | {efficiency} | {fmt(ck['interval_steps'], '{:.0f}')} |")
        print_profiles([row for run in runs for row in restart_profiles(run)])
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
