"""The rendered PyTorchJob's (and TrainJob's) container command, run for real: two "pods" on this
host with the PET_* env the Training Operator (or Kubeflow Trainer) injects, ft_launcher agents
meeting through c10d rendezvous."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import yaml

from resilient_training.cli import main as cli
from resilient_training.launch import trainjob
from resilient_training.run import events
from tests.support import pods


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_operator_env_matches_the_job():
    job = {"metadata": {"name": "j"}, "spec": {"nprocPerNode": "8", "pytorchReplicaSpecs": {"Worker": {"replicas": 4}},
                                               "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": 3,
                                                                 "maxReplicas": 4, "rdzvId": "run-1", "maxRestarts": 6}}}
    assert pods.operator_env(job, rdzv_port=29400) == {
        "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "127.0.0.1:29400", "PET_NNODES": "3:4",
        "PET_NPROC_PER_NODE": "8", "PET_RDZV_ID": "run-1", "PET_MAX_RESTARTS": "6"}


@pytest.mark.slow
def test_two_pods_rendezvous_from_the_operator_env_and_train(tmp_path):
    job_file = tmp_path / "job.yaml"
    mount = tmp_path / "mnt"  # stands for the claim's mount in every pod
    assert cli.main(["render-job", "--name", "rt-pods", "--nodes", "2", "--gpus-per-node", "0", "--procs-per-node", "1",
                     "--nvrx-version", "0.4.1", "--pvc", "claim", "--mount-path", str(mount), "--steps", "6",
                     "--checkpoint-every", "2",
                     # The launcher path is under test; in-process restart and async saves add processes, not coverage.
                     "--no-inprocess", "--no-async-checkpoint", "-o", str(job_file)]) == 0
    job = yaml.safe_load(job_file.read_text())
    results = pods.run_pods(job, log_dir=tmp_path / "logs", rdzv_port=_free_port(), timeout_s=150, extra_env={
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"})
    assert [r.exit_code for r in results] == [0, 0], "\n".join(r.log.read_text()[-3000:] for r in results)
    run_dir = mount / "runs" / "rt-pods"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_6"
    starts = events.select(events.read_events(run_dir), "start")
    assert sorted(e.rank for e in starts) == [0, 1]
    assert {e.fields["world_size"] for e in starts} == {2}  # one world across the two "pods"


@pytest.mark.slow
def test_a_worker_killed_in_one_pod_is_recovered_by_both_pods(tmp_path):
    """Rank 1's worker is SIGKILLed: its agent restarts it, the other pod's agent restarts its own
    worker for the new rendezvous round, and both resume from the last commit. In-process restart
    stays on: the surviving rank must hand over to the launcher, not stop the job."""
    job_file = tmp_path / "job.yaml"
    mount = tmp_path / "mnt"
    assert cli.main(["render-job", "--name", "rt-kill", "--nodes", "2", "--gpus-per-node", "0", "--procs-per-node", "1",
                     "--nvrx-version", "0.4.1", "--pvc", "claim", "--mount-path", str(mount), "--steps", "10",
                     "--checkpoint-every", "2", "--no-async-checkpoint", "--faults", "sigkill@5:1",
                     "-o", str(job_file)]) == 0
    job = yaml.safe_load(job_file.read_text())
    results = pods.run_pods(job, log_dir=tmp_path / "logs", rdzv_port=_free_port(), timeout_s=200, extra_env={
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"})
    assert [r.exit_code for r in results] == [0, 0], "\n".join(r.log.read_text()[-3000:] for r in results)
    run_dir = mount / "runs" / "rt-kill"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_10"
    log = events.read_events(run_dir)
    assert [e["fault"] for e in events.select(log, "fault_injected")] == ["sigkill@5:1"]
    loads = [e.step for e in events.select(log, "load_done") if e.step]
    assert loads and set(loads) == {4}


def test_trainer_env_and_kubelet_expansion_match_the_trainjob():
    job = {"metadata": {"name": "j"}, "spec": {"trainer": {"numNodes": 4, "numProcPerNode": 8}}}
    runtime = {"spec": {"mlPolicy": {"numNodes": 1, "torch": {}}}}
    env = pods.trainer_env(job, runtime, 2, master_addr="j-node-0-0.j", master_port=29500)
    assert env == {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2",
                   "PET_MASTER_ADDR": "j-node-0-0.j", "PET_MASTER_PORT": "29500"}
    assert pods.expand("--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", env) == \
        "--rdzv-endpoint=j-node-0-0.j:29500"
    assert pods.expand("$(UNSET) $$(PET_NODE_RANK)", env) == "$(UNSET) $(PET_NODE_RANK)"  # as the kubelet leaves them


@pytest.mark.slow
def test_trainjob_a_worker_killed_in_one_pod_is_recovered_by_both_pods(tmp_path):
    """The same fault through the TrainJob: each pod runs the shipped runtime's ft_launcher command
    with the TrainJob's args and the Trainer's PET_* env (static master address and port, node
    rank from the completion index); the agents meet through c10d at PET_MASTER_ADDR:PORT, and
    the killed worker is restarted inside the pods (no pod is replaced)."""
    job_file = tmp_path / "trainjob.yaml"
    mount = tmp_path / "mnt"
    assert cli.main(["render-job", "--kind", "trainjob", "--name", "rt-tj", "--nodes", "2", "--gpus-per-node", "0",
                     "--procs-per-node", "1", "--nvrx-version", "0.4.1", "--pvc", "claim", "--mount-path", str(mount),
                     "--steps", "10", "--checkpoint-every", "2", "--no-async-checkpoint", "--faults", "sigkill@5:1",
                     "-o", str(job_file)]) == 0
    job = yaml.safe_load(job_file.read_text())
    shipped = Path(__file__).resolve().parents[1] / "manifests" / "runtimes" / "nvrx-ft-launcher.yaml"
    runtime = yaml.safe_load(shipped.read_text())
    assert runtime["metadata"]["name"] == job["spec"]["runtimeRef"]["name"] == trainjob.RUNTIME_NAME
    results = pods.run_trainjob_pods(job, runtime, log_dir=tmp_path / "logs", master_port=_free_port(),
                                     timeout_s=200, extra_env={
                                         "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                                         "OMP_NUM_THREADS": "1"})
    assert [r.exit_code for r in results] == [0, 0], "\n".join(r.log.read_text()[-3000:] for r in results)
    run_dir = mount / "runs" / "rt-tj"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_10"
    log = events.read_events(run_dir)
    assert [e["fault"] for e in events.select(log, "fault_injected")] == ["sigkill@5:1"]
    starts = events.select(log, "start")
    assert {e.fields["world_size"] for e in starts} == {2}  # one world across the two "pods"
    loads = [e.step for e in events.select(log, "load_done") if e.step]
    assert loads and set(loads) == {4}  # both pods' workers resumed from the last commit
