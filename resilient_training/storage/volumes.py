"""Static PersistentVolume + PersistentVolumeClaim for an FSx for Lustre file system (FSx CSI driver).

The volume is pre-bound to the claim (``claimRef`` on the PV, ``volumeName`` on the PVC) so no
other claim can take it, uses ``storageClassName: ""`` so no provisioner steps in, and
``Retain`` so deleting the PV object never deletes the file system behind Kubernetes' back:
the file system's life is the run's business (teardown), not the cluster's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

CSI_DRIVER = "fsx.csi.aws.com"
# On every PV/PVC provision_storage creates. manifests/rbac/pv-admission-policy.yaml lets the
# launcher create or delete only PVs carrying the managed-by label: keep the two in step.
LABELS = {"app.kubernetes.io/name": "resilient-training", "app.kubernetes.io/managed-by": "resilient-training"}


def pv_manifest(*, name: str, claim: str, namespace: str, fs_id: str, dns_name: str, mount_name: str,
                capacity_gib: int, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": dict(labels)},
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


def pvc_manifest(*, name: str, namespace: str, volume: str, capacity_gib: int, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": volume,
            "resources": {"requests": {"storage": f"{capacity_gib}Gi"}},
        },
    }


def _status(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


def create_pv(core: Any, manifest: dict[str, Any], progress: Callable[[str], None] = print) -> bool:
    """Create the PV; on 409 accept an existing one only if it points at the same file system.

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
    handle = existing.spec.csi.volume_handle if existing.spec and existing.spec.csi else None
    if handle != manifest["spec"]["csi"]["volumeHandle"]:
        raise RuntimeError(f"PersistentVolume {name} already exists for another volume ({handle}); pick another name")
    progress(f"k8s: PersistentVolume {name} already exists for {handle} (an earlier attempt)")
    return False


def create_pvc(core: Any, manifest: dict[str, Any], progress: Callable[[str], None] = print) -> bool:
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


def delete_pvc(core: Any, name: str, namespace: str, progress: Callable[[str], None] = print) -> str:
    from kubernetes.client.exceptions import ApiException

    try:
        core.delete_namespaced_persistent_volume_claim(name, namespace)
    except ApiException as exc:
        if _status(exc) == 404:
            progress(f"k8s: PersistentVolumeClaim {namespace}/{name} is already gone")
            return "gone"
        raise
    progress(f"k8s: deleted PersistentVolumeClaim {namespace}/{name}")
    return "deleted"


def delete_pv(core: Any, name: str, progress: Callable[[str], None] = print) -> str:
    from kubernetes.client.exceptions import ApiException

    try:
        core.delete_persistent_volume(name)
    except ApiException as exc:
        if _status(exc) == 404:
            progress(f"k8s: PersistentVolume {name} is already gone")
            return "gone"
        raise
    progress(f"k8s: deleted PersistentVolume {name}")
    return "deleted"
