"""manifests/: kustomize builds offline, core objects pass kubernetes-validate --strict, the RBAC
grants exactly the verbs the components use, the IAM policy is tag-scoped and holds no secrets."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import boto3
import kubernetes_validate
import pytest
import yaml
from botocore.stub import Stubber
from kubeflow.training import TrainingClient
from kubernetes import client as k8s

from resilient_training.launch import jobshape, pytorchjob
from resilient_training.launch import watch as launch
from resilient_training.run import config
from resilient_training.storage import fsx, volumes
from resilient_training.storage.provision import provision_storage
from resilient_training.storage.teardown import teardown
from tests.support import kube_api
from tests.support.kube_api import Phase

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
K8S_VERSION = "1.32"  # the kubectl here; EKS supports it
KUSTOMIZATIONS = ["base", "storageclass", "overlays/irsa", "overlays/kubeflow-profile", "overlays/argo"]


def kustomize(path: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(MANIFESTS / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomizations_build_and_pass_strict_validation(path):
    docs = kustomize(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_no_cluster_scoped_object_is_given_a_namespace(path):
    """A stranger trial found overlays/argo's admission policies namespaced: it sets the namespace
    again after base's transformer had taken it off them."""
    placed = [(d["kind"], d["metadata"]["name"]) for d in kustomize(path)
              if d["kind"] in CLUSTER_SCOPED and "namespace" in d["metadata"]]
    assert placed == []


def test_strict_validation_can_fail():
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"},
                                      "automountToken": False}, K8S_VERSION, strict=True)


def test_generated_pv_pvc_and_the_jobs_pod_template_pass_strict_validation():
    labels = {"app.kubernetes.io/name": "resilient-training"}
    kubernetes_validate.validate(volumes.pv_manifest(
        name="rt-x-pv", claim="rt-x-data", namespace="team-a", fs_id="fs-0123456789abcdef0",
        dns_name="fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", mount_name="abcdefgh", capacity_gib=2400,
        labels=labels), K8S_VERSION, strict=True)
    kubernetes_validate.validate(volumes.pvc_manifest(
        name="rt-x-data", namespace="team-a", volume="rt-x-pv", capacity_gib=2400, labels=labels),
        K8S_VERSION, strict=True)
    from resilient_training.run.storage_ref import StorageRef

    ref = StorageRef(backend="pvc", run_dir="/mnt/run/runs/x", mount_path="/mnt/run", namespace="team-a",
                     pvc_name="rt-x-data")
    spec = pytorchjob.JobSpec(name="rt-x", namespace="team-a", storage=ref, nodes=8, efa_per_node=32, cpu="180",
                              memory="1800Gi", train=config.TrainConfig(run_dir=ref.run_dir),
                              tolerations=[pytorchjob.parse_toleration("nvidia.com/gpu:NoSchedule")])
    job = pytorchjob.to_dict(pytorchjob.build_job(spec))
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "rt-x-worker"},
                                  "template": template}, K8S_VERSION, strict=True)


# Stand-in request -> (apiGroup, resource, verb) as RBAC sees it.
_GROUPS = {"pytorchjobs": "kubeflow.org", "trainjobs": "trainer.kubeflow.org"}


def _verb(method: str, path: str, resource: str) -> str:
    if method == "POST":
        return "create"
    if method == "DELETE":
        return "delete"
    named = not path.rstrip("/").endswith(resource.split("/")[0]) or resource == "pods/log"
    return "get" if named else "list"


def _exercise_every_component(server) -> None:
    """provision (fsx) -> launch (fails, so the failure path reads logs and events) -> teardown."""
    api = k8s.ApiClient(server.configuration())
    core = k8s.CoreV1Api(api)
    client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fs = {"FileSystemId": "fs-0123456789abcdef0", "Lifecycle": "AVAILABLE", "StorageCapacity": 1200,
          "DNSName": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", "LustreConfiguration": {"MountName": "m"},
          "Tags": [{"Key": fsx.TOKEN_TAG, "Value": fsx.request_token("run-1")}]}
    with Stubber(client) as stubber:
        stubber.add_response("describe_file_systems", {"FileSystems": []}, {})
        stubber.add_response("create_file_system", {"FileSystem": fs})
        stubber.add_response("describe_file_systems", {"FileSystems": [fs]})
        params = dict(backend="fsx", run_id="run-1", namespace="team-a", fsx_subnet_id="subnet-0123456789abcdef0",
                      fsx_security_group_ids="sg-0123456789abcdef0", region="us-east-1", core_api=core,
                      fsx_client=client, progress=print)
        ref = provision_storage(**params)
        # A retried step: finds its file system by tag, its PV and PVC by name (409 then get).
        stubber.add_response("describe_file_systems", {"FileSystems": [fs]}, {})
        stubber.add_response("describe_file_systems", {"FileSystems": [fs]})
        assert provision_storage(**params) == ref
        server.state.job_timeline = [Phase("Created"), Phase("Running"), Phase("Failed", exit_code=1)]
        server.add_event("team-a", "Pod", "rt-job-worker-0", "BackOff", "restarting failed container")
        spec = pytorchjob.JobSpec(name="rt-job", namespace="team-a", storage=ref, run_id="run-1",
                                  train=config.TrainConfig(run_dir=ref.run_dir))
        training = TrainingClient(client_configuration=server.configuration(), namespace="team-a")
        with pytest.raises(launch.JobFailed):
            launch.launch(spec, training_client=training, timeout_s=10, poll_s=0.01, progress=print)
        # The same run on Kubeflow Trainer: a TrainJob that fails, so its failure path reads logs and events too.
        server.add_event("team-a", "Pod", "rt-train-node-0-0-g0", "BackOff", "restarting failed container")
        spec = jobshape.JobSpec(kind="trainjob", name="rt-train", namespace="team-a", storage=ref, run_id="run-1",
                                train=config.TrainConfig(run_dir=ref.run_dir))
        with pytest.raises(launch.JobFailed, match="exit code 1"):
            launch.launch(spec, api=launch.TrainJobs(k8s.CustomObjectsApi(api), core, "team-a"), timeout_s=10,
                          poll_s=0.01, progress=print)
        stubber.add_response("describe_file_systems", {"FileSystems": [fs]})
        stubber.add_response("delete_file_system", {"FileSystemId": fs["FileSystemId"], "Lifecycle": "DELETING"})
        teardown(ref, run_id="run-1", job_name="rt-job", core_api=core, training_client=training, fsx_client=client)
        teardown(ref, run_id="run-1", job_name="rt-train", core_api=core, training_client=training,
                 delete_file_system=False)


