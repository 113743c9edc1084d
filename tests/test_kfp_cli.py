"""compile / upload / submit / schedule / runs / schedules: the real CLI and the real kfp.Client
against a small stateful KFP v2beta1 API server (tests/support/kfp_api_server.py)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kfp import components

from resilient_training.cli.main import main
from resilient_training.kfp.compile import compile_pipeline
from tests.support.kfp_api_server import API, FakeKfpServer
from tests.support.kfp_fixture_pipelines import PIPELINES, PIPELINES_CHANGED

REPO = Path(__file__).resolve().parent.parent
REGISTRY = "tests.support.kfp_fixture_pipelines:PIPELINES"
CHANGED = "tests.support.kfp_fixture_pipelines:PIPELINES_CHANGED"
VERSION_NAME = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{12}$")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    # The developer's own endpoint, token or pod credentials must not leak into these tests.
    for name in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_TOKEN", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-such-token"))


@pytest.fixture
def server():
    with FakeKfpServer() as fake:
        yield fake


@pytest.fixture
def cli(capsys):
    def run(*args: str) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def compiled_hash(tmp_path: Path, registry: dict, key: str = "tiny-train") -> tuple[str, dict]:
    compiled = compile_pipeline(key, registry[key], tmp_path / "expected" / f"{key}.yaml")
    return compiled.content_hash, compiled.spec


# --- compile -------------------------------------------------------------------------------


def test_compile_writes_yaml_that_loads_back_with_the_dag(cli, tmp_path):
    code, out, err = cli("compile", "--registry", REGISTRY, "-o", tmp_path / "out")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tiny-bench.yaml", "tiny-train.yaml"]
    assert f"tiny-train: {tmp_path / 'out' / 'tiny-train.yaml'}" in out

    path = tmp_path / "out" / "tiny-train.yaml"
    loaded = components.load_component_from_file(str(path))
    assert loaded.name == "tiny-train"
    assert loaded.component_spec.inputs["nodes"].default == 2
    spec, platform = yaml.safe_load_all(path.read_text())
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"exit-handler-1", "teardown"}
    assert tasks["teardown"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert inner["condition-2"]["taskInfo"]["name"] == "converged"
    assert "tolerance" in inner["condition-2"]["triggerPolicy"]["condition"]
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["backend"] == {
        "defaultValue": "local", "description": "storage backend, local | pvc | fsx.",
        "isOptional": True, "parameterType": "STRING",
    }
    assert "isOptional" not in parameters["run_id"]
    assert platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]["imagePullSecret"]


def test_compile_one_pipeline_to_a_file_and_refuse_unknown_names(cli, tmp_path):
    code, out, err = cli("compile", "--registry", REGISTRY, "--pipeline", "tiny-bench", "-o", tmp_path / "b.yaml")
    assert code == 0, err
    assert components.load_component_from_file(str(tmp_path / "b.yaml")).name == "tiny-bench"

    code, out, err = cli("compile", "--registry", REGISTRY, "-o", tmp_path / "both.yaml")
    assert code == 2
    assert "is one file but 2 pipelines are selected (tiny-train, tiny-bench)" in err
    assert not (tmp_path / "both.yaml").exists()

    code, out, err = cli("compile", "--registry", REGISTRY, "--pipeline", "nope", "-o", tmp_path / "x")
    assert (code, err) == (2, "error: unknown pipeline 'nope'; known pipelines: tiny-train, tiny-bench\n")

    code, out, err = cli("compile", "--registry", "tests.support.kfp_fixture_pipelines:NOTHING", "-o", tmp_path / "x")
    assert (code, err) == (
        2, "error: no pipelines registered: tests.support.kfp_fixture_pipelines.NOTHING is missing or empty\n")


def test_the_projects_own_pipelines_compile_and_load_back(cli, tmp_path):
    from resilient_training import pipelines

    registry = pipelines.PIPELINES
    assert set(registry) == {"resilient-training", "recovery-benchmark"}
    code, out, err = cli("compile", "-o", tmp_path / "out")
    assert code == 0, err
    for key in registry:
        assert components.load_component_from_file(str(tmp_path / "out" / f"{key}.yaml"))


# --- upload --------------------------------------------------------------------------------


def test_upload_creates_then_adds_versions_and_never_uploads_the_same_content_twice(cli, tmp_path):
    first_hash, first_spec = compiled_hash(tmp_path, PIPELINES)
    changed_hash, _ = compiled_hash(tmp_path, PIPELINES_CHANGED)
    assert first_hash != changed_hash
    # One item per page, so finding earlier content has to walk every page.
    with FakeKfpServer(max_page_size=1) as server:
        code, out, err = cli("upload", "--host", server.url, "--registry", REGISTRY)
        assert code == 0, err
        [pipeline] = server.pipelines.values()
        [version] = server.versions.values()
        assert pipeline["display_name"] == "tiny-train"
        assert pipeline["description"] == "Tiny training pipeline for the CLI tests."
        assert VERSION_NAME.match(version["display_name"]) and version["display_name"].endswith(first_hash[:12])
        assert f"content sha256:{first_hash}" in version["description"]
        assert version["pipeline_spec"] == first_spec  # the multipart upload carried the compiled file
        assert f"created pipeline 'tiny-train' (id {pipeline['pipeline_id']})" in out
        assert f"{server.url}/#/pipelines/details/{pipeline['pipeline_id']}/version/{version['pipeline_version_id']}" in out

        code, out, err = cli("upload", "--host", server.url, "--registry", REGISTRY)
        assert code == 0, err
        assert out.startswith(f"unchanged: version '{version['display_name']}' of 'tiny-train' already holds this content")
        assert len(server.calls("POST", f"{API}/pipelines/upload_version")) == 1

        code, out, err = cli("upload", "--host", server.url, "--registry", CHANGED)
        assert code == 0, err
        assert len(server.versions) == 2
        assert out.startswith("uploaded version ")

        code, out, err = cli("upload", "--host", server.url, "--registry", CHANGED, "--version", "v1.0")
        assert code == 0, err
        assert [v["display_name"] for v in server.versions.values()][-1] == "v1.0"
        code, out, err = cli("upload", "--host", server.url, "--registry", CHANGED, "--version", "v1.0")
        assert code == 0 and out.startswith("unchanged: version 'v1.0'"), out + err

        # The first content again: found on the last page, nothing uploaded.
        code, out, err = cli("upload", "--host", server.url, "--registry", REGISTRY)
        assert code == 0 and out.startswith(f"unchanged: version '{version['display_name']}'"), out + err

        code, out, err = cli("upload", "--host", server.url, "--registry", REGISTRY, "--version", "v1.0")
        assert code == 1
        assert err == (f"error: pipeline 'tiny-train' on {server.url} already has a version 'v1.0' with other content; "
                       "choose another --version\n")
        assert len(server.versions) == 3
        assert len(server.pipelines) == 1
        assert len(server.calls("POST", f"{API}/pipelines")) == 1


def test_upload_a_compiled_file_under_another_name(cli, server, tmp_path):
    cli("compile", "--registry", REGISTRY, "--pipeline", "tiny-bench", "-o", tmp_path / "bench.yaml")
    code, out, err = cli("upload", "--host", server.url, "--package", tmp_path / "bench.yaml", "--name", "nightly-bench")
    assert code == 0, err
    [pipeline] = server.pipelines.values()
    [version] = server.versions.values()
    assert pipeline["display_name"] == "nightly-bench"
    assert version["pipeline_spec"]["pipelineInfo"]["name"] == "tiny-bench"


# --- submit --------------------------------------------------------------------------------


def test_submit_runs_the_newest_uploaded_version_in_an_experiment_created_once(cli, server):
    assert cli("upload", "--host", server.url, "--registry", REGISTRY)[0] == 0
    assert cli("upload", "--host", server.url, "--registry", CHANGED, "--version", "v2")[0] == 0
    [old, new] = server.versions.values()

    code, out, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--experiment", "nightly",
                         "--param", "run_id=r1", "--param", "nodes=3", "--param", "inject_faults=false")
    assert code == 0, err
    [experiment] = server.experiments.values()
    assert experiment["display_name"] == "nightly"
    [run] = server.runs.values()
    assert run["experiment_id"] == experiment["experiment_id"]
    assert run["pipeline_version_reference"] == {
        "pipeline_id": new["pipeline_id"], "pipeline_version_id": new["pipeline_version_id"],
    }
    assert "pipeline_spec" not in run
    assert run["runtime_config"]["parameters"] == {"run_id": "r1", "nodes": 3, "inject_faults": False}
    assert re.match(r"^tiny-train-\d{8}-\d{6}$", run["display_name"])
    assert f"created experiment 'nightly' (id {experiment['experiment_id']})" in out
    assert "from tiny-train version v2" in out
    assert f"{server.url}/#/runs/details/{run['run_id']}" in out

    code, out, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--experiment", "nightly",
                         "--param", "run_id=r2", "--run-name", "second", "--version", old["display_name"])
    assert code == 0, err
    assert len(server.experiments) == 1
    assert "using experiment 'nightly'" in out
    second = list(server.runs.values())[-1]
    assert second["display_name"] == "second"
    assert second["pipeline_version_reference"]["pipeline_version_id"] == old["pipeline_version_id"]


def test_submit_with_the_package_sends_the_spec_and_needs_no_upload(cli, server, tmp_path):
    _, spec = compiled_hash(tmp_path, PIPELINES)
    code, out, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--package", "--param", "run_id=p1",
                         "--namespace", "team-a")
    assert code == 0, err
    assert server.pipelines == {}
    [run] = server.runs.values()
    assert "pipeline_version_reference" not in run
    # kfp.Client sends the PipelineSpec and, beside it, the Kubernetes platform spec.
    assert run["pipeline_spec"]["pipeline_spec"]["pipelineInfo"] == spec["pipelineInfo"]
    assert run["pipeline_spec"]["platform_spec"]["platforms"]["kubernetes"]
    [experiment] = server.experiments.values()
    assert (experiment["display_name"], experiment["namespace"]) == ("resilient-training", "team-a")

    cli("compile", "--registry", REGISTRY, "--pipeline", "tiny-bench", "-o", tmp_path / "bench.yaml")
    code, out, err = cli("submit", "--host", server.url, "--package", tmp_path / "bench.yaml", "--param", "repeats=5")
    assert code == 0, err
    bench = list(server.runs.values())[-1]
    assert bench["pipeline_spec"]["pipelineInfo"]["name"] == "tiny-bench"
    assert bench["runtime_config"]["parameters"] == {"repeats": 5}


def test_submit_and_schedule_say_whether_steps_are_cached_and_send_caching_off(cli, server, tmp_path):
    # The project's own pipeline: caching compiled off in every DAG (exit handler, conditions).
    code, out, err = cli("submit", "--host", server.url, "--package", "--param", "storage=pvc", "--param",
                         "pvc_name=data", "--param", "promote_to=s3://models/x", "--param", "launcher=pytorchjob")
    assert code == 0, err
    assert "caching: off for all 8 steps (compiled in: a KFP server runs each step anew, never from an earlier run)" in out
    [run] = server.runs.values()
    assert "enableCache: true" not in yaml.safe_dump(run["pipeline_spec"])
    code, out, err = cli("schedule", "--host", server.url, "--package", "--pipeline", "recovery-benchmark",
                         "--cron", "0 0 2 * * *", "--param", "storage=pvc", "--param", "pvc_name=data",
                         "--param", "launcher=pytorchjob")
    assert code == 0, err
    assert "caching: off for all 5 steps" in out
    # A pipeline compiled with KFP's default (caching on) is named as such, step by step; kfp.Client's
    # enable_caching=False still reaches the top-level tasks of a sent package.
    code, out, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--package", "--param", "run_id=c")
    assert code == 0, err
    assert "caching: ON for 3 of 3 steps (comp-condition-2/promote, comp-exit-handler-1/train, root/teardown)" in out
    root = list(server.runs.values())[-1]["pipeline_spec"]["pipeline_spec"]["root"]["dag"]["tasks"]
    assert root["teardown"]["cachingOptions"] == {}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # Each typed right, so the KFP server would take it; a step of the run (of every scheduled
        # run) would refuse it minutes later (stranger trial). Refused here with that step's rule.
        (["nodes=-1", "storage=pvc", "pvc_name=data", "launcher=pytorchjob"], "--param: nodes must be an integer from 1"),
        (["launcher=bogus"], "--param: launcher must be one of local, pytorchjob, trainjob, got 'bogus'"),
        (["faults=garbage"], "--param: faults: bad fault 'garbage'"),
        (["faults=sigkill@12:5"], "rank 5 does not exist (world size 2)"),
        (["storage=pvc", "pvc_name=Training_Data"], "--param: pvc_name 'Training_Data' is not a DNS-1123 subdomain"),
        (["storage=pvc"], "storage 'pvc' needs pvc_name"),
        (["launcher=trainjob"], "launcher 'trainjob' needs storage every pod can mount (pvc or fsx), got 'local'"),
        (["storage=pvc", "pvc_name=data", "launcher=pytorchjob", "trainer_image=ghcr.io/Org/trainer:1"],
         "is not an image reference"),
        (["train_overrides={\"seed\": 18446744073709551616}"], "seed must be between 0 and 4294967295"),
        (["train_overrides={\"step_seconds\": 1e308}"], "step_seconds must be between 0 and 3600"),
        (["min_improvement=1.5"], "min_improvement must be a finite number in [0, 1)"),
        (["export=onnx"], "--param: export 'onnx'"),
        (["namespace=team-a\n", "storage=pvc", "pvc_name=data"], "contains a control character"),
        # Found by the next stranger trial: each passed the first version of the check.
        ([], "storage 'local' is a directory on one machine"),
        (["storage=pvc", "pvc_name=data", "launcher=pytorchjob", "promote_to=s3://models/x "],
         "parameter 'promote_to' value 's3://models/x ' has blanks around it"),
        (["storage=pvc", "pvc_name=data", "promote_to=promoted"], "promote_to 'promoted' is relative"),
        (["storage=pvc", "pvc_name=data", "promote_to=/mnt/run/runs"], "contains the run directory"),
        (["storage=pvc", "pvc_name=data", "promote_to=/"], "is not on the run's claim (/mnt/run)"),
        # Lost with the promote step's pod as a relative path is (stranger trial): refused too.
        (["storage=pvc", "pvc_name=data", "promote_to=/tmp/models"], "promote_to '/tmp/models' is not on the run's claim"),
        (["storage=pvc", "pvc_name=data", "promote_to=S3://models/x"], "only a directory or s3://bucket/prefix (lowercase"),
        (["storage=pvc", "pvc_name=data", "promote_to=/mnt/run/promoted", "export=hf"],
         "export 'hf' writes a transformers model"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "train_overrides={\"steps\": 5}"],
         "train_overrides sets 'steps', which the pipeline's steps parameter overwrites"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "train_overrides={\"checkpoint\": {\"every\": 7}}"],
         "train_overrides sets checkpoint.every"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "task=resilient_training.tasks.gpt:task "],
         "has blanks around it"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "task_args={\" lr\": \"0.1\"}"],
         "task argument name ' lr' has blanks around it"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "task_args={\"lr\": \"1\", \"lr\": \"2\"}"],
         "key 'lr' is given twice"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "train_overrides={\"min_world_size\": 3}"],
         "min_world_size 3 exceeds the world size 2"),
        # Stranger trial: the FSx sizing was dropped without a word under storage=pvc.
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "launcher=pytorchjob", "fsx_capacity_gib=2400"],
         "--param: fsx_capacity_gib is for storage=fsx, and storage 'pvc' would ignore it"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "launcher=trainjob", "nodes=2",
          "procs_per_node=2", "gpus_per_node=2", "train_overrides={\"restart\": {\"min_world_size\": 5}}"],
         "min_world_size 5 exceeds the world size 4 (nodes 2 x 2 per node)"),
        (["storage=fsx", "fsx_file_system_id=fs-0123456789abcdef0", "region=us-east-1 ", "promote_to=s3://m/x"],
         "parameter 'region' value 'us-east-1 ' has blanks around it"),
        (["storage=fsx", "fsx_subnet_id=subnet-1", "fsx_security_group_ids=sg-0123456789abcdef0"],
         "fsx_subnet_id 'subnet-1' is not a subnet id"),
        # A PERSISTENT_2 file system could not be made from the pipeline (no throughput parameter; stranger trial).
        (["storage=fsx", "fsx_subnet_id=subnet-0123456789abcdef0", "fsx_security_group_ids=sg-0123456789abcdef0",
          "promote_to=s3://models/x", "fsx_deployment_type=PERSISTENT_2"],
         "--param: fsx_deployment_type PERSISTENT_2 needs fsx_per_unit_throughput in (125, 250, 500, 1000) MB/s/TiB, "
         "got 0"),
        (["storage=pvc", "pvc_name=data", "launcher=pytorchjob", "promote_to=s3://models/x",
          "trainer_image=ghcr.io/org/trainer@sha256:" + "a" * 32], "trainer_image 'ghcr.io/org/trainer@sha256:"),
        (["nodes=٤"], "parameter 'nodes' must be an integer, got '٤'"),
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "steps=1", "faults="],
         "--param: steps 1: the convergence gate compares the loss of the first steps with that of the last"),
        # Found only by every worker before (stranger trial): a shipped task is made here with the run's task_args.
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "task=resilient_training.tasks.llama:task",
          "task_args={\"seqlen\": \"64\"}"], "task_args: task resilient_training.tasks.llama:task raised while being "
         "created: ValueError: llama task: unknown task arg seqlen (known: preset, data, seq_len,"),
        # The built-in task's settings with another task were accepted and ignored (stranger trial).
        (["storage=pvc", "pvc_name=data", "promote_to=s3://models/x", "task=resilient_training.tasks.llama:task",
          "train_overrides={\"lr\": 0.5}"], "train_overrides lr: the built-in task's settings, which task "
         "resilient_training.tasks.llama:task never reads: put what it takes in task_args"),
    ],
)
def test_the_resilient_training_pipeline_s_arguments_are_checked_by_its_steps_rules(cli, server, params, message):
    code, _, err = cli("submit", "--host", server.url, "--package", *[a for p in params for a in ("--param", p)])
    assert code == 2, err
    assert message in err and err.count("\n") == 1 and err.startswith("error: "), err
    assert server.requests == []


def test_a_schedule_must_promote_each_run_to_a_place_of_its_own(cli, server):
    # One run may promote to a fixed place; a schedule's second run would find the first one's model there.
    base = ["storage=pvc", "pvc_name=data", "launcher=pytorchjob"]
    code, _, err = cli("schedule", "--host", server.url, "--package", "--cron", "0 0 2 * * *",
                       *[a for p in [*base, "promote_to=/mnt/run/promoted"] for a in ("--param", p)])
    assert code == 2 and err == (
        "error: --param: promote_to '/mnt/run/promoted' is the same place for every scheduled run: the first run's "
        "model takes it and promotion refuses every later one; put {run_id} in it (the run's id), e.g. "
        "/mnt/run/promoted/{run_id}\n")
    assert server.requests == []
    code, _, err = cli("submit", "--host", server.url, "--package",
                       *[a for p in [*base, "promote_to=/mnt/run/promoted"] for a in ("--param", p)])
    assert code == 0, err


def test_a_persistent_2_file_system_is_requested_with_its_throughput(cli, server):
    params = ["storage=fsx", "fsx_subnet_id=subnet-0123456789abcdef0", "fsx_security_group_ids=sg-0123456789abcdef0",
              "promote_to=s3://models/x", "fsx_deployment_type=PERSISTENT_2", "fsx_per_unit_throughput=250",
              "fsx_capacity_gib=2400", "launcher=trainjob"]
    code, _, err = cli("submit", "--host", server.url, "--package", *[a for p in params for a in ("--param", p)])
    assert code == 0, err
    [run] = server.runs.values()
    assert run["runtime_config"]["parameters"]["fsx_per_unit_throughput"] == 250


def test_good_arguments_of_the_resilient_training_pipeline_are_sent(cli, server):
    params = ["storage=pvc", "pvc_name=training-data", "launcher=pytorchjob", "nodes=2", "faults=sigkill@12:3",
              "trainer_image=123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1.0", "export=safetensors",
              "promote_to=s3://models/llama-ft/{run_id}", "task_args={\"seq_len\": 64}"]
    code, _, err = cli("schedule", "--host", server.url, "--package", "--cron", "0 0 2 * * *",
                       *[a for p in params for a in ("--param", p)])
    assert code == 0, err
    [job] = server.recurring_runs.values()
    assert job["runtime_config"]["parameters"]["nodes"] == 2  # rank 3 exists: 2 nodes x 8 GPUs


def test_submit_before_upload_says_how_to_upload(cli, server):
    code, out, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--param", "run_id=x")
    assert code == 1
    assert err == (f"error: pipeline 'tiny-train' is not on {server.url}; upload it first "
                   f"(resilient-training upload --host {server.url}) or send the package with --package\n")
    assert server.runs == {} and server.experiments == {}


# --- schedule ------------------------------------------------------------------------------


def test_schedule_sends_cron_concurrency_catchup_and_params(cli, server):
    assert cli("upload", "--host", server.url, "--registry", REGISTRY)[0] == 0
    [version] = server.versions.values()
    code, out, err = cli("schedule", "--host", server.url, "--registry", REGISTRY, "--cron", "0 0 2 * * *",
                         "--max-concurrency", "3", "--no-catchup", "--param", "run_id=nightly", "--param", "nodes=4",
                         "--job-name", "nightly")
    assert code == 0, err
    [sent] = [r.json for r in server.calls("POST", f"{API}/recurringruns")]
    assert sent["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}
    assert sent["max_concurrency"] == 3
    assert sent["no_catchup"] is True
    assert sent["mode"] == "ENABLE"
    assert sent["display_name"] == "nightly"
    assert sent["runtime_config"]["parameters"] == {"run_id": "nightly", "nodes": 4}
    assert sent["pipeline_version_reference"]["pipeline_version_id"] == version["pipeline_version_id"]
    [job] = server.recurring_runs.values()
    assert f"recurring run 'nightly' created (id {job['recurring_run_id']})" in out
    assert "cron '0 0 2 * * *', max concurrency 1" not in out and "max concurrency 3, catchup off" in out
    assert f"{server.url}/#/recurringrun/details/{job['recurring_run_id']}" in out

    code, out, err = cli("schedule", "--host", server.url, "--registry", REGISTRY, "--cron", "0 30 9 ? * MON-FRI",
                         "--param", "run_id=weekday")
    assert code == 0, err
    weekday = server.calls("POST", f"{API}/recurringruns")[-1].json
    assert (weekday["display_name"], weekday["max_concurrency"], weekday["no_catchup"]) == ("tiny-train-schedule", 1, False)

    code, out, err = cli("schedule", "--host", server.url, "--registry", REGISTRY, "--cron", "0 0 3 * * *",
                         "--param", "run_id=again", "--job-name", "nightly")
    assert code == 1
    assert f"a recurring run named 'nightly' already exists in that experiment on {server.url}" in err
    assert len(server.recurring_runs) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cron", "0 2 * * *"], "Did you mean '0 0 2 * * *'?"),
        (["--cron", "0 0 24 * * *"], "hour field: 24 is outside 0-23"),
        (["--cron", "0 0 2 * * *", "--max-concurrency", "0"], "--max-concurrency must be 1-10 (the KFP API's range), got 0"),
        (["--cron", "0 0 2 * * *", "--max-concurrency", "11"], "--max-concurrency must be 1-10"),
        (["--cron", "0 0 2 * * *", "--param", "nodes"], "--param 'nodes' is not key=value"),
        (["--cron", "0 0 2 * * *", "--param", "nodes=two"], "parameter 'nodes' must be an integer, got 'two'"),
        (["--cron", "0 0 2 * * *", "--param", "colour=red"], "unknown parameter 'colour'"),
        (["--cron", "0 0 2 * * *", "--pipeline", "nope"], "unknown pipeline 'nope'"),
        (["--cron", "0 0 2 * * *"], "missing required parameter(s): run_id"),
        (["--cron", "0 0 2 * * *", "--auth", "in-cluster"], "--auth in-cluster: no token file at"),
        (["--cron", "0 0 2 * * *", "--auth", "token"], "--auth token needs --token or $KF_PIPELINES_TOKEN"),
        # stranger trial: the token was dropped without a word
        (["--cron", "0 0 2 * * *", "--auth", "none", "--token", "abc"], "--token is not sent with --auth none"),
        (["--cron", "0 0 2 * * *", "--auth", "in-cluster", "--token", "abc"], "--token is not sent with --auth in-cluster"),
        (["--cron", "0 0 2 * * *", "--auth", "kubeconfig", "--token", "abc"], "--token is not sent with --auth kubeconfig"),
        (["--cron", "0 0 2 * * *", "--auth", "none", "--context", "c"], "--kubeconfig/--context are not read with"),
    ],
)
def test_bad_schedule_input_fails_before_any_request(cli, server, args, message):
    params = [] if "missing" in message or "--param" in args else ["--param", "run_id=x"]
    code, out, err = cli("schedule", "--host", server.url, "--registry", REGISTRY, *params, *args)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert server.requests == []


# --- runs / schedules ----------------------------------------------------------------------


def test_runs_and_schedules_list_compact_tables(cli, server):
    assert cli("upload", "--host", server.url, "--registry", REGISTRY)[0] == 0
    for experiment, name in (("a", "run-a1"), ("a", "run-a2"), ("b", "run-b1")):
        code, _, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--experiment", experiment,
                           "--run-name", name, "--param", "run_id=x")
        assert code == 0, err
    code, _, err = cli("schedule", "--host", server.url, "--registry", REGISTRY, "--experiment", "b", "--cron",
                       "0 0 2 * * *", "--max-concurrency", "2", "--no-catchup", "--param", "run_id=x",
                       "--job-name", "nightly")
    assert code == 0, err

    code, out, err = cli("runs", "--host", server.url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "ID", "NAME", "STATE", "CREATED", "FINISHED"]
    assert [line.split()[1] for line in lines[1:]] == ["run-b1", "run-a2", "run-a1"]  # newest first
    assert all(" PENDING " in line for line in lines[1:])

    code, out, err = cli("runs", "--host", server.url, "--experiment", "a", "--limit", "1")
    assert code == 0, err
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["run-a2"]

    code, out, err = cli("runs", "--host", server.url, "--experiment", "missing")
    assert (code, err) == (1, f"error: experiment 'missing' on {server.url}: No experiment is found with name missing.\n")

    code, out, err = cli("schedules", "--host", server.url)
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split() == ["RECURRING", "RUN", "ID", "NAME", "SCHEDULE", "MODE", "MAX", "CONC", "CATCHUP", "CREATED"]
    job_id = next(iter(server.recurring_runs))
    assert row.split()[:9] == [job_id, "nightly", "cron", "0", "0", "2", "*", "*", "*"]
    assert row.split()[9:12] == ["ENABLE", "2", "off"]

    code, out, err = cli("schedules", "--host", server.url, "--experiment", "a")
    assert (code, out) == (0, "no recurring runs\n")


# --- hosts and credentials -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_host_is_one_clear_line(cli):
    host = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    code, out, err = cli("runs", "--host", host)
    assert code == 1
    assert err == f"error: cannot reach Kubeflow Pipelines at {host} (health check): connection refused\n"
    assert time.monotonic() - started < 5


def test_a_host_that_never_answers_times_out(cli):
    # Listening but never accepting: the connection opens (kernel backlog), no answer comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        host = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        code, out, err = cli("schedules", "--host", host, "--timeout", "0.5")
        assert time.monotonic() - started < 5
    assert (code, err) == (1, f"error: cannot reach Kubeflow Pipelines at {host} (health check): timed out\n")


def test_a_url_that_is_not_the_kfp_api_fails_at_once(cli, server):
    started = time.monotonic()
    code, out, err = cli("schedules", "--host", server.url + "/not-kfp/")
    assert code == 1
    assert "answered HTTP 404" in err and "is this the Kubeflow Pipelines API endpoint?" in err
    # kfp.Client alone would retry healthz 5 times, 5 s apart.
    assert time.monotonic() - started < 5
    assert [r.path for r in server.requests] == ["/not-kfp/apis/v2beta1/healthz"]


def test_a_login_page_instead_of_the_api_is_named(cli):
    with FakeKfpServer(login_proxy=True) as server:
        code, out, err = cli("runs", "--host", server.url)
    assert code == 1
    assert err == (f"error: {server.url} answered /apis/v2beta1/healthz with text/html; charset=utf-8, not the KFP API's "
                   "JSON (a login page? credentials used: none; see --token)\n")
    assert [r.path for r in server.requests] == ["/apis/v2beta1/healthz", "/login"]


def test_a_multi_user_server_needs_a_namespace_for_experiments_and_runs(cli):
    with FakeKfpServer(multi_user=True) as server:
        code, out, err = cli("runs", "--host", server.url)
        assert (code, err) == (1, f"error: {server.url} is a multi-user Kubeflow Pipelines: give --namespace "
                                  "(your profile's namespace) for experiments and runs\n")
        assert {r.path for r in server.requests} == {f"{API}/healthz"}  # ours, then kfp.Client's own
        code, out, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--package", "--param", "run_id=x",
                             "--namespace", "team-a")
        assert code == 0, err
        [experiment] = server.experiments.values()
        assert experiment["namespace"] == "team-a"
        code, out, err = cli("runs", "--host", server.url, "--namespace", "team-a")
        assert code == 0, err
        assert server.requests[-1].query["namespace"] == "team-a"


def test_host_needs_a_scheme_and_is_required(cli, server):
    code, out, err = cli("runs", "--host", "localhost:8080")
    assert (code, err) == (2, "error: --host must be an http:// or https:// URL, got 'localhost:8080'\n")
    code, out, err = cli("runs")
    assert (code, err) == (2, "error: --host URL is required (or set KF_PIPELINES_ENDPOINT)\n")
    code, out, err = cli("runs", "--host", server.url, "--timeout", "0")
    assert (code, err) == (2, "error: --timeout must be a positive number of seconds, got 0.0\n")
    code, out, err = cli("runs", "--host", server.url, "--limit", "0")
    assert (code, err) == (2, "error: --limit must be at least 1, got 0\n")
    assert server.requests == []


def write_kubeconfig(path: Path) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "main",
        "clusters": [{"name": "c", "cluster": {"server": "https://kubernetes.invalid"}}],
        "users": [{"name": "right", "user": {"token": "s3cret"}}, {"name": "wrong", "user": {"token": "nope"}},
                  {"name": "cert", "user": {"client-certificate-data": "eA==", "client-key-data": "eA=="}}],
        "contexts": [{"name": "main", "context": {"cluster": "c", "user": "right"}},
                     {"name": "other", "context": {"cluster": "c", "user": "wrong"}},
                     {"name": "certs", "context": {"cluster": "c", "user": "cert"}}],
    }
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("way", ["--token", "env", "in-cluster", "kubeconfig"])
def test_each_credential_source_sends_the_bearer_token(cli, monkeypatch, tmp_path, way):
    args = []
    if way == "--token":
        args = ["--token", "s3cret"]
    elif way == "env":
        monkeypatch.setenv("KF_PIPELINES_TOKEN", "s3cret")
    elif way == "in-cluster":
        (tmp_path / "token").write_text("s3cret\n")
        monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "token"))
    else:
        args = ["--kubeconfig", write_kubeconfig(tmp_path / "kubeconfig")]
    with FakeKfpServer(token="s3cret") as server:
        code, out, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--package", "--param", "run_id=x",
                             *args)
        assert code == 0, err
        assert len(server.runs) == 1
        assert {r.headers.get("authorization") for r in server.requests} == {"Bearer s3cret"}


def test_refused_credentials_say_which_were_used(cli, tmp_path):
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig")
    with FakeKfpServer(token="s3cret") as server:
        code, out, err = cli("runs", "--host", server.url)
        assert code == 1
        assert err == (f"error: {server.url} answered HTTP 401 Unauthorized (health check): Unauthenticated: missing or "
                       "invalid bearer token; credentials used: none (see --token, --auth)\n")
        code, out, err = cli("runs", "--host", server.url, "--kubeconfig", kubeconfig, "--context", "other")
        assert code == 1 and f"credentials used: kubeconfig {kubeconfig} context other" in err
        assert server.requests[-1].headers["authorization"] == "Bearer nope"
        count = len(server.requests)
        code, out, err = cli("runs", "--host", server.url, "--kubeconfig", kubeconfig, "--context", "certs")
        assert code == 2 and "has no bearer token (client certificates cannot be forwarded" in err
        code, out, err = cli("runs", "--host", server.url, "--kubeconfig", tmp_path / "missing")
        assert code == 2 and "cannot read a token from kubeconfig" in err
        assert len(server.requests) == count


def test_the_installed_command_prints_one_line_not_a_traceback(server, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    command = [sys.executable, "-m", "resilient_training.cli"]
    host = f"http://127.0.0.1:{free_port()}"
    five = subprocess.run([*command, "schedule", "--host", server.url, "--registry", REGISTRY, "--cron", "0 2 * * *",
                           "--param", "run_id=x"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert five.returncode == 2
    assert five.stderr.count("\n") == 1 and "Did you mean '0 0 2 * * *'?" in five.stderr
    refused = subprocess.run([*command, "runs", "--host", host], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr == f"error: cannot reach Kubeflow Pipelines at {host} (health check): connection refused\n"
    assert server.requests == []


# --- stranger trial 5 ---------------------------------------------------------------------------

OK_PARAMS = ["--param", "storage=pvc", "--param", "pvc_name=data", "--param", "promote_to=s3://models/x",
             "--param", "launcher=pytorchjob"]


@pytest.mark.parametrize(
    ("command", "flag", "value", "message"),
    [
        # Each reached the server as typed: an experiment 'team-a\n' that `runs --experiment team-a` cannot find.
        ("submit", "--experiment", "team-a\n", "--experiment 'team-a\\n' contains a control character"),
        ("submit", "--experiment", " team-a ", "--experiment ' team-a ' has blanks around it"),
        ("submit", "--experiment", "", "--experiment is empty"),
        ("submit", "--run-name", "nightly\n", "--run-name 'nightly\\n' contains a control character"),
        ("submit", "--version", "v1\n", "--version 'v1\\n' contains a control character"),
        ("submit", "--name", "resilient-training ", "--name 'resilient-training ' has blanks around it"),
        ("submit", "--param", "steps= 40", "parameter 'steps' value ' 40' has blanks around it"),
        ("submit", "--param", "efa_per_node=3 ", "parameter 'efa_per_node' value '3 ' has blanks around it"),
        ("submit", "--param", "export=safetensors ", "parameter 'export' value 'safetensors ' has blanks around it"),
        ("submit", "--param", 'tolerations=[{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]',
         "--param: toleration {'key': 'a', 'effect': 'NoSchedule', 'tolerationSeconds': 5}: tolerationSeconds needs "
         "effect NoExecute"),
        ("schedule", "--job-name", "nightly\n", "--job-name 'nightly\\n' contains a control character"),
        ("schedule", "--job-name", "", "--job-name is empty"),  # silently the default name before
        ("schedule", "--experiment", "a\tb", "--experiment 'a\\tb' contains a control character"),
        ("upload", "--name", "resilient-training\n", "--name 'resilient-training\\n' contains a control character"),
        ("upload", "--version", "v1\n", "--version 'v1\\n' contains a control character"),
        ("upload", "--version", " ", "--version is empty"),
        ("runs", "--experiment", "x\n", "--experiment 'x\\n' contains a control character"),
        ("schedules", "--experiment", "x\n", "--experiment 'x\\n' contains a control character"),
        # Stranger trial 6: each was created on the server.
        ("upload", "--name", "p\u0085x", "--name 'p\\x85x' contains a control character"),
        ("submit", "--experiment", "team\udcc3", "--experiment 'team\\udcc3' contains bytes that are not UTF-8"),
        ("schedule", "--job-name", "n\x85x", "--job-name 'n\\x85x' contains a control character"),
        ("submit", "--run-name", "r\u202eevil", "--run-name 'r\\u202eevil' contains an invisible format character "
                                                "(U+202E, RIGHT-TO-LEFT OVERRIDE)"),
        ("submit", "--experiment", "team\u200b", "--experiment 'team\\u200b' contains an invisible format character"),
        ("submit", "--experiment", "e" * 2000, "--experiment is 2000 characters long: give at most 128"),
        ("upload", "--version", "v" * 129, "--version is 129 characters long: give at most 128"),
    ],
)
def test_names_sent_to_the_server_are_refused_with_a_newline_blanks_or_empty(cli, server, command, flag, value,
                                                                               message):
    extra = {"submit": ["--package", *OK_PARAMS], "upload": [],
             "schedule": ["--package", "--cron", "0 0 2 * * *", "--param", "storage=pvc", "--param", "pvc_name=data",
                          "--param", "promote_to=s3://m/{run_id}", "--param", "launcher=pytorchjob"],
             "runs": [], "schedules": []}[command]
    if flag == "--version":  # exclusive with --package
        extra = [a for a in extra if a != "--package"]
    code, _, err = cli(command, "--host", server.url, *extra, flag, value)
    assert code == 2, err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert server.requests == []


def test_a_missing_version_is_named_plainly(cli, server):
    assert cli("upload", "--host", server.url, "--registry", REGISTRY)[0] == 0
    code, _, err = cli("submit", "--host", server.url, "--registry", REGISTRY, "--param", "run_id=x",
                       "--version", "nope")
    assert (code, err) == (1, f"error: pipeline 'tiny-train' on {server.url} has no version 'nope'\n")


@pytest.mark.parametrize(("host", "message"), [
    ("http://localhost:99999", "--host 'http://localhost:99999' is not a URL: Port out of range 0-65535"),
    ("http://localhost:80a", "--host 'http://localhost:80a' is not a URL: Port could not be cast to integer value"),
    ("http://", "--host 'http://' names no host"),
])
def test_a_host_that_is_not_a_url_is_bad_input(cli, host, message):
    code, _, err = cli("runs", "--host", host)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("content", [b"garbage: [\n", bytes(range(256)) * 2, b"just a string\n", b"- a\n- list\n"])
def test_a_kubeconfig_that_is_not_one_is_one_line(cli, server, tmp_path, content):
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_bytes(content)
    code, _, err = cli("runs", "--host", server.url, "--kubeconfig", kubeconfig)
    assert code == 2, err
    assert err.startswith(f"error: cannot read a token from kubeconfig {kubeconfig}") and err.count("\n") == 1, err
    assert "object does not support item assignment" not in err and "has no attribute" not in err, err
    assert server.requests == []


def test_compile_to_a_json_name_is_refused_not_made_a_directory(cli, tmp_path):
    code, _, err = cli("compile", "--pipeline", "resilient-training", "-o", tmp_path / "x.json")
    assert (code, err) == (2, f"error: -o {tmp_path / 'x.json'}: KFP IR is written as YAML: give a .yaml file or "
                              "a directory\n")
    code, _, err = cli("compile", "--format", "argo", "-o", tmp_path / "x.json")
    assert code == 2 and "-o must be a directory" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # The second pipeline was sent with whatever it was given (stranger trial).
        (["steps=-1"], "steps must be positive"),
        (['strategies=[{"name": "bad name!"}]'], "strategies: strategy name 'bad name!' must be 1-63 letters"),
        (["strategies=[]"], "strategies is empty"),
        (['strategies=[{"name": "a"}, {"name": "a"}]'], "strategies: names must be unique (each names a directory): a"),
        (['strategies=[{"name": "a", "checkpoint_every": 0}]'], "strategy a: "),
        (["faults=sigkill@12:9"], "rank 9 does not exist"),
        (["launcher=bogus"], "launcher must be one of local, pytorchjob, trainjob, got 'bogus'"),
        (["pvc_name=Bad_Name"], "pvc_name 'Bad_Name' is not a DNS-1123 subdomain"),
        (["trainer_image=Org/x"], "is not an image reference"),
        (["service_account=Bad_SA"], "service account 'Bad_SA' is not a DNS-1123 subdomain"),
        # The defaults themselves cannot run on a cluster: storage first, then the launcher.
        (["storage=local", "launcher=local", "pvc_name="], "storage 'local' is a directory on one machine"),
        (["launcher=local"], "launcher 'local' would train inside the launch step's own pod (the components image, "
                             "no torch or NVRx): on a cluster use launcher=pytorchjob or trainjob"),
    ],
)
@pytest.mark.parametrize("command", ["submit", "schedule"])
def test_the_recovery_benchmark_s_arguments_are_checked_by_its_steps_rules(cli, server, command, params, message):
    given = {"storage": "pvc", "pvc_name": "data", "launcher": "pytorchjob"}
    given.update(p.split("=", 1) for p in params)
    cron = ["--cron", "0 0 3 * * SUN"] if command == "schedule" else []
    code, _, err = cli(command, "--host", server.url, "--package", "--pipeline", "recovery-benchmark", *cron,
                       *[a for k, v in given.items() for a in ("--param", f"{k}={v}")])
    assert code == 2, err
    assert message in err and err.count("\n") == 1 and err.startswith("error: --param: "), err
    assert server.requests == []


def test_the_recovery_benchmark_with_cluster_arguments_is_sent(cli, server):
    code, out, err = cli("schedule", "--host", server.url, "--package", "--pipeline", "recovery-benchmark",
                         "--cron", "0 0 3 * * SUN", "--job-name", "weekly-bench", "--param", "storage=pvc",
                         "--param", "pvc_name=training-data", "--param", "launcher=pytorchjob")
    assert code == 0, err
    [job] = server.recurring_runs.values()
    assert job["runtime_config"]["parameters"]["launcher"] == "pytorchjob"


def test_the_default_launcher_is_refused_on_a_server(cli, server):
    code, _, err = cli("submit", "--host", server.url, "--package", *OK_PARAMS[:-2])
    assert (code, err) == (2, "error: --param: launcher 'local' would train inside the launch step's own pod (the "
                              "components image, no torch or NVRx): on a cluster use launcher=pytorchjob or trainjob; "
                              "local is for `resilient-training run`\n")
    assert server.requests == []


def compile_in_a_process(out: Path, *args: str, env: dict[str, str] | None = None, seed: str = "0",
                         ) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter: the image variables are read at import, the hash seed differs per call."""
    environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(out.parent),
                   "PYTHONHASHSEED": seed, **(env or {})}
    return subprocess.run([sys.executable, "-m", "resilient_training.cli", "compile", "-o", str(out), *args],
                          capture_output=True, text=True, env=environment, cwd=out.parent, timeout=120)


