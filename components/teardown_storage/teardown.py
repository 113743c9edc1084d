"""Delete what a run created: its PyTorchJob, its PVC/PV, its FSx file system when ephemeral.

Safe to call twice and after a partial provisioning: anything already gone counts as done.
A reused file system or a user's own claim is never touched (the storage ref says what the run
created, and the file system must also carry the run's token tag). Every step is attempted even
when one fails; the failures are raised together at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resilient_training.components.provision_storage import fsx, volumes
from resilient_training.storage_ref import StorageRef


def delete_job(training_client: Any, name: str, namespace: str, progress: Callable[[str], None] = print) -> str:
    """Delete a PyTorchJob (its pods go with it); ``gone`` when it does not exist."""
    try:
        training_client.delete_job(name, namespace=namespace)
    except RuntimeError as exc:  # TrainingClient wraps the ApiException
        if getattr(exc.__cause__, "status", None) == 404:
            progress(f"k8s: PyTorchJob {namespace}/{name} is already gone")
            return "gone"
        raise
    progress(f"k8s: deleted PyTorchJob {namespace}/{name}")
    return "deleted"


def teardown(
    ref: StorageRef,
    *,
    run_id: str,
    job_name: str = "",
    job_namespace: str = "",
    delete_file_system: bool = True,
    core_api: Any = None,
    training_client: Any = None,
    fsx_client: Any = None,
    progress: Callable[[str], None] = print,
) -> dict[str, str]:
    """Returns what happened to each object (``deleted``, ``gone``, ``deleting``, ``kept``)."""
    done: dict[str, str] = {}
    errors: list[str] = []

    def attempt(key: str, action: Callable[[], str]) -> None:
        try:
            done[key] = action()
        except Exception as exc:  # noqa: BLE001 - collected, raised after the other steps ran
            done[key] = "error"
            errors.append(f"{key}: {exc}")

    if job_name:
        attempt(f"pytorchjob/{job_name}",
                lambda: delete_job(training_client, job_name, job_namespace or ref.namespace or "default", progress))
    if ref.created_pvc:
        attempt(f"pvc/{ref.pvc_name}", lambda: volumes.delete_pvc(core_api, ref.pvc_name, ref.namespace, progress))
    elif ref.pvc_name:
        done[f"pvc/{ref.pvc_name}"] = "kept"
    if ref.created_pv:
        attempt(f"pv/{ref.pv_name}", lambda: volumes.delete_pv(core_api, ref.pv_name, progress))
    if ref.fsx_id:
        if ref.created_fsx and delete_file_system:
            attempt(f"fsx/{ref.fsx_id}",
                    lambda: fsx.delete(fsx_client, ref.fsx_id, token=fsx.request_token(run_id), progress=progress))
        else:
            why = "reused, not this run's" if not ref.created_fsx else "delete_file_system is off"
            progress(f"fsx: keeping {ref.fsx_id} ({why})")
            done[f"fsx/{ref.fsx_id}"] = "kept"
    if errors:
        raise RuntimeError("teardown could not delete everything: " + "; ".join(errors))
    return done


def teardown_from_json(storage_ref: str, *, run_id: str, job_name: str = "", delete_file_system: bool = True,
                       progress: Callable[[str], None] = print) -> dict[str, str]:
    """The component's entry: parse the ref, make only the clients needed, tear down."""
    ref = StorageRef.from_json(storage_ref)
    if job_name:
        from resilient_training import k8s_names

        k8s_names.check_dns1035_label(job_name, "job_name")
    if ref.fsx_id and ref.created_fsx and not run_id:
        raise ValueError("run_id is needed to delete the run's file system (its token tag is checked)")
    core_api = training_client = fsx_client = None
    if ref.shared or job_name:
        from kubernetes import client

        from resilient_training import kube_client

        cfg = kube_client.configuration()
        core_api = client.CoreV1Api(client.ApiClient(cfg))
        if job_name:
            from kubeflow.training import TrainingClient

            training_client = TrainingClient(client_configuration=cfg, namespace=ref.namespace or "default")
    if ref.fsx_id and ref.created_fsx and delete_file_system:
        import boto3

        fsx_client = boto3.client("fsx", region_name=ref.region or None)
    return teardown(ref, run_id=run_id, job_name=job_name, delete_file_system=delete_file_system, core_api=core_api,
                    training_client=training_client, fsx_client=fsx_client, progress=progress)
