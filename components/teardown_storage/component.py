"""KFP component: delete what the run created (job, PVC/PV, ephemeral FSx); for the exit handler."""

from kfp import dsl

from resilient_training.launch import images


@dsl.component(base_image=images.COMPONENTS_IMAGE, install_kfp_package=False)
def teardown_storage(
    run_id: str,
    storage: str = "local",
    namespace: str = "",
    pvc_name: str = "",
    fsx_file_system_id: str = "",
    region: str = "",
    storage_ref: str = "",
    delete_job: bool = True,
    job_name: str = "",
    delete_file_system: bool = True,
    strategies: list = [],  # noqa: B006 - KFP reads the default
) -> str:
    """Delete the run's PyTorchJob or TrainJob, PVC, PV and (when it created it) FSx file system. Safe to repeat.

    Runs in the pipeline's exit handler, so a failed or cancelled run leaves nothing billing. An
    exit task cannot take other tasks' outputs: give it the run id and the same storage parameters
    as ``provision_storage``; what the run created is found from them (derived names, the run's
    FSx token tag), even if provisioning was killed half-way. A reused file system or a claim the
    user supplied is never deleted, nor a PVC or PV without this run's label
    (``resilient-training.io/run-token``): another run's claim of the same ``pvc_name`` is left
    alone with one line, and the step succeeds. Given the recovery benchmark's ``strategies``, it
    also deletes each strategy's job (named from ``<run_id>-<name>``), even when ``run_strategies``
    died without deleting it; only a job labelled with that strategy's run id is deleted, any other
    one under the name is left alone with one line (``kept``).

    Args:
        run_id: The same run id given to ``provision_storage`` and ``launch_training``.
        storage: As given to ``provision_storage``: ``local``, ``pvc`` or ``fsx``.
        namespace: As given to ``provision_storage``; empty = this pod's namespace.
        pvc_name: As given to ``provision_storage`` (``fsx``: a claim name chosen there).
        fsx_file_system_id: As given to ``provision_storage``: a reused file system, never deleted.
        region: AWS region of the file system; empty = the pod's default.
        storage_ref: ``provision_storage``'s output, when available (outside an exit handler); it
            replaces the four storage parameters above.
        delete_job: Also delete the run's PyTorchJob or TrainJob (found by the name
            ``launch_training`` derives from ``run_id``); already gone counts as done.
        job_name: Delete this PyTorchJob or TrainJob instead of the derived one.
        delete_file_system: Delete an FSx file system this run created; off keeps it for inspection.
        strategies: The recovery benchmark's strategies, as given to ``run_strategies``: with
            ``delete_job``, each one's PyTorchJob or TrainJob is deleted too (empty: none).

    Returns:
        JSON object: each object (``kind/name``) and what happened (deleted, gone, deleting, kept).

    """
    import json

    from resilient_training.bench.strategy import strategy_run_ids
    from resilient_training.storage.teardown import teardown_storage as teardown

    # Each strategy trained under its own run id (its job's name and run-id label derive from it).
    done = teardown(run_id=run_id, storage=storage, namespace=namespace, pvc_name=pvc_name,
                    fsx_file_system_id=fsx_file_system_id, region=region, storage_ref=storage_ref,
                    delete_job=delete_job, job_name=job_name, delete_file_system=delete_file_system,
                    job_run_ids=strategy_run_ids(run_id, strategies))
    print("teardown: " + (", ".join(f"{key} {what}" for key, what in done.items()) or f"nothing to delete ({storage})"))
    return json.dumps(done, sort_keys=True)
