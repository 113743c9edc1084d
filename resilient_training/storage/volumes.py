"""Static PersistentVolume + PersistentVolumeClaim for an FSx for Lustre file system (FSx CSI driver).

The volume is pre-bound to the claim (``claimRef`` on the PV, ``volumeName`` on the PVC) so no
other claim can take it, uses ``storageClassName: ""`` so no provisioner steps in, and
``Retain`` so deleting the PV object never deletes the file system behind Kubernetes' back:
the file system's life is the run's business (teardown), not the cluster's.

Each PV/PVC also says which run made it (:func:`run_marks`): a claim name is the user's choice
(``pvc_name``), so two runs can name the same claim, and only the run that made an object may
delete it (:func:`delete_pvc_of_run`, :func:`delete_pv_of_run`) or adopt it on a retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from resilient_training.storage import fsx

CSI_DRIVER = "fsx.csi.aws.com"
# On every PV/PVC provision_storage creates. manifests/rbac/pv-admission-policy.yaml lets the
# launcher create or delete only PVs carrying the managed-by label: keep the two in step.
LABELS = {"app.kubernetes.io/name": "resilient-training", "app.kubernetes.io/managed-by": "resilient-training"}
# The run that made a PV/PVC: its token (the FSx tag's value; a label value holds at most 63
# characters of a few kinds, a run id need not fit) and, for the message naming it, its id.
RUN_TOKEN_LABEL = fsx.TOKEN_TAG
RUN_ID_ANNOTATION = fsx.RUN_TAG


def run_marks(run_id: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(labels, annotations)`` that mark a PV/PVC as made by ``run_id``."""
    return {RUN_TOKEN_LABEL: fsx.request_token(run_id)}, {RUN_ID_ANNOTATION: run_id}


def not_made_by(obj: Any, token: str) -> str:
    """Why ``obj`` (a PV or PVC read back) is not the object of the run whose token is ``token``;
    empty when it is.
    """
    metadata = getattr(obj, "metadata", None)
    labels = getattr(metadata, "labels", None) or {}
    if labels.get(RUN_TOKEN_LABEL) == token:
        return ""
    creator = (getattr(metadata, "annotations", None) or {}).get(RUN_ID_ANNOTATION)
    if creator and labels.get(RUN_TOKEN_LABEL):
        return f"run {creator} created it"
    if labels.get(RUN_TOKEN_LABEL):
        return "another run created it"
    return f"no run created it (it has no {RUN_TOKEN_LABEL} label)"


