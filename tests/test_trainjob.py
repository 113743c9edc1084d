"""The TrainJob and the NVRx ClusterTrainingRuntime: valid against Trainer v2.3's CRDs (strict) and
its admission rules for 1 to 128 nodes, the shipped runtime is the generated one, the restart
policy says what it should, and launch/attach/fail/cancel run against the stand-in API server."""

from __future__ import annotations

import copy
import signal
import threading
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from resilient_training.cli import main as cli
from resilient_training.launch import cancel, jobshape, trainjob
from resilient_training.launch import watch as launch
from resilient_training.run import config
from resilient_training.run.storage_ref import StorageRef
from tests.support import crd_schema, kube_api
from tests.support.kube_api import Phase

ROOT = Path(__file__).resolve().parents[1]
REF = StorageRef(backend="pvc", run_dir="/mnt/run/runs/r1", mount_path="/mnt/run", namespace="team-a",
                 pvc_name="rt-r1-data")


def spec(**overrides):
    fields = dict(kind="trainjob", name="rt-r1", namespace="team-a", storage=REF, run_id="run-1",
                  train=config.TrainConfig(run_dir=REF.run_dir))
    return jobshape.JobSpec(**{**fields, **overrides})


def rendered(**overrides) -> dict:
    return trainjob.to_dict(trainjob.build_job(spec(**overrides)))


@pytest.fixture(scope="module")
def schemas():
    root = ROOT.parent / "shared" / "schemas"
    if not root.is_dir():
        pytest.skip("../shared/schemas is absent (a user's clone has no ../shared)")
    return {"TrainJob": crd_schema.load_crd_schema(root / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
            "ClusterTrainingRuntime": crd_schema.load_crd_schema(
                root / "trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1"),
            "stock": yaml.safe_load((root / "trainer-runtime-torch-distributed.yaml").read_text())}


def runtime() -> dict:
    return trainjob.to_dict(trainjob.build_runtime())


def all_errors(job: dict, runtime_obj: dict, schemas) -> list[str]:
    return (crd_schema.schema_errors(job, schemas["TrainJob"])
            + crd_schema.trainjob_admission_errors(job, {runtime_obj["metadata"]["name"]: runtime_obj}))


def test_runtime_is_valid_and_the_shipped_manifest_is_the_generated_one(schemas):
    obj = runtime()
    assert crd_schema.schema_errors(obj, schemas["ClusterTrainingRuntime"]) == []
    assert crd_schema.runtime_admission_errors(obj) == []
    shipped = (ROOT / "manifests" / "runtimes" / "nvrx-ft-launcher.yaml").read_text()
    assert shipped == trainjob.runtime_yaml(), "regenerate: python -c 'from resilient_training.launch import " \
        "trainjob; print(trainjob.runtime_yaml(), end=\"\")' > manifests/runtimes/nvrx-ft-launcher.yaml"
    # The stock runtime of the same release passes the same checks: they are not stricter than the Trainer.
    assert crd_schema.schema_errors(schemas["stock"], schemas["ClusterTrainingRuntime"]) == []
    assert crd_schema.runtime_admission_errors(schemas["stock"]) == []


def test_runtimes_kustomization_builds_the_runtime(schemas):
    from tests.test_manifests import kustomize

    (built,) = kustomize("runtimes")
    assert built == runtime()
    assert crd_schema.schema_errors(built, schemas["ClusterTrainingRuntime"]) == []


@pytest.mark.parametrize("nodes", [1, 2, 8, 64, 128])
def test_rendered_trainjob_is_valid_for_crd_and_admission(nodes, schemas):
    job = rendered(nodes=nodes, gpus_per_node=8, efa_per_node=32, cpu="180", memory="1800Gi",
                   node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"},
                   tolerations=[jobshape.parse_toleration("nvidia.com/gpu:NoSchedule")], service_account="trainer-s3",
                   active_deadline_seconds=86400)
    assert all_errors(job, runtime(), schemas) == []
    assert job["spec"]["trainer"]["numNodes"] == nodes
    assert job["spec"]["trainer"]["numProcPerNode"] == 8
    # The longest name that still fits is accepted by both our checks and the admission rules.
    longest = "r" * (63 - len(f"-node-0-{nodes - 1}-abcde"))
    assert all_errors(rendered(nodes=nodes, name=longest), runtime(), schemas) == []
    with pytest.raises(ValueError, match="too long"):
        spec(nodes=nodes, name=longest + "x")
    too_long = rendered(nodes=nodes, name=longest)
    too_long["metadata"]["name"] += "x"  # past our check: the JobSet rule catches it as well
    assert [e for e in all_errors(too_long, runtime(), schemas) if "exceed 63 characters" in e]


def test_validators_reject_what_the_api_server_and_trainer_would(schemas):
    good, rt = rendered(), runtime()
    cases = {
        "unknown field": lambda j: j["spec"]["trainer"].update(nprocPerNode=8),
        "unknown pod patch field": lambda j: _pod_patch(j).update(priorityClassName="high"),
        "reserved env": lambda j: j["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"}),
        "env in node patch": lambda j: _pod_patch(j)["containers"][0].update(env=[{"name": "A", "value": "1"}]),
        "unknown container": lambda j: _pod_patch(j)["containers"].append({"name": "sidecar"}),
        "unknown replicated job": lambda j: _patch_job(j).update(name="worker"),
        "bad manager": lambda j: j["spec"]["runtimePatches"][0].update(manager="launcher"),
        "missing runtime": lambda j: j["spec"]["runtimeRef"].update(name="torch-distributed"),
        "bad name": lambda j: j["metadata"].update(name="Rt_1"),
        "string nodes": lambda j: j["spec"]["trainer"].update(numNodes="2"),
    }
    for what, mutate in cases.items():
        job = copy.deepcopy(good)
        mutate(job)
        assert all_errors(job, rt, schemas), what
    bad_runtimes = {
        "two replicas": lambda r: _rjob(r).update(replicas=2),
        "no node container": lambda r: _rjob(r)["template"]["spec"]["template"]["spec"]["containers"][0].update(
            name="trainer"),
        "restart OnFailure with podFailurePolicy": lambda r: _rjob(r)["template"]["spec"]["template"]["spec"].update(
            restartPolicy="OnFailure"),
        "exit code 0 with In": lambda r: _exit_rule(r)["values"].insert(0, 0),
        "unknown strategy": lambda r: r["spec"]["template"]["spec"]["failurePolicy"].update(restartStrategy="Always"),
        "two ml policies": lambda r: r["spec"]["mlPolicy"].update(mpi={}),
        "unknown job failure reason": lambda r: r["spec"]["template"]["spec"]["failurePolicy"]["rules"][0].update(
            onJobFailureReasons=["Evicted"]),
        "gated in-place restart": lambda r: r["spec"]["template"]["spec"]["failurePolicy"].update(
            restartStrategy="InPlaceRestart"),
        "unknown target": lambda r: r["spec"]["template"]["spec"]["failurePolicy"]["rules"][0].update(
            targetReplicatedJobs=["worker"]),
    }
    for what, mutate in bad_runtimes.items():
        obj = copy.deepcopy(rt)
        mutate(obj)
        assert (crd_schema.schema_errors(obj, schemas["ClusterTrainingRuntime"])
                + crd_schema.runtime_admission_errors(obj)), what


