"""teardown: deletes only what the run created, is safe to repeat, tries every step."""

from __future__ import annotations

import json

import boto3
import pytest
from kubeflow.training import TrainingClient
from kubernetes import client as k8s
from moto import mock_aws

from resilient_training.components.teardown_storage import teardown_storage
from resilient_training.launch.pytorchjob import job_name_for_run
from resilient_training.run.storage_ref import StorageRef
from resilient_training.storage import fsx, volumes
from resilient_training.storage.provision import volume_names
from resilient_training.storage.teardown import teardown
from resilient_training.storage.teardown import teardown_storage as teardown_storage_fn
from tests.support import kube_api


def fsx_ref(fs_id="fs-0123456789abcdef0", created_fsx=True):
    return StorageRef(backend="fsx", run_dir="/mnt/run/runs/run-1", mount_path="/mnt/run", namespace="team-a",
                      pvc_name="rt-run-1-data", pv_name="rt-run-1-pv", fsx_id=fs_id, region="us-east-1",
                      created_pvc=True, created_pv=True, created_fsx=created_fsx)


def marked(name, run_id):
    """Metadata as provision_storage writes it: the run's mark (label and annotation)."""
    labels, annotations = volumes.run_marks(run_id)
    return {"name": name, "labels": {**labels, **volumes.LABELS}, "annotations": annotations}


@pytest.fixture
def kube():
    with kube_api.running() as server:
        api = k8s.ApiClient(server.configuration())
        core = k8s.CoreV1Api(api)
        core.create_persistent_volume({"metadata": marked("rt-run-1-pv", "run-1"), "spec": {
            "capacity": {"storage": "1200Gi"}, "accessModes": ["ReadWriteMany"],
            "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": "fs-0123456789abcdef0"}}})
        core.create_namespaced_persistent_volume_claim("team-a", {"metadata": marked("rt-run-1-data", "run-1"), "spec": {
            "accessModes": ["ReadWriteMany"], "volumeName": "rt-run-1-pv",
            "resources": {"requests": {"storage": "1200Gi"}}}})
        yield server, core, TrainingClient(client_configuration=server.configuration(), namespace="team-a")


