"""KFP component: the convergence gate (a thin wrapper over convergence.py)."""

# No `from __future__ import annotations` here: KFP reads the real annotation objects.
from kfp import dsl

from resilient_training.launch.images import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def check_convergence(
    run_dir: str,
    metrics: dsl.Output[dsl.Metrics],
    summary: dsl.Output[dsl.Markdown],
    verdict: dsl.Output[dsl.Artifact],
    max_final_loss: float = -1.0,
    min_improvement: float = 0.1,
    window: int = 5,
    continuity_rtol: float = 1e-3,
    jump_rtol: float = 0.15,
    reference_run_dir: str = "",
    reference_rtol: float = 0.05,
) -> bool:
    """Gate a run on its loss curve from the event log: finite, learned, continuous across every restore.

    Writes RUN/gates/convergence.json, which promotion requires. Branch on the returned value
    (dsl.If(task.outputs["Output"] == True)) to skip promotion when the gate fails; a single output,
    because kfp.local resolves only `Output` in conditions.

    Args:
        run_dir: Run directory on shared storage (holds events/ and checkpoints/).
        metrics: Output metrics: passed (1/0), final and first-window loss, improvement,
            restores checked, worst continuity deviation.
        summary: Output Markdown: every check with its numbers and why it passed or failed.
        verdict: Output JSON artifact: the full verdict, including every restore compared.
        max_final_loss: Final-window mean loss must be below this; a negative value derives
            0.8 x ln(vocab_size) from the run's checkpoint manifest.
        min_improvement: Required relative improvement of the final window over the first.
        window: Steps in the first and in the final window.
        continuity_rtol: Relative tolerance between the first loss after a restore and the
            loss logged for the same step before the fault.
        jump_rtol: Relative tolerance when only the restored step's own loss is known.
        reference_run_dir: Optional reference run whose loss curve this run must follow ("" for none).
        reference_rtol: Relative tolerance against the reference curve.

    Returns:
        True when every check passed.

    """
    import json

    from resilient_training.gates.convergence import (
        ConvergenceConfig,
        check_and_record,
    )

    config = ConvergenceConfig(
        max_final_loss=None if max_final_loss < 0 else max_final_loss, min_improvement=min_improvement,
        window=window, continuity_rtol=continuity_rtol, jump_rtol=jump_rtol, reference_rtol=reference_rtol,
    )
    result = check_and_record(run_dir, config, reference_dir=reference_run_dir or None)
    learned = result.check("improvement").values
    continuity = result.check("continuity").values
    metrics.log_metric("passed", 1.0 if result.passed else 0.0)
    for key in ("final_mean", "first_mean", "improvement"):
        if learned.get(key) is not None and learned[key] == learned[key]:
            metrics.log_metric(key, round(float(learned[key]), 6))
    metrics.log_metric("restores_checked", float(continuity["checked"]))
    metrics.log_metric("restores_failed", float(continuity["failed"]))
    if continuity.get("max_deviation") is not None:
        metrics.log_metric("continuity_max_deviation", float(continuity["max_deviation"]))
    with open(summary.path, "w", encoding="utf-8") as handle:
        handle.write(f"# Convergence gate: {'PASSED' if result.passed else 'FAILED'}\n\n")
        handle.write("| check | result | reason |\n|---|---|---|\n")
        for check in result.checks:
            state = "skipped" if check.skipped else ("passed" if check.passed else "**FAILED**")
            handle.write(f"| {check.name} | {state} | {check.reason.replace('|', '/')} |\n")
    with open(verdict.path, "w", encoding="utf-8") as handle:
        json.dump(result.to_dict(), handle, indent=1, allow_nan=True)
    return result.passed