def test_rbac_grants_exactly_the_verbs_the_components_use():
    with kube_api.running() as server:
        _exercise_every_component(server)
        used = set()
        for method, path in server.state.requests:
            resource, _, _ = kube_api.route(path)
            used.add((_GROUPS.get(resource, ""), resource, _verb(method, path, resource)))
    granted = set()
    for doc in kustomize("base"):
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        granted |= {(group, resource, verb) for verb in rule["verbs"]}
    assert used == granted


def test_iam_policy_allows_every_fsx_call_the_code_makes():
    source = (ROOT / "resilient_training" / "storage" / "fsx.py").read_text()
    calls = set(re.findall(r"client\.([a-z_]+)\(", source)) | set(re.findall(r'get_paginator\("([a-z_]+)"\)', source))
    calls -= {"get_paginator"}
    actions = {"fsx:" + "".join(part.title() for part in call.split("_")) for call in calls}
    assert actions >= {"fsx:CreateFileSystem", "fsx:DeleteFileSystem", "fsx:DescribeFileSystems"}
    policy = json.loads((MANIFESTS / "iam" / "fsx-provisioner-policy.json").read_text())
    allowed = set()
    for statement in policy["Statement"]:
        allowed |= set(statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]])
    assert actions <= allowed, actions - allowed


S3_ACTIONS = {"get_object": {"s3:GetObject"}, "head_object": {"s3:GetObject"}, "put_object": {"s3:PutObject"},
              "head_bucket": {"s3:ListBucket"}, "delete_object": {"s3:DeleteObject"},
              "upload_file": {"s3:PutObject", "s3:AbortMultipartUpload"}}  # multipart, aborted on a failure


def test_the_promotion_policy_allows_every_s3_call_promotion_makes_on_its_bucket_only():
    """A stranger trial: the role the Argo steps run as had no s3:PutObject, so the documented
    promote_to=s3://... failed at the last step, after the whole training."""
    source = "".join((ROOT / "resilient_training" / "gates" / name).read_text() for name in ("promote.py", "export.py"))
    calls = set(re.findall(r"client\.([a-z_]+)\(", source)) & (set(S3_ACTIONS) | {"list_objects_v2", "copy_object"})
    assert calls == set(S3_ACTIONS), calls  # a new call: add what it needs here and to the policy
    policy = json.loads((MANIFESTS / "iam" / "promotion-policy.json").read_text())
    allowed: dict[str, set[str]] = {}
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow" and "*" not in statement["Resource"].split(":::")[1].split("/")[0]
        for action in statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]:
            allowed.setdefault(action, set()).add(statement["Resource"])
    assert set().union(*(S3_ACTIONS[c] for c in calls)) == set(allowed)
    assert allowed["s3:ListBucket"] == {"arn:aws:s3:::example-models"}
    assert all(resources == {"arn:aws:s3:::example-models/*"} for action, resources in allowed.items()
               if action != "s3:ListBucket")


def test_iam_policy_is_tag_scoped_and_files_hold_no_credentials():
    policy = json.loads((MANIFESTS / "iam" / "fsx-provisioner-policy.json").read_text())
    by_action = {}
    for statement in policy["Statement"]:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        for action in actions:
            by_action[action] = statement
    # What each action allows is tested case by case in tests/test_iam_policy.py.
    for action in ("fsx:CreateFileSystem", "fsx:TagResource", "fsx:DeleteFileSystem",
                   "fsx:CreateDataRepositoryAssociation"):
        assert by_action[action]["Condition"], action
    assert "fsx:*" not in by_action and "*" not in by_action
    secret = re.compile(r"(AKIA|ASIA)[0-9A-Z]{16}|aws_secret_access_key|BEGIN [A-Z ]*PRIVATE KEY|token:\s*\S{20,}",
                        re.IGNORECASE)
    for path in sorted(p for p in MANIFESTS.rglob("*") if p.is_file()) + sorted((ROOT / "images").rglob("*")):
        if path.is_file():
            assert not secret.search(path.read_text()), path
