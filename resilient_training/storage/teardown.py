"""Delete what a run created: its PyTorchJob or TrainJob, its PVC/PV, its FSx file system when ephemeral.

KFP's exit task cannot take another task's output, so what to delete is worked out from the run
id and the provisioning parameters (:func:`owned_by_run`): the PV/PVC names derive from the run id,
and the file system is the one carrying the run's token tag; found this way, even a file system
whose provisioning step was killed before it could report it is deleted. Given a storage ref
instead (:meth:`Owned.from_ref`), exactly what it lists. A run that launched more jobs than its own
(the recovery benchmark: one per strategy, each under its own run id ``<run id>-<name>``) names
their run ids (``job_run_ids``), and each of those jobs is found by the name derived from its run id.

Safe to call twice: anything already gone counts as done. A reused file system or a user's own
claim is never touched, a file system is deleted only if it carries the run's token tag, and a
PV or PVC only if it carries the run's mark (label ``resilient-training.io/run-token``): a fixed
``pvc_name`` in overlapping runs names the first run's claim in the second run's teardown, which
leaves it alone (``kept``) and says which run made it. A job of ``job_run_ids`` is deleted only if
its run-id label (``resilient-training.io/run-id``, which launch puts on every job) is that run id's,
and with the uid it was read with as a precondition; one without it is ``kept`` and named. Every
step is attempted even when one fails; the failures are raised together at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from resilient_training.launch import jobshape, trainjob, watch
from resilient_training.run.storage_ref import BACKENDS, StorageRef
from resilient_training.storage import fsx, volumes
from resilient_training.storage.provision import volume_names


@dataclass
class Owned:
    """What a run owns (delete) and what it only used (keep)."""

    namespace: str = ""
    pvc_name: str = ""
    pv_name: str = ""
    fsx_id: str = ""
    kept: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_ref(cls, ref: StorageRef) -> Owned:
        owned = cls(namespace=ref.namespace)
        if ref.created_pvc:
            owned.pvc_name = ref.pvc_name
        elif ref.pvc_name:
            owned.kept[f"pvc/{ref.pvc_name}"] = "the user's claim"
        if ref.created_pv:
            owned.pv_name = ref.pv_name
        if ref.fsx_id and ref.created_fsx:
            owned.fsx_id = ref.fsx_id
        elif ref.fsx_id:
            owned.kept[f"fsx/{ref.fsx_id}"] = "reused, not this run's"
        return owned


def owned_by_run(*, run_id: str, storage: str, namespace: str, pvc_name: str = "", fsx_file_system_id: str = "",
                 fsx_client: Any = None) -> Owned:
    """Work out what ``provision_storage`` created for this run from its parameters."""
    if storage not in BACKENDS:
        raise ValueError(f"storage must be one of {', '.join(BACKENDS)}, got {storage!r}")
    owned = Owned(namespace=namespace)
    if storage == "pvc" and pvc_name:
        owned.kept[f"pvc/{pvc_name}"] = "the user's claim"
    if storage != "fsx":
        return owned
    owned.pv_name, owned.pvc_name = volume_names(run_id, pvc_name)
    if fsx_file_system_id:
        owned.kept[f"fsx/{fsx_file_system_id}"] = "reused, not this run's"
    elif fsx_client is not None:
        found = fsx.find_by_token(fsx_client, fsx.request_token(run_id))
        owned.fsx_id = found["FileSystemId"] if found else ""
    return owned


# Each job kind as the custom-objects API addresses it: (kind, group, version, plural, delete propagation).
# A TrainJob goes in the foreground (its JobSet and pods first), as ``watch.TrainJobs`` deletes it.
_JOB_KINDS = {
    "pytorchjob": ("PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", None),
    "trainjob": ("TrainJob", trainjob.GROUP, trainjob.VERSION, trainjob.PLURAL, "Foreground"),
}


def job_run_label(job_run_id: str) -> str:
    """The value of the run-id label launch puts on the job of ``job_run_id`` (cut to fit a label)."""
    return jobshape._run_label(job_run_id)  # the launchers' own rule, not a copy of it


def _check_job_run_ids(job_run_ids: Sequence[str]) -> None:
    if isinstance(job_run_ids, str) or any(not isinstance(r, str) or not r for r in job_run_ids):
        raise ValueError(f"job_run_ids must be a list of non-empty run ids, got {job_run_ids!r}")


def delete_job_of_run(custom_api: Any, kind: str, namespace: str, name: str, job_run_id: str,
                      progress: Callable[[str], None] = print) -> str:
    """Delete the job only if it carries ``job_run_id``'s run-id label; ``deleted``, ``gone`` or ``kept``.

    Read first (404: ``gone``), then deleted with the uid read as a precondition, so a job made
    again under the name since is not deleted either. Other API errors are raised.
    """
    from kubernetes import client as k8s

    kind_name, group, version, plural, propagation = _JOB_KINDS[kind]
    what = f"{kind_name} {namespace}/{name}"
    try:
        job = custom_api.get_namespaced_custom_object(group, version, namespace, plural, name)
    except Exception as exc:
        if watch.api_status(exc) == 404:  # also when the kind's CRD is not installed
            progress(f"k8s: {what} is already gone")
            return "gone"
        raise
    meta = job.get("metadata") or {}
    found, expected = (meta.get("labels") or {}).get(jobshape.RUN_ID_LABEL), job_run_label(job_run_id)
    if found != expected:
        why = (f"its label {jobshape.RUN_ID_LABEL} is {found!r}" if found is not None
               else f"it has no label {jobshape.RUN_ID_LABEL}")
        progress(f"k8s: leaving {what} alone: {why}, not this run's {expected!r}")
        return "kept"
    uid = meta.get("uid") or ""
    options = k8s.V1DeleteOptions(propagation_policy=propagation,
                                  preconditions=k8s.V1Preconditions(uid=uid) if uid else None)
    try:
        custom_api.delete_namespaced_custom_object(group, version, namespace, plural, name, body=options)
    except Exception as exc:
        if watch.api_status(exc) == 404:
            progress(f"k8s: {what} is already gone")
            return "gone"
        if watch.api_status(exc) == 409 and uid:  # the uid precondition failed: the job read is gone
            progress(f"k8s: leaving {what} alone: it was deleted and made again since it was read")
            return "kept"
        raise
    progress(f"k8s: deleted {what}")
    return "deleted"


def teardown(
    owned: Owned | StorageRef,
    *,
    run_id: str,
    job_name: str = "",
    job_run_ids: Sequence[str] = (),
    delete_file_system: bool = True,
    core_api: Any = None,
    training_client: Any = None,
    trainjob_api: Any = None,
    fsx_client: Any = None,
    progress: Callable[[str], None] = print,
) -> dict[str, str]:
    """Returns what happened to each object (``deleted``, ``gone``, ``deleting``, ``kept``: a reused file system,
    a user's claim, or a PV/PVC without this run's mark).

    The job is deleted through ``training_client`` (PyTorchJob) and ``trainjob_api`` (a
    :class:`~resilient_training.launch.watch.TrainJobs`, default: through ``training_client``'s API client).
    ``job_run_ids``: run ids of further jobs the run launched (the benchmark's strategies), each job
    found by the name derived from its run id and deleted only if it carries that run id's label
    (:func:`delete_job_of_run`).
    """
    _check_job_run_ids(job_run_ids)
    if isinstance(owned, StorageRef):
        owned = Owned.from_ref(owned)
    done: dict[str, str] = {}
    errors: list[str] = []

    def attempt(key: str, action: Callable[[], str]) -> None:
        try:
            done[key] = action()
        except Exception as exc:  # noqa: BLE001 - collected, raised after the other steps ran
            done[key] = "error"
            errors.append(f"{key}: {exc}")

    namespace = owned.namespace or "default"
    if (job_name or job_run_ids) and trainjob_api is None and training_client is not None:
        # The same API server: TrainJobs through the TrainingClient's own custom-objects client.
        trainjob_api = watch.TrainJobs(training_client.custom_api, training_client.core_api, namespace)
    if job_name:
        # The run's job is a PyTorchJob or a TrainJob (same name either way): delete whichever exists.
        for kind, api in (("pytorchjob", training_client and watch.PyTorchJobs(training_client, namespace)),
                          ("trainjob", trainjob_api)):
            if api is not None:
                attempt(f"{kind}/{job_name}", lambda api=api: watch.delete_job(api, job_name, progress))
    # The further jobs (one per benchmark strategy): by their derived names, and only with their run's label.
    for job_run_id in dict.fromkeys(job_run_ids):
        name = jobshape.job_name_for_run(job_run_id)
        for kind, custom_api in (("pytorchjob", training_client and training_client.custom_api),
                                 ("trainjob", trainjob_api and trainjob_api.custom_api)):
            if custom_api is not None:
                attempt(f"{kind}/{name}", lambda custom_api=custom_api, kind=kind, name=name, job_run_id=job_run_id:
                        delete_job_of_run(custom_api, kind, namespace, name, job_run_id, progress))
    # By name, but only what carries this run's mark: a fixed pvc_name may name another run's claim.
    if owned.pvc_name:
        attempt(f"pvc/{owned.pvc_name}",
                lambda: volumes.delete_pvc_of_run(core_api, owned.pvc_name, owned.namespace, run_id, progress))
    if owned.pv_name:
        attempt(f"pv/{owned.pv_name}", lambda: volumes.delete_pv_of_run(core_api, owned.pv_name, run_id, progress))
    if owned.fsx_id:
        if delete_file_system:
            attempt(f"fsx/{owned.fsx_id}",
                    lambda: fsx.delete(fsx_client, owned.fsx_id, token=fsx.request_token(run_id), progress=progress))
        else:
            owned.kept[f"fsx/{owned.fsx_id}"] = "delete_file_system is off"
    for key, why in owned.kept.items():
        progress(f"keeping {key} ({why})")
        done[key] = "kept"
    if errors:
        raise RuntimeError("teardown could not delete everything: " + "; ".join(errors))
    return done


def teardown_storage(
    *,
    run_id: str,
    storage: str = "local",
    namespace: str = "",
    pvc_name: str = "",
    fsx_file_system_id: str = "",
    region: str = "",
    storage_ref: str = "",
    delete_job: bool = True,
    job_name: str = "",
    job_run_ids: Sequence[str] = (),
    delete_file_system: bool = True,
    core_api: Any = None,
    training_client: Any = None,
    trainjob_api: Any = None,
    fsx_client: Any = None,
    progress: Callable[[str], None] = print,
) -> dict[str, str]:
    """The component's entry: validate, make only the clients needed, find what the run owns, delete it.

    ``storage_ref`` (when given) overrides ``storage``/``namespace``/``pvc_name``/``fsx_file_system_id``.
    With ``delete_job`` and no ``job_name``, the run's job (PyTorchJob or TrainJob) is found by
    the name ``launch_training`` derives from the run id; with ``delete_job``, the jobs of ``job_run_ids``
    (the benchmark's strategies) are deleted too, each only if it carries its run id's label.
    """
    from resilient_training.launch import k8s_names
    from resilient_training.launch.jobshape import job_name_for_run

    if not run_id:
        raise ValueError("run_id must not be empty: what to delete is derived from it")
    ref = StorageRef.from_json(storage_ref) if storage_ref else None
    if ref is not None:
        storage, namespace, region = ref.backend, ref.namespace, ref.region or region
    elif storage not in BACKENDS:
        raise ValueError(f"storage must be one of {', '.join(BACKENDS)}, got {storage!r}")
    if storage == "fsx" and fsx_file_system_id:
        fsx.check_file_system_id(fsx_file_system_id)
    if job_name:
        k8s_names.check_dns1035_label(job_name, "job_name")
    elif delete_job and storage != "local":
        job_name = job_name_for_run(run_id)
    _check_job_run_ids(job_run_ids)
    needs_kube = storage != "local"
    job_run_ids = list(job_run_ids) if delete_job and needs_kube else []
    if needs_kube and not namespace:
        from resilient_training.launch import kube_client

        namespace = kube_client.default_namespace()
    if needs_kube:
        k8s_names.check_dns1123_label(namespace, "namespace")
    if pvc_name:
        k8s_names.check_dns1123_subdomain(pvc_name, "pvc_name")
    if needs_kube and (core_api is None or ((job_name or job_run_ids) and training_client is None)):
        from kubernetes import client

        from resilient_training.launch import kube_client

        cfg = kube_client.configuration()
        core_api = core_api or client.CoreV1Api(client.ApiClient(cfg))
        if (job_name or job_run_ids) and training_client is None:
            from kubeflow.training import TrainingClient

            training_client = TrainingClient(client_configuration=cfg, namespace=namespace)
    if storage == "fsx" and fsx_client is None and (delete_file_system or ref is None):
        import boto3

        fsx_client = boto3.client("fsx", region_name=region or None)
    owned = Owned.from_ref(ref) if ref is not None else owned_by_run(
        run_id=run_id, storage=storage, namespace=namespace, pvc_name=pvc_name,
        fsx_file_system_id=fsx_file_system_id, fsx_client=fsx_client)
    return teardown(owned, run_id=run_id, job_name=job_name if needs_kube else "", job_run_ids=job_run_ids,
                    delete_file_system=delete_file_system, core_api=core_api, training_client=training_client,
                    trainjob_api=trainjob_api, fsx_client=fsx_client, progress=progress)
