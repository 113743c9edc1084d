"""launch_training as a KFP component under kfp.local: the pytorchjob and trainjob backends against
the kube API stand-in (found through KUBECONFIG), and the local backend running the real trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient_training.components.launch_training import launch_training
from resilient_training.launch.pytorchjob import job_name_for_run
from resilient_training.run.storage_ref import StorageRef
from tests.support import kube_api
from tests.support.kube_api import Phase

REF = StorageRef(backend="fsx", run_dir="/mnt/run/runs/run-7", mount_path="/mnt/run", namespace="team-a",
                 pvc_name="rt-run-7-data", pv_name="rt-run-7-pv", fsx_id="fs-0123456789abcdef0", created_fsx=True,
                 created_pv=True, created_pvc=True)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with kube_api.running() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield server


def test_pytorchjob_backend_through_the_local_runner(kfp_local, cluster):
    task = launch_training(storage_ref=REF.to_json(), run_id="run-7", launcher="pytorchjob", nodes=8, min_nodes=6,
                           steps=100, faults="sigkill@50:9", efa_per_node=32,
                           train_overrides={"heartbeat_timeout": 120.0, "model": {"d_model": 1024, "n_heads": 16}},
                           node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"},
                           tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                           cpu="180", memory="1800Gi", shm_size="128Gi", poll_seconds=0.05, timeout_seconds=30)
    assert task.outputs["job_name"] == job_name_for_run("run-7")
    assert task.outputs["run_dir"] == "/mnt/run/runs/run-7"
    job = cluster.get("pytorchjobs", job_name_for_run("run-7"), "team-a")
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    args = container["args"]
    assert worker["replicas"] == 8 and container["command"] == ["resilient-ft-launcher"]
    assert container["resources"]["limits"]["memory"] == "1800Gi" and container["resources"]["limits"]["cpu"] == "180"
    (shm,) = [v for v in worker["template"]["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert shm["emptyDir"]["sizeLimit"] == "128Gi"
    assert (job["spec"]["elasticPolicy"]["minReplicas"], job["spec"]["elasticPolicy"]["maxReplicas"]) == (6, 8)
    for flag, value in (("--steps", "100"), ("--faults", "sigkill@50:9"), ("--heartbeat-timeout", "120.0"),
                        ("--model-d-model", "1024"), ("--run-dir", "/mnt/run/runs/run-7"), ("--export-format", "")):
        assert args[args.index(flag) + 1] == value
    assert json.loads({e["name"]: e["value"] for e in container["env"]}["RT_STORAGE_REF"])["fsx_id"] == REF.fsx_id


def test_trainjob_backend_through_the_local_runner(kfp_local, cluster):
    task = launch_training(storage_ref=REF.to_json(), run_id="run-7", launcher="trainjob", nodes=8, steps=100,
                           faults="sigkill@50:9", efa_per_node=32, train_overrides={"heartbeat_timeout": 120.0},
                           tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                           service_account="trainer-s3", poll_seconds=0.05, timeout_seconds=30, export="hf",
                           task="resilient_training.tasks.llama:LlamaTask")  # (hf of the built-in task: refused)
    assert task.outputs["job_name"] == job_name_for_run("run-7")
    job = cluster.get("trainjobs", job_name_for_run("run-7"), "team-a")
    trainer = job["spec"]["trainer"]
    args = trainer["args"]
    assert job["spec"]["runtimeRef"]["name"] == "nvrx-ft-launcher"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (8, 8)
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
    # export: the workers refuse at their first start a model the promotion's export cannot hold
    for flag, value in (("--steps", "100"), ("--faults", "sigkill@50:9"), ("--heartbeat-timeout", "120.0"),
                        ("--run-dir", "/mnt/run/runs/run-7"), ("--export-format", "hf")):
        assert args[args.index(flag) + 1] == value
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer-s3"
    assert {v["name"]: v for v in pod["volumes"]}["run-storage"]["persistentVolumeClaim"]["claimName"] == REF.pvc_name
    assert cluster.names("pytorchjobs") == []


def test_trainjob_backend_refuses_what_a_trainjob_cannot_express(kfp_local, cluster, capfd):
    with pytest.raises(RuntimeError):  # kfp.local reports the step's ValueError as a failed task
        launch_training(storage_ref=REF.to_json(), run_id="run-7", launcher="trainjob", nodes=8, min_nodes=6,
                        poll_seconds=0.05, timeout_seconds=30)
    out, err = capfd.readouterr()
    assert "a TrainJob is not elastic" in out + err
    assert cluster.names("trainjobs") == []  # refused before anything was created


def test_failed_job_fails_the_step(kfp_local, cluster):
    cluster.state.job_timeline = [Phase("Created"), Phase("Failed", reason="PyTorchJobFailed", message="boom",
                                                          exit_code=1)]
    with pytest.raises(RuntimeError):
        launch_training(storage_ref=REF.to_json(), run_id="run-7", launcher="pytorchjob", poll_seconds=0.05,
                        timeout_seconds=30)


@pytest.mark.slow
def test_local_backend_trains_for_real(kfp_local, tmp_path):
    """The component's local path end to end: real ft_launcher and gloo workers (~15 s on 2 cores)."""
    ref = StorageRef(backend="local", run_dir=str(tmp_path / "run"))
    # In-process restart and async saves are the trainer's own tests; here the launch path matters.
    task = launch_training(storage_ref=ref.to_json(), run_id="local-1", launcher="local", steps=4, checkpoint_every=2,
                           inprocess=False, async_checkpoint=False, procs_per_node=2)
    assert task.outputs["job_name"] == "" and task.outputs["run_dir"] == ref.run_dir
    assert (Path(ref.run_dir) / "checkpoints" / "latest").read_text().strip() == "step_4"