def test_the_recovery_benchmark_compiles_to_the_same_bytes_in_every_process(tmp_path):
    # A dict default's key order in the IR header changed per process: every `upload` was a new version.
    paths = [tmp_path / f"rb{seed}.yaml" for seed in ("1", "2", "3")]
    for seed, path in zip(("1", "2", "3"), paths, strict=True):
        done = compile_in_a_process(path, "--pipeline", "recovery-benchmark", seed=seed)
        assert done.returncode == 0, done.stderr
    assert len({path.read_bytes() for path in paths}) == 1


@pytest.mark.parametrize(("value", "message"), [
    ("my reg/comp:1", "$RT_COMPONENTS_IMAGE must be a non-empty image reference without spaces, got 'my reg/comp:1'"),
    ("reg.io/comp:1\n", "$RT_COMPONENTS_IMAGE must be a non-empty image reference without spaces"),
    ("", "$RT_COMPONENTS_IMAGE must be a non-empty image reference without spaces, got ''"),
    ("Reg/Comp", "$RT_COMPONENTS_IMAGE 'Reg/Comp' is not an image reference"),
])
@pytest.mark.parametrize("fmt", ["kfp", "argo"])
def test_the_components_image_variable_is_checked_as_render_job_checks_an_image(tmp_path, value, message, fmt):
    done = compile_in_a_process(tmp_path / "out", "--format", fmt, env={"RT_COMPONENTS_IMAGE": value})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {message}") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_the_trainer_image_variable_is_compiled_in_and_nothing_changes_without_it(tmp_path):
    image = "my.reg.io/team/trainer:9.9"
    plain, baked = tmp_path / "plain.yaml", tmp_path / "baked.yaml"
    assert compile_in_a_process(plain, "--pipeline", "resilient-training").returncode == 0
    assert compile_in_a_process(tmp_path / "again.yaml", "--pipeline", "resilient-training",
                                seed="7").returncode == 0
    assert plain.read_bytes() == (tmp_path / "again.yaml").read_bytes()
    done = compile_in_a_process(baked, "--pipeline", "resilient-training", env={"RT_TRAINER_IMAGE": image})
    assert done.returncode == 0, done.stderr
    assert plain.read_bytes() != baked.read_bytes()
    spec = next(yaml.safe_load_all(baked.read_text()))
    assert spec["root"]["inputDefinitions"]["parameters"]["trainer_image"]["defaultValue"] == image
    plain_spec = next(yaml.safe_load_all(plain.read_text()))
    assert plain_spec["root"]["inputDefinitions"]["parameters"]["trainer_image"]["defaultValue"] == ""

    argo = tmp_path / "argo"
    done = compile_in_a_process(argo, "--format", "argo", env={"RT_TRAINER_IMAGE": image})
    assert done.returncode == 0, done.stderr
    template = yaml.safe_load((argo / "resilient-training.workflowtemplate.yaml").read_text())
    params = {p["name"]: p["value"] for p in template["spec"]["arguments"]["parameters"]}
    assert params["trainer_image"] == image

    done = compile_in_a_process(tmp_path / "bad", env={"RT_TRAINER_IMAGE": "my reg/trainer:1"})
    assert (done.returncode, done.stderr) == (
        2, "error: $RT_TRAINER_IMAGE must be a non-empty image reference without spaces, got 'my reg/trainer:1'\n")


