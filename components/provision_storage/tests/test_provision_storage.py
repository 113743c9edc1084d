"""provision_storage end to end: real boto3 (moto / Stubber) and the real kubernetes client
against the in-test API server; bad inputs refused before any call; no FSx left after a failure."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import ANY, Stubber
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from moto import mock_aws

from resilient_training.run.storage_ref import StorageRef
from resilient_training.storage import fsx
from resilient_training.storage.provision import provision_storage
from resilient_training.storage.teardown import teardown
from tests.support import kube_api

FS_ID = "fs-0123456789abcdef0"
SUBNET = "subnet-0123456789abcdef0"
SG = "sg-0123456789abcdef0"
FSX_ARGS = dict(fsx_subnet_id=SUBNET, fsx_security_group_ids=SG, region="us-east-1")


@pytest.fixture
def kube():
    with kube_api.running() as server:
        yield server, k8s.CoreV1Api(k8s.ApiClient(server.configuration()))


@pytest.fixture
def stubbed():
    client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def _fs(state, run_id="run-1"):
    return {"FileSystemId": FS_ID, "FileSystemType": "LUSTRE", "Lifecycle": state, "StorageCapacity": 2400,
            "DNSName": f"{FS_ID}.fsx.us-east-1.amazonaws.com",
            "LustreConfiguration": {"MountName": "x7k2mbmv", "DeploymentType": "SCRATCH_2"},
            "Tags": [{"Key": fsx.TOKEN_TAG, "Value": fsx.request_token(run_id)}]}


def _expect_create(stubber, states=("CREATING", "AVAILABLE")):
    stubber.add_response("describe_file_systems", {"FileSystems": []}, {})
    stubber.add_response("create_file_system", {"FileSystem": _fs("CREATING")},
                         {"ClientRequestToken": fsx.request_token("run-1"), "FileSystemType": "LUSTRE",
                          "FileSystemTypeVersion": "2.15", "StorageCapacity": 2400, "StorageType": "SSD",
                          "SubnetIds": [SUBNET], "SecurityGroupIds": [SG], "LustreConfiguration": ANY, "Tags": ANY})
    for state in states:
        stubber.add_response("describe_file_systems", {"FileSystems": [_fs(state)]}, {"FileSystemIds": [FS_ID]})


def test_fsx_creates_file_system_pv_and_pvc_then_teardown_removes_all_twice(kube, stubbed):
    server, core = kube
    client, stubber = stubbed
    _expect_create(stubber)
    messages = []
    ref = provision_storage(backend="fsx", run_id="run-1", namespace="team-a", fsx_capacity_gib=2400, fsx_poll_s=0.01,
                            bind_timeout_s=5, core_api=core, fsx_client=client, progress=messages.append, **FSX_ARGS)
    assert ref.fsx_id == FS_ID and ref.created_fsx and ref.created_pv and ref.created_pvc
    assert ref.run_dir == "/mnt/run/runs/run-1" and ref.namespace == "team-a"
    assert StorageRef.from_json(ref.to_json()) == ref
    pv = server.get("persistentvolumes", ref.pv_name)
    assert pv["spec"]["csi"] == {"driver": "fsx.csi.aws.com", "volumeHandle": FS_ID,
                                 "volumeAttributes": {"dnsname": f"{FS_ID}.fsx.us-east-1.amazonaws.com",
                                                      "mountname": "x7k2mbmv"}}
    assert pv["spec"]["claimRef"] == {"namespace": "team-a", "name": ref.pvc_name}
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain" and pv["spec"]["capacity"] == {"storage": "2400Gi"}
    pvc = server.get("persistentvolumeclaims", ref.pvc_name, "team-a")
    assert pvc["spec"]["volumeName"] == ref.pv_name and pvc["spec"]["storageClassName"] == ""
    assert pvc["status"]["phase"] == "Bound"
    assert any("CREATING" in m for m in messages) and any("AVAILABLE" in m for m in messages)

    stubber.add_response("describe_file_systems", {"FileSystems": [_fs("AVAILABLE")]}, {"FileSystemIds": [FS_ID]})
    stubber.add_response("delete_file_system", {"FileSystemId": FS_ID, "Lifecycle": "DELETING"}, {"FileSystemId": FS_ID})
    done = teardown(ref, run_id="run-1", core_api=core, fsx_client=client)
    assert set(done.values()) == {"deleted"}
    assert server.names("persistentvolumes") == [] and server.names("persistentvolumeclaims") == []

    stubber.add_client_error("describe_file_systems", "FileSystemNotFound", "File system does not exist.")
    again = teardown(ref, run_id="run-1", core_api=core, fsx_client=client)
    assert set(again.values()) == {"gone"}


def test_failure_creating_the_pv_deletes_the_new_file_system(kube, stubbed):
    server, core = kube
    client, stubber = stubbed
    _expect_create(stubber, states=("AVAILABLE",))
    # The clean-up: find the run's file system by id, check its token tag, delete it.
    stubber.add_response("describe_file_systems", {"FileSystems": [_fs("AVAILABLE")]}, {"FileSystemIds": [FS_ID]})
    stubber.add_response("delete_file_system", {"FileSystemId": FS_ID, "Lifecycle": "DELETING"}, {"FileSystemId": FS_ID})
    server.state.fail_next[("POST", "persistentvolumes")] = 403
    with pytest.raises(ApiException) as info:
        provision_storage(backend="fsx", run_id="run-1", namespace="team-a", fsx_capacity_gib=2400, fsx_poll_s=0.01,
                          core_api=core, fsx_client=client, progress=print, **FSX_ARGS)
    assert info.value.status == 403
    assert server.names("persistentvolumes") == [] and server.names("persistentvolumeclaims") == []


def test_failure_binding_the_claim_removes_pvc_pv_and_file_system(kube, stubbed):
    server, core = kube
    client, stubber = stubbed
    _expect_create(stubber, states=("AVAILABLE",))
    stubber.add_response("describe_file_systems", {"FileSystems": [_fs("AVAILABLE")]}, {"FileSystemIds": [FS_ID]})
    stubber.add_response("delete_file_system", {"FileSystemId": FS_ID, "Lifecycle": "DELETING"}, {"FileSystemId": FS_ID})

    def progress(message):  # the bind check (the GET after the claim is made) fails, not the check before
        if "created PersistentVolumeClaim" in message:
            server.state.fail_next[("GET", "persistentvolumeclaims")] = 500

    with pytest.raises(ApiException):
        provision_storage(backend="fsx", run_id="run-1", namespace="team-a", fsx_capacity_gib=2400, fsx_poll_s=0.01,
                          core_api=core, fsx_client=client, progress=progress, **FSX_ARGS)
    assert server.names("persistentvolumes") == [] and server.names("persistentvolumeclaims") == []


def _expect_persistent_create(stubber):
    stubber.add_response("describe_file_systems", {"FileSystems": []}, {})
    stubber.add_response("create_file_system", {"FileSystem": _fs("CREATING")},
                         {"ClientRequestToken": fsx.request_token("run-1"), "FileSystemType": "LUSTRE",
                          "FileSystemTypeVersion": "2.15", "StorageCapacity": 2400, "StorageType": "SSD",
                          "SubnetIds": [SUBNET], "SecurityGroupIds": [SG], "Tags": ANY,
                          "LustreConfiguration": {"DeploymentType": "PERSISTENT_2", "DataCompressionType": "NONE",
                                                  "PerUnitStorageThroughput": 250}})
    stubber.add_response("describe_file_systems", {"FileSystems": [_fs("AVAILABLE")]}, {"FileSystemIds": [FS_ID]})
    stubber.add_response("describe_data_repository_associations", {"Associations": []},
                         {"Filters": [{"Name": "file-system-id", "Values": [FS_ID]}]})
    events = {"Events": ["NEW", "CHANGED", "DELETED"]}
    stubber.add_response("create_data_repository_association",
                         {"Association": {"AssociationId": "dra-0123456789abcdef0"}},
                         {"FileSystemId": FS_ID, "FileSystemPath": "/", "DataRepositoryPath": "s3://training-data/c4",
                          "BatchImportMetaDataOnCreate": True,
                          "S3": {"AutoImportPolicy": events, "AutoExportPolicy": events},
                          "ClientRequestToken": fsx.request_token("run-1"),
                          "Tags": [{"Key": fsx.TOKEN_TAG, "Value": fsx.request_token("run-1")},
                                   {"Key": fsx.RUN_TAG, "Value": "run-1"},
                                   {"Key": fsx.MANAGED_TAG, "Value": fsx.MANAGED_VALUE}]})


PERSISTENT = dict(fsx_capacity_gib=2400, fsx_deployment_type="PERSISTENT_2", fsx_per_unit_throughput=250,
                  fsx_import_path="s3://training-data/c4", fsx_export_path="s3://training-data/c4")


def test_persistent_2_links_s3_through_a_data_repository_association(kube, stubbed):
    server, core = kube
    client, stubber = stubbed
    _expect_persistent_create(stubber)
    for state in ("CREATING", "AVAILABLE"):
        stubber.add_response("describe_data_repository_associations",
                             {"Associations": [{"AssociationId": "dra-0123456789abcdef0", "Lifecycle": state}]},
                             {"AssociationIds": ["dra-0123456789abcdef0"]})
    messages = []
    ref = provision_storage(backend="fsx", run_id="run-1", namespace="team-a", fsx_poll_s=0.01, core_api=core,
                            fsx_client=client, progress=messages.append, **FSX_ARGS, **PERSISTENT)
    assert ref.created_fsx and server.get("persistentvolumes", ref.pv_name) is not None
    assert any("association dra-0123456789abcdef0 is AVAILABLE" in m for m in messages)


def test_failed_data_repository_association_deletes_the_file_system(kube, stubbed):
    server, core = kube
    client, stubber = stubbed
    _expect_persistent_create(stubber)
    stubber.add_response("describe_data_repository_associations", {"Associations": [{
        "AssociationId": "dra-0123456789abcdef0", "Lifecycle": "FAILED",
        "FailureDetails": {"Message": "Access denied to s3://training-data"}}]})
    stubber.add_response("describe_file_systems", {"FileSystems": [_fs("AVAILABLE")]}, {"FileSystemIds": [FS_ID]})
    stubber.add_response("delete_file_system", {"FileSystemId": FS_ID, "Lifecycle": "DELETING"}, {"FileSystemId": FS_ID})
    with pytest.raises(fsx.FsxError, match="is FAILED: Access denied to s3://training-data"):
        provision_storage(backend="fsx", run_id="run-1", namespace="team-a", fsx_poll_s=0.01, core_api=core,
                          fsx_client=client, progress=print, **FSX_ARGS, **PERSISTENT)
    assert [r for r in server.state.requests if r[0] != "GET"] == []  # failed before any object was made


def test_timeout_in_the_middle_of_provisioning_leaves_no_file_system(kube, monkeypatch):
    """moto keeps the state: the file system exists after create and is gone after the failure."""
    _, core = kube
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        client = boto3.client("fsx", region_name="us-east-1")
        seen = []

        def progress(message):
            seen.append(message)
            if "creating fs-" in message:
                assert len(client.describe_file_systems()["FileSystems"]) == 1

        # moto reports no Lifecycle, so the file system never becomes AVAILABLE: the wait times out.
        with pytest.raises(TimeoutError):
            provision_storage(backend="fsx", run_id="run-1", namespace="team-a", fsx_timeout_s=0.3, fsx_poll_s=0.1,
                              core_api=core, fsx_client=client, progress=progress, **FSX_ARGS)
        assert any("creating fs-" in m for m in seen)
        assert client.describe_file_systems()["FileSystems"] == []


def test_reused_file_system_is_never_deleted(kube, stubbed):
    server, core = kube
    client, stubber = stubbed
    stubber.add_response("describe_file_systems", {"FileSystems": [_fs("AVAILABLE", run_id="long-lived")]},
                         {"FileSystemIds": [FS_ID]})
    ref = provision_storage(backend="fsx", run_id="run-1", namespace="team-a", fsx_file_system_id=FS_ID,
                            core_api=core, fsx_client=client, progress=print)
    assert not ref.created_fsx and ref.created_pv and ref.created_pvc
    done = teardown(ref, run_id="run-1", core_api=core, fsx_client=client)  # no AWS call is stubbed: none is made
    assert done[f"fsx/{FS_ID}"] == "kept"
    assert server.names("persistentvolumes") == []


def test_pvc_backend_uses_an_existing_claim_and_teardown_keeps_it(kube):
    server, core = kube
    core.create_namespaced_persistent_volume_claim("team-a", {
        "metadata": {"name": "shared-data"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}}})
    ref = provision_storage(backend="pvc", run_id="run-1", namespace="team-a", pvc_name="shared-data", core_api=core)
    assert (ref.backend, ref.pvc_name, ref.run_dir, ref.created_pvc) == ("pvc", "shared-data", "/mnt/run/runs/run-1", False)
    assert teardown(ref, run_id="run-1", core_api=core) == {"pvc/shared-data": "kept"}
    assert server.names("persistentvolumeclaims") == ["shared-data"]
    with pytest.raises(ValueError, match="does not exist"):
        provision_storage(backend="pvc", run_id="run-1", namespace="team-a", pvc_name="missing", core_api=core)


def test_local_backend_makes_the_run_directory(tmp_path):
    ref = provision_storage(backend="local", run_id="run/1 a", local_root=str(tmp_path))
    assert ref.backend == "local" and ref.run_dir == str(tmp_path / "runs" / "run-1-a")
    assert (tmp_path / "runs" / "run-1-a").is_dir()


BAD_INPUTS = [
    (dict(backend="s3"), "storage backend must be one of"),
    (dict(run_id=""), "run_id must not be empty"),
    (dict(namespace="Team_A"), "not a DNS-1123 label"),
    (dict(backend="pvc"), "needs pvc_name"),
    (dict(backend="pvc", pvc_name="My_Claim"), "pvc_name 'My_Claim' is not a DNS-1123 subdomain"),
    (dict(mount_path="data"), "mount_path 'data' must be an absolute directory"),
    (dict(mount_path="/dev/shm"), "mount_path '/dev/shm' collides with /dev/shm"),
    (dict(mount_path="/mnt/run\n"), "control characters"),
    (dict(mount_path="/mnt/../dev"), "must be an absolute directory without '.', '..'"),
    (dict(run_subdir="../escape"), "without '..'"),
    (dict(fsx_capacity_gib=1000), "use 1200, 2400 or a multiple of 2400 GiB"),
    (dict(fsx_capacity_gib=3600), "use 1200, 2400 or a multiple of 2400 GiB"),
    (dict(fsx_deployment_type="SCRATCH_1"), "deployment_type must be one of"),
    (dict(fsx_deployment_type="PERSISTENT_2"), "PERSISTENT_2 needs per_unit_throughput"),
    (dict(fsx_deployment_type="PERSISTENT_2", fsx_per_unit_throughput=300), "PERSISTENT_2 needs per_unit_throughput"),
    (dict(fsx_per_unit_throughput=250), "applies to PERSISTENT_2 only"),
    (dict(fsx_deployment_type="PERSISTENT_2", fsx_per_unit_throughput=250, fsx_import_path="s3://data-a/in",
          fsx_export_path="s3://data-a/out"), "export_path must be empty or equal to import_path"),
    (dict(fsx_subnet_id="subnet-xyz"), "is not a subnet id"),
    (dict(fsx_subnet_id=""), "is not a subnet id"),
    (dict(fsx_security_group_ids=""), "at least one security group"),
    (dict(fsx_security_group_ids="default"), "is not a security group id"),
    (dict(fsx_import_path="https://bucket/data"), "must be s3://bucket"),
    (dict(fsx_export_path="s3://bucket/out"), "needs an import_path"),
    (dict(fsx_import_path="s3://data-a/in", fsx_export_path="s3://data-b/out"), "differs from the import bucket"),
    (dict(fsx_tags={"aws:owner": "me"}), "no 'aws:' prefix"),
    (dict(fsx_tags={"owner": "x" * 300}), "tag value for 'owner' is invalid"),
    (dict(fsx_tags={"resilient-training.io/run-token": "x"}), "reserved prefix"),
    (dict(fsx_lustre_version="2.10"), "lustre_version must be one of"),
    (dict(region="mars-north"), "is not an AWS region name"),
    (dict(fsx_timeout_s=0), "fsx_timeout_s must be positive"),
    (dict(fsx_poll_s=60, fsx_timeout_s=30), "exceeds fsx_timeout_s"),
    (dict(fsx_file_system_id="fs-123"), "is not an FSx id"),
    (dict(fsx_file_system_id=FS_ID), "fsx_file_system_id reuses a file system: fsx_subnet_id is for a new one"),
    # A reused file system keeps its own size and type: these were dropped without a word (stranger trial).
    (dict(fsx_file_system_id=FS_ID, fsx_subnet_id="", fsx_security_group_ids="", fsx_deployment_type="BOGUS"),
     "fsx_deployment_type is for a new one and would be ignored"),
    (dict(fsx_file_system_id=FS_ID, fsx_subnet_id="", fsx_security_group_ids="", fsx_capacity_gib=-7),
     "fsx_capacity_gib is for a new one and would be ignored"),
    (dict(fsx_file_system_id=FS_ID, fsx_subnet_id="", fsx_security_group_ids="", fsx_tags={"owner": "me"}),
     "fsx_tags is for a new one and would be ignored"),
    # Each would be ignored by another backend: refused, not dropped (stranger trial).
    (dict(backend="pvc", pvc_name="claim"), "fsx_subnet_id is for storage=fsx, and storage 'pvc' would ignore it"),
    (dict(backend="local", fsx_subnet_id="", fsx_security_group_ids="", fsx_capacity_gib=2400),
     "fsx_capacity_gib is for storage=fsx, and storage 'local' would ignore it"),
    (dict(backend="pvc", pvc_name="claim", fsx_subnet_id="", fsx_security_group_ids="",
          fsx_deployment_type="PERSISTENT_2"), "fsx_deployment_type is for storage=fsx"),
    (dict(backend="pvc", pvc_name="claim", fsx_subnet_id="", fsx_security_group_ids=[], fsx_tags={},
          fsx_lustre_version="2.12"), "fsx_lustre_version is for storage=fsx"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_inputs_are_refused_before_any_call(kube, stubbed, overrides, message):
    server, core = kube
    client, _ = stubbed  # no response queued: any AWS call would raise a different error
    params = dict(backend="fsx", run_id="run-1", namespace="team-a", **FSX_ARGS)
    params.update(overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        provision_storage(core_api=core, fsx_client=client, progress=print, **params)
    assert server.state.requests == []
