"""The PyTorchJob builder: schema-valid for any node count, webhook-valid, the right command."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import yaml

from resilient_training.launch import pytorchjob
from resilient_training.run import config
from resilient_training.run.storage_ref import StorageRef
from tests.support import crd_schema

MOUNT = "/mnt/run"


def make_spec(**overrides):
    storage = StorageRef(backend="fsx", run_dir=f"{MOUNT}/runs/r1", mount_path=MOUNT, namespace="team-a",
                         pvc_name="rt-r1-data", pv_name="rt-r1-pv", fsx_id="fs-0123456789abcdef0", created_fsx=True)
    train = config.TrainConfig(run_dir=f"{MOUNT}/runs/r1", faults="sigkill@12:3")
    values = dict(name="rt-r1", namespace="team-a", train=train, storage=storage,
                  nodes=2, gpus_per_node=8, efa_per_node=32, run_id="0f8e2f6c-3a44-4bfb-9d1c-5f0f0e4c2a11",
                  node_selector={"node.kubernetes.io/instance-type": "p5en.48xlarge"},
                  tolerations=[pytorchjob.parse_toleration("nvidia.com/gpu:NoSchedule")],
                  service_account="rt-trainer", cpu="180", memory="1800Gi", active_deadline_seconds=86400)
    values.update(overrides)
    return pytorchjob.JobSpec(**values)


@functools.cache
def _load_schema(path):
    return crd_schema.load_crd_schema(path)


@pytest.fixture
def pytorchjob_schema(shared_schemas):
    return _load_schema(shared_schemas / "kubeflow.org_pytorchjobs.yaml")


@pytest.mark.parametrize("nodes", [1, 2, 8, 64])
def test_rendered_job_is_valid_for_crd_and_webhook(nodes, pytorchjob_schema):
    # Through YAML: what kubectl would read.
    job = yaml.safe_load(pytorchjob.to_yaml(pytorchjob.build_job(make_spec(nodes=nodes))))
    assert crd_schema.schema_errors(job, pytorchjob_schema) == []
    assert crd_schema.webhook_errors(job) == []
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == nodes
    assert job["spec"]["elasticPolicy"]["minReplicas"] == job["spec"]["elasticPolicy"]["maxReplicas"] == nodes


def test_validator_rejects_unknown_fields_and_webhook_violations(pytorchjob_schema, shared_schemas):
    """The checks above can fail: a typo'd field, a wrong container name, both nproc forms."""
    job = pytorchjob.to_dict(pytorchjob.build_job(make_spec()))
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    job["spec"]["runPolicy"]["backoffLimit"] = "three"
    errors = crd_schema.schema_errors(job, pytorchjob_schema)
    assert any("imagePullPolicyy" in e for e in errors), errors
    assert any("backoffLimit" in e for e in errors), errors

    job = pytorchjob.to_dict(pytorchjob.build_job(make_spec()))
    job["metadata"]["name"] = "1-starts-with-digit"
    job["spec"]["elasticPolicy"]["nProcPerNode"] = 8
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["name"], container["image"] = "trainer", ""
    errors = crd_schema.webhook_errors(job)
    assert len(errors) == 4, errors

    job = pytorchjob.to_dict(pytorchjob.build_job(make_spec()))
    job["spec"]["pytorchReplicaSpecs"] = {"Master": job["spec"]["pytorchReplicaSpecs"]["Worker"]}
    errors = crd_schema.webhook_errors(job)
    assert any("Worker" in e for e in errors) and any("must be 1" in e for e in errors), errors


def test_int_or_string_and_preserve_unknown_fields_are_respected():
    schema = {"type": "object", "properties": {
        "q": {"x-kubernetes-int-or-string": True},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "strict": {"type": "object", "properties": {"a": {"type": "string"}}},
    }}
    assert crd_schema.schema_errors({"q": 3, "free": {"anything": 1}, "strict": {"a": "x"}}, schema) == []
    assert crd_schema.schema_errors({"q": "3Gi"}, schema) == []
    assert crd_schema.schema_errors({"q": [1]}, schema)
    assert crd_schema.schema_errors({"strict": {"b": 1}}, schema)


def test_container_runs_ft_launcher_with_operator_env_and_nvrx_switches():
    spec = make_spec(nodes=8)
    job = pytorchjob.to_dict(pytorchjob.build_job(spec))
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    assert container["command"] == ["resilient-ft-launcher"]
    args = container["args"]
    split = args.index("-m")
    launcher_flags, module, trainer_args = args[:split], args[split + 1], args[split + 2:]
    assert module == "resilient_training.runtime.worker"
    # Rendezvous and sizes come from the operator's PET_* env, for any node count.
    assert not [f for f in launcher_flags if f.startswith(("--nnodes", "--nproc-per-node", "--rdzv", "--standalone"))]
    assert "--ft-rank-heartbeat-timeout=10.0" in launcher_flags
    assert any(f.startswith("--ft-gpu-memory-reclaim-timeout=") for f in launcher_flags)  # NVRx 0.7.0 by default
    assert f"--ft-checkpoint-iteration-file={MOUNT}/runs/r1/ft_iteration" in launcher_flags
    assert config.from_argv(trainer_args) == spec.train
    assert job["spec"]["nprocPerNode"] == "8" and "nProcPerNode" not in job["spec"]["elasticPolicy"]
    assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    assert job["spec"]["elasticPolicy"]["rdzvId"] == spec.run_id
    assert job["spec"]["elasticPolicy"]["maxRestarts"] == spec.train.restart.max_restarts
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29400, "protocol": "TCP"}]
    assert worker["restartPolicy"] == "ExitCode"
    assert job["spec"]["runPolicy"] == {"backoffLimit": 3, "activeDeadlineSeconds": 86400,
                                        "ttlSecondsAfterFinished": 604800, "cleanPodPolicy": "Running"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert StorageRef.from_json(env["RT_STORAGE_REF"]) == spec.storage
    assert not any(k.startswith("PET_") for k in env)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32",
                                                "cpu": "180", "memory": "1800Gi"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}, "runAsNonRoot": True,
                                            "allowPrivilegeEscalation": False}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "run-storage": MOUNT}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["run-storage"]["persistentVolumeClaim"] == {"claimName": "rt-r1-data"}
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5en.48xlarge"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["serviceAccountName"] == "rt-trainer"


