"""Both pipelines compile to IR that loads back, with the DAG, defaults and descriptions a
Kubeflow user sees; `run` and `bench` run them end to end with real processes and faults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kfp import compiler, components

from resilient_training.pipelines import PIPELINES


def _compile(name: str, tmp_path: Path) -> dict:
    path = tmp_path / f"{name}.yaml"
    compiler.Compiler().compile(PIPELINES[name], str(path))
    assert components.load_component_from_file(str(path))  # loads back with kfp
    return yaml.safe_load_all(path.read_text()).__next__()


def _tasks(dag: dict) -> dict:
    return dag["dag"]["tasks"]


def test_resilient_training_dag_has_the_exit_handler_gates_and_condition(tmp_path):
    spec = _compile("resilient-training", tmp_path)
    root = _tasks(spec["root"])
    assert set(root) == {"exit-handler-1", "teardown-storage"}
    assert root["teardown-storage"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    inner = _tasks(spec["components"]["comp-exit-handler-1"])
    assert {"check-arguments", "provision-storage", "launch-training", "validate-checkpoint", "check-convergence",
            "resilience-report", "condition-2"} <= set(inner)
    # Nothing is made before the arguments are checked.
    assert inner["provision-storage"]["dependentTasks"] == ["check-arguments"]
    assert inner["condition-2"]["triggerPolicy"]["condition"].endswith("== true")
    nested = _tasks(spec["components"]["comp-condition-2"])
    promote_holder = spec["components"][nested["condition-3"]["componentRef"]["name"]]
    assert set(_tasks(promote_holder)) == {"promote-model"}
    assert "check-convergence" in inner["resilience-report"]["dependentTasks"]  # the report runs whatever the gates say


def test_every_pipeline_parameter_has_a_default_and_a_description(tmp_path):
    for name in PIPELINES:
        spec = _compile(name, tmp_path)
        params = spec["root"]["inputDefinitions"]["parameters"]
        assert params, name
        for key, param in params.items():
            assert "defaultValue" in param or param.get("isOptional"), (name, key)
            assert len(param.get("description", "")) > 10, (name, key)
    params = _compile("resilient-training", tmp_path)["root"]["inputDefinitions"]["parameters"]
    assert params["storage"]["defaultValue"] == "local"
    assert params["launcher"]["defaultValue"] == "local"
    assert "pvc" in params["storage"]["description"] and "fsx" in params["storage"]["description"]


def test_steps_mount_the_run_claim_on_a_cluster(tmp_path):
    path = tmp_path / "rt.yaml"
    compiler.Compiler().compile(PIPELINES["resilient-training"], str(path))
    platform = list(yaml.safe_load_all(path.read_text()))[1]
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    mounted = {name for name, cfg in executors.items() if cfg.get("pvcMount")}
    assert {"exec-launch-training", "exec-validate-checkpoint", "exec-check-convergence",
            "exec-promote-model", "exec-resilience-report"} <= mounted


def test_benchmark_dag_runs_strategies_then_compares(tmp_path):
    spec = _compile("recovery-benchmark", tmp_path)
    inner = _tasks(spec["components"]["comp-exit-handler-1"])
    assert set(inner) == {"check-benchmark-arguments", "provision-storage", "run-strategies", "compare-strategies"}
    assert inner["provision-storage"]["dependentTasks"] == ["check-benchmark-arguments"]
    strategies = spec["root"]["inputDefinitions"]["parameters"]["strategies"]["defaultValue"]
    assert [s["name"] for s in strategies] == ["inprocess+async", "ft_launcher+async", "ft_launcher+sync",
                                              "torchrun+sync"]


# --------------------------------------------------------------------------- caching and retries

# Every container step of both pipelines has side effects; a new step must be added here on purpose.
SIDE_EFFECTING = {
    "resilient-training": {"root/teardown-storage", "comp-exit-handler-1/check-arguments",
                           "comp-exit-handler-1/provision-storage",
                           "comp-exit-handler-1/launch-training", "comp-exit-handler-1/validate-checkpoint",
                           "comp-exit-handler-1/check-convergence", "comp-exit-handler-1/resilience-report",
                           "comp-condition-3/promote-model"},
    "recovery-benchmark": {"root/teardown-storage", "comp-exit-handler-1/check-benchmark-arguments",
                           "comp-exit-handler-1/provision-storage",
                           "comp-exit-handler-1/run-strategies", "comp-exit-handler-1/compare-strategies"},
}
# Idempotent steps that meet transient failures (cloud throttling, an API blip while watching the job).
RETRIED = {"root/teardown-storage", "comp-exit-handler-1/provision-storage", "comp-exit-handler-1/launch-training"}
KFP_IMPLICIT_WINDOW = 3600  # what the IR says when set_retry was given no backoff_max_duration


def _seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def caching_and_retry_problems(spec: dict) -> list[str]:
    """What is wrong with a compiled pipeline's caching and retry settings, one line per problem."""
    from resilient_training.kfp.compile import cached_tasks, executor_tasks

    problems = [f"{key}: cached" for key in cached_tasks(spec)]
    for key, task in executor_tasks(spec).items():
        policy = task.get("retryPolicy")
        if policy is None:
            continue
        window = _seconds(policy.get("backoffMaxDuration", "0s"))
        if window == KFP_IMPLICIT_WINDOW:
            problems.append(f"{key}: retry window is KFP's implicit 1 h (set backoff_max_duration)")
        elif window <= _seconds(policy.get("backoffDuration", "0s")):
            problems.append(f"{key}: retry window shorter than its first backoff")
    return problems


