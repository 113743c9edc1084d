"""Two runs that name the same claim (a fixed ``pvc_name`` with storage=fsx, e.g. in a schedule that
lets runs overlap): the second run's provisioning fails, and its exit handler's teardown must not
delete the first run's claim or volume while the first run trains. Real boto3 (moto) and the real
kubernetes client against the in-test API server."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from kubeflow.training import TrainingClient
from kubernetes import client as k8s
from moto import mock_aws

from resilient_training.storage import fsx, volumes
from resilient_training.storage.provision import provision_storage, volume_names
from resilient_training.storage.teardown import teardown_storage
from tests.support import kube_api

CLAIM = "nightly-claim"
NAMESPACE = "team-a"
FSX_ARGS = dict(fsx_subnet_id="subnet-0123456789abcdef0", fsx_security_group_ids="sg-0123456789abcdef0",
                region="us-east-1", fsx_poll_s=0.01, bind_timeout_s=5)


class AvailableFsx:
    """moto's FSx, whose file systems report no Lifecycle and no MountName: here AVAILABLE with one,
    as AWS's become; everything else (tags, the token lookup, delete) is moto's own state."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def describe_file_systems(self, **kwargs: Any) -> dict[str, Any]:
        answer = self._client.describe_file_systems(**kwargs)
        for fs in answer["FileSystems"]:
            fs["Lifecycle"] = fs.get("Lifecycle") or "AVAILABLE"
            fs.setdefault("LustreConfiguration", {}).setdefault("MountName", "abcdefgh")
        return answer