def _metadata(labels: dict[str, str], annotations: dict[str, str] | None, **fields: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {**fields, "labels": dict(labels)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return metadata


def pv_manifest(*, name: str, claim: str, namespace: str, fs_id: str, dns_name: str, mount_name: str,
                capacity_gib: int, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": _metadata(labels, annotations, name=name),
        "spec": {
            "capacity": {"storage": f"{capacity_gib}Gi"},
            "volumeMode": "Filesystem",
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            # flock: checkpoint commit and NVRx use POSIX locks; Lustre refuses them without it.
            "mountOptions": ["flock"],
            "claimRef": {"namespace": namespace, "name": claim},
            "csi": {
                "driver": CSI_DRIVER,
                "volumeHandle": fs_id,
                "volumeAttributes": {"dnsname": dns_name, "mountname": mount_name},
            },
        },
    }


def pvc_manifest(*, name: str, namespace: str, volume: str, capacity_gib: int, labels: dict[str, str],
                 annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(labels, annotations, name=name, namespace=namespace),
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": volume,
            "resources": {"requests": {"storage": f"{capacity_gib}Gi"}},
        },
    }


def _status(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


def _token(manifest: dict[str, Any]) -> str:
    return (manifest["metadata"].get("labels") or {}).get(RUN_TOKEN_LABEL, "")


def taken(kind: str, where: str, why: str) -> RuntimeError:
    """A name that another run, or no run, owns: this run must not adopt (and later delete) the object."""
    if kind == "PersistentVolume":  # (its name derives from the run id)
        return RuntimeError(f"{kind} {where} already exists and {why}: this run's volume, named from the run id, "
                            "cannot take its place")
    return RuntimeError(f"{kind} {where} already exists and {why}: each run needs a claim of its own; give another "
                        "pvc_name, or leave pvc_name empty (then it is named from the run id)")


def check_claim_free(core: Any, name: str, namespace: str, token: str) -> None:
    """Refuse a claim name that exists and is not this run's, before anything is created for the run
    (an earlier attempt of the same run made it: then it is the run's own).
    """
    from kubernetes.client.exceptions import ApiException

    try:
        existing = core.read_namespaced_persistent_volume_claim(name, namespace)
    except ApiException as exc:
        if _status(exc) == 404:
            return
        raise
    if why := not_made_by(existing, token):
        raise taken("PersistentVolumeClaim", f"{namespace}/{name}", why)


def create_pv(core: Any, manifest: dict[str, Any], progress: Callable[[str], None] = print) -> bool:
    """Create the PV; on 409 accept an existing one only if this run made it, for the same file system.

    Returns True when this call created it.
    """
    from kubernetes.client.exceptions import ApiException

    name = manifest["metadata"]["name"]
    try:
        core.create_persistent_volume(manifest)
        progress(f"k8s: created PersistentVolume {name}")
        return True
    except ApiException as exc:
        if _status(exc) != 409:
            raise
    existing = core.read_persistent_volume(name)
    if why := not_made_by(existing, _token(manifest)):
        raise taken("PersistentVolume", name, why)
    handle = existing.spec.csi.volume_handle if existing.spec and existing.spec.csi else None
    if handle != manifest["spec"]["csi"]["volumeHandle"]:
        raise RuntimeError(f"PersistentVolume {name} already exists for another volume ({handle}); pick another name")
    progress(f"k8s: PersistentVolume {name} already exists for {handle} (an earlier attempt)")
    return False


def create_pvc(core: Any, manifest: dict[str, Any], progress: Callable[[str], None] = print) -> bool:
    """Create the PVC; on 409 accept an existing one only if this run made it, for the same volume.

    Returns True when this call created it.
    """
    from kubernetes.client.exceptions import ApiException

    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        core.create_namespaced_persistent_volume_claim(namespace, manifest)
        progress(f"k8s: created PersistentVolumeClaim {namespace}/{name}")
        return True
    except ApiException as exc:
        if _status(exc) != 409:
            raise
    existing = core.read_namespaced_persistent_volume_claim(name, namespace)
    if why := not_made_by(existing, _token(manifest)):
        raise taken("PersistentVolumeClaim", f"{namespace}/{name}", why)
    if existing.spec.volume_name != manifest["spec"]["volumeName"]:
        raise RuntimeError(
            f"PersistentVolumeClaim {namespace}/{name} already exists for volume {existing.spec.volume_name!r}; "
            "pick another name"
        )
    progress(f"k8s: PersistentVolumeClaim {namespace}/{name} already exists (an earlier attempt)")
    return False


def wait_bound(core: Any, name: str, namespace: str, *, timeout_s: float, poll_s: float = 2.0,
               progress: Callable[[str], None] = print) -> None:
    start = time.monotonic()
    while True:
        phase = core.read_namespaced_persistent_volume_claim(name, namespace).status.phase
        if phase == "Bound":
            progress(f"k8s: PersistentVolumeClaim {namespace}/{name} is Bound")
            return
        if phase == "Lost":
            raise RuntimeError(f"PersistentVolumeClaim {namespace}/{name} is Lost: its volume is gone")
        if time.monotonic() - start + poll_s > timeout_s:
            raise TimeoutError(f"PersistentVolumeClaim {namespace}/{name} still {phase} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def read_pvc(core: Any, name: str, namespace: str) -> Any:
    """The user's existing claim; a clear error when it is missing."""
    from kubernetes.client.exceptions import ApiException

    try:
        return core.read_namespaced_persistent_volume_claim(name, namespace)
    except ApiException as exc:
        if _status(exc) == 404:
            raise ValueError(f"PersistentVolumeClaim {namespace}/{name} does not exist: create it first") from exc
        raise


def _delete_options(uid: str) -> Any:
    """Delete only the object read (its uid): not one made under the same name since."""
    from kubernetes import client

    return client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)) if uid else None


def _delete(what: str, call: Callable[..., Any], *, uid: str, progress: Callable[[str], None]) -> str:
    from kubernetes.client.exceptions import ApiException

    try:
        call(body=_delete_options(uid))
    except ApiException as exc:
        if _status(exc) == 404:
            progress(f"k8s: {what} is already gone")
            return "gone"
        if _status(exc) == 409 and uid:  # the uid precondition failed: the object read is gone
            progress(f"k8s: leaving {what} alone: it was deleted and made again since it was read")
            return "kept"
        raise
    progress(f"k8s: deleted {what}")
    return "deleted"


def delete_pvc(core: Any, name: str, namespace: str, progress: Callable[[str], None] = print, *,
               uid: str = "") -> str:
    """Delete the claim (``uid``: only that object); ``deleted``, ``gone`` or ``kept``."""
    return _delete(f"PersistentVolumeClaim {namespace}/{name}",
                   lambda body: core.delete_namespaced_persistent_volume_claim(name, namespace, body=body),
                   uid=uid, progress=progress)


def delete_pv(core: Any, name: str, progress: Callable[[str], None] = print, *, uid: str = "") -> str:
    """Delete the volume (``uid``: only that object); ``deleted``, ``gone`` or ``kept``."""
    return _delete(f"PersistentVolume {name}", lambda body: core.delete_persistent_volume(name, body=body),
                   uid=uid, progress=progress)


def _delete_of_run(what: str, read: Callable[[], Any], delete: Callable[[str], str], run_id: str,
                   progress: Callable[[str], None]) -> str:
    from kubernetes.client.exceptions import ApiException

    try:
        existing = read()
    except ApiException as exc:
        if _status(exc) == 404:
            progress(f"k8s: {what} is already gone")
            return "gone"
        raise
    if why := not_made_by(existing, fsx.request_token(run_id)):
        progress(f"k8s: leaving {what} alone: {why}, not this run ({run_id})")
        return "kept"
    return delete(existing.metadata.uid or "")


def delete_pvc_of_run(core: Any, name: str, namespace: str, run_id: str,
                      progress: Callable[[str], None] = print) -> str:
    """Delete the claim only if ``run_id`` made it (:func:`run_marks`); ``deleted``, ``gone`` or ``kept``."""
    return _delete_of_run(f"PersistentVolumeClaim {namespace}/{name}",
                          lambda: core.read_namespaced_persistent_volume_claim(name, namespace),
                          lambda uid: delete_pvc(core, name, namespace, progress, uid=uid), run_id, progress)


def delete_pv_of_run(core: Any, name: str, run_id: str, progress: Callable[[str], None] = print) -> str:
    """Delete the volume only if ``run_id`` made it (:func:`run_marks`); ``deleted``, ``gone`` or ``kept``."""
    return _delete_of_run(f"PersistentVolume {name}", lambda: core.read_persistent_volume(name),
                          lambda uid: delete_pv(core, name, progress, uid=uid), run_id, progress)
