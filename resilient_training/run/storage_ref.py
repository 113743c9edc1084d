"""The storage reference passed from ``provision_storage`` to ``launch_training`` and ``teardown_storage``.

One small record says where a run's files live and what this run created, so teardown deletes
exactly that (never a reused file system or a user's claim). Components pass it as a JSON string.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

BACKENDS = ("local", "pvc", "fsx")


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageRef:
    """Where a run's checkpoints and events live, and which objects this run owns."""

    backend: str
    """``local`` (a directory on this machine), ``pvc`` (an existing claim) or ``fsx``."""
    run_dir: str
    """The run directory as the training processes see it (inside the mount for pvc/fsx)."""
    mount_path: str = ""
    """Where the claim is mounted in pods (pvc/fsx); ``run_dir`` lies under it."""
    namespace: str = ""
    """Namespace of the claim (pvc/fsx)."""
    pvc_name: str = ""
    """PersistentVolumeClaim the pods mount (pvc/fsx)."""
    pv_name: str = ""
    """Static PersistentVolume bound to the claim (fsx)."""
    fsx_id: str = ""
    """FSx for Lustre file system id (fsx)."""
    fsx_dns_name: str = ""
    """DNS name of the file system (fsx)."""
    fsx_mount_name: str = ""
    """Lustre mount name of the file system (fsx)."""
    region: str = ""
    """AWS region of the file system (fsx)."""
    created_pvc: bool = False
    """This run created the claim, so teardown deletes it."""
    created_pv: bool = False
    """This run created the volume, so teardown deletes it."""
    created_fsx: bool = False
    """This run created the file system, so teardown may delete it (never a reused one)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"storage backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.run_dir:
            raise ValueError("storage ref needs a run_dir")
        if self.backend in ("pvc", "fsx") and not (self.pvc_name and self.namespace and self.mount_path):
            raise ValueError(f"a {self.backend} storage ref needs pvc_name, namespace and mount_path")
        if self.backend == "fsx" and not self.fsx_id:
            raise ValueError("an fsx storage ref needs fsx_id")
        if self.created_fsx and self.backend != "fsx":
            raise ValueError("created_fsx is only meaningful for the fsx backend")

    @property
    def shared(self) -> bool:
        """True when pods on different nodes see the same files (a claim)."""
        return self.backend in ("pvc", "fsx")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | dict) -> StorageRef:
        # kfp.local hands a JSON string output to a ParallelFor body already parsed.
        try:
            data = text if isinstance(text, dict) else json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"storage ref is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"storage ref must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"storage ref has unknown keys: {', '.join(unknown)}")
        missing = sorted(f.name for f in fields(cls) if f.name in ("backend", "run_dir") and f.name not in data)
        if missing:
            raise ValueError(f"storage ref misses {', '.join(missing)}")
        return cls(**data)
