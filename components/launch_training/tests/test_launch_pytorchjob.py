"""launch: the real TrainingClient against the stateful kube API stand-in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kubeflow.training import TrainingClient
from kubernetes import client as k8s

from resilient_training.launch import pytorchjob
from resilient_training.launch import watch as launch
from resilient_training.launch.backends import launch_training
from resilient_training.launch.pytorchjob import job_name_for_run
from resilient_training.run import config
from resilient_training.run.storage_ref import StorageRef
from tests.support import kube_api
from tests.support.kube_api import Phase

REPO = Path(__file__).resolve().parents[3]  # tests.support lives at the repo root
REF = StorageRef(backend="pvc", run_dir="/mnt/run/runs/run-1", mount_path="/mnt/run", namespace="team-a",
                 pvc_name="shared")


def make_spec(nodes=2):
    return pytorchjob.JobSpec(name="rt-run-1", namespace="team-a", train=config.TrainConfig(run_dir=REF.run_dir),
                              storage=REF, nodes=nodes, gpus_per_node=8, run_id="run-1")


@pytest.fixture
def kube():
    with kube_api.running() as server:
        yield server, TrainingClient(client_configuration=server.configuration(), namespace="team-a")


def test_creates_the_job_waits_and_streams_worker_0(kube):
    server, training = kube
    lines = []
    outcome = launch.launch(make_spec(), training_client=training, timeout_s=10, poll_s=0.01, progress=lines.append)
    assert (outcome.job_name, outcome.attached) == ("rt-run-1", False)
    stored = server.get("pytorchjobs", "rt-run-1", "team-a")
    expected = pytorchjob.to_dict(pytorchjob.build_job(make_spec()))
    assert stored["spec"] == expected["spec"]
    states = [line for line in lines if "team-a/rt-run-1:" in line]
    assert [s.split(": ")[1].split(" ")[0] for s in states] == ["Created", "Running", "Succeeded"]
    assert "[rt-run-1-worker-0] step 2 loss 5.1" in lines
    assert not any(line.startswith("[rt-run-1-worker-1]") for line in lines)  # elastic: no master, worker 0 only


def test_streams_all_workers_or_none(kube):
    server, training = kube
    lines = []
    launch.launch(make_spec(nodes=3), training_client=training, timeout_s=10, poll_s=0.01, stream_logs="all",
                  progress=lines.append)
    assert {line.split("]")[0] for line in lines if line.startswith("[rt-")} == {
        "[rt-run-1-worker-0", "[rt-run-1-worker-1", "[rt-run-1-worker-2"}
    server.state.objects.clear()
    server.state.job_progress.clear()
    quiet = []
    launch.launch(make_spec(), training_client=training, timeout_s=10, poll_s=0.01, stream_logs="none",
                  progress=quiet.append)
    assert not any(line.startswith("[rt-") for line in quiet)


def test_replaced_pods_are_followed_again_and_transient_api_errors_are_survived(kube):
    server, training = kube
    server.state.job_timeline = [Phase("Created"), Phase("Running"), Phase("Restarting", reason="PyTorchJobRestarting"),
                                 Phase("Running", new_pods=True), Phase("Succeeded")]
    lines = []

    def progress(line):
        lines.append(line)
        if "Restarting" in line:  # the API server hiccups once right after the restart
            server.state.fail_next[("GET", "pytorchjobs")] = 500

    launch.launch(make_spec(), training_client=training, timeout_s=10, poll_s=0.05, progress=progress)
    assert sum(line == "[rt-run-1-worker-0] step 2 loss 5.1" for line in lines) == 2  # one per pod incarnation
    assert any(line.startswith("warning: reading the job failed (1/5)") for line in lines)
    assert [s.split(": ")[1].split(" ")[0] for s in lines if "team-a/rt-run-1:" in s] == [
        "Created", "Running", "Restarting", "Running", "Succeeded"]


def test_a_job_deleted_underneath_fails_the_step_clearly(kube):
    server, training = kube
    server.state.job_timeline = [Phase("Created"), Phase("Running")]

    def progress(line):
        if "Running" in line:
            server.state.store("pytorchjobs").clear()

    with pytest.raises(launch.JobFailed, match="disappeared while running"):
        launch.launch(make_spec(), training_client=training, timeout_s=10, poll_s=0.05, stream_logs="none",
                      progress=progress)


def test_attaches_to_an_existing_job_on_409(kube):
    server, training = kube
    k8s.CustomObjectsApi(k8s.ApiClient(server.configuration())).create_namespaced_custom_object(
        "kubeflow.org", "v1", "team-a", "pytorchjobs", pytorchjob.to_dict(pytorchjob.build_job(make_spec())))
    lines = []
    outcome = launch.launch(make_spec(), training_client=training, timeout_s=10, poll_s=0.01, progress=lines.append)
    assert outcome.attached and any("attaching" in line for line in lines)
    assert server.names("pytorchjobs") == ["rt-run-1"]
    posts = [r for r in server.state.requests if r[0] == "POST"]
    assert len(posts) == 2  # the test's create and the launcher's, answered 409


def test_a_retried_step_recreates_a_job_its_earlier_attempt_left_failed(kube):
    server, training = kube
    failed = pytorchjob.to_dict(pytorchjob.build_job(make_spec()))
    failed["metadata"]["namespace"] = "team-a"
    failed["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed",
                                        "message": "attempt 1 failed"}]}
    server.state.store("pytorchjobs")[("team-a", "rt-run-1")] = failed
    server.state.job_progress[("team-a", "rt-run-1")] = 99  # the stand-in leaves this one as it is
    lines = []
    outcome = launch.launch(make_spec(), training_client=training, timeout_s=10, poll_s=0.01, stream_logs="none",
                            progress=lines.append)
    assert not outcome.attached
    assert any("failed in an earlier attempt (PyTorchJobFailed): recreating it" in line for line in lines)
    assert [r[0] for r in server.state.requests if r[1].endswith("/pytorchjobs") or "/pytorchjobs/" in r[1]][:4] == [
        "POST", "GET", "DELETE", "GET"]
    assert server.get("pytorchjobs", "rt-run-1", "team-a")["status"]["conditions"][-1]["type"] == "Succeeded"


def test_failure_carries_the_jobs_reason_exit_codes_and_log_tail(kube):
    server, training = kube
    server.state.job_timeline = [Phase("Created"), Phase("Running"),
                                 Phase("Failed", reason="PyTorchJobFailed",
                                       message="PyTorchJob rt-run-1 is failed because 1 Worker replica(s) failed.",
                                       exit_code=93)]
    server.state.pod_logs["rt-run-1-worker-0"] = "step 7 loss nan\nnan guard: giving up (exit 93)\n"
    with pytest.raises(launch.JobFailed) as info:
        launch.launch(make_spec(), training_client=training, timeout_s=10, poll_s=0.01, stream_logs="none")
    text = str(info.value)
    assert "PyTorchJobFailed: PyTorchJob rt-run-1 is failed because 1 Worker replica(s) failed." in text
    assert "rt-run-1-worker-0: exit code 93 Error (deterministic failure: do not restart)" in text
    assert "nan guard: giving up (exit 93)" in text


def test_timeout_deletes_the_job(kube):
    server, training = kube
    server.state.job_timeline = [Phase("Created"), Phase("Running")]  # never finishes
    with pytest.raises(TimeoutError, match="still Running"):
        launch.launch(make_spec(), training_client=training, timeout_s=0.5, poll_s=0.05, stream_logs="none")
    assert server.names("pytorchjobs") == [] and server.names("pods") == []


def test_pending_pods_show_why_and_the_timeout_says_it_again(kube):
    server, training = kube
    server.state.job_timeline = [Phase("Created")]  # the pods never schedule
    server.add_event("team-a", "Pod", "rt-run-1-worker-1", "FailedScheduling",
                     "0/12 nodes are available: 12 Insufficient nvidia.com/gpu.")
    server.add_event("team-a", "Pod", "other-job-worker-0", "FailedScheduling", "not ours")
    server.add_event("team-a", "Pod", "rt-run-1-worker-0", "Scheduled", "assigned", type_="Normal")
    lines = []
    with pytest.raises(TimeoutError) as info:
        launch.launch(make_spec(), training_client=training, timeout_s=0.5, poll_s=0.05, stream_logs="none",
                      progress=lines.append)
    warnings = [line for line in lines if "warning:" in line]
    assert warnings == ["  warning: Pod rt-run-1-worker-1: FailedScheduling: 0/12 nodes are available: "
                        "12 Insufficient nvidia.com/gpu."]  # once, though polled many times
    assert "Insufficient nvidia.com/gpu" in str(info.value) and "not ours" not in str(info.value)


def test_sigterm_deletes_the_job_and_exits_143(tmp_path):
    """A real process, cancelled the way KFP cancels a step: SIGTERM to the pod's process."""
    with kube_api.running() as server:
        server.state.job_timeline = [Phase("Created"), Phase("Running")]
        script = tmp_path / "step.py"
        script.write_text(textwrap.dedent(f"""
            from kubeflow.training import TrainingClient
            from tests.support.kube_api import KubeApiServer
            from kubernetes import client
            from resilient_training.launch import watch as launch
            from tests_launch_spec import make_spec
            cfg = client.Configuration(); cfg.host = {server.url!r}
            training = TrainingClient(client_configuration=cfg, namespace="team-a")
            launch.launch(make_spec(), training_client=training, timeout_s=60, poll_s=0.05, stream_logs="none")
        """))
        (tmp_path / "tests_launch_spec.py").write_text(textwrap.dedent("""
            from resilient_training.run import config
            from resilient_training.launch import pytorchjob
            from resilient_training.run.storage_ref import StorageRef
            REF = StorageRef(backend="pvc", run_dir="/mnt/run/runs/run-1", mount_path="/mnt/run",
                             namespace="team-a", pvc_name="shared")
            def make_spec():
                return pytorchjob.JobSpec(name="rt-run-1", namespace="team-a", storage=REF, run_id="run-1",
                                          train=config.TrainConfig(run_dir=REF.run_dir), nodes=2)
        """))
        proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO)))})
        deadline = time.monotonic() + 30
        while server.get("pytorchjobs", "rt-run-1", "team-a") is None or server.state.job_progress.get(
                ("team-a", "rt-run-1"), -1) < 1:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the job never reached Running"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
        assert proc.returncode == 143, out
        assert "step cancelled (SIGTERM)" in out
        assert server.names("pytorchjobs") == []