def _compiled_by_cli(tmp_path: Path) -> dict[str, dict]:
    proc = _cli("compile", "-o", str(tmp_path / "ir"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {name: yaml.safe_load_all((tmp_path / "ir" / f"{name}.yaml").read_text()).__next__()
            for name in SIDE_EFFECTING}


def test_compiled_pipelines_cache_no_side_effect_and_retry_with_an_explicit_window(tmp_path):
    from resilient_training.kfp.compile import executor_tasks

    compiled = _compiled_by_cli(tmp_path)
    for name, spec in compiled.items():
        tasks = executor_tasks(spec)
        assert set(tasks) == SIDE_EFFECTING[name], name  # every step classified, none missed in a nested DAG
        assert caching_and_retry_problems(spec) == [], name
        for key, task in tasks.items():
            assert not (task.get("cachingOptions") or {}).get("enableCache"), (name, key)
            assert ("retryPolicy" in task) == (key in RETRIED), (name, key)
        assert "Caching is off for every step" in spec["pipelineInfo"]["description"], name
    spec = compiled["resilient-training"]
    launch = executor_tasks(spec)["comp-exit-handler-1/launch-training"]
    job_limit = spec["components"]["comp-launch-training"]["inputDefinitions"]["parameters"]["timeout_seconds"]
    # Argo counts the window from the first attempt: it must outlast the job's own limit.
    assert _seconds(launch["retryPolicy"]["backoffMaxDuration"]) > job_limit["defaultValue"]


def test_local_runs_get_the_same_dags_without_retries_and_still_uncached(tmp_path):
    from resilient_training.kfp.compile import executor_tasks
    from resilient_training.pipelines import LOCAL_PIPELINES

    for name, pipeline in LOCAL_PIPELINES.items():
        path = tmp_path / f"{name}.yaml"
        compiler.Compiler().compile(pipeline, str(path))
        tasks = executor_tasks(yaml.safe_load_all(path.read_text()).__next__())
        assert set(tasks) == SIDE_EFFECTING[name]
        assert not [key for key, task in tasks.items() if "retryPolicy" in task or task.get("cachingOptions")]


def test_the_caching_check_fails_on_a_cached_step_and_an_implicit_retry_window(tmp_path):
    from kfp import dsl

    from resilient_training.kfp.compile import cached_tasks

    def step(x: int) -> int:
        return x

    step.__annotations__ = {"x": int, "return": int}  # real types: this module postpones annotations
    step = dsl.component(step, base_image="python:3.11-slim")

    @dsl.pipeline(name="careless")
    def careless():
        with dsl.ExitHandler(step(x=0).set_caching_options(False)):
            step(x=1)  # cached by default, inside a nested DAG
            step(x=2).set_caching_options(False).set_retry(2)  # no backoff_max_duration
            step(x=3).set_caching_options(False).set_retry(2, backoff_duration="60s", backoff_max_duration="30s")

    path = tmp_path / "careless.yaml"
    compiler.Compiler().compile(careless, str(path))
    spec = yaml.safe_load(path.read_text())
    # KFP names the exit task "step" and the others step-2, step-3, step-4.
    assert cached_tasks(spec) == ["comp-exit-handler-1/step-2"]
    assert caching_and_retry_problems(spec) == [
        "comp-exit-handler-1/step-2: cached",
        "comp-exit-handler-1/step-3: retry window is KFP's implicit 1 h (set backoff_max_duration)",
        "comp-exit-handler-1/step-4: retry window shorter than its first backoff",
    ]


# --------------------------------------------------------------------------- end to end


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "resilient_training.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_run_trains_through_faults_validates_gates_reports_and_promotes(tmp_path):
    out = tmp_path / "out"
    proc = _cli("run", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "validation:         PASSED" in text and "convergence:        PASSED" in text
    report = Path(text.split("resilience report:")[1].split()[0])
    assert report.is_file() and "<img" in report.read_text() and "http" not in report.read_text().split("<img")[0]
    promoted = Path(text.split("promoted model:")[1].split()[0])
    assert (promoted / "promotion.json").is_file() and (promoted / "manifest.json").is_file()
    numbers = json.loads(Path(text.split("report numbers:")[1].split()[0]).read_text())
    assert numbers["steps"]["completed"] == 40 and numbers["recovery_seconds"]["all"]["count"] == 3
    assert "goodput: training" in text
    run_dir = Path(text.split("run directory:")[1].split()[0])
    injected = [json.loads(line)["fault"] for f in (run_dir / "events").glob("*.jsonl")
                for line in f.read_text().splitlines() if '"fault_injected"' in line]
    assert sorted(injected) == ["exception@22:0", "hang@33:1", "sigkill@12:1"]
    # A demo a person can read: a line as each step starts and ends, the trainer's own lines, the
    # summary; the local runner's executor JSON and warnings only in the log the summary names.
    lines = text.splitlines()
    assert len(lines) < 80, text
    for step in ("provision-storage", "launch-training", "validate-checkpoint", "check-convergence",
                 "resilience-report", "promote-model", "teardown-storage"):
        assert sum(line.endswith(f"▶ {step}") for line in lines) == 1, step
        assert sum(f"✓ {step} (" in line for line in lines) == 1, step
    assert any("fault sigkill@12:1 injected" in line for line in lines)
    assert "KFP Executor" not in text and "executor_input" not in text and "Warning" not in proc.stderr
    log = Path(text.split("local runner log:")[1].split()[0])
    assert log.parent == out / "logs"
    assert "Got executor_input:" in log.read_text() and "fault sigkill@12:1 injected" in log.read_text()


@pytest.mark.slow
def test_a_nan_run_is_refused_promotion_and_says_why(tmp_path):
    proc = _cli("run", "--output-dir", str(tmp_path / "out"), "--steps", "20", "--faults", "nan@8:0",
                "--train-overrides", '{"nan_guard": false}')
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "convergence:        FAILED" in proc.stdout
    assert "non-finite" in proc.stdout
    assert "promoted model:     none" in proc.stdout
    assert not any((tmp_path / "out" / "promoted").glob("*/promotion.json"))


@pytest.mark.slow
def test_run_turns_the_in_process_layer_off_by_its_flag(tmp_path):
    """A stranger trial: `run` had no flag for the pipeline's inprocess (nor async_checkpoint,
    ft_launcher) parameter, and train_overrides refused to set it: in-process restarts could not
    be turned off. With --no-inprocess the exception is recovered by ft_launcher."""
    proc = _cli("run", "--output-dir", str(tmp_path / "out"), "--steps", "12", "--checkpoint-every", "4",
                "--faults", "exception@6:0", "--no-inprocess", "--no-async-checkpoint",
                "--max-final-loss", "6", "--min-improvement", "0.05")  # 12 steps learn little
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    numbers = json.loads(Path(proc.stdout.split("report numbers:")[1].split()[0]).read_text())
    assert [f["layer"] for f in numbers["faults"]] == ["launcher"], numbers["faults"]
    run_dir = Path(proc.stdout.split("run directory:")[1].split()[0])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["restart"]["inprocess"] is False and config["checkpoint"]["async_save"] is False


@pytest.mark.slow
def test_a_failure_in_the_middle_still_runs_teardown(tmp_path):
    out = tmp_path / "out"
    proc = _cli("run", "--output-dir", str(out), "--steps", "12", "--faults", "exception@4:0x99",
                "--train-overrides", '{"max_inprocess_restarts": 1, "max_restarts": 0}')
    assert proc.returncode == 1
    assert "FAILED" in proc.stderr and "launch-training" in proc.stderr
    # OUTPUT/kfp/<time>-<pid>/<pipeline run>/<step>: each invocation's own kfp.local root
    assert list((out / "kfp").glob("*/*/teardown-storage/executor_output.json")), "teardown did not run"
    assert not list((out / "kfp").glob("*/*/validate-checkpoint"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--steps", "-1"], "steps must be positive"),
        (["run", "--faults", "sigkill@3:5"], "rank 5 does not exist (world size 2)"),
        (["run", "--train-overrides", '{"bogus": 1}'], "unknown trainer setting"),
        (["run", "--train-overrides", "[1]"], "must be a JSON object"),
        (["run", "--export", "onnx"], "--export 'onnx': choose dcp, torch, safetensors, hf"),
        (["bench", "--strategies", '[{"name": "a b"}]'], "strategy name 'a b'"),
        (["bench", "--nproc", "0"], "world size must be at least 1"),
    ],
)
def test_bad_input_fails_before_anything_starts(tmp_path, args, message):
    proc = _cli(*args, "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()