def _patch_job(job):
    return job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]


def _pod_patch(job):
    return _patch_job(job)["template"]["spec"]["template"]["spec"]


def _rjob(rt):
    return rt["spec"]["template"]["spec"]["replicatedJobs"][0]


def _exit_rule(rt):
    return _rjob(rt)["template"]["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"]


def test_a_field_the_trainer_api_does_not_know_is_an_error_not_dropped():
    from kubeflow_trainer_api import models

    good = rendered()
    assert trainjob.to_dict(trainjob.typed(models.TrainerV1alpha1TrainJob, good)) == good
    bad = copy.deepcopy(good)
    bad["spec"]["trainer"]["nprocPerNode"] = 8  # the v1 spelling
    with pytest.raises(ValueError, match="does not know"):
        trainjob.typed(models.TrainerV1alpha1TrainJob, bad)


def test_same_job_shape_as_the_pytorchjob():
    """Volumes, mounts, resources, env, scheduling: the same parameters give the same pod parts."""
    from resilient_training.launch import pytorchjob

    shape = dict(nodes=4, gpus_per_node=8, efa_per_node=4, shm_size="128Gi", node_selector={"pool": "gpu"},
                 tolerations=[jobshape.parse_toleration("nvidia.com/gpu:NoSchedule")], service_account="sa-1",
                 env={"EXTRA": "1"})
    tj = rendered(**shape)
    pj = pytorchjob.to_dict(pytorchjob.build_job(spec(kind="pytorchjob", **shape)))
    pod = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    patch = _pod_patch(tj)
    assert patch["volumes"] == pod["volumes"]
    assert patch["containers"][0]["volumeMounts"] == container["volumeMounts"]
    for key in ("nodeSelector", "tolerations", "serviceAccountName", "terminationGracePeriodSeconds"):
        assert patch[key] == pod[key], key
    assert tj["spec"]["trainer"]["resourcesPerNode"] == container["resources"]
    assert tj["spec"]["trainer"]["env"] == container["env"]
    assert tj["spec"]["trainer"]["image"] == container["image"]
    # Same ft_launcher and trainer flags; the TrainJob adds only the rendezvous id.
    assert tj["spec"]["trainer"]["args"] == ["--rdzv-id=run-1", *container["args"]]
    assert "command" not in tj["spec"]["trainer"]  # the runtime's ft_launcher
    assert patch["containers"][0]["name"] == "node"