def test_the_pipeline_runs_worker_pods_as_the_trainer_service_account(tmp_path):
    from resilient_training.pipelines.resilient_training import resilient_training as pipeline

    assert pipeline.component_spec.inputs["service_account"].default == "resilient-training-trainer"
    compiled = compile_pipeline("resilient-training", pipeline, tmp_path / "rt.yaml")
    inner = compiled.spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["launch-training"]
    wiring = inner["inputs"]["parameters"]["service_account"]
    assert wiring == {"componentInputParameter": "pipelinechannel--service_account"}


def test_a_package_that_is_not_yaml_is_one_line(cli, server, tmp_path):
    (tmp_path / "bad.yaml").write_text("a: [\n  b: c\n")
    code, _, err = cli("upload", "--host", server.url, "--package", tmp_path / "bad.yaml")
    assert code == 2 and err.startswith(f"error: cannot read pipeline package {tmp_path / 'bad.yaml'}: ") and \
        err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["efa_per_node", "node_selector", "tolerations", "cpu", "memory", "shm_size"])
def test_the_pipeline_passes_the_worker_pods_placement_to_the_launch_step(tmp_path, name):
    # The launch step had them, the pipeline did not: worker pods could not ask for EFA or GPU nodes (stranger trial).
    from resilient_training.pipelines.resilient_training import resilient_training as pipeline

    compiled = compile_pipeline("resilient-training", pipeline, tmp_path / "rt.yaml")
    inner = compiled.spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["launch-training"]
    assert inner["inputs"]["parameters"][name] == {"componentInputParameter": f"pipelinechannel--{name}"}


