"""The KFP component under kfp.local's SubprocessRunner (a real subprocess, real clients)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client as k8s

from resilient_training.components.provision_storage import provision_storage
from resilient_training.run.storage_ref import StorageRef
from tests.support import kube_api


def test_local_storage_through_the_local_runner(kfp_local, tmp_path):
    task = provision_storage(run_id="run-42", storage="local", local_root=str(tmp_path))
    ref = StorageRef.from_json(task.outputs["storage_ref"])
    assert ref.backend == "local" and Path(ref.run_dir) == tmp_path / "runs" / "run-42"
    assert task.outputs["pvc_name"] == "" and task.outputs["run_dir"] == ref.run_dir
    assert Path(ref.run_dir).is_dir()


def test_pvc_storage_through_the_local_runner_and_kubeconfig(kfp_local, tmp_path, monkeypatch):
    with kube_api.running() as server:
        k8s.CoreV1Api(k8s.ApiClient(server.configuration())).create_namespaced_persistent_volume_claim(
            "team-a", {"metadata": {"name": "shared"}, "spec": {"accessModes": ["ReadWriteMany"],
                                                                "resources": {"requests": {"storage": "1Ti"}}}})
        # The component's subprocess finds the stand-in through KUBECONFIG, as it would a cluster.
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        task = provision_storage(run_id="run-42", storage="pvc", pvc_name="shared", mount_path="/data")
        ref = StorageRef.from_json(task.outputs["storage_ref"])
        assert task.outputs["pvc_name"] == "shared"
        assert (ref.backend, ref.namespace, ref.pvc_name, ref.run_dir) == ("pvc", "team-a", "shared", "/data/runs/run-42")
        assert ("GET", "/api/v1/namespaces/team-a/persistentvolumeclaims/shared") in server.state.requests


def test_bad_input_fails_the_step(kfp_local):
    with pytest.raises(RuntimeError):
        provision_storage(run_id="run-42", storage="fsx", fsx_subnet_id="subnet-0123456789abcdef0",
                          fsx_security_group_ids="sg-0123456789abcdef0", fsx_capacity_gib=1000, namespace="team-a")
