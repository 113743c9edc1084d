"""KFP component: integrity validation of a run's checkpoint (a thin wrapper over validate.py)."""

# No `from __future__ import annotations` here: KFP reads the real annotation objects.
from kfp import dsl

from resilient_training.launch.images import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def validate_checkpoint(
    run_dir: str,
    metrics: dsl.Output[dsl.Metrics],
    summary: dsl.Output[dsl.Markdown],
    findings: dsl.Output[dsl.Artifact],
    all_checkpoints: bool = False,
    load: bool = True,
) -> bool:
    """Re-read every byte of the run's latest checkpoint and prove it complete, intact and loadable.

    Writes RUN/gates/validation.json, which promotion requires. Temporary directories left by
    saves in flight or killed mid-write are reported as ignored, not as corruption. Branch on
    the returned value (dsl.If(task.outputs["Output"] == True)); a single output, because kfp.local
    resolves only `Output` in conditions.

    Args:
        run_dir: Run directory on shared storage (holds checkpoints/ and events/), or one
            checkpoints/step_N directory.
        metrics: Output metrics: valid (1/0), findings, step of the latest checkpoint, bytes
            read, read GB/s, seconds.
        summary: Output Markdown: the verdict, every check passed and every finding.
        findings: Output JSON artifact: the full validation report (checkpoint paths, checks,
            findings, ignored leftovers).
        all_checkpoints: Validate every committed checkpoint, not only the one `latest` names.
        load: Load the checkpoint into a freshly built model and compare tensor hashes.

    Returns:
        True when a committed checkpoint was validated and no finding was raised.

    """
    import json

    from resilient_training.gates.validate import format_validation, validate, write_validation_record

    report = validate(run_dir, all_checkpoints=all_checkpoints, load=load)
    write_validation_record(run_dir, report)
    latest = report.checkpoints[-1] if report.checkpoints else None
    metrics.log_metric("valid", 1.0 if report.valid else 0.0)
    metrics.log_metric("findings", float(len(report.all_findings)))
    if latest is not None:
        metrics.log_metric("step", float(latest.step if latest.step is not None else -1))
        metrics.log_metric("bytes", float(sum(c.bytes for c in report.checkpoints)))
        metrics.log_metric("seconds", round(sum(c.seconds for c in report.checkpoints), 3))
        if latest.read_seconds:
            metrics.log_metric("read_gbps", round(latest.bytes / latest.read_seconds / 1e9, 3))
    with open(summary.path, "w", encoding="utf-8") as handle:
        handle.write(f"# Checkpoint validation: {'VALID' if report.valid else 'INVALID'}\n\n```\n")
        handle.write(format_validation(report) + "\n```\n")
    with open(findings.path, "w", encoding="utf-8") as handle:
        json.dump(report.to_dict(), handle, indent=1, allow_nan=True)
    return report.valid
