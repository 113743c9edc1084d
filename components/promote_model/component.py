"""KFP component: gated promotion of a checkpoint (a thin wrapper over promote.py)."""

# No `from __future__ import annotations` here: KFP reads the real annotation objects.
from kfp import dsl

from resilient_training.launch.images import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def promote_model(
    checkpoint: str,
    dest: str,
    model: dsl.Output[dsl.Model],
    promotion: dsl.Output[dsl.Artifact],
) -> str:
    """Copy a checkpoint that passed validation and the convergence gate of its run to DEST.

    Refuses (fails the task) unless RUN/gates/validation.json and RUN/gates/convergence.json
    both passed for this very checkpoint. Atomic and idempotent: a retry after a crash
    completes the promotion; a second run for the same checkpoint is a no-op.

    Args:
        checkpoint: RUN/checkpoints/step_N, or a run directory (its latest checkpoint).
        dest: Destination directory or s3://bucket/prefix (credentials from the
            environment, as boto3 finds them).
        model: Output Model artifact: its URI is DEST; metadata carries step, bytes and the
            manifest digest.
        promotion: Output JSON artifact: the promotion record (source, both gate records, files).

    Returns:
        The destination the model was promoted to.

    """
    import json

    from resilient_training.gates.promote import promote, read_promotion

    outcome = promote(checkpoint, dest)
    record = read_promotion(dest)
    model.uri = dest
    model.metadata.update({"step": outcome["step"], "bytes": outcome["bytes"],
                           "already_promoted": outcome["already_promoted"],
                           "manifest_checksum": record["source"]["manifest_checksum"] if record else ""})
    with open(promotion.path, "w", encoding="utf-8") as handle:
        json.dump({"outcome": outcome, "record": record}, handle, indent=1, allow_nan=True)
    return dest