@pytest.mark.parametrize(("param", "message"), [
    ('node_selector={"node.kubernetes.io/instance-type": 5}', "labels and values are strings"),
    ('node_selector={"bad key!": "x"}', "node selector key"),
    ('node_selector=["p5"]', "parameter 'node_selector' must be a JSON object"),
    ('tolerations={"key": "nvidia.com/gpu"}', "parameter 'tolerations' must be a JSON"),
    ('tolerations=["nvidia.com/gpu"]', "a toleration is a mapping"),
    ('tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "x": 1}]',
     "unknown fields"),
    ('tolerations=[{"key": "a", "tolerationSeconds": "60"}]', "tolerationSeconds must be an integer"),
    ("efa_per_node=33", "efa_per_node must be between 0 and 32"),
    # Stranger trial: the pipeline had no way to size the worker pods (memory, /dev/shm, CPUs).
    ("memory=512Mi", "memory '512Mi' is below 1Gi"),
    ("shm_size=10E", "shm_size '10E' is past the largest byte count"),
    ("shm_size=", "shm_size '' is not a Kubernetes quantity"),
    ("cpu=lots", "cpu 'lots' is not a Kubernetes quantity"),
])
def test_worker_pod_placement_is_checked_before_the_run_is_created(cli, server, param, message):
    code, _, err = cli("submit", "--host", server.url, "--package", *OK_PARAMS, "--param", param)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert server.requests == []