@pytest.fixture
def cluster(monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    with mock_aws(), kube_api.running() as server:
        core = k8s.CoreV1Api(k8s.ApiClient(server.configuration()))
        training = TrainingClient(client_configuration=server.configuration(), namespace=NAMESPACE)
        yield server, core, training, AvailableFsx(boto3.client("fsx", region_name="us-east-1"))


def _provision(run_id: str, core: Any, aws: Any, progress=print):
    return provision_storage(backend="fsx", run_id=run_id, namespace=NAMESPACE, pvc_name=CLAIM, core_api=core,
                             fsx_client=aws, progress=progress, **FSX_ARGS)


def _teardown(run_id: str, core: Any, training: Any, aws: Any, progress=print) -> dict[str, str]:
    """The exit handler's form: the run id and the provisioning parameters, no storage ref."""
    return teardown_storage(run_id=run_id, storage="fsx", namespace=NAMESPACE, pvc_name=CLAIM, core_api=core,
                            training_client=training, fsx_client=aws, progress=progress)


def _file_systems(aws: Any) -> dict[str, str]:
    """Each file system's run (its run-id tag)."""
    return {fs["FileSystemId"]: {t["Key"]: t["Value"] for t in fs["Tags"]}[fsx.RUN_TAG]
            for fs in aws.describe_file_systems()["FileSystems"]}


def _a_trains_while_b_tears_down(server, core, training, aws, ref_a) -> None:
    """B's exit handler leaves A's claim and volume alone, in one line, and succeeds; A's own
    teardown then deletes them and its file system; both teardowns are safe to repeat."""
    pv_b, _ = volume_names("run-b")
    lines: list[str] = []
    done = _teardown("run-b", core, training, aws, lines.append)
    assert done[f"pvc/{CLAIM}"] == "kept" and done[f"pv/{pv_b}"] == "gone"
    assert [line for line in lines if CLAIM in line] == [
        f"k8s: leaving PersistentVolumeClaim {NAMESPACE}/{CLAIM} alone: run run-a created it, not this run (run-b)"]
    assert server.get("persistentvolumeclaims", CLAIM, NAMESPACE)["spec"]["volumeName"] == ref_a.pv_name
    assert server.names("persistentvolumes") == [ref_a.pv_name]
    assert _file_systems(aws) == {ref_a.fsx_id: "run-a"}
    assert ("DELETE", f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims/{CLAIM}") not in server.state.requests

    claim_uid = server.get("persistentvolumeclaims", CLAIM, NAMESPACE)["metadata"]["uid"]
    done = _teardown("run-a", core, training, aws)
    assert {key: done[key] for key in (f"pvc/{CLAIM}", f"pv/{ref_a.pv_name}", f"fsx/{ref_a.fsx_id}")} == {
        f"pvc/{CLAIM}": "deleted", f"pv/{ref_a.pv_name}": "deleted", f"fsx/{ref_a.fsx_id}": "deleted"}
    # Deleted with the uid read as a precondition: a claim made again under the name meanwhile is not this one.
    path = f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims/{CLAIM}"
    assert server.state.delete_options[path]["preconditions"] == {"uid": claim_uid}
    assert server.names("persistentvolumeclaims") == server.names("persistentvolumes") == []
    assert _file_systems(aws) == {}
    for run_id in ("run-a", "run-b"):
        assert set(_teardown(run_id, core, training, aws).values()) == {"gone"}


def test_a_claim_name_another_run_holds_fails_provisioning_before_any_file_system(cluster):
    server, core, training, aws = cluster
    ref_a = _provision("run-a", core, aws)
    claim = server.get("persistentvolumeclaims", CLAIM, NAMESPACE)
    assert claim["metadata"]["labels"][volumes.RUN_TOKEN_LABEL] == fsx.request_token("run-a")
    assert claim["metadata"]["annotations"] == {volumes.RUN_ID_ANNOTATION: "run-a"}
    assert server.get("persistentvolumes", ref_a.pv_name)["metadata"]["labels"][volumes.RUN_TOKEN_LABEL] == \
        fsx.request_token("run-a")

    with pytest.raises(RuntimeError, match=f"PersistentVolumeClaim {NAMESPACE}/{CLAIM} already exists and run run-a "
                                           "created it: each run needs a claim of its own"):
        _provision("run-b", core, aws)
    assert _file_systems(aws) == {ref_a.fsx_id: "run-a"}  # none made for B
    assert server.names("persistentvolumes") == [ref_a.pv_name]
    _a_trains_while_b_tears_down(server, core, training, aws, ref_a)


def test_a_claim_made_by_another_run_meanwhile_is_refused_on_409_and_kept_by_teardown(cluster):
    """The race itself: B finds the name free, makes its file system and volume; A's claim appears
    before B's (the two provision at once); B's claim creation meets A's claim (409)."""
    server, core, training, aws = cluster
    made: dict[str, Any] = {}

    def b_progress(message: str) -> None:
        if message.startswith("k8s: created PersistentVolume ") and "run-a" not in made:
            made["run-a"] = _provision("run-a", core, aws)

    with pytest.raises(RuntimeError, match=f"PersistentVolumeClaim {NAMESPACE}/{CLAIM} already exists and run run-a "
                                           "created it"):
        _provision("run-b", core, aws, b_progress)
    ref_a = made["run-a"]
    assert ("POST", f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims") in server.state.requests
    # B's provisioning removed what it made (its volume, its file system), not A's.
    assert server.names("persistentvolumes") == [ref_a.pv_name]
    assert _file_systems(aws) == {ref_a.fsx_id: "run-a"}
    _a_trains_while_b_tears_down(server, core, training, aws, ref_a)


def test_a_retried_provisioning_adopts_its_own_claim_and_a_users_claim_is_never_taken(cluster):
    server, core, training, aws = cluster
    first = _provision("run-a", core, aws)
    again = _provision("run-a", core, aws)  # a retried step: the same run's objects, found by their mark
    assert (again.pvc_name, again.pv_name, again.fsx_id) == (first.pvc_name, first.pv_name, first.fsx_id)
    assert len(_file_systems(aws)) == 1
    done = _teardown("run-a", core, training, aws)
    assert [done[f"pvc/{CLAIM}"], done[f"pv/{first.pv_name}"], done[f"fsx/{first.fsx_id}"]] == ["deleted"] * 3

    # A claim no run made (a user's own, by hand): storage=fsx neither adopts nor deletes it.
    core.create_namespaced_persistent_volume_claim(NAMESPACE, {"metadata": {"name": CLAIM}, "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}}})
    with pytest.raises(RuntimeError, match="already exists and no run created it"):
        _provision("run-c", core, aws)
    lines: list[str] = []
    assert _teardown("run-c", core, training, aws, lines.append)[f"pvc/{CLAIM}"] == "kept"
    assert f"k8s: leaving PersistentVolumeClaim {NAMESPACE}/{CLAIM} alone: no run created it (it has no " \
           f"{volumes.RUN_TOKEN_LABEL} label), not this run (run-c)" in lines
    assert server.names("persistentvolumeclaims") == [CLAIM] and _file_systems(aws) == {}


def test_a_claim_replaced_between_the_read_and_the_delete_is_left_alone(cluster):
    """The delete carries the uid read: the API server answers 409 when the name is another object's now."""
    server, core, training, aws = cluster
    _provision("run-a", core, aws)
    server.state.fail_next[("DELETE", "persistentvolumeclaims")] = 409
    lines: list[str] = []
    assert _teardown("run-a", core, training, aws, lines.append)[f"pvc/{CLAIM}"] == "kept"
    assert f"k8s: leaving PersistentVolumeClaim {NAMESPACE}/{CLAIM} alone: it was deleted and made again since it " \
           "was read" in lines
