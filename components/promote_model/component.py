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
    export: str = "",
) -> str:
    """Copy a checkpoint that passed validation and the convergence gate of its run to DEST.

    Refuses (fails the task) unless RUN/gates/validation.json and RUN/gates/convergence.json
    both passed for this very checkpoint. Atomic and idempotent: a retry after a crash
    completes the promotion; a second run for the same checkpoint is a no-op.

    Args:
        checkpoint: RUN/checkpoints/step_N, or a run directory (its latest checkpoint).
        dest: Destination directory or s3://bucket/prefix (credentials from the
            environment, as boto3 finds them). ``{run_id}`` in it is replaced by the name of the
            run's directory (the pipeline run's id), so that each run of a schedule has its own.
        model: Output Model artifact: its URI is DEST; metadata carries step, bytes and the
            manifest digest.
        promotion: Output JSON artifact: the promotion record (source, both gate records, files).
        export: Also write the promoted checkpoint in a format other tools load, inside DEST:
            "safetensors" (DEST/model.safetensors), "torch" (DEST/model.pt), "hf" (DEST/hf/, a
            Hugging Face model directory, for transformers models); "dcp" or empty adds nothing
            (DEST already is a DCP checkpoint).

    Returns:
        The destination the model was promoted to ({run_id} replaced).

    """
    import json

    from resilient_training.gates.export import FORMATS
    from resilient_training.gates.promote import promote, read_promotion

    if export.strip() not in ("", *FORMATS):  # before promoting: a typo must not leave half the work done
        raise ValueError(f"export {export!r}: choose one of {', '.join(FORMATS)} (or empty for none)")
    outcome = promote(checkpoint, dest)
    dest = outcome["dest"]  # {run_id} replaced
    record = read_promotion(dest)
    exported = None
    if export.strip():
        from resilient_training.gates.export import export_promoted

        exported = export_promoted(checkpoint, dest, export.strip())
    model.uri = dest
    model.metadata.update({"step": outcome["step"], "bytes": outcome["bytes"],
                           "already_promoted": outcome["already_promoted"],
                           "manifest_checksum": record["source"]["manifest_checksum"] if record else "",
                           "export": exported["out"] if exported else ""})
    with open(promotion.path, "w", encoding="utf-8") as handle:
        json.dump({"outcome": outcome, "record": record, "export": exported}, handle, indent=1, allow_nan=True)
    return dest
