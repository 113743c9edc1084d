"""KFP component: provision a run's storage (local directory, existing PVC, or FSx for Lustre + PV/PVC)."""

from typing import NamedTuple, Optional

from kfp import dsl

from resilient_training.launch import images


@dsl.component(base_image=images.COMPONENTS_IMAGE, install_kfp_package=False)
def provision_storage(
    run_id: str,
    storage: str = "local",
    namespace: str = "",
    mount_path: str = "/mnt/run",
    run_subdir: str = "",
    local_root: str = "runs",
    pvc_name: str = "",
    fsx_file_system_id: str = "",
    fsx_subnet_id: str = "",
    fsx_security_group_ids: str = "",
    fsx_capacity_gib: int = 1200,
    fsx_deployment_type: str = "SCRATCH_2",
    fsx_per_unit_throughput: int = 0,
    fsx_lustre_version: str = "2.15",
    fsx_import_path: str = "",
    fsx_export_path: str = "",
    fsx_tags: Optional[dict] = None,  # noqa: UP045 - KFP reads the annotation; keep the typing form it knows
    region: str = "",
    fsx_timeout_seconds: int = 1800,
    fsx_poll_seconds: float = 30.0,
) -> NamedTuple("Outputs", [("storage_ref", str), ("pvc_name", str), ("run_dir", str)]):
    """Make the run's storage exist and return its reference (JSON) for launch and teardown.

    Args:
        run_id: Pipeline run id (pass ``dsl.PIPELINE_JOB_ID_PLACEHOLDER``); names and the FSx
            idempotency token derive from it, so a retried step finds what it created.
        storage: ``local`` (a directory here), ``pvc`` (an existing claim) or ``fsx`` (FSx for
            Lustre, created or reused, with a static PV/PVC).
        namespace: Namespace of the claim and the training job; empty = this pod's namespace.
        mount_path: Where worker pods mount the claim (pvc/fsx).
        run_subdir: Run directory under the mount or ``local_root``; empty = ``runs/<run_id>``.
        local_root: Root directory for ``storage=local``.
        pvc_name: ``pvc``: the existing claim (ReadWriteMany for several nodes). ``fsx``: name of
            the claim to create; empty = derived from the run id. Refused if a claim of that name
            exists that this run did not create (another run's: teardown deletes only its own).
        fsx_file_system_id: Reuse this FSx file system (``fs-...``); it is never deleted.
        fsx_subnet_id: Subnet of the new file system (same AZ as the GPU nodes).
        fsx_security_group_ids: Comma-separated security groups; they must allow Lustre (TCP 988).
        fsx_capacity_gib: Capacity in GiB: 1200, 2400 or a multiple of 2400.
        fsx_deployment_type: ``SCRATCH_2`` (default, cheapest, no replication) or ``PERSISTENT_2``.
        fsx_per_unit_throughput: ``PERSISTENT_2`` only: 125, 250, 500 or 1000 MB/s per TiB.
        fsx_lustre_version: Lustre version, ``2.15`` (default) or ``2.12``.
        fsx_import_path: ``s3://bucket[/prefix]`` linked as data repository (files load lazily):
            the import path of a ``SCRATCH_2``, a data repository association of a ``PERSISTENT_2``.
        fsx_export_path: ``SCRATCH_2``: export path in the import bucket. ``PERSISTENT_2``: the
            import path again to export changes back automatically.
        fsx_tags: Extra tags on the file system (cost allocation).
        region: AWS region; empty = the pod's default (``AWS_REGION``).
        fsx_timeout_seconds: Give up waiting for AVAILABLE after this long (then delete it).
        fsx_poll_seconds: Seconds between status polls while the file system is created.

    Returns:
        storage_ref: The storage reference as JSON (``resilient_training.run.storage_ref.StorageRef``)
            for ``launch_training``.
        pvc_name: The claim to mount into later steps (``kubernetes.mount_pvc`` at ``mount_path``);
            empty for ``local``.
        run_dir: The run directory (checkpoints/, events/).

    """
    from collections import namedtuple

    from resilient_training.storage.provision import provision_storage as provision

    ref = provision(
        backend=storage, run_id=run_id, namespace=namespace, mount_path=mount_path, run_subdir=run_subdir,
        local_root=local_root, pvc_name=pvc_name, fsx_file_system_id=fsx_file_system_id,
        fsx_subnet_id=fsx_subnet_id, fsx_security_group_ids=fsx_security_group_ids,
        fsx_capacity_gib=fsx_capacity_gib, fsx_deployment_type=fsx_deployment_type,
        fsx_per_unit_throughput=fsx_per_unit_throughput, fsx_lustre_version=fsx_lustre_version,
        fsx_import_path=fsx_import_path, fsx_export_path=fsx_export_path, fsx_tags=fsx_tags, region=region,
        fsx_timeout_s=fsx_timeout_seconds, fsx_poll_s=fsx_poll_seconds,
    )
    print(f"storage ref: {ref.to_json()}")
    outputs = namedtuple("Outputs", ["storage_ref", "pvc_name", "run_dir"])
    return outputs(ref.to_json(), ref.pvc_name, ref.run_dir)