def test_nvrx_version_selects_launcher_flags_and_switches_reach_the_worker():
    old = pytorchjob.to_dict(pytorchjob.build_job(make_spec(nvrx_version="0.4.1", gpus_per_node=0, procs_per_node=2,
                                                            efa_per_node=0)))
    (container,) = old["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert "--ft-enable-nic-monitor=false" in container["args"]
    assert not any(a.startswith("--ft-gpu-memory-reclaim-timeout=") for a in container["args"])
    assert "nvidia.com/gpu" not in container["resources"]["limits"] and old["spec"]["nprocPerNode"] == "2"
    assert "FI_PROVIDER" not in {e["name"] for e in container["env"]}

    spec = make_spec()
    train = config.from_dict({**spec.train.to_dict(), "ft_launcher": False, "inprocess": False, "async_checkpoint": False})
    spec = dataclasses.replace(spec, train=train)
    job = pytorchjob.to_dict(pytorchjob.build_job(spec))
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["command"] == ["python"] and container["args"][:2] == ["-m", "torch.distributed.run"]
    for flag in ("--no-ft-launcher", "--no-inprocess", "--no-async-checkpoint"):
        assert flag in container["args"]


def test_elastic_range():
    job = pytorchjob.to_dict(pytorchjob.build_job(make_spec(nodes=8, min_nodes=6)))
    assert (job["spec"]["elasticPolicy"]["minReplicas"], job["spec"]["elasticPolicy"]["maxReplicas"]) == (6, 8)


BAD_SPECS = [
    ({"name": "Rt_Job"}, "DNS-1035"),
    ({"name": "9lives"}, "DNS-1035"),
    ({"name": "a" * 55, "nodes": 64}, "too long for 64 nodes"),
    ({"namespace": "Team"}, "namespace"),
    ({"nodes": 0}, "nodes must be"),
    ({"nodes": 5000}, "nodes must be"),
    ({"nodes": 4, "min_nodes": 5}, "min_nodes"),
    ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"gpus_per_node": 0}, "procs_per_node"),
    ({"gpus_per_node": 4, "procs_per_node": 8}, "one process per GPU"),
    ({"efa_per_node": 33}, "efa_per_node"),
    ({"image": ""}, "image"),
    ({"image": "repo/trainer: latest"}, "image"),
    ({"memory": "lots"}, "quantity"),
    ({"namespace": "other"}, "own namespace"),
    ({"node_selector": {"bad key!": "x"}}, "label key"),
    ({"tolerations": [{"key": "k", "operator": "Sometimes"}]}, "operator"),
    ({"tolerations": [{"key": "k", "effect": "NoWay"}]}, "effect"),
    ({"service_account": "Admin"}, "service account"),
    ({"rdzv_port": 70000}, "rdzv_port"),
    ({"backoff_limit": -1}, "backoff_limit"),
    ({"env": {"PET_NNODES": "3"}}, "Training Operator"),
    ({"image_pull_policy": "Sometimes"}, "image_pull_policy"),
    ({"train": config.TrainConfig(run_dir=f"{MOUNT}/runs/r1", faults="sigkill@12:16")}, "rank 16 does not exist"),
    ({"train": config.TrainConfig(run_dir=f"{MOUNT}/runs/r1", faults="sigkill@99:1")}, "after the last step"),
    ({"train": config.TrainConfig(run_dir=f"{MOUNT}/runs/r1", faults="meteor@3:1")}, "faults:"),
]


@pytest.mark.parametrize(("overrides", "needle"), BAD_SPECS, ids=[n for _, n in BAD_SPECS])
def test_bad_job_specs_are_refused_with_the_reason(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        make_spec(**overrides)


def test_storage_must_be_shared_and_hold_the_run_dir():
    local = StorageRef(backend="local", run_dir="/tmp/run")
    with pytest.raises(ValueError, match="not shared between pods"):
        make_spec(storage=local)
    with pytest.raises(ValueError, match="must lie under the storage mount"):
        make_spec(train=config.TrainConfig(run_dir="/elsewhere/r1"))


@pytest.mark.parametrize("ft_launcher", [True, False])
def test_warm_spare_makes_the_container_start_the_spare_stub(ft_launcher):
    spec = make_spec()
    train = config.from_dict({**spec.train.to_dict(), "warm_spare": True, "ft_launcher": ft_launcher})
    job = pytorchjob.to_dict(pytorchjob.build_job(dataclasses.replace(spec, train=train)))
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    args = container["args"]
    module = args[args.index("-m", 2 if not ft_launcher else 0) + 1]
    assert module == "resilient_training.runtime.spare_stub" and "--warm-spare" in args
