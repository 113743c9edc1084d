"""The recovery benchmark's teardown deletes every strategy job its run made, and nothing else.

``run_strategies`` launches one job per strategy, under the run id ``<run id>-<name>``; if that
step dies without its SIGTERM handler (OOM kill, node loss, SIGKILL), those jobs (still holding
GPUs) are left on the cluster, and the exit handler's teardown must find them. The jobs here are
made by the real ``run_strategies`` (so with launch's own names and labels) against the in-test
API server, through the real kubernetes and kubeflow-training clients.
"""

from __future__ import annotations

import json

import pytest
import yaml
from kfp import compiler
from kubeflow.training import TrainingClient
from kubernetes import client as k8s

from resilient_training.bench.strategy import DEFAULT_STRATEGIES, parse_strategy, run_strategies, strategy_run_ids
from resilient_training.components.teardown_storage import teardown_storage
from resilient_training.launch import jobshape, trainjob, watch
from resilient_training.launch.jobshape import job_name_for_run
from resilient_training.pipelines import PIPELINES
from resilient_training.run.storage_ref import StorageRef
from resilient_training.storage.teardown import teardown
from resilient_training.storage.teardown import teardown_storage as teardown_storage_fn
from tests.support import kube_api

NAMESPACE = "team-a"
CLAIM = "bench-claim"  # the user's claim (storage=pvc): teardown keeps it
NAMES = [parse_strategy(s)[0] for s in DEFAULT_STRATEGIES]
PLURALS = {"pytorchjob": "pytorchjobs", "trainjob": "trainjobs"}


class Killed(BaseException):
    """The step's pod killed mid-benchmark (SIGKILL, OOM kill): no SIGTERM handler runs, nothing is deleted."""


def strategy_jobs(run_id: str, names=NAMES) -> list[str]:
    return [job_name_for_run(f"{run_id}-{name}") for name in names]


@pytest.fixture
def kube():
    with kube_api.running() as server:
        api = k8s.ApiClient(server.configuration())
        yield server, k8s.CoreV1Api(api), TrainingClient(client_configuration=server.configuration(),
                                                         namespace=NAMESPACE)


def bench(server, training, run_id, *, kind="pytorchjob", strategies=DEFAULT_STRATEGIES, killed_after=0):
    """The benchmark's run_strategies step on the API stand-in; ``killed_after`` N created jobs, it dies."""
    ref = StorageRef(backend="pvc", run_dir=f"/mnt/run/runs/{run_id}", mount_path="/mnt/run", namespace=NAMESPACE,
                     pvc_name=CLAIM)
    created = []

    def progress(line: str) -> None:
        if line.startswith("created "):
            created.append(line)
            if len(created) == killed_after:
                raise Killed(line)

    job_api = None
    if kind == "trainjob":
        api = k8s.ApiClient(server.configuration())
        job_api = watch.TrainJobs(k8s.CustomObjectsApi(api), k8s.CoreV1Api(api), NAMESPACE)
    kwargs = dict(storage_ref=ref.to_json(), run_id=run_id, strategies=strategies, launcher=kind,
                  train={"steps": 4, "checkpoint_every": 2}, nodes=1, gpus_per_node=0, procs_per_node=1,
                  training_client=training, job_api=job_api, poll_s=0.01, stream_logs="none", progress=progress)
    if killed_after:
        with pytest.raises(Killed):
            run_strategies(**kwargs)
    else:
        run_strategies(**kwargs)
    return created


def test_the_component_deletes_every_strategy_job_of_a_killed_benchmark_and_not_a_prefix_runs(
        kfp_local, kube, tmp_path, monkeypatch):
    """Run ``abc`` dies while its second strategy trains; run ``abc-1`` (an id ours is a prefix of) has
    the same strategies. ``abc``'s teardown, through the component as KFP runs it, deletes ``abc``'s two
    jobs and only them."""
    server, _, training = kube
    assert len(bench(server, training, "abc", killed_after=2)) == 2
    bench(server, training, "abc-1")
    ours, theirs = strategy_jobs("abc"), strategy_jobs("abc-1")
    assert server.names("pytorchjobs") == sorted([*ours[:2], *theirs])
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    task = teardown_storage(run_id="abc", storage="pvc", namespace=NAMESPACE, pvc_name=CLAIM,
                            strategies=DEFAULT_STRATEGIES)
    done = json.loads(task.output)
    own = job_name_for_run("abc")  # the name a resilient-training run's job would have: none here
    assert done == {f"pytorchjob/{own}": "gone", f"trainjob/{own}": "gone",
                    f"pytorchjob/{ours[0]}": "deleted", f"pytorchjob/{ours[1]}": "deleted",
                    f"pytorchjob/{ours[2]}": "gone", f"pytorchjob/{ours[3]}": "gone",
                    **{f"trainjob/{name}": "gone" for name in ours}, f"pvc/{CLAIM}": "kept"}
    assert server.names("pytorchjobs") == sorted(theirs)  # the other run's jobs, all four, untouched
    assert not any(p.startswith(tuple(ours)) for p in server.names("pods"))  # the GPUs' pods went with them
    again = json.loads(teardown_storage(run_id="abc", storage="pvc", namespace=NAMESPACE, pvc_name=CLAIM,
                                        strategies=DEFAULT_STRATEGIES).output)
    assert set(again.values()) == {"gone", "kept"}


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_teardown_deletes_all_strategy_jobs_of_either_kind_and_leaves_another_runs(kube, kind):
    server, core, training = kube
    bench(server, training, "abc", kind=kind)
    bench(server, training, "abc-1", kind=kind)
    ours, theirs = strategy_jobs("abc"), strategy_jobs("abc-1")
    lines: list[str] = []
    done = teardown_storage_fn(run_id="abc", storage="pvc", namespace=NAMESPACE, pvc_name=CLAIM,
                               job_run_ids=strategy_run_ids("abc", DEFAULT_STRATEGIES), core_api=core,
                               training_client=training, progress=lines.append)
    assert {name: done[f"{kind}/{name}"] for name in ours} == dict.fromkeys(ours, "deleted")
    assert server.names(PLURALS[kind]) == sorted(theirs)
    if kind == "trainjob":  # foreground (the JobSet's pods first), and only the job that was read
        options = server.state.delete_options[
            f"/apis/{trainjob.GROUP}/{trainjob.VERSION}/namespaces/{NAMESPACE}/trainjobs/{ours[0]}"]
        assert options["propagationPolicy"] == "Foreground" and options["preconditions"]["uid"]
    assert f"k8s: deleted {'PyTorchJob' if kind == 'pytorchjob' else 'TrainJob'} {NAMESPACE}/{ours[0]}" in lines
    # Its own teardown deletes the other run's.
    teardown_storage_fn(run_id="abc-1", storage="pvc", namespace=NAMESPACE, pvc_name=CLAIM,
                        job_run_ids=strategy_run_ids("abc-1", DEFAULT_STRATEGIES), core_api=core,
                        training_client=training, progress=lines.append)
    assert server.names(PLURALS[kind]) == []


