"""Amazon FSx for Lustre with boto3: create (idempotent per run), wait, reuse, delete.

Idempotency has two layers. The create call carries a ``ClientRequestToken`` derived from the
run id, so a retried request returns the same file system; and the file system is tagged with
that token, so a retried *step* (a new process, hours later, when AWS no longer remembers the
token) finds it by tag instead of creating a second one.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEPLOYMENT_TYPES = ("SCRATCH_2", "PERSISTENT_2")
PERSISTENT_2_THROUGHPUTS = (125, 250, 500, 1000)  # MB/s per TiB
LUSTRE_VERSIONS = ("2.12", "2.15")
# Tags on everything this module creates (file system, data repository association), set in the
# create call itself: manifests/iam/fsx-provisioner-policy.json allows creation only with them,
# tagging only during creation (fsx:CreateAction), and deletion only of what carries them.
TOKEN_TAG = "resilient-training.io/run-token"
"""Each run's own value (``request_token``): delete() refuses a file system without the run's value."""
TOKEN_PREFIX = "rt-"
RUN_TAG = "resilient-training.io/run-id"
MANAGED_TAG = "resilient-training.io/managed-by"
MANAGED_VALUE = "resilient-training"
FAILED_STATES = ("FAILED", "MISCONFIGURED", "MISCONFIGURED_UNAVAILABLE", "DELETING")
_SUBNET = re.compile(r"subnet-[0-9a-f]{8,17}")
_SG = re.compile(r"sg-[0-9a-f]{8,17}")
_FS_ID = re.compile(r"fs-[0-9a-f]{8,21}")
_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9]")
_TAG_TEXT = re.compile(r"[\w .:/=+\-@]*")  # AWS: letters, digits, spaces (not newlines), _.:/=+-@
_S3_PATH = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/.*)?")


def check_region(region: str) -> None:
    """An AWS region name, or empty (the client's default)."""
    if region and not _REGION.fullmatch(region):
        raise ValueError(f"region {region!r} is not an AWS region name (e.g. us-east-1)")


class FsxError(RuntimeError):
    """The file system reached a state it cannot leave by waiting (FAILED, MISCONFIGURED, ...)."""


def request_token(run_id: str) -> str:
    """The run's idempotency token: stable, at most 63 characters of ``[A-Za-z0-9_.-]``."""
    return TOKEN_PREFIX + hashlib.sha256(run_id.encode()).hexdigest()[:40]


def check_capacity(deployment_type: str, capacity_gib: int) -> None:
    if not isinstance(capacity_gib, int) or isinstance(capacity_gib, bool):
        raise ValueError(f"capacity_gib must be an integer number of GiB, got {capacity_gib!r}")
    # SCRATCH_2 and PERSISTENT_2 (SSD) both take 1200, 2400, then steps of 2400 GiB.
    if capacity_gib not in (1200, 2400) and (capacity_gib <= 0 or capacity_gib % 2400):
        raise ValueError(
            f"capacity_gib {capacity_gib} is not valid for {deployment_type}: use 1200, 2400 or a multiple of 2400 GiB"
        )


@dataclass(frozen=True, kw_only=True)
class FsxRequest:
    """A new FSx for Lustre file system for one run; validated on construction, before any call."""

    run_id: str
    subnet_id: str
    security_group_ids: tuple[str, ...]
    region: str = ""
    capacity_gib: int = 1200
    deployment_type: str = "SCRATCH_2"
    per_unit_throughput: int = 0
    """PERSISTENT_2 only: MB/s per TiB, one of 125, 250, 500, 1000."""
    lustre_version: str = "2.15"
    data_compression: str = "NONE"
    import_path: str = ""
    """``s3://bucket[/prefix]`` to lazy-load from: SCRATCH_2 import path, PERSISTENT_2 data repository association."""
    export_path: str = ""
    """SCRATCH_2: export path in the import bucket. PERSISTENT_2: equal to import_path to export changes back."""
    tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("run_id must not be empty: the idempotency token is derived from it")
        check_region(self.region)
        if self.deployment_type not in DEPLOYMENT_TYPES:
            raise ValueError(f"deployment_type must be one of {', '.join(DEPLOYMENT_TYPES)}, got {self.deployment_type!r}")
        check_capacity(self.deployment_type, self.capacity_gib)
        if self.deployment_type == "PERSISTENT_2":
            if self.per_unit_throughput not in PERSISTENT_2_THROUGHPUTS:
                raise ValueError(
                    f"PERSISTENT_2 needs per_unit_throughput in {PERSISTENT_2_THROUGHPUTS} MB/s/TiB, "
                    f"got {self.per_unit_throughput}"
                )
            if self.export_path and self.export_path != self.import_path:
                raise ValueError(
                    "PERSISTENT_2 links one S3 path both ways (a data repository association): "
                    "export_path must be empty or equal to import_path"
                )
        elif self.per_unit_throughput:
            raise ValueError(f"per_unit_throughput applies to PERSISTENT_2 only, not {self.deployment_type}")
        if self.lustre_version not in LUSTRE_VERSIONS:
            raise ValueError(f"lustre_version must be one of {', '.join(LUSTRE_VERSIONS)}, got {self.lustre_version!r}")
        if self.data_compression not in ("NONE", "LZ4"):
            raise ValueError(f"data_compression must be NONE or LZ4, got {self.data_compression!r}")
        if not _SUBNET.fullmatch(self.subnet_id or ""):
            raise ValueError(f"subnet_id {self.subnet_id!r} is not a subnet id (subnet-0123456789abcdef0)")
        if not self.security_group_ids:
            raise ValueError("at least one security group is required (it must allow Lustre traffic, TCP 988)")
        if len(self.security_group_ids) > 50:
            raise ValueError(f"at most 50 security groups, got {len(self.security_group_ids)}")
        for sg in self.security_group_ids:
            if not _SG.fullmatch(sg):
                raise ValueError(f"security group {sg!r} is not a security group id (sg-0123456789abcdef0)")
        self._check_s3()
        user_tags = {k: v for k, v in self.tags.items()}
        if len(user_tags) + 3 > 50:
            raise ValueError(f"at most 47 tags (3 are ours), got {len(user_tags)}")
        for key, value in user_tags.items():
            if not 1 <= len(key) <= 128 or not _TAG_TEXT.fullmatch(key) or key.lower().startswith("aws:"):
                raise ValueError(f"tag key {key!r} is invalid: 1-128 of letters, digits, spaces, _.:/=+-@, no 'aws:' prefix")
            if len(value) > 256 or not _TAG_TEXT.fullmatch(value):
                raise ValueError(f"tag value for {key!r} is invalid: at most 256 of letters, digits, spaces, _.:/=+-@")
            if key.startswith("resilient-training.io/"):
                raise ValueError(f"tag key {key!r} uses the reserved prefix resilient-training.io/")

    def _check_s3(self) -> None:
        import_match = _S3_PATH.fullmatch(self.import_path) if self.import_path else None
        if self.import_path and not import_match:
            raise ValueError(f"import_path {self.import_path!r} must be s3://bucket[/prefix]")
        if self.export_path:
            export_match = _S3_PATH.fullmatch(self.export_path)
            if not export_match:
                raise ValueError(f"export_path {self.export_path!r} must be s3://bucket[/prefix]")
            if not import_match:
                raise ValueError("export_path needs an import_path in the same bucket")
            if export_match.group(1) != import_match.group(1):
                raise ValueError(
                    f"export_path bucket {export_match.group(1)!r} differs from the import bucket {import_match.group(1)!r}"
                )

    @property
    def token(self) -> str:
        return request_token(self.run_id)

    @property
    def ownership_tags(self) -> dict[str, str]:
        """The run's tags on what it creates (the IAM policy's conditions name these keys)."""
        return {TOKEN_TAG: self.token, RUN_TAG: self.run_id[:256], MANAGED_TAG: MANAGED_VALUE}

    @property
    def links_by_association(self) -> bool:
        """PERSISTENT_2 links S3 through a data repository association made after creation."""
        return self.deployment_type == "PERSISTENT_2" and bool(self.import_path)

    def create_arguments(self) -> dict[str, Any]:
        lustre: dict[str, Any] = {"DeploymentType": self.deployment_type, "DataCompressionType": self.data_compression}
        if self.per_unit_throughput:
            lustre["PerUnitStorageThroughput"] = self.per_unit_throughput
        if self.links_by_association:
            pass  # linked after creation (link_data_repository)
        elif self.import_path:
            lustre["ImportPath"] = self.import_path
            lustre["AutoImportPolicy"] = "NEW_CHANGED_DELETED"
            if self.export_path:
                lustre["ExportPath"] = self.export_path
        tags = {**self.tags, **self.ownership_tags}
        return {
            "ClientRequestToken": self.token,
            "FileSystemType": "LUSTRE",
            "FileSystemTypeVersion": self.lustre_version,
            "StorageCapacity": self.capacity_gib,
            "StorageType": "SSD",
            "SubnetIds": [self.subnet_id],
            "SecurityGroupIds": list(self.security_group_ids),
            "LustreConfiguration": lustre,
            "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
        }


def check_file_system_id(fs_id: str) -> None:
    if not _FS_ID.fullmatch(fs_id or ""):
        raise ValueError(f"file system id {fs_id!r} is not an FSx id (fs-0123456789abcdef0)")


def _tags(fs: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in fs.get("Tags", [])}


def find_by_token(client: Any, token: str) -> dict[str, Any] | None:
    """The run's file system, if an earlier attempt created it (and it is not being deleted)."""
    for page in client.get_paginator("describe_file_systems").paginate():
        for fs in page.get("FileSystems", []):
            if _tags(fs).get(TOKEN_TAG) == token and fs.get("Lifecycle") != "DELETING":
                return fs
    return None


def create(client: Any, request: FsxRequest, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Create the run's file system, or return the one an earlier attempt of this run created."""
    existing = find_by_token(client, request.token)
    if existing is not None:
        progress(f"fsx: reusing {existing['FileSystemId']} created earlier by this run (token {request.token})")
        return existing
    fs = client.create_file_system(**request.create_arguments())["FileSystem"]
    progress(f"fsx: creating {fs['FileSystemId']} ({request.deployment_type}, {request.capacity_gib} GiB)")
    return fs


def describe(client: Any, fs_id: str) -> dict[str, Any]:
    systems = client.describe_file_systems(FileSystemIds=[fs_id])["FileSystems"]
    if not systems:
        raise FsxError(f"file system {fs_id} not found")
    return systems[0]


def wait_available(
    client: Any,
    fs_id: str,
    *,
    timeout_s: float,
    poll_s: float = 30.0,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Poll until AVAILABLE; raise :class:`FsxError` on a failed state, ``TimeoutError`` after ``timeout_s``."""
    start = time.monotonic()
    last = None
    while True:
        fs = describe(client, fs_id)
        state = fs.get("Lifecycle", "UNKNOWN")
        elapsed = time.monotonic() - start
        if state != last:
            progress(f"fsx: {fs_id} is {state} after {elapsed:.0f} s")
            last = state
        if state == "AVAILABLE":
            return fs
        if state in FAILED_STATES:
            reason = (fs.get("FailureDetails") or {}).get("Message", "no details given")
            raise FsxError(f"file system {fs_id} is {state}: {reason}")
        if elapsed + poll_s > timeout_s:
            raise TimeoutError(f"file system {fs_id} still {state} after {elapsed:.0f} s (timeout {timeout_s:.0f} s)")
        time.sleep(poll_s)


def link_data_repository(
    client: Any,
    fs_id: str,
    request: FsxRequest,
    *,
    timeout_s: float,
    poll_s: float = 30.0,
    progress: Callable[[str], None] = print,
) -> str:
    """Associate ``request.import_path`` with the file system root (PERSISTENT_2); idempotent; returns its id.

    Files appear lazily (metadata imported at creation, contents on first read); new, changed and
    deleted S3 objects are imported automatically, and exported back when ``export_path`` is set.
    """
    events = ["NEW", "CHANGED", "DELETED"]
    existing = client.describe_data_repository_associations(
        Filters=[{"Name": "file-system-id", "Values": [fs_id]}])["Associations"]
    match = [a for a in existing if a.get("DataRepositoryPath") == request.import_path
             and a.get("Lifecycle") not in ("DELETING", "FAILED")]
    if match:
        association_id = match[0]["AssociationId"]
        progress(f"fsx: {request.import_path} is already linked to {fs_id} ({association_id})")
    else:
        s3: dict[str, Any] = {"AutoImportPolicy": {"Events": events}}
        if request.export_path:
            s3["AutoExportPolicy"] = {"Events": events}
        association_id = client.create_data_repository_association(
            FileSystemId=fs_id, FileSystemPath="/", DataRepositoryPath=request.import_path,
            BatchImportMetaDataOnCreate=True, S3=s3, ClientRequestToken=request.token,
            Tags=[{"Key": k, "Value": v} for k, v in request.ownership_tags.items()],
        )["Association"]["AssociationId"]
        progress(f"fsx: linking {request.import_path} to {fs_id} ({association_id})")
    start, last = time.monotonic(), None
    while True:
        (association,) = client.describe_data_repository_associations(AssociationIds=[association_id])["Associations"]
        state, elapsed = association.get("Lifecycle", "UNKNOWN"), time.monotonic() - start
        if state != last:
            progress(f"fsx: data repository association {association_id} is {state} after {elapsed:.0f} s")
            last = state
        if state == "AVAILABLE":
            return association_id
        if state in ("FAILED", "MISCONFIGURED", "DELETING"):
            reason = (association.get("FailureDetails") or {}).get("Message", "no details given")
            raise FsxError(f"data repository association {association_id} ({request.import_path}) is {state}: {reason}")
        if elapsed + poll_s > timeout_s:
            raise TimeoutError(f"data repository association {association_id} still {state} after {elapsed:.0f} s")
        time.sleep(poll_s)


def mount_info(fs: dict[str, Any]) -> tuple[str, str]:
    """``(dns_name, mount_name)`` for the CSI volume attributes."""
    lustre = fs.get("LustreConfiguration") or {}
    dns, mount = fs.get("DNSName", ""), lustre.get("MountName", "")
    if not dns or not mount:
        raise FsxError(f"file system {fs.get('FileSystemId')} reports no DNSName/MountName; is it a Lustre file system?")
    return dns, mount


def delete(client: Any, fs_id: str, *, token: str, settle_timeout_s: float = 1800.0, poll_s: float = 30.0,
           progress: Callable[[str], None] = print) -> str:
    """Delete a file system this run created; ``gone``/``deleting``/``deleted``. Safe to repeat.

    Refuses a file system that does not carry the run's token tag, so a reused file system is
    never deleted whatever the caller's bookkeeping says. If AWS refuses the delete while the file
    system is still CREATING or UPDATING (a run cancelled during provisioning), it is retried until
    the file system settles, up to ``settle_timeout_s``, so a cancelled run does not leave it behind.
    """
    from botocore.exceptions import ClientError

    start = time.monotonic()
    while True:
        try:
            fs = describe(client, fs_id)
        except (FsxError, client.exceptions.FileSystemNotFound):
            progress(f"fsx: {fs_id} is already gone")
            return "gone"
        if _tags(fs).get(TOKEN_TAG) != token:
            raise FsxError(f"refusing to delete {fs_id}: it was not created by this run (no {TOKEN_TAG}={token} tag)")
        state = fs.get("Lifecycle")
        if state == "DELETING":
            progress(f"fsx: {fs_id} is already being deleted")
            return "deleting"
        try:
            # Lustre takes no final backup by default (and cannot for scratch or S3-linked file systems).
            client.delete_file_system(FileSystemId=fs_id)
        except client.exceptions.FileSystemNotFound:
            progress(f"fsx: {fs_id} is already gone")
            return "gone"
        except ClientError as exc:
            if state not in ("CREATING", "UPDATING"):
                raise
            waited = time.monotonic() - start
            if waited + poll_s > settle_timeout_s:
                raise TimeoutError(f"file system {fs_id} is still {state} after {waited:.0f} s and cannot be "
                                   f"deleted yet ({exc}): delete it once it settles") from exc
            progress(f"fsx: {fs_id} is {state} and cannot be deleted yet; retrying ({waited:.0f} s)")
            time.sleep(poll_s)
            continue
        progress(f"fsx: deleting {fs_id}")
        return "deleted"
