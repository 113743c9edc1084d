"""Provision a run's storage: a local directory, an existing claim, or FSx for Lustre + PV/PVC.

Everything is validated before the first call. For ``fsx``, anything this call created is
deleted again if a later step fails (timeout, FAILED file system, PV refused), so a failed
provisioning leaves nothing billing; the exit handler's teardown covers the rest of the run.
The PV and PVC carry the run's mark (:func:`volumes.run_marks`), and a claim name that exists
without this run's mark is refused before anything is created: teardown deletes only marked objects.
"""

from __future__ import annotations

import inspect
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient_training.launch import k8s_names
from resilient_training.run.storage_ref import BACKENDS, StorageRef
from resilient_training.storage import fsx, volumes


def volume_names(run_id: str, pvc_name: str = "") -> tuple[str, str]:
    """``(pv, pvc)`` names of a run's FSx volume: derived from the run id so teardown finds them
    from the run id alone (a KFP exit task cannot take another task's output).
    """
    base = k8s_names.name_for_run("rt", run_id)
    return base + "-pv", pvc_name or base + "-data"


@dataclass(frozen=True, kw_only=True)
class ProvisionRequest:
    """What ``provision_storage`` was asked for; construction validates every field."""

    backend: str
    run_id: str
    namespace: str = "default"
    mount_path: str = "/mnt/run"
    run_subdir: str = ""
    """Run directory under the mount (pvc/fsx) or under ``local_root``; default ``runs/<run id>``."""
    local_root: str = "runs"
    pvc_name: str = ""
    """pvc: the existing claim; fsx: name of the claim to create (default derived from the run id),
    refused when it exists and another run (or no run) made it."""
    existing_fsx_id: str = ""
    """fsx: reuse this file system instead of creating one (never deleted by teardown)."""
    fsx: fsx.FsxRequest | None = None
    """fsx: the file system to create (when not reusing)."""
    fsx_timeout_s: float = 1800.0
    fsx_poll_s: float = 30.0
    bind_timeout_s: float = 300.0
    bind_poll_s: float = 2.0
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"storage backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.run_id:
            raise ValueError("run_id must not be empty: names and idempotency tokens are derived from it")
        sub = self.run_subdir or self.default_subdir
        if sub.startswith("/") or ".." in Path(sub).parts:
            raise ValueError(f"run_subdir {sub!r} must be a relative path without '..'")
        for name in ("fsx_timeout_s", "fsx_poll_s", "bind_timeout_s", "bind_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.fsx_poll_s > self.fsx_timeout_s:
            raise ValueError(f"fsx_poll_s ({self.fsx_poll_s}) exceeds fsx_timeout_s ({self.fsx_timeout_s})")
        if self.backend == "local":
            return
        k8s_names.check_dns1123_label(self.namespace, "namespace")
        k8s_names.check_mount_path(self.mount_path, "mount_path")
        if self.backend == "pvc":
            if not self.pvc_name:
                raise ValueError("storage 'pvc' needs pvc_name: the existing claim to mount")
            k8s_names.check_dns1123_subdomain(self.pvc_name, "pvc_name")
            if self.fsx or self.existing_fsx_id:
                raise ValueError("fsx settings were given but storage is 'pvc'")
            return
        if self.pvc_name:
            k8s_names.check_dns1123_subdomain(self.pvc_name, "pvc_name")
        if self.existing_fsx_id:
            fsx.check_file_system_id(self.existing_fsx_id)
            if self.fsx is not None:
                raise ValueError("give either existing_fsx_id (reuse) or fsx settings (create), not both")
        elif self.fsx is None:
            raise ValueError("storage 'fsx' needs either existing_fsx_id or the file system to create (subnet, groups)")
        elif self.fsx.run_id != self.run_id:
            raise ValueError("the fsx request belongs to another run id")
        for key, value in self.labels.items():
            k8s_names.check_label_key(key, "label key")
            k8s_names.check_label_value(value, f"label value for {key!r}")

    @property
    def default_subdir(self) -> str:
        return "runs/" + (re.sub(r"[^A-Za-z0-9._-]+", "-", self.run_id).strip("-.") or "run")

    @property
    def volume_names(self) -> tuple[str, str]:
        """``(pv, pvc)`` names this run creates for ``fsx``."""
        return volume_names(self.run_id, self.pvc_name)

    def run_dir(self, root: str) -> str:
        return posixpath.join(root.rstrip("/") or "/", self.run_subdir or self.default_subdir)


def provision(
    request: ProvisionRequest,
    *,
    core_api: Any = None,
    fsx_client: Any = None,
    progress: Callable[[str], None] = print,
) -> StorageRef:
    """Make the storage exist and return its reference (see module docstring)."""
    if request.backend == "local":
        root = Path(request.local_root).expanduser().resolve()
        run_dir = Path(request.run_dir(str(root)))
        run_dir.mkdir(parents=True, exist_ok=True)
        progress(f"local: run directory {run_dir}")
        return StorageRef(backend="local", run_dir=str(run_dir))
    if request.backend == "pvc":
        claim = volumes.read_pvc(core_api, request.pvc_name, request.namespace)
        modes = claim.spec.access_modes or []
        if "ReadWriteMany" not in modes:
            progress(f"warning: claim {request.pvc_name} is {modes}, not ReadWriteMany: pods on other nodes cannot mount it")
        progress(f"pvc: using existing claim {request.namespace}/{request.pvc_name} ({claim.status.phase})")
        return StorageRef(backend="pvc", run_dir=request.run_dir(request.mount_path), mount_path=request.mount_path,
                          namespace=request.namespace, pvc_name=request.pvc_name)
    return _provision_fsx(request, core_api=core_api, fsx_client=fsx_client, progress=progress)


def _provision_fsx(request: ProvisionRequest, *, core_api: Any, fsx_client: Any,
                   progress: Callable[[str], None]) -> StorageRef:
    created: dict[str, Any] = {}
    pv_name, pvc_name = request.volume_names
    run_labels, annotations = volumes.run_marks(request.run_id)
    # Ours last: a caller's label cannot unset the policy's one, nor the run's mark teardown reads.
    labels = {**request.labels, **run_labels, **volumes.LABELS}
    # A claim name taken by another run (a fixed pvc_name in overlapping runs) fails the run here,
    # before a file system is made for nothing; create_pvc checks again (a claim made meanwhile).
    volumes.check_claim_free(core_api, pvc_name, request.namespace, run_labels[volumes.RUN_TOKEN_LABEL])
    try:
        if request.existing_fsx_id:
            progress(f"fsx: reusing existing file system {request.existing_fsx_id} (teardown will not delete it)")
            fs_id = request.existing_fsx_id
        else:
            fs_id = fsx.create(fsx_client, request.fsx, progress)["FileSystemId"]
            created["fsx"] = fs_id  # owned by the run from here on: clean it up if anything below fails
        fs = fsx.wait_available(fsx_client, fs_id, timeout_s=request.fsx_timeout_s, poll_s=request.fsx_poll_s,
                                progress=progress)
        if request.fsx is not None and request.fsx.links_by_association:
            fsx.link_data_repository(fsx_client, fs_id, request.fsx, timeout_s=request.fsx_timeout_s,
                                     poll_s=request.fsx_poll_s, progress=progress)
        dns_name, mount_name = fsx.mount_info(fs)
        capacity = int(fs.get("StorageCapacity") or (request.fsx.capacity_gib if request.fsx else 1200))
        if volumes.create_pv(core_api, volumes.pv_manifest(
                name=pv_name, claim=pvc_name, namespace=request.namespace, fs_id=fs_id, dns_name=dns_name,
                mount_name=mount_name, capacity_gib=capacity, labels=labels, annotations=annotations), progress):
            created["pv"] = pv_name
        if volumes.create_pvc(core_api, volumes.pvc_manifest(
                name=pvc_name, namespace=request.namespace, volume=pv_name, capacity_gib=capacity, labels=labels,
                annotations=annotations), progress):
            created["pvc"] = pvc_name
        volumes.wait_bound(core_api, pvc_name, request.namespace, timeout_s=request.bind_timeout_s,
                           poll_s=request.bind_poll_s, progress=progress)
    except BaseException:
        progress(f"provisioning failed; removing what it created: {created or 'nothing'}")
        _undo(created, request, core_api=core_api, fsx_client=fsx_client, progress=progress)
        raise
    # A PV/PVC found from an earlier attempt of this run (its run mark) is the run's too.
    return StorageRef(
        backend="fsx", run_dir=request.run_dir(request.mount_path), mount_path=request.mount_path,
        namespace=request.namespace, pvc_name=pvc_name, pv_name=pv_name, fsx_id=fs_id, fsx_dns_name=dns_name,
        fsx_mount_name=mount_name, region=(request.fsx.region if request.fsx else "") or _client_region(fsx_client),
        created_pvc=True, created_pv=True,
        created_fsx=not request.existing_fsx_id,
    )


def _client_region(client: Any) -> str:
    return getattr(getattr(client, "meta", None), "region_name", "") or ""


def _undo(created: dict[str, Any], request: ProvisionRequest, *, core_api: Any, fsx_client: Any,
          progress: Callable[[str], None]) -> None:
    # Best effort, every step tried: the original error is what the caller must see.
    steps = []
    if "pvc" in created:
        steps.append(lambda: volumes.delete_pvc(core_api, created["pvc"], request.namespace, progress))
    if "pv" in created:
        steps.append(lambda: volumes.delete_pv(core_api, created["pv"], progress))
    if "fsx" in created:
        steps.append(lambda: fsx.delete(fsx_client, created["fsx"], token=request.fsx.token, progress=progress))
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported, then the next step still runs
            progress(f"cleanup step failed: {exc}")


def provision_request(
    *,
    backend: str,
    run_id: str,
    namespace: str = "default",
    mount_path: str = "/mnt/run",
    run_subdir: str = "",
    local_root: str = "runs",
    pvc_name: str = "",
    fsx_file_system_id: str = "",
    fsx_subnet_id: str = "",
    fsx_security_group_ids: str | list[str] = "",
    fsx_capacity_gib: int = 1200,
    fsx_deployment_type: str = "SCRATCH_2",
    fsx_per_unit_throughput: int = 0,
    fsx_lustre_version: str = "2.15",
    fsx_import_path: str = "",
    fsx_export_path: str = "",
    fsx_tags: dict[str, str] | None = None,
    region: str = "",
    fsx_timeout_s: float = 1800.0,
    fsx_poll_s: float = 30.0,
    bind_timeout_s: float = 300.0,
) -> ProvisionRequest:
    """The validated request for flat parameters; no client is made (a pipeline's arguments are checked with it
    before a run is created).

    Raises:
        ValueError: naming the parameter that the request refuses.

    """
    creating_fsx = backend == "fsx" and not fsx_file_system_id
    request = ProvisionRequest(
        backend=backend, run_id=run_id, namespace=namespace, mount_path=mount_path, run_subdir=run_subdir,
        local_root=local_root, pvc_name=pvc_name, existing_fsx_id=fsx_file_system_id,
        fsx=fsx.FsxRequest(
            run_id=run_id, region=region, subnet_id=fsx_subnet_id,
            security_group_ids=_split(fsx_security_group_ids), capacity_gib=fsx_capacity_gib,
            deployment_type=fsx_deployment_type, per_unit_throughput=fsx_per_unit_throughput,
            lustre_version=fsx_lustre_version, import_path=fsx_import_path, export_path=fsx_export_path,
            tags=dict(fsx_tags or {}),
        ) if creating_fsx else None,
        fsx_timeout_s=fsx_timeout_s, fsx_poll_s=fsx_poll_s, bind_timeout_s=bind_timeout_s,
    )
    # Settings given that nothing would read: (a stranger trial's fsx_capacity_gib with storage=pvc,
    # and fsx_deployment_type=BOGUS with a reused file system, went unused without a word).
    given = [name for name, value in locals().items() if name in _FSX_ONLY  # (the arguments, by name)
             and value and value != _FSX_ONLY[name]]  # "", [], None and 0 are "not given" too
    if backend != "fsx" and given:
        raise ValueError(f"{given[0]} is for storage=fsx, and storage {backend!r} would ignore it: leave it at its "
                         "default, or use storage=fsx")
    if backend == "fsx" and fsx_file_system_id and (unread := [name for name in given if name in _NEW_FSX_ONLY]):
        raise ValueError(f"fsx_file_system_id reuses a file system: {unread[0]} is for a new one and would be "
                         "ignored; leave it at its default")
    return request


# provision_request's settings that only a new or reused FSx file system reads, with their defaults
# (the timeouts are the provision step's own, for any backend).
_FSX_ONLY = {name: parameter.default for name, parameter in inspect.signature(provision_request).parameters.items()
             if name.startswith("fsx_") and name not in ("fsx_timeout_s", "fsx_poll_s")}


# Of those, what only a file system made for the run reads (a reused one keeps its own; its tags too).
_NEW_FSX_ONLY = {name for name in _FSX_ONLY if name != "fsx_file_system_id"}


def planned_ref(request: ProvisionRequest) -> StorageRef:
    """The reference :func:`provision` would return for ``request`` (pvc and fsx: its claim, mount and run
    directory; nothing is looked up or created), for checks made before the run.
    """
    if request.backend == "local":
        return StorageRef(backend="local", run_dir=request.run_dir(request.local_root))
    pv_name, pvc_name = request.volume_names
    return StorageRef(backend=request.backend, run_dir=request.run_dir(request.mount_path),
                      mount_path=request.mount_path, namespace=request.namespace, pvc_name=pvc_name,
                      pv_name=pv_name if request.backend == "fsx" else "",
                      # a file system to be created has no id yet: this stands for it
                      fsx_id=(request.existing_fsx_id or "fs-to-be-created") if request.backend == "fsx" else "")


def _split(values: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(values, str):
        return tuple(v.strip() for v in values.split(",") if v.strip())
    return tuple(values)


def provision_storage(
    *,
    backend: str,
    namespace: str = "",
    core_api: Any = None,
    fsx_client: Any = None,
    progress: Callable[[str], None] = print,
    **params: Any,
) -> StorageRef:
    """Flat parameters (what the KFP component passes; those of :func:`provision_request`) ->
    validated request -> :func:`provision`. ``namespace`` empty: the pod's or kubeconfig's.

    Clients are made only after validation, and only those the backend needs.
    """
    if backend != "local" and not namespace:
        from resilient_training.launch import kube_client

        namespace = kube_client.default_namespace()
    request = provision_request(backend=backend, namespace=namespace or "default", **params)
    if backend != "local" and core_api is None:
        from kubernetes import client

        from resilient_training.launch import kube_client

        core_api = client.CoreV1Api(client.ApiClient(kube_client.configuration()))
    if backend == "fsx" and fsx_client is None:
        import boto3

        fsx_client = boto3.client("fsx", region_name=params.get("region") or None)
    return provision(request, core_api=core_api, fsx_client=fsx_client, progress=progress)
