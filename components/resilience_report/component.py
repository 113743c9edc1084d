"""KFP component: the resilience report (a thin wrapper over report.py and resilient_training.gates.metrics)."""

# No `from __future__ import annotations` here: KFP reads the real annotation objects.
from kfp import dsl

from resilient_training.launch.images import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def resilience_report(
    run_dir: str,
    report: dsl.Output[dsl.HTML],
    metrics: dsl.Output[dsl.Metrics],
    numbers: dsl.Output[dsl.Artifact],
) -> float:
    """Write the resilience report of a run: goodput, recoveries, checkpoints, from the event log.

    Runs whether or not the gates passed (put it in the exit handler or after them
    unconditionally): a failed run is the one whose report matters most.

    Args:
        run_dir: Run directory on shared storage (holds events/).
        report: Output HTML: loss curve with fault and restore markers, timeline of attempts,
            goodput bars, recovery time distribution, checkpoint freshness; self-contained.
        metrics: Output metrics: goodput, steps, faults, recovery p50/p95/max, rollback,
            checkpoint stall, suggested interval.
        numbers: Output JSON artifact: every number the report shows.

    Returns:
        Infrastructure goodput of the run ((wall - downtime) / wall).

    """
    import json

    from resilient_training.gates.metrics import compute_metrics
    from resilient_training.gates.report import write_report

    m = compute_metrics(run_dir)
    write_report(run_dir, report.path, metrics=m)
    flat = {
        "training_goodput": m["training_goodput"],
        "infrastructure_goodput": m["infrastructure_goodput"],
        "steps_completed": m["steps"]["completed"],
        "steps_replayed": m["steps"]["replayed"],
        "faults": len([f for f in m["faults"] if f["layer"] != "none"]),
        "unrecovered_faults": m["unrecovered_faults"],
        "faults_not_injected": len(m["faults_not_injected"]),
        "recovery_p50_seconds": m["recovery_seconds"]["all"]["p50"],
        "recovery_p95_seconds": m["recovery_seconds"]["all"]["p95"],
        "recovery_max_seconds": m["recovery_seconds"]["all"]["max"],
        "rollback_mean_steps": m["rollback_steps"]["mean"],
        "checkpoint_stall_mean_seconds": m["checkpoints"]["stall_seconds"]["mean"],
        "suggested_interval_steps": m["suggested_checkpoint_interval"]["daly_steps"],
        "wall_seconds": m["wall_seconds"],
    }
    for key, value in flat.items():
        if value is not None:
            metrics.log_metric(key, round(float(value), 6))
    with open(numbers.path, "w", encoding="utf-8") as handle:
        json.dump(m, handle, indent=1, allow_nan=True, default=str)
    return float(m["infrastructure_goodput"] or 0.0)