def test_worker_pod_placement_reaches_the_server(cli, server):
    code, _, err = cli("submit", "--host", server.url, "--package", *OK_PARAMS, "--param", "efa_per_node=32",
                       "--param", 'node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"}',
                       "--param", 'tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]',
                       "--param", "cpu=180", "--param", "memory=1800Gi", "--param", "shm_size=128Gi")
    assert code == 0, err
    [run] = server.runs.values()
    parameters = run["runtime_config"]["parameters"]
    assert parameters["efa_per_node"] == 32
    assert parameters["node_selector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert parameters["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert (parameters["cpu"], parameters["memory"], parameters["shm_size"]) == ("180", "1800Gi", "128Gi")


# --- compile --default: the IR's defaults, what the KFP UI's Create run form starts from ----------------

CLUSTER_DEFAULTS = ["--default", "storage=pvc", "--default", "pvc_name=training-data", "--default",
                    "launcher=pytorchjob", "--default", "promote_to=/mnt/run/promoted"]


def test_compiled_cluster_defaults_are_what_the_form_shows_and_what_submit_accepts(cli, server, tmp_path):
    """Stranger trial: the IR kept the laptop's defaults, so the KFP UI's Create run (which checks
    nothing) started from storage=local and launcher=local. The defaults a team compiles in pass the
    checks submit makes, and a run submitted from that file with no --param is sent as they are."""
    from resilient_training.kfp.compile import load_package

    out = tmp_path / "rt.yaml"
    code, _, err = cli("compile", "-o", out, "--pipeline", "resilient-training", *CLUSTER_DEFAULTS,
                       "--default", 'node_selector={"b": "2", "a": "1"}')
    assert code == 0 and err == "", err  # no laptop note: these defaults run on a cluster
    compiled = load_package(out)
    assert {name: compiled.inputs[name].default for name in ("storage", "launcher", "pvc_name", "node_selector")} \
        == {"storage": "pvc", "launcher": "pytorchjob", "pvc_name": "training-data", "node_selector": {"a": "1", "b": "2"}}
    header = out.read_text().split("\ndeployment", 1)[0]  # the comment kfp writes above the spec says them too
    assert "#    launcher: str [Default: 'pytorchjob']" in header
    assert "#    node_selector: dict [Default: {'a': '1', 'b': '2'}]" in header
    code, _, err = cli("submit", "--host", server.url, "--package", out)
    assert code == 0, err
    [run] = server.runs.values()
    spec = run["pipeline_spec"]["pipeline_spec"]["root"]["inputDefinitions"]["parameters"]
    assert spec["launcher"]["defaultValue"] == "pytorchjob" and spec["storage"]["defaultValue"] == "pvc"
    assert not run["runtime_config"].get("parameters")  # nothing given: the server runs the compiled defaults


def test_without_defaults_compile_says_the_form_starts_from_a_laptop_s(cli, tmp_path):
    code, _, err = cli("compile", "-o", tmp_path / "out")
    assert code == 0
    notes = err.splitlines()
    assert len(notes) == 2 and all(n.startswith("note: ") and "storage 'local' is a directory on one machine" in n
                                   and "--default KEY=VALUE" in n for n in notes), err


@pytest.mark.parametrize(("args", "message"), [
    # what submit would refuse is not baked into the form either
    (["--default", "storage=pvc"], "error: --default: storage 'pvc' needs pvc_name"),
    (CLUSTER_DEFAULTS[:-2], "error: --default: promote_to 'promoted' is relative"),
    ([*CLUSTER_DEFAULTS, "--default", "steps=-1"], "error: --default: steps must be positive"),
    (["--default", "nodes=2\n"], "error: parameter 'nodes' value '2\\n' contains a control character"),
    (["--default", "bogus=1"], "error: unknown parameter 'bogus'"),
    (["--default", "storage"], "error: --default 'storage' is not key=value"),
    ([*CLUSTER_DEFAULTS, "--default", "launcher=trainjob"], "error: parameter 'launcher' is given twice"),
    # Stranger trial: a string no rule checks went into the header comment with its line break (a
    # traceback, and a broken file over the team's); numbers past 2**53 were refused after the write.
    ([*CLUSTER_DEFAULTS, "--default", "fsx_deployment_type=a\nb"],
     "error: --default: fsx_deployment_type 'a\\nb' contains a control character"),
    ([*CLUSTER_DEFAULTS, "--default", "checkpoint_every=9007199254740993"],
     "error: --default: checkpoint_every 9007199254740993 is past what the IR holds exactly"),
    ([*CLUSTER_DEFAULTS, "--default", 'task_args={"vocab_size": 99999999999999999999999}'],
     "error: --default: task_args: the IR would hold"),
])
def test_defaults_a_run_s_steps_would_refuse_are_refused_in_one_line(cli, tmp_path, args, message):
    out = tmp_path / "rt.yaml"
    out.write_text("the team's compiled pipeline\n")
    code, _, err = cli("compile", "-o", out, "--pipeline", "resilient-training", *args)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert out.read_text() == "the team's compiled pipeline\n"  # refused before anything was written


@pytest.mark.parametrize(("args", "message"), [
    (CLUSTER_DEFAULTS, "error: --default: name the pipeline it is for with --pipeline NAME"),
    (["--format", "argo", "--pipeline", "resilient-training", *CLUSTER_DEFAULTS], "error: --default: KFP IR only"),
])
def test_defaults_need_one_kfp_pipeline(cli, tmp_path, args, message):
    code, _, err = cli("compile", "-o", tmp_path / "out", *args)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_yaml_suffix_in_capitals_names_a_file_too(cli, tmp_path):
    code, _, err = cli("compile", "-o", tmp_path / "RT.YAML", "--pipeline", "resilient-training", *CLUSTER_DEFAULTS)
    assert code == 0, err
    assert (tmp_path / "RT.YAML").is_file()  # it made a directory RT.YAML/ holding resilient-training.yaml


# --- stranger trial: every request bounded, answers that are not the API's, hosts, limits, packages ----------


def tiny_package(tmp_path: Path) -> Path:
    return compile_pipeline("tiny-train", PIPELINES["tiny-train"], tmp_path / "tiny-train.yaml").path


@pytest.mark.parametrize(("paths", "command", "action"), [
    (("",), ["runs"], "listing runs"),
    (("",), ["schedules"], "listing recurring runs"),
    (("",), ["submit", "--param", "run_id=x", "--package"], "finding experiment 'resilient-training'"),
    (("",), ["schedule", "--param", "run_id=x", "--cron", "0 0 2 * * *", "--package"],
     "finding experiment 'resilient-training'"),
    (("",), ["upload", "--package"], "looking up pipeline 'tiny-train'"),
    (("/runs",), ["submit", "--param", "run_id=x", "--run-name", "r1", "--package"], "creating run 'r1'"),
    (("/pipelines/upload_version",), ["upload", "--package"], "uploading version"),
])
def test_every_request_is_bounded_by_the_timeout(cli, tmp_path, paths, command, action):
    # Only the health check had --timeout: past it, `runs` waited 659 s on a server that never answered.
    package = [tiny_package(tmp_path)] if command[-1] == "--package" else []
    with FakeKfpServer(broken="hang", hang_s=4, broken_paths=paths) as server:
        started = time.monotonic()
        code, _, err = cli(*command, *package, "--host", server.url, "--timeout", "1")
        elapsed = time.monotonic() - started
        assert code == 1 and err.startswith(f"error: {server.url} did not answer within 1 s ({action}")
        assert err.count("\n") == 1, err
        assert elapsed < 3.5, elapsed
        assert len([r for r in server.requests if r.path.startswith(tuple(API + p for p in paths))
                    and not r.path.endswith("/healthz")]) == 1  # not retried


@pytest.mark.parametrize(("paths", "action"), [(("/healthz",), "health check"), (("/runs",), "listing runs")])
def test_a_server_that_trickles_its_answer_is_bounded_per_request(cli, paths, action):
    # urllib3's timeouts bound each read: a byte every 0.2 s kept `runs` going for 40 s at --timeout 1.
    with FakeKfpServer(broken="trickle", broken_paths=paths) as server:
        started = time.monotonic()
        code, _, err = cli("runs", "--host", server.url, "--timeout", "1")
        elapsed = time.monotonic() - started
    assert code == 1 and err == (f"error: {server.url} did not finish answering within 2 s, twice --timeout (to "
                                 f"connect, then to answer) ({action})\n"), err
    assert elapsed < 5, elapsed


@pytest.mark.parametrize("value", ["1e10", "99999999999", "86400.5"])
@pytest.mark.parametrize("command", ["runs", "schedules", "upload", "submit", "schedule"])
def test_a_timeout_past_a_day_is_bad_input(cli, command, value):
    # 1e10 was an OverflowError traceback from the socket layer.
    extra = {"upload": ["--registry", REGISTRY], "submit": ["--registry", REGISTRY, "--package", "--param", "run_id=x"],
             "schedule": ["--registry", REGISTRY, "--package", "--param", "run_id=x", "--cron", "0 0 2 * * *"]}
    code, _, err = cli(command, *extra.get(command, []), "--host", "http://localhost:1", "--timeout", value)
    assert (code, err) == (2, f"error: --timeout must be at most 86400 seconds (a day), got {float(value):g}\n")


@pytest.mark.parametrize(("broken", "paths", "command", "message"), [
    ("empty", ("",), ["upload", "--package"], "answered without a pipeline id (creating pipeline 'tiny-train')"),
    ("empty", ("",), ["submit", "--param", "run_id=x", "--package"],
     "answered without an experiment id (creating experiment 'resilient-training')"),
    ("empty", ("/runs",), ["submit", "--param", "run_id=x", "--run-name", "r1", "--package"],
     "answered without a run id (creating run 'r1')"),
    ("empty", ("/recurringruns",), ["schedule", "--param", "run_id=x", "--cron", "0 0 2 * * *", "--package"],
     "answered without a recurring run id (creating recurring run 'tiny-train-schedule')"),
    ("empty", ("/pipelines/upload_version",), ["upload", "--package"],
     "answered without a pipeline version id (uploading version"),
    ("html", ("",), ["runs"], "answered with text/html; charset=utf-8, not the KFP API's JSON (listing runs)"),
    ("html", ("",), ["schedules"],
     "answered with text/html; charset=utf-8, not the KFP API's JSON (listing recurring runs)"),
    ("html", ("",), ["upload", "--package"],
     "answered with text/html; charset=utf-8, not the KFP API's JSON (looking up pipeline 'tiny-train')"),
])
def test_an_answer_that_is_not_the_api_s_fails_in_one_line(cli, tmp_path, broken, paths, command, message):
    # {} made upload a ValueError traceback and submit/schedule "created (id None)"; an HTML page made runs "no runs".
    package = [tiny_package(tmp_path)] if command[-1] == "--package" else []
    with FakeKfpServer(broken=broken, broken_paths=paths) as server:
        code, out, err = cli(*command, *package, "--host", server.url)
    assert code == 1 and err.startswith(f"error: {server.url} {message}") and err.count("\n") == 1, err
    assert "None" not in out


@pytest.mark.parametrize(("host", "message"), [
    # Each built wrong URLs: the API path went after the query or fragment.
    ("http://127.0.0.1:1?x=1", "--host 'http://127.0.0.1:1?x=1' has a query or fragment (?, #)"),
    ("http://127.0.0.1:1#frag", "--host 'http://127.0.0.1:1#frag' has a query or fragment (?, #)"),
    ("http://127.0.0.1:1/?", "--host 'http://127.0.0.1:1/?' has a query or fragment (?, #)"),
    # The password was echoed in "cannot reach ... at http://user:pw@localhost:1", and never sent.
    ("http://user:pw@localhost:1/", "--host 'http://user:***@localhost:1/' carries a user name or password"),
    ("http://user@localhost:1/", "--host 'http://user@localhost:1/' carries a user name or password"),
    ("http://user:pw@localhost:99999", "--host 'http://user:***@localhost:99999' is not a URL"),
    ("http://user:pw@localhost:1/ x", "--host 'http://user:***@localhost:1/ x' contains a space"),
])
def test_a_host_with_a_query_or_a_password_is_refused_and_the_password_not_shown(cli, host, message):
    code, _, err = cli("runs", "--host", host)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert "pw" not in err


@pytest.mark.parametrize(("command", "limit"), [("runs", "99999999999999999999"), ("schedules", "3000000000"),
                                                ("runs", "2147483648")])
def test_a_limit_past_the_api_s_int32_page_size_is_refused(cli, server, command, limit):
    code, _, err = cli(command, "--host", server.url, "--limit", limit)
    assert (code, err) == (2, f"error: --limit must be at most 2147483647 (the KFP API's page size is an int32), "
                              f"got {limit}\n")
    assert server.requests == []
    code, out, err = cli(command, "--host", server.url, "--limit", "2147483647")
    assert code == 0, err


@pytest.mark.parametrize("command", [["upload"], ["submit", "--param", "run_id=x"],
                                     ["schedule", "--param", "run_id=x", "--cron", "0 0 2 * * *"]])
def test_a_package_file_and_another_pipeline_name_are_refused(cli, server, tmp_path, command):
    # schedule --package X.yaml --pipeline recovery-benchmark scheduled X.yaml's pipeline without a word.
    package = tiny_package(tmp_path)
    code, _, err = cli(*command, "--host", server.url, "--package", package, "--pipeline", "recovery-benchmark")
    assert (code, err) == (2, f"error: --pipeline recovery-benchmark: --package {package} holds pipeline 'tiny-train' "
                              "(drop one of them)\n")
    assert server.requests == []
    code, _, err = cli(*command, "--host", server.url, "--package", package, "--pipeline", "tiny-train")
    assert code == 0, err  # they agree


def test_an_empty_package_path_is_named(cli, server):
    code, _, err = cli("upload", "--host", server.url, "--package", "")
    assert (code, err) == (2, "error: --package is empty: give the compiled pipeline's YAML file\n")


def test_the_health_check_is_asked_once_with_the_timeout(cli, server):
    # kfp.Client() asked healthz again itself, with no timeout and five retries 5 s apart (stranger trial).
    code, out, err = cli("runs", "--host", server.url, "--timeout", "1")
    assert (code, out) == (0, "no runs\n"), err
    assert [r.path for r in server.requests] == [f"{API}/healthz", f"{API}/runs"]


def test_submit_and_schedule_run_the_steps_as_the_service_account_given(cli, server):
    """A stranger trial: nothing made a KFP run's steps use resilient-training-launcher (the account
    manifests/base binds); on a single-user install they ran as pipeline-runner, granted nothing."""
    args = ["--host", server.url, "--package", "--param", "storage=pvc", "--param", "pvc_name=data",
            "--param", "launcher=pytorchjob", "--service-account", "resilient-training-launcher"]
    code, _, err = cli("submit", *args, "--param", "promote_to=s3://models/x")
    assert code == 0, err
    assert list(server.runs.values())[-1]["service_account"] == "resilient-training-launcher"
    code, _, err = cli("schedule", *args, "--cron", "0 0 2 * * *", "--param", "promote_to=s3://models/x/{run_id}")
    assert code == 0, err
    assert list(server.recurring_runs.values())[-1]["service_account"] == "resilient-training-launcher"
    code, _, err = cli("submit", *args[:-1], "Launcher_SA", "--param", "promote_to=s3://models/x")
    assert code == 2 and err.startswith("error: --service-account") and err.count("\n") == 1, err


def test_a_run_that_inherits_the_demonstration_faults_is_told_so(cli, server):
    """A stranger trial: `submit` and `schedule` without --param faults ran the pipeline's default
    schedule (made to fail and recover) with no word, where Argo's compile says it."""
    args = ["--host", server.url, "--package", "--param", "storage=pvc", "--param", "pvc_name=data",
            "--param", "launcher=pytorchjob"]
    code, _, err = cli("submit", *args, "--param", "promote_to=s3://models/x")
    assert code == 0, err
    assert "note: the run inherits the pipeline's demonstration faults (sigkill@12:1" in err, err
    code, _, err = cli("schedule", *args, "--cron", "0 0 2 * * *", "--param", "promote_to=s3://models/x/{run_id}")
    assert code == 0 and "note: each scheduled run inherits the pipeline's demonstration faults" in err, err
    code, _, err = cli("submit", *args, "--param", "promote_to=s3://models/x", "--param", "faults=")
    assert code == 0 and "demonstration faults" not in err, err