def test_a_job_under_a_strategy_name_without_the_runs_label_is_left_and_named(kube):
    """A job with the derived name of one of our strategies but no run-id label, or another run's
    label, is not ours: it is left, its key reads ``kept`` and a line names it. The strategy job
    that does carry our label is deleted."""
    server, core, training = kube
    bench(server, training, "abc", strategies=DEFAULT_STRATEGIES[2:3])
    unlabelled, foreign, ours = strategy_jobs("abc", NAMES[:3])
    custom = k8s.CustomObjectsApi(core.api_client)
    for name, labels in ((unlabelled, {}), (foreign, {jobshape.RUN_ID_LABEL: "someone-else"})):
        custom.create_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", {
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "labels": labels},
            "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1}}}})
    lines: list[str] = []
    done = teardown_storage_fn(run_id="abc", storage="pvc", namespace=NAMESPACE, pvc_name=CLAIM,
                               job_run_ids=strategy_run_ids("abc", DEFAULT_STRATEGIES), core_api=core,
                               training_client=training, progress=lines.append)
    assert done[f"pytorchjob/{unlabelled}"] == done[f"pytorchjob/{foreign}"] == "kept"
    assert done[f"pytorchjob/{ours}"] == "deleted"
    assert server.names("pytorchjobs") == sorted([unlabelled, foreign])
    assert (f"k8s: leaving PyTorchJob {NAMESPACE}/{unlabelled} alone: it has no label {jobshape.RUN_ID_LABEL}, "
            f"not this run's 'abc-{NAMES[0].replace('+', '-')}'") in lines
    assert (f"k8s: leaving PyTorchJob {NAMESPACE}/{foreign} alone: its label {jobshape.RUN_ID_LABEL} is "
            f"'someone-else', not this run's 'abc-{NAMES[1].replace('+', '-')}'") in lines


def test_an_api_error_on_one_strategy_job_is_reported_and_the_rest_still_deleted(kube):
    server, core, training = kube
    bench(server, training, "abc")
    ours = strategy_jobs("abc")
    server.state.fail_next[("GET", "pytorchjobs")] = 500  # reading the first strategy's job
    with pytest.raises(RuntimeError, match=rf"pytorchjob/{ours[0]}: .*500"):
        teardown_storage_fn(run_id="abc", storage="pvc", namespace=NAMESPACE, pvc_name=CLAIM,
                            job_run_ids=strategy_run_ids("abc", DEFAULT_STRATEGIES), core_api=core,
                            training_client=training, progress=lambda line: None)
    assert server.names("pytorchjobs") == [ours[0]]  # the other three went all the same
    server.state.fail_next[("DELETE", "pytorchjobs")] = 403  # now the delete itself is refused
    ref = StorageRef(backend="pvc", run_dir="/mnt/run/runs/abc", mount_path="/mnt/run", namespace=NAMESPACE,
                     pvc_name=CLAIM)
    with pytest.raises(RuntimeError, match=rf"pytorchjob/{ours[0]}: .*403"):
        teardown(ref, run_id="abc", job_run_ids=strategy_run_ids("abc", DEFAULT_STRATEGIES), core_api=core,
                 training_client=training, progress=lambda line: None)
    assert server.names("pytorchjobs") == [ours[0]]
    assert set(teardown(ref, run_id="abc", job_run_ids=strategy_run_ids("abc", DEFAULT_STRATEGIES), core_api=core,
                        training_client=training, progress=lambda line: None).values()) == {"deleted", "gone", "kept"}
    assert server.names("pytorchjobs") == []


def test_the_benchmark_pipeline_gives_teardown_its_strategies(tmp_path):
    path = tmp_path / "bench.yaml"
    compiler.Compiler().compile(PIPELINES["recovery-benchmark"], str(path))
    spec = next(yaml.safe_load_all(path.read_text()))
    teardown = spec["root"]["dag"]["tasks"]["teardown-storage"]
    assert teardown["inputs"]["parameters"]["strategies"] == {"componentInputParameter": "strategies"}


def test_strategy_run_ids_skip_what_run_strategies_refuses():
    """run_strategies refuses a list holding one of these before training any: no job was made for it."""
    assert strategy_run_ids("abc", [{"name": "a"}, {"name": "a"}, {"name": "../x"}, {"x": 1}, "b", {"name": "c"}]) \
        == ["abc-a", "abc-c"]