def test_bad_inputs_fail_before_any_call(kube):
    server, training = kube
    ref = REF.to_json()
    cases = [
        (dict(launcher="slurm"), "launcher must be one of"),
        (dict(train={"stepz": 3}), "unknown trainer settings: stepz"),
        (dict(train={"model": {"d_model": 64.5}}), "model setting d_model must be an integer"),
        (dict(train={"run_dir": "/x"}), "run_dir comes from the storage ref"),
        (dict(train={"steps": 0}), "steps must be positive"),
        (dict(storage_ref=StorageRef(backend="local", run_dir="/tmp/r").to_json()), "needs storage every pod can mount"),
        (dict(storage_ref="{not json"), "storage ref is not JSON"),
        (dict(run_id=""), "run_id must not be empty"),
        (dict(nodes=0), "nodes must be"),
        (dict(stream_logs="some"), "stream_logs must be one of"),
        (dict(tolerations=[{"key": "a", "effect": "Never"}]), "toleration effect"),
    ]
    for overrides, message in cases:
        params = dict(storage_ref=ref, run_id="run-1", launcher="pytorchjob", training_client=training)
        params.update(overrides)
        with pytest.raises(ValueError, match=message):
            launch_training(**params)
    assert server.state.requests == []


def test_job_name_is_deterministic_and_valid():
    name = job_name_for_run("0f8e2f6c-3a44-4bfb-9d1c-5f0f0e4c2a11")
    assert name == job_name_for_run("0f8e2f6c-3a44-4bfb-9d1c-5f0f0e4c2a11") != job_name_for_run("another")
    assert name.startswith("rt-0f8e2f6c") and len(name) <= 40