@pytest.fixture
def aws(monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield boto3.client("fsx", region_name="us-east-1")


def _job(name):
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
            "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2}}}}


def test_deletes_the_runs_trainjob_and_nothing_else(kube):
    server, core, training = kube
    custom = k8s.CustomObjectsApi(core.api_client)
    for name in ("rt-run-1", "someone-elses-job"):
        custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", "team-a", "trainjobs", {
            "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": name},
            "spec": {"runtimeRef": {"name": "nvrx-ft-launcher"}}})
    ref = StorageRef(backend="pvc", run_dir="/mnt/run/runs/x", mount_path="/mnt/run", namespace="team-a",
                     pvc_name="users-claim")
    done = teardown(ref, run_id="run-1", job_name="rt-run-1", core_api=core, training_client=training)
    assert done == {"pytorchjob/rt-run-1": "gone", "trainjob/rt-run-1": "deleted", "pvc/users-claim": "kept"}
    assert server.names("trainjobs") == ["someone-elses-job"]
    assert ("DELETE", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/rt-run-1") in server.state.requests


def test_deletes_job_claim_volume_and_file_system_and_is_idempotent(kube, aws):
    server, core, training = kube
    fs_id = fsx.create(aws, fsx.FsxRequest(run_id="run-1", subnet_id="subnet-0123456789abcdef0",
                                           security_group_ids=("sg-0123456789abcdef0",)), print)["FileSystemId"]
    k8s.CustomObjectsApi(core.api_client).create_namespaced_custom_object(
        "kubeflow.org", "v1", "team-a", "pytorchjobs", _job("rt-run-1"))
    ref = fsx_ref(fs_id)
    first = teardown(ref, run_id="run-1", job_name="rt-run-1", core_api=core, training_client=training, fsx_client=aws)
    assert first == {"pytorchjob/rt-run-1": "deleted", "trainjob/rt-run-1": "gone", "pvc/rt-run-1-data": "deleted",
                     "pv/rt-run-1-pv": "deleted", f"fsx/{fs_id}": "deleted"}
    assert aws.describe_file_systems()["FileSystems"] == []
    assert server.names("pytorchjobs") == server.names("persistentvolumes") == []
    second = teardown(ref, run_id="run-1", job_name="rt-run-1", core_api=core, training_client=training, fsx_client=aws)
    assert set(second.values()) == {"gone"}


def test_keeps_a_reused_file_system_and_can_keep_its_own(kube, aws):
    _, core, _ = kube
    other = fsx.create(aws, fsx.FsxRequest(run_id="shared-fs", subnet_id="subnet-0123456789abcdef0",
                                           security_group_ids=("sg-0123456789abcdef0",)), print)["FileSystemId"]
    done = teardown(fsx_ref(other, created_fsx=False), run_id="run-1", core_api=core, fsx_client=aws)
    assert done[f"fsx/{other}"] == "kept"
    # Even if the bookkeeping were wrong, the token tag protects another run's file system.
    with pytest.raises(RuntimeError, match="not created by this run"):
        teardown(fsx_ref(other), run_id="run-1", core_api=core, fsx_client=aws)
    assert len(aws.describe_file_systems()["FileSystems"]) == 1


def test_one_failing_step_does_not_stop_the_others(kube, aws):
    server, core, _ = kube
    server.state.fail_next[("DELETE", "persistentvolumeclaims")] = 500
    with pytest.raises(RuntimeError, match="pvc/rt-run-1-data"):
        teardown(fsx_ref(), run_id="run-1", core_api=core, fsx_client=aws, delete_file_system=False)
    assert server.names("persistentvolumes") == []  # the PV step still ran
    assert teardown(fsx_ref(), run_id="run-1", core_api=core, fsx_client=aws, delete_file_system=False) == {
        "pvc/rt-run-1-data": "deleted", "pv/rt-run-1-pv": "gone", "fsx/fs-0123456789abcdef0": "kept"}


def test_component_in_the_local_runner_with_the_storage_ref(kfp_local, kube, tmp_path, monkeypatch):
    server, core, _ = kube
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    job = job_name_for_run("run-1")  # what launch_training named it
    for name in (job, "someone-elses-job"):
        k8s.CustomObjectsApi(core.api_client).create_namespaced_custom_object(
            "kubeflow.org", "v1", "team-a", "pytorchjobs", _job(name))
    ref = fsx_ref(created_fsx=True)
    task = teardown_storage(run_id="run-1", storage_ref=ref.to_json(), delete_file_system=False)
    assert json.loads(task.output) == {f"pytorchjob/{job}": "deleted", f"trainjob/{job}": "gone",
                                       "pvc/rt-run-1-data": "deleted",
                                       "pv/rt-run-1-pv": "deleted", "fsx/fs-0123456789abcdef0": "kept"}
    assert server.names("pytorchjobs") == ["someone-elses-job"]
    again = teardown_storage(run_id="run-1", storage_ref=ref.to_json(), delete_file_system=False)
    assert set(json.loads(again.output).values()) == {"gone", "kept"}


def test_exit_handler_form_finds_everything_from_the_run_id(kube, aws):
    """No storage ref (an exit task cannot take outputs): derived names and the token tag suffice,
    even when provisioning was killed right after creating the file system."""
    server, core, training = kube
    fs_id = fsx.create(aws, fsx.FsxRequest(run_id="run-9", subnet_id="subnet-0123456789abcdef0",
                                           security_group_ids=("sg-0123456789abcdef0",)), print)["FileSystemId"]
    other = fsx.create(aws, fsx.FsxRequest(run_id="run-10", subnet_id="subnet-0123456789abcdef0",
                                           security_group_ids=("sg-0123456789abcdef0",)), print)["FileSystemId"]
    pv, pvc = volume_names("run-9")
    core.create_persistent_volume({"metadata": marked(pv, "run-9"), "spec": {
        "capacity": {"storage": "1200Gi"}, "accessModes": ["ReadWriteMany"],
        "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": fs_id}}})
    params = dict(run_id="run-9", storage="fsx", namespace="team-a", core_api=core, training_client=training,
                  fsx_client=aws)
    first = teardown_storage_fn(**params)
    assert first == {f"pytorchjob/{job_name_for_run('run-9')}": "gone", f"trainjob/{job_name_for_run('run-9')}": "gone",
                     f"pvc/{pvc}": "gone", f"pv/{pv}": "deleted",
                     f"fsx/{fs_id}": "deleted"}
    assert [fs["FileSystemId"] for fs in aws.describe_file_systems()["FileSystems"]] == [other]
    second = teardown_storage_fn(**params)
    assert set(second.values()) == {"gone"}  # the file system is no longer found by its tag
    reused = teardown_storage_fn(**{**params, "run_id": "run-10", "fsx_file_system_id": other})
    assert reused[f"fsx/{other}"] == "kept"
    assert len(aws.describe_file_systems()["FileSystems"]) == 1


def test_bad_teardown_inputs_are_refused_before_any_call(kube):
    server, core, training = kube
    before = list(server.state.requests)
    for params, message in [
        (dict(run_id=""), "run_id must not be empty"),
        (dict(run_id="r", storage="nfs"), "storage must be one of"),
        (dict(run_id="r", storage="fsx", namespace="team-a", fsx_file_system_id="fs-1"), "is not an FSx id"),
        (dict(run_id="r", storage="pvc", namespace="Team A"), "not a DNS-1123 label"),
        (dict(run_id="r", storage="pvc", namespace="team-a", job_name="Job_1"), "not a DNS-1035 label"),
        (dict(run_id="r", storage_ref="{}"), "storage ref misses backend, run_dir"),
    ]:
        with pytest.raises(ValueError, match=message):
            teardown_storage_fn(core_api=core, training_client=training, **params)
    assert server.state.requests == before


def test_local_storage_needs_no_cluster(kfp_local, tmp_path):
    ref = StorageRef(backend="local", run_dir=str(tmp_path / "run"))
    assert json.loads(teardown_storage(storage_ref=ref.to_json(), run_id="run-1").output) == {}
    assert json.loads(teardown_storage(run_id="run-1").output) == {}
