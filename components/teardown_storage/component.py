"""KFP component: delete what the run created (job, PVC/PV, ephemeral FSx); for the exit handler."""

from kfp import dsl

from resilient_training import images


@dsl.component(base_image=images.COMPONENTS_IMAGE, install_kfp_package=False)
def teardown_storage(
    storage_ref: str,
    run_id: str,
    job_name: str = "",
    delete_file_system: bool = True,
) -> str:
    """Delete the run's PyTorchJob, PVC, PV and (when it created it) FSx file system. Safe to repeat.

    Runs in the pipeline's exit handler, so a failed or cancelled run leaves nothing billing.
    A reused file system or a claim the user supplied is never deleted.

    Args:
        storage_ref: The JSON from ``provision_storage``.
        run_id: The same run id given to ``provision_storage`` (its token guards the delete).
        job_name: PyTorchJob to delete as well (``launch_training``'s ``job_name``); empty = none.
        delete_file_system: Delete an FSx file system this run created; off keeps it for inspection.

    Returns:
        JSON object: each object (``kind/name``) and what happened (deleted, gone, deleting, kept).

    """
    import json

    from resilient_training.components.teardown_storage.teardown import teardown_from_json

    done = teardown_from_json(storage_ref, run_id=run_id, job_name=job_name, delete_file_system=delete_file_system)
    print(json.dumps(done, indent=1))
    return json.dumps(done, sort_keys=True)