def test_runtime_leaves_rank_faults_to_nvrx_and_restarts_pods_only_when_killed():
    rt = runtime()
    jobset = rt["spec"]["template"]["spec"]
    job = _rjob(rt)["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    assert container["command"] == ["resilient-ft-launcher", "--rdzv-backend=c10d",
                                    "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    disrupted, deterministic = job["podFailurePolicy"]["rules"]
    assert disrupted == {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert deterministic["action"] == "FailJob"
    codes = set(deterministic["onExitCodes"]["values"])
    assert {1, 93} <= codes and not codes & {0, 128 + signal.SIGKILL, 128 + signal.SIGTERM}
    assert jobset["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    assert jobset["failurePolicy"]["maxRestarts"] == trainjob.RUNTIME_MAX_RESTARTS
    assert jobset["failurePolicy"]["rules"] == [{"action": "FailJobSet", "name": "deterministicFailure",
                                                 "onJobFailureReasons": ["PodFailurePolicy"],
                                                 "targetReplicatedJobs": ["node"]}]


def _job_outcome(job_spec: dict, exit_code: int, conditions: tuple[str, ...]) -> str:
    """What the Job controller does with one failed pod: Kubernetes' podFailurePolicy semantics
    (rules in order, the first match acts; no match counts) against ``backoffLimit``."""
    for rule in job_spec["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is not None:
            in_values = exit_code in codes["values"]
            if exit_code and (in_values if codes["operator"] == "In" else not in_values):
                break
        elif any(c["type"] in conditions and c.get("status", "True") == "True" for c in rule["onPodConditions"]):
            break
    else:
        rule = {"action": "Count"}
    if rule["action"] == "FailJob":
        return "PodFailurePolicy"
    if rule["action"] == "Ignore" or job_spec["backoffLimit"] > 0:
        return "pod replaced"
    return "BackoffLimitExceeded"


def _jobset_action(jobset: dict, reason: str, rjob: str) -> str:
    """JobSet's failurePolicy: the first rule matching the failed Job's reason and replicated job; else restart."""
    for rule in jobset["failurePolicy"]["rules"]:
        if (not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"]) and \
                (not rule.get("targetReplicatedJobs") or rjob in rule["targetReplicatedJobs"]):
            return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize(("exit_code", "conditions", "expected"), [
    (93, (), "FailJobSet"),  # the trainer's deterministic failure
    (1, (), "FailJobSet"),  # ft_launcher gave up after its restart budget
    (137, (), "RestartJobSet"),  # SIGKILL: OOM kill, node loss
    (143, (), "RestartJobSet"),  # SIGTERM from outside
    (1, ("DisruptionTarget",), "RestartJobSet"),  # evicted or preempted: ft_launcher exits 1 on SIGTERM
    (137, ("DisruptionTarget",), "RestartJobSet"),
])
def test_what_the_shipped_runtime_does_with_a_failed_pod(exit_code, conditions, expected):
    rt = yaml.safe_load((ROOT / "manifests" / "runtimes" / "nvrx-ft-launcher.yaml").read_text())
    rjob = _rjob(rt)
    reason = _job_outcome(rjob["template"]["spec"], exit_code, conditions)
    # By design a pod NVRx cannot save recreates the whole gang (JobSet), never one pod inside the Job
    # (node 0's agent hosts the c10d store: replacing it alone strands the others).
    outcome = reason if reason == "pod replaced" else _jobset_action(rt["spec"]["template"]["spec"], reason, rjob["name"])
    assert outcome == expected


def test_torchrun_when_ft_launcher_is_off():
    job = rendered(train=config.from_dict({"run_dir": REF.run_dir, "ft_launcher": False}))
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == ["python", "-m", "torch.distributed.run", *trainjob.RENDEZVOUS_FLAGS, "--rdzv-id=run-1"]
    assert trainer["args"][:2] == ["--max-restarts=6", "--monitor-interval=0.2"]
    assert trainer["args"][2:4] == ["-m", jobshape.WORKER_MODULE]


def test_on_another_runtime_the_trainer_command_is_given_in_full(schemas):
    """The Trainer's stock runtime has no command: with ours left out, the image's entrypoint got
    the ft_launcher flags (``--rdzv-id=...``) as its program."""
    stock = copy.deepcopy(schemas["stock"])
    job = trainjob.to_dict(trainjob.build_job(spec(), runtime=stock["metadata"]["name"]))
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == [trainjob.nvrx_adapter.FT_LAUNCHER_SCRIPT, *trainjob.RENDEZVOUS_FLAGS]
    assert trainer["args"][0] == "--rdzv-id=run-1" and jobshape.WORKER_MODULE in trainer["args"]
    assert all_errors(job, stock, schemas) == []
    # On ours, the runtime's command stays the one source of it.
    assert "command" not in rendered()["spec"]["trainer"]


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"min_nodes": 1, "nodes": 2}, "not elastic"),
    ({"priority_class": "high"}, "priority_class"),
    ({"backoff_limit": 5}, "maxRestarts"),
    ({"image_pull_policy": "Always"}, "image_pull_policy"),
    ({"env": {"PET_MASTER_PORT": "1"}}, "PET_"),
    ({"kind": "mpijob"}, "kind must be"),
])
def test_what_a_trainjob_cannot_express_is_refused(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        spec(**overrides)


def test_render_job_kind_trainjob(tmp_path, capsys):
    out = tmp_path / "tj.yaml"
    assert cli.main(["render-job", "--kind", "trainjob", "--name", "rt-cli", "--namespace", "team-a", "--nodes", "2",
                     "--gpus-per-node", "8", "--pvc", "claim", "--steps", "7", "-o", str(out)]) == 0
    job = yaml.safe_load(out.read_text())
    assert job["kind"] == "TrainJob" and job["spec"]["runtimeRef"]["name"] == trainjob.RUNTIME_NAME
    assert "--steps" in job["spec"]["trainer"]["args"]
    capsys.readouterr()
    for argv, needle in ((["--min-nodes", "1"], "not elastic"), (["--ttl", "60"], "--ttl"),
                         (["--runtime", "Bad_Name"], "--runtime")):
        bad = tmp_path / "bad.yaml"
        assert cli.main(["render-job", "--kind", "trainjob", "--name", "rt-cli", "--nodes", "2", "--gpus-per-node",
                         "8", "--pvc", "claim", "-o", str(bad), *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and not bad.exists()
    # The default kind is still the PyTorchJob.
    assert cli.main(["render-job", "--name", "rt-cli", "--nodes", "2", "--gpus-per-node", "8", "--pvc", "claim",
                     "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["kind"] == "PyTorchJob"


@pytest.fixture
def server():
    with kube_api.running() as s:
        yield s


def _api(server):
    api = k8s.ApiClient(server.configuration())
    return launch.TrainJobs(k8s.CustomObjectsApi(api), k8s.CoreV1Api(api), "team-a")


def test_launch_creates_waits_streams_node_0_and_succeeds(server):
    lines: list[str] = []
    outcome = launch.launch(spec(nodes=2), api=_api(server), timeout_s=10, poll_s=0.01, progress=lines.append)
    assert not outcome.attached
    created = server.get("trainjobs", "rt-r1", "team-a")
    assert created["spec"]["trainer"]["numNodes"] == 2
    assert ("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs") in server.state.requests
    assert any(line.startswith("[rt-r1-node-0-0-") and "loss" in line for line in lines)
    assert not any(line.startswith("[rt-r1-node-0-1-") for line in lines)  # worker-0 mode: node 0 only
    assert "TrainJob team-a/rt-r1 succeeded" in lines[-1]


def test_retried_step_attaches_and_a_failed_one_is_recreated(server):
    server.state.job_timeline = [Phase("Running")]
    with pytest.raises(TimeoutError):
        launch.launch(spec(), api=_api(server), timeout_s=0.05, poll_s=0.01, delete_on_timeout=False,
                      progress=print)
    server.state.job_timeline = [Phase("Running"), Phase("Succeeded")]
    server.state.job_progress.clear()
    lines: list[str] = []
    assert launch.launch(spec(), api=_api(server), timeout_s=10, poll_s=0.01, progress=lines.append).attached
    assert any("already exists" in line for line in lines)
    # Now leave it Failed: the next attempt deletes and recreates it.
    server.state.job_timeline = [Phase("Failed", exit_code=137)]
    server.state.job_progress.clear()
    with pytest.raises(launch.JobFailed):
        launch.launch(spec(), api=_api(server), timeout_s=10, poll_s=0.01, progress=print)
    server.state.job_timeline = [Phase("Succeeded")]
    lines.clear()
    outcome = launch.launch(spec(), api=_api(server), timeout_s=10, poll_s=0.01, progress=lines.append)
    assert not outcome.attached and any("recreating it" in line for line in lines)


def test_failure_names_the_reason_exit_codes_and_log_tail(server):
    server.state.job_timeline = [Phase("Running"), Phase("Failed", reason="FailedJobs", message="jobset failed",
                                                          exit_code=93)]
    server.add_event("team-a", "Pod", "rt-r1-node-0-0-g0", "FailedMount", "claim not bound")
    server.add_event("team-a", "Job", "rt-r1-node-0", "BackoffLimitExceeded", "job has reached the backoff limit")
    # A decoy: another job whose name starts with this one's and its pod name.
    server.add_event("team-a", "Pod", "rt-r1-node-node-0-0-abcde", "FailedScheduling", "someone else's pod")
    with pytest.raises(launch.JobFailed) as info:
        launch.launch(spec(nodes=2), api=_api(server), timeout_s=10, poll_s=0.01, stream_logs="none", progress=print)
    text = str(info.value)
    assert "TrainJob team-a/rt-r1 failed: FailedJobs: jobset failed" in text
    assert "exit code 93" in text and "deterministic failure" in text
    assert "last log lines of rt-r1-node-0-0-g0" in text and "FailedMount" in text
    assert "BackoffLimitExceeded" in text and "someone else's pod" not in text


def test_sigterm_deletes_the_trainjob(server):
    server.state.job_timeline = [Phase("Running")]
    timer = threading.Timer(0.3, lambda: signal.raise_signal(signal.SIGTERM))
    timer.start()
    with pytest.raises(cancel.Cancelled):
        launch.launch(spec(), api=_api(server), timeout_s=30, poll_s=0.02, progress=print)
    timer.join()
    assert server.names("trainjobs") == []
    path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/rt-r1"
    assert ("DELETE", path) in server.state.requests
    # Foreground: the JobSet and its pods are gone before the TrainJob, so a re-created one never meets them.
    assert server.state.delete_options[path].get("propagationPolicy") == "Foreground"


def test_launch_training_dispatches_to_a_trainjob(server):
    from resilient_training.launch.backends import launch_training

    ref = StorageRef(backend="pvc", run_dir="/mnt/run/runs/run-7", mount_path="/mnt/run", namespace="team-a",
                     pvc_name="claim")
    name = launch_training(storage_ref=ref.to_json(), run_id="run-7", launcher="trainjob", nodes=2,
                           train={"steps": 9}, job_api=_api(server), poll_s=0.01, timeout_s=10, progress=print)
    assert name == jobshape.job_name_for_run("run-7") and server.names("trainjobs") == [name]
    with pytest.raises(ValueError, match="not elastic"):
        launch_training(storage_ref=ref.to_json(), run_id="run-7", launcher="trainjob", nodes=2, min_nodes=1,
                        job_api=_api(server), progress=print)


def test_an_empty_toleration_effect_or_key_is_left_out_as_kubernetes_reads_it():
    """Stranger trial: effect "" (any effect) passed every check, then the TrainJob's typed model
    (the CRD's enum) refused it in the launch step, after storage was made. Left out, it means the
    same for both job kinds."""
    from resilient_training.launch import pytorchjob

    tolerations = [{"key": "b", "operator": "Exists", "effect": ""}, {"key": "a", "value": "", "effect": ""}]
    for tol in tolerations:
        jobshape._check_toleration(tol)  # what every check before the launch lets through
    # (An empty key with Exists tolerates every taint, NoExecute too: refused, as render-job refuses it.)
    with pytest.raises(ValueError, match="Exists without a key tolerates every taint"):
        jobshape._check_toleration({"key": "", "operator": "Exists", "effect": ""})
    tj = rendered(tolerations=tolerations)
    pj = pytorchjob.to_dict(pytorchjob.build_job(spec(kind="pytorchjob", tolerations=tolerations)))
    expected = [{"key": "b", "operator": "Exists"}, {"key": "a"}]
    assert _pod_patch(tj)["tolerations"] == expected
    assert pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["tolerations"] == expected
