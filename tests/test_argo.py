"""`compile --format argo`: the resilient-training pipeline as an Argo WorkflowTemplate and CronWorkflow.

Valid against the shipped Argo v4.1.2 CRDs; the same tasks, inputs, guards, mounts and exit
handler as the KFP pipeline (compared through the compiled KFP IR, so a change to one that is
not made to the other fails here); each step's command line is real: the gate and promotion
steps run here as Argo would start them, against a real `resilient-training train` run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient_training.argo import step as argo_step
from resilient_training.argo import workflow as argo
from resilient_training.cli.main import main as cli
from resilient_training.launch import images
from resilient_training.pipelines.resilient_training import resilient_training
from tests.support import crd_schema, runs

CRON_FLAGS = ["--schedule", "15 4 * * 1-5", "--schedule", "@every 12h", "--timezone", "Europe/Berlin",
              "--concurrency-policy", "Allow", "--starting-deadline", "900",
              "--cron-param", "storage=fsx", "--cron-param", "fsx_file_system_id=fs-0123456789abcdef0",
              "--cron-param", "steps=400", "--cron-param", 'train_overrides={"lr": 0.001}',
              "--cron-param", "promote_to=/mnt/run/promoted/{run_id}"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("argo")
    assert cli(["compile", "--format", "argo", "-o", str(out), *CRON_FLAGS]) == 0
    paths = argo.output_paths(out)
    return {"template": yaml.safe_load(paths.workflow_template.read_text()),
            "cron": yaml.safe_load(paths.cron_workflow.read_text()), "dir": out}


@pytest.fixture(scope="module")
def kfp_ir(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from resilient_training.kfp import compile as kfp_compile

    path = tmp_path_factory.mktemp("kfp") / "resilient-training.yaml"
    kfp_compile.compile_pipeline("resilient-training", resilient_training, path)
    return list(yaml.safe_load_all(path.read_text()))


def templates(wt: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in wt["spec"]["templates"]}


def dag_tasks(wt: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in templates(wt)[name]["dag"]["tasks"]}


# --- valid objects ------------------------------------------------------------------------------


def test_both_objects_are_valid_against_the_argo_crds(compiled, shared_schemas):
    for key, crd in (("template", "argoproj.io_workflowtemplates.yaml"), ("cron", "argoproj.io_cronworkflows.yaml")):
        schema = crd_schema.load_crd_schema(shared_schemas / crd, "v1alpha1")
        assert crd_schema.schema_errors(compiled[key], schema) == [], key
        if key == "template":
            # The check is strict down in the templates: a misspelt field would be caught.
            planted = json.loads(json.dumps(compiled[key]))
            planted["spec"]["templates"][0]["container"]["imagePullPolicyy"] = "Always"
            assert any("imagePullPolicyy" in e for e in crd_schema.schema_errors(planted, schema))
    assert compiled["template"]["kind"] == "WorkflowTemplate" and compiled["cron"]["kind"] == "CronWorkflow"
    assert compiled["template"]["apiVersion"] == compiled["cron"]["apiVersion"] == "argoproj.io/v1alpha1"


def test_cron_fields_come_from_the_flags_and_it_starts_the_template(compiled):
    spec = compiled["cron"]["spec"]
    assert spec["schedules"] == ["15 4 * * 1-5", "@every 12h"]
    assert spec["timezone"] == "Europe/Berlin"
    assert spec["concurrencyPolicy"] == "Allow"
    assert spec["startingDeadlineSeconds"] == 900
    assert "schedule" not in spec  # removed in Argo v4
    assert spec["workflowSpec"] == {
        "workflowTemplateRef": {"name": compiled["template"]["metadata"]["name"]},
        # --cron-param values, as the text the steps parse back (typed by the pipeline's inputs).
        "arguments": {"parameters": [{"name": "storage", "value": "fsx"},
                                     {"name": "fsx_file_system_id", "value": "fs-0123456789abcdef0"},
                                     {"name": "steps", "value": "400"},
                                     {"name": "train_overrides", "value": '{"lr": 0.001}'},
                                     {"name": "promote_to", "value": "/mnt/run/promoted/{run_id}"}]},
    }


def test_cron_defaults(tmp_path):
    assert cli(["compile", "--format", "argo", "-o", str(tmp_path)]) == 0
    spec = yaml.safe_load(argo.output_paths(tmp_path).cron_workflow.read_text())["spec"]
    assert spec["schedules"] == ["0 2 * * *"] and spec["timezone"] == "UTC" and spec["concurrencyPolicy"] == "Forbid"
    assert "startingDeadlineSeconds" not in spec
    assert spec["workflowSpec"] == {"workflowTemplateRef": {"name": "resilient-training"}}


# --- the same pipeline as KFP -------------------------------------------------------------------


Retry = tuple[int, float, float, float]  # (retries, first backoff s, factor, window s)


def _argo_seconds(text: str) -> float:
    """A duration as Argo reads a backoff's: a bare integer is seconds, else a Go duration (60s, 1h30m)."""
    if text.isdigit():
        return float(text)
    parts = re.findall(r"([0-9]+)(h|m|s)", text)
    assert "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def kfp_retry(policy: dict[str, Any] | None) -> Retry | None:
    """A task's retryPolicy in the KFP IR (durations are protobuf JSON: "60s")."""
    if policy is None:
        return None
    return (int(policy["maxRetryCount"]), float(policy["backoffDuration"].removesuffix("s")),
            float(policy["backoffFactor"]), float(policy["backoffMaxDuration"].removesuffix("s")))


def argo_retry(strategy: dict[str, Any] | None) -> Retry | None:
    """A template's retryStrategy in the WorkflowTemplate."""
    if strategy is None:
        return None
    backoff = strategy["backoff"]
    return (int(strategy["limit"]), _argo_seconds(backoff["duration"]), float(backoff["factor"]),
            _argo_seconds(backoff["maxDuration"]))


def _kfp_source(spec: dict[str, Any], env: dict[str, tuple]) -> tuple:
    if "componentInputParameter" in spec:
        return env[spec["componentInputParameter"]]
    if "taskOutputParameter" in spec:
        out = spec["taskOutputParameter"]
        return ("output", out["producerTask"], out["outputParameterKey"])
    constant = spec["runtimeValue"]["constant"]
    return ("run_id",) if constant == "{{$.pipeline_job_uuid}}" else ("const", str(constant))


def kfp_tasks(ir: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every component task of the KFP IR: component, inputs by source, guards, exit handler or not, retries."""
    spec, platform = ir[0], (ir[1] if len(ir) > 1 else {})
    executors = platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})
    found: dict[str, dict[str, Any]] = {}

    def walk(dag: dict[str, Any], env: dict[str, tuple], guards: frozenset, in_exit_handler: bool,
             after: frozenset = frozenset()) -> None:
        for name, task in dag["tasks"].items():
            task_after = after | set(task.get("dependentTasks", []))
            inputs = {k: _kfp_source(v, env) for k, v in task.get("inputs", {}).get("parameters", {}).items()}
            component = spec["components"][task["componentRef"]["name"]]
            condition = task.get("triggerPolicy", {}).get("condition")
            inner = guards
            if condition:
                match = re.fullmatch(r"inputs\.parameter_values\['(.+)'\] == true", condition)
                assert match, condition
                inner = guards | {inputs[match.group(1)]}
            exit_task = task.get("triggerPolicy", {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED"
            if "dag" in component:
                walk(component["dag"], inputs, inner, in_exit_handler or name.startswith("exit-handler"), task_after)
                continue
            mounts = executors.get(component["executorLabel"], {}).get("pvcMount", [])
            claims = [(_kfp_source(m["pvcNameParameter"], env), m["mountPath"]) for m in mounts]
            found[name] = {"component": task["componentRef"]["name"].removeprefix("comp-"), "inputs": inputs,
                           "guards": inner, "exit": exit_task, "claims": claims,
                           "after": frozenset(task_after) if not exit_task else frozenset(),
                           "retry": kfp_retry(task.get("retryPolicy"))}

    walk(spec["root"]["dag"], {name: ("param", name) for name in spec["root"]["inputDefinitions"]["parameters"]},
         frozenset(), False)
    return with_ancestors(found)


def with_ancestors(tasks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Replace each task's direct predecessors ("after") by all its ancestors."""
    def ancestors(name: str) -> frozenset:
        direct = tasks[name]["after"]
        return frozenset(direct).union(*(ancestors(d) for d in direct))

    return {name: {**task, "after": ancestors(name)} for name, task in tasks.items()}


def _argo_source(text: str) -> tuple:
    for pattern, kind in ((r"\{\{workflow\.parameters\.([\w-]+)\}\}", "param"),
                          (r"\{\{tasks\.([\w-]+)\.outputs\.parameters\.([\w-]+)\}\}", "output")):
        if match := re.fullmatch(pattern, text):
            return (kind, *match.groups())
    return ("run_id",) if text == "{{workflow.uid}}" else ("const", text)


def argo_tasks(wt: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The same view of the WorkflowTemplate."""
    by_name = templates(wt)
    found = {}
    for dag_name, is_exit in ((wt["spec"]["entrypoint"], False), (wt["spec"]["onExit"], True)):
        for task in by_name[dag_name]["dag"]["tasks"]:
            args = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
            template = by_name[task["template"]]
            command = template["container"]["command"]
            guards = frozenset(_argo_source(m.group(1)) for m in re.finditer(r"(\{\{[^}]+\}\}) == true",
                                                                               task.get("when", "")))
            claim = args.pop("claim", "")
            args.pop("artifacts_dir", None)
            found[task["name"]] = {
                "component": command[command.index("resilient_training.argo.step") + 1].replace("_", "-"),
                "inputs": {k: _argo_source(v) for k, v in args.items()}, "guards": guards, "exit": is_exit,
                "claims": [(_argo_source(claim), m["mountPath"]) for m in template["container"].get("volumeMounts", [])],
                "after": frozenset(re.findall(r"[a-z][\w-]*", task.get("depends", ""))),
                "retry": argo_retry(template.get("retryStrategy")),
            }
    return with_ancestors(found)


def test_same_tasks_inputs_guards_mounts_and_exit_handler_as_the_kfp_pipeline(compiled, kfp_ir):
    kfp, argo_view = kfp_tasks(kfp_ir), argo_tasks(compiled["template"])
    assert set(kfp) == set(argo_view) == {
        "check-arguments", "provision-storage", "launch-training", "validate-checkpoint", "check-convergence",
        "promote-model", "resilience-report", "teardown-storage"}
    for name in kfp:
        assert argo_view[name] == kfp[name], name
    # Argo resolves {{tasks.X...}} only for ancestors: every upstream output a task reads is one.
    for name, task in argo_view.items():
        sources = [*task["inputs"].values(), *task["guards"], *(claim for claim, _ in task["claims"])]
        assert {s[1] for s in sources if s[0] == "output"} <= task["after"], name


def test_the_comparison_notices_a_changed_wiring_or_order(compiled, kfp_ir):
    """The drift test can fail: rewire one input, or start the report before the gate, and it is caught."""
    planted = json.loads(json.dumps(compiled["template"]))
    for task in templates(planted)["main"]["dag"]["tasks"]:
        if task["name"] == "check-convergence":
            for p in task["arguments"]["parameters"]:
                if p["name"] == "min_improvement":
                    p["value"] = "{{workflow.parameters.max_final_loss}}"
        if task["name"] == "resilience-report":
            task["depends"] = "launch-training"
    kfp, changed = kfp_tasks(kfp_ir), argo_tasks(planted)
    assert changed["check-convergence"]["inputs"] != kfp["check-convergence"]["inputs"]
    assert changed["resilience-report"]["after"] == {"launch-training", "provision-storage", "check-arguments"}
    assert changed["resilience-report"] != kfp["resilience-report"]


def test_the_same_steps_retry_with_the_kfp_pipeline_s_count_backoff_and_window(compiled, kfp_ir):
    """Argo retried nothing while KFP retried three steps: a transient failure (cloud throttling, an API
    blip while launch watched its job) failed the whole Argo run and tore its training job down."""
    kfp, argo_view = kfp_tasks(kfp_ir), argo_tasks(compiled["template"])
    assert {name: argo_view[name]["retry"] for name in argo_view} == {name: kfp[name]["retry"] for name in kfp}
    assert {name: task["retry"] for name, task in argo_view.items() if task["retry"]} == {
        "provision-storage": (3, 60.0, 2.0, 10800.0), "launch-training": (2, 60.0, 2.0, 93600.0),
        "teardown-storage": (3, 60.0, 2.0, 10800.0)}
    by_name = templates(compiled["template"])
    # An attempt whose pod was lost (an Argo Error, not a Failure) is retried too: these steps are idempotent.
    assert {by_name[name]["retryStrategy"]["retryPolicy"] for name in ("provision-storage", "launch-training",
                                                                      "teardown-storage")} == {"Always"}
    # The window counts from the first attempt: it outlasts the launch step's own job limit.
    job_limit = argo_step.load_component("launch_training").component_spec.inputs["timeout_seconds"].default
    assert argo_view["launch-training"]["retry"][3] > job_limit
    # The comparison notices a changed limit.
    planted = json.loads(json.dumps(compiled["template"]))
    templates(planted)["launch-training"]["retryStrategy"]["limit"] = 3
    assert argo_tasks(planted)["launch-training"]["retry"] != kfp["launch-training"]["retry"]


def test_a_fractional_backoff_factor_is_refused_not_rounded():
    # Argo's backoff.factor is an integer; pipelines/defaults.py could say 1.5 for KFP.
    assert argo.retry_strategy((2, "60s", 2.0, "600s")).backoff.factor.root == 2
    with pytest.raises(ValueError, match="retry backoff factor 1.5: Argo takes a whole number"):
        argo.retry_strategy((2, "60s", 1.5, "600s"))


def test_promotion_is_guarded_by_both_gates_and_waits_for_both(compiled):
    promote = dag_tasks(compiled["template"], "main")["promote-model"]
    assert promote["when"] == ("{{tasks.validate-checkpoint.outputs.parameters.Output}} == true && "
                               "{{tasks.check-convergence.outputs.parameters.Output}} == true")
    assert set(re.findall(r"[\w-]+", promote["depends"])) == {"validate-checkpoint", "check-convergence"}


def test_teardown_runs_on_exit_only(compiled):
    wt = compiled["template"]
    assert wt["spec"]["onExit"] == "exit-handler"
    assert list(dag_tasks(wt, "exit-handler")) == ["teardown-storage"]
    assert "teardown-storage" not in dag_tasks(wt, "main")


def test_parameters_are_the_pipelines_with_its_defaults_and_descriptions(compiled):
    params = compiled["template"]["spec"]["arguments"]["parameters"]
    inputs = resilient_training.component_spec.inputs
    assert [p["name"] for p in params] == list(inputs)
    for p in params:
        spec = inputs[p["name"]]
        assert p["description"].startswith(" ".join(spec.description.split())), p["name"]
        if p["name"] == "storage":
            # Steps run in separate pods: only shared storage; the enum refuses local at submit.
            assert p["enum"] == ["pvc", "fsx"] and p["value"] == "pvc"
        elif p["name"] == "launcher":
            # local trains in the launch step's pod: the release's components image has no torch or NVRx.
            assert p["enum"] == ["pytorchjob", "trainjob"] and p["value"] == "pytorchjob"
        else:
            assert "enum" not in p
            assert p["value"] == argo.argo_value(spec.default), p["name"]
    # What the steps parse back is the pipeline's default value again.
    as_text = {p["name"]: p["value"] for p in params}
    assert json.loads(as_text["train_overrides"]) == {} and as_text["async_checkpoint"] == "true"
    assert float(as_text["max_final_loss"]) == inputs["max_final_loss"].default


def test_steps_run_the_component_in_the_components_image_without_a_shell_or_memoization(compiled):
    wt = compiled["template"]
    assert "memoize" not in json.dumps(wt)
    containers = [t for t in wt["spec"]["templates"] if "container" in t]
    assert len(containers) == 8
    for template in containers:
        container = template["container"]
        assert container["image"] == images.COMPONENTS_IMAGE
        command = container["command"]
        assert command[:3] == ["python", "-m", "resilient_training.argo.step"]
        assert command[3] in argo_step.COMPONENTS and command[4:6] == ["--outputs", argo.OUTPUTS_DIR]
        # One argv element per component input, each exactly NAME={{inputs.parameters.NAME}}.
        component = argo_step.load_component(command[3])
        names = [arg.partition("=")[0] for arg in container["args"]]
        assert set(names) <= set(component.component_spec.inputs)
        assert container["args"] == [f"{n}={{{{inputs.parameters.{n}}}}}" for n in names]
        outputs = [p["name"] for p in template.get("outputs", {}).get("parameters", [])]
        assert outputs == [n for n, s in (component.component_spec.outputs or {}).items() if "@" not in s.type]


# --- the command lines are real -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real, short run: 8 steps, 2 gloo workers under ft_launcher (the gates' wiring is what is tested here).

    This module's copy of the session's shared run (the steps write their records into it).
    """
    from tests.support.gates import copy_run

    return copy_run(runs.two_rank_gpt_run(tmp_path_factory.getbasetemp()), tmp_path_factory.mktemp("argo-run") / "run")


def argo_task_command(wt: dict[str, Any], task_name: str, context: dict[str, str], work: Path,
                      extra: tuple[str, ...] = ()) -> list[str]:
    """One DAG task's container command as Argo would start it, here (``extra``: more NAME=VALUE items)."""
    task = dag_tasks(wt, "main")[task_name]
    template = templates(wt)[task["template"]]

    def substitute(text: str, values: dict[str, str]) -> str:
        def one(match: re.Match) -> str:
            assert match.group(1) in values, f"{task_name}: nothing for {match.group(1)}"
            return values[match.group(1)]
        return re.sub(r"\{\{([^}]+)\}\}", one, text)

    inputs = {f"inputs.parameters.{p['name']}": substitute(p["value"], context)
              for p in task["arguments"]["parameters"]}
    outputs_dir = work / task_name
    command = [substitute(part, inputs) for part in template["container"]["command"] + template["container"]["args"]]
    return [sys.executable if part == "python" else str(outputs_dir) if part == argo.OUTPUTS_DIR else part
            for part in command] + list(extra)


def task_outputs(wt: dict[str, Any], task_name: str, context: dict[str, str], work: Path) -> dict[str, str]:
    """The output parameters a task's command wrote, read as Argo reads them (and added to ``context``)."""
    template = templates(wt)[dag_tasks(wt, "main")[task_name]["template"]]
    outputs_dir = work / task_name
    found = {}
    for p in template["outputs"]["parameters"]:
        path = Path(p["valueFrom"]["path"].replace(argo.OUTPUTS_DIR, str(outputs_dir)))
        found[p["name"]] = path.read_text()
        context[f"tasks.{task_name}.outputs.parameters.{p['name']}"] = found[p["name"]]
    return found


def run_argo_task(wt: dict[str, Any], task_name: str, context: dict[str, str], work: Path) -> dict[str, str]:
    """Start one DAG task's container command the way Argo would, here; return its output parameters."""
    proc = subprocess.run(argo_task_command(wt, task_name, context, work), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return task_outputs(wt, task_name, context, work)


def when_holds(expression: str, context: dict[str, str]) -> bool:
    """Argo's `when` for the only form used here: `A == true && B == true`."""
    clauses = [c.strip() for c in re.sub(r"\{\{([^}]+)\}\}", lambda m: context[m.group(1)], expression).split("&&")]
    assert all(re.fullmatch(r"\w+ == true", c) for c in clauses), clauses
    return all(c == "true == true" for c in clauses)


@pytest.mark.slow
def test_gate_promotion_and_report_steps_run_as_argo_starts_them(compiled, tiny_run, tmp_path):
    wt = compiled["template"]
    context = {f"workflow.parameters.{p['name']}": p["value"] for p in wt["spec"]["arguments"]["parameters"]}
    # The run has 8 steps: a lenient convergence gate lets it pass; promote to a local directory.
    context |= {"workflow.parameters.max_final_loss": "100.0", "workflow.parameters.min_improvement": "0.01",
                "workflow.parameters.promote_to": str(tmp_path / "promoted"),
                "tasks.launch-training.outputs.parameters.run_dir": str(tiny_run),
                "tasks.provision-storage.outputs.parameters.pvc_name": "run-claim"}
    assert run_argo_task(wt, "validate-checkpoint", context, tmp_path) == {"Output": "true"}
    assert run_argo_task(wt, "check-convergence", context, tmp_path) == {"Output": "true"}
    artifacts = tiny_run / argo.ARTIFACTS_DIRNAME
    assert json.loads((artifacts / "validate-checkpoint" / "metrics").read_text())["valid"] == 1.0
    assert "Convergence gate: PASSED" in (artifacts / "check-convergence" / "summary").read_text()
    promote = dag_tasks(wt, "main")["promote-model"]
    assert when_holds(promote["when"], context)
    assert run_argo_task(wt, "promote-model", context, tmp_path) == {"Output": str(tmp_path / "promoted")}
    record = json.loads((artifacts / "promote-model" / "promotion").read_text())
    assert record["outcome"]["step"] == 8
    report = run_argo_task(wt, "resilience-report", context, tmp_path)
    assert 0.0 < float(report["Output"]) <= 1.0
    assert (artifacts / "resilience-report" / "report").read_text().lstrip().lower().startswith("<!doctype html")

    # The default gate (10% improvement, a loss limit from the vocabulary) fails this short run:
    # the step succeeds, says false, and the guard keeps promotion from starting.
    context |= {"workflow.parameters.max_final_loss": "-1.0", "workflow.parameters.min_improvement": "0.5"}
    assert run_argo_task(wt, "check-convergence", context, tmp_path / "strict") == {"Output": "false"}
    assert not when_holds(promote["when"], context)


def test_a_retried_launch_step_attaches_to_the_job_its_lost_attempt_started(compiled, tmp_path, monkeypatch):
    """Argo retries launch-training in a new pod with the same arguments. The job's name derives from
    {{workflow.uid}}, the same in every attempt, so the retry attaches to the running job instead of
    starting a second one. The first attempt's pod is lost here (SIGKILL) while its PyTorchJob runs.
    """
    import os
    import signal
    import time

    from resilient_training.launch.jobshape import job_name_for_run
    from resilient_training.run.storage_ref import StorageRef
    from tests.support import kube_api
    from tests.support.kube_api import Phase

    wt = compiled["template"]
    uid = "6f1d2c3b-4a59-4e8f-9d7c-0b1a2e3f4d5c"
    ref = StorageRef(backend="pvc", run_dir=f"/mnt/run/runs/{uid}", mount_path="/mnt/run", namespace="team-a",
                     pvc_name="training-data")
    context = {f"workflow.parameters.{p['name']}": p["value"] for p in wt["spec"]["arguments"]["parameters"]}
    context |= {"workflow.uid": uid, "tasks.provision-storage.outputs.parameters.storage_ref": ref.to_json(),
                "tasks.provision-storage.outputs.parameters.pvc_name": ref.pvc_name}
    fast = ("poll_seconds=0.05",)  # the template's default polls every 15 s
    name = job_name_for_run(uid)
    with kube_api.running() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        server.state.job_timeline = [Phase("Created"), Phase("Running")]  # runs until the retry
        first = subprocess.Popen(argo_task_command(wt, "launch-training", context, tmp_path / "attempt-1", fast),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not any(c["type"] == "Running" and c["status"] == "True"
                          for c in ((server.get("pytorchjobs", name, "team-a") or {}).get("status") or {})
                          .get("conditions", [])):
                assert first.poll() is None and time.monotonic() < deadline, "the first attempt never saw its job run"
                time.sleep(0.05)
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
        job_uid = server.get("pytorchjobs", name, "team-a")["metadata"]["uid"]
        server.state.job_timeline += [Phase("Running"), Phase("Succeeded", reason="PyTorchJobSucceeded")]

        retry = subprocess.run(argo_task_command(wt, "launch-training", context, tmp_path / "attempt-2", fast),
                               capture_output=True, text=True, timeout=240)
        assert retry.returncode == 0, retry.stdout[-2000:] + retry.stderr[-3000:]
        assert f"PyTorchJob team-a/{name} already exists (Running, a retried step): attaching to it" in retry.stdout
        assert task_outputs(wt, "launch-training", context, tmp_path / "attempt-2") == {
            "job_name": name, "run_dir": ref.run_dir}
        assert server.names("pytorchjobs") == [name]
        assert server.get("pytorchjobs", name, "team-a")["metadata"]["uid"] == job_uid  # the same job throughout
        calls = [method for method, path in server.state.requests if "/pytorchjobs" in path]
        assert calls.count("POST") == 2 and "DELETE" not in calls  # the retry's create was answered 409


# --- the step entry point -----------------------------------------------------------------------


def test_provision_step_takes_arguments_literally_and_writes_its_outputs(tmp_path, capsys):
    """No shell between Argo and the component: a value with shell syntax is data, not a command."""
    root = tmp_path / "runs; touch pwned"
    outputs = tmp_path / "out"
    rc = argo_step.main(["provision_storage", "--outputs", str(outputs), "run_id=wf-1234", "storage=local",
                         f"local_root={root}"])
    assert rc == 0, capsys.readouterr()
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    run_dir = Path((outputs / "run_dir").read_text())
    assert run_dir.is_dir() and run_dir.is_relative_to(root)
    assert json.loads((outputs / "storage_ref").read_text())["run_dir"] == str(run_dir)
    assert (outputs / "pvc_name").read_text() == ""


@pytest.mark.parametrize(("argv", "message"), [
    (["no_such_component", "x=1"], "unknown component 'no_such_component'"),
    (["os", "x=1"], "unknown component 'os'"),
    (["validate_checkpoint", "run_dir=/r", "bogus=1"], "has no input 'bogus'"),
    (["validate_checkpoint", "run_dir=/r", "metrics=/x"], "has no input 'metrics'"),  # an artifact, not an argument
    (["validate_checkpoint", "run_dir=/r", "load=maybe"], "'load' must be true or false, got 'maybe'"),
    (["validate_checkpoint", "run_dir=/r", "run_dir=/s"], "'run_dir' is given twice"),
    (["validate_checkpoint", "load=true"], "validate-checkpoint needs run_dir"),
    (["validate_checkpoint", "run_dir"], "'run_dir' is not NAME=VALUE"),
    (["check_convergence", "run_dir=/r", "max_final_loss=nan"], "'max_final_loss' must be a number"),
    (["check_convergence", "run_dir=/r", "max_final_loss=0.0_5"], "'max_final_loss' must be a number, got '0.0_5'"),
    (["check_convergence", "run_dir=/r", "min_improvement=٠.٥"], "'min_improvement' must be a number, got '٠.٥'"),
    (["launch_training", "storage_ref={}", "run_id=r", "steps=4.5"], "'steps' must be an integer"),
    (["launch_training", "storage_ref={}", "run_id=r", "train_overrides=[1]"], "must be a JSON object"),
    (["launch_training", "storage_ref={}", "run_id=r", 'tolerations={"a": 1}'], "'tolerations' must be a JSON list"),
    (["launch_training", "storage_ref={}", "run_id=r", "node_selector=[1]"], "'node_selector' must be a JSON object"),
    # A gate threshold nothing checked before the run, or a missing run: a traceback after training (stranger trial).
    (["check_convergence", "run_dir=RUN", "max_final_loss=0.6", "min_improvement=-0.5"],
     "min_improvement must be a finite number in [0, 1)"),
    (["check_convergence", "run_dir=RUN", "max_final_loss=0"], "max_final_loss must be finite and > 0, got 0.0"),
    (["check_convergence", "run_dir=RUN", "window=0"], "window must be at least 1 step"),
    (["check_convergence", "run_dir=/nonexistent"], "run_dir '/nonexistent' is not a directory"),
    (["check_convergence", "run_dir=RUN", "reference_run_dir=/nonexistent"],
     "reference_run_dir '/nonexistent' is not a directory"),
])
def test_step_refuses_unusable_arguments_with_one_line_and_writes_nothing(argv, message, tmp_path, capsys):
    outputs = tmp_path / "out"
    (tmp_path / "run").mkdir()
    argv = [arg.replace("RUN", str(tmp_path / "run")) for arg in argv]
    assert argo_step.main([argv[0], "--outputs", str(outputs), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not outputs.exists()


# --- bad compile flags --------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--schedule", "0 0 2 * * *"], "has 6 fields (KFP's form, seconds first), but Argo cron has 5"),
    (["--schedule", "0 2 * *"], "has 4 fields"),
    (["--schedule", "61 2 * * *"], "minute field: 61 is outside 0-59"),
    (["--schedule", "0 2 * * mon-fri", "--schedule", "@fortnightly"], "unknown cron descriptor '@fortnightly'"),
    (["--schedule", "@every"], "@every needs one duration"),
    (["--schedule", "@every 1 h"], "@every needs one duration"),
    (["--timezone", "Mars/Olympus"], "unknown time zone 'Mars/Olympus'"),
    (["--timezone", "../../etc/passwd"], "unknown time zone"),
    (["--concurrency-policy", "forbid"], "concurrency policy must be one of Allow, Forbid, got 'forbid'"),
    (["--concurrency-policy", ""], "concurrency policy must be one of Allow, Forbid, got ''"),  # was Forbid
    (["--starting-deadline", "-5"], "--starting-deadline must be a positive number of seconds"),
    (["--starting-deadline", "0"], "--starting-deadline must be a positive number of seconds, got 0"),
    (["--pipeline", "recovery-benchmark"], "writes the 'resilient-training' pipeline only"),
    (["-o", "one.yaml"], "-o must be a directory"),
    (["--cron-param", "storage=local"], "--cron-param: storage must be one of pvc, fsx on Argo, got 'local'"),
    (["--cron-param", "nodes=two"], "--cron-param: input 'nodes' must be an integer, got 'two'"),
    (["--cron-param", "nodez=2"], "--cron-param: resilient-training has no input 'nodez'"),
    (["--cron-param", "steps=4", "--cron-param", "steps=5"], "--cron-param: input 'steps' is given twice"),
    (["--cron-param", "train_overrides=[]"], "must be a JSON object"),
    # Typed right, refused by a step of every scheduled run (stranger trial): checked with the steps' own rules.
    (["--cron-param", "pvc_name=data", "--cron-param", "nodes=-1"], "--cron-param: nodes must be an integer from 1"),
    (["--cron-param", "pvc_name=data", "--cron-param", "launcher=bogus"],
     "--cron-param: launcher must be one of local, pytorchjob, trainjob, got 'bogus'"),
    (["--cron-param", "pvc_name=data", "--cron-param", "faults=garbage"], "--cron-param: faults: bad fault 'garbage'"),
    (["--cron-param", "pvc_name=Bad_Name"], "--cron-param: pvc_name 'Bad_Name' is not a DNS-1123 subdomain"),
    (["--cron-param", "pvc_name=data\n"], "contains a control character"),
    (["--cron-param", "steps=400"], "--cron-param: storage 'pvc' needs pvc_name"),
    (["--cron-param", "pvc_name=data", "--cron-param", "launcher=pytorchjob", "--cron-param", "trainer_image=Org/x"],
     "is not an image reference"),
    (["--cron-param", "pvc_name=data", "--cron-param", 'train_overrides={"seed": -1}'],
     "--cron-param: seed must be between 0 and 4294967295"),
    (["--cron-param", "pvc_name=data", "--cron-param", "export=onnx"], "--cron-param: export 'onnx'"),
    # (launcher=local dropping the worker pods' placement: test_launcher_local_with_pod_placement_is_refused)
    (["--cron-param", "pvc_name=data", "--cron-param", "launcher=pytorchjob", "--cron-param", "shm_size=1Mi"],
     "--cron-param: shm_size '1Mi' is below 256Mi"),
    (["--cron-param", "pvc_name=data", "--cron-param", "launcher=pytorchjob", "--cron-param", 'node_selector={"k": 5}'],
     "--cron-param: node selector {'k': 5}: labels and values are strings"),
    (["--cron-param", "pvc_name=data", "--cron-param", "launcher=pytorchjob", "--cron-param", 'tolerations=["gpu"]'],
     "--cron-param: a toleration is a mapping"),
    (["--schedule", "@every 0s"], "@every needs a duration of at least 1m (a run at most once a minute), got '0s'"),
    (["--schedule", "@every 1s"], "@every needs a duration of at least 1m"),  # accepted before (stranger trial)
    (["--schedule", "@every 59s"], "@every needs a duration of at least 1m"),
    # Go parses these, the CronWorkflow CRD's pattern does not: written before (stranger trial)
    (["--schedule", "@every 0.5h"], "@every takes whole numbers of each unit (the CronWorkflow CRD refuses '0.5h')"),
    (["--schedule", "@every 1m0.5s"], "write 30m for 0.5h"),
    (["--schedule", "0 2 * * *", "--schedule", "0  2 * * *"], "--schedule '0 2 * * *' is given twice"),
    (["--schedule", "0 2 31 2 *"], "never fires"),
    (["--schedule", "0 ² * * *"], "hour field: '²' is not a number"),  # a traceback before (stranger trial)
    (["--schedule", "@every 2562048h"], "past Go's longest duration"),
    (["--schedule", "CRON_TZ=Europe/Berlin 0 2 * * *"], "give --timezone Europe/Berlin and the schedule alone, '0 2 * * *'"),
    (["--cron-param", "pvc_name=data"], "promote_to 'promoted' is relative: on a cluster it lands"),
    (["--cron-param", "pvc_name=data", "--cron-param", "promote_to=/mnt/run"], "contains the run directory"),
    # Every run of the schedule would promote into the place the first one's model holds (stranger trial).
    (["--cron-param", "pvc_name=data", "--cron-param", "promote_to=s3://models/nightly"],
     "--cron-param: promote_to 's3://models/nightly' is the same place for every scheduled run: the first run's "
     "model takes it and promotion refuses every later one; put {run_id} in it (the run's id), e.g. "
     "s3://models/nightly/{run_id}"),
    (["--cron-param", "pvc_name=data", "--cron-param", "promote_to=/mnt/run/runs/{run_id}/model"],
     "is inside the run directory"),
    (["--cron-param", "pvc_name=data", "--cron-param", "promote_to=/tmp/models/{run_id}"],
     "is not on the run's claim (/mnt/run)"),
    (["--cron-param", "pvc_name=data", "--cron-param", "promote_to=s3://models/{runid}"],
     "that is not the field {run_id}"),
    (["--cron-param", "pvc_name=data", "--cron-param", "promote_to=s3://Models/x"],
     "promote_to: 's3://Models/x' names no valid bucket"),
    (["--cron-param", "nodes=1_0"], "input 'nodes' must be an integer, got '1_0'"),
    (["--cron-param", "min_improvement=1_0.0"], "input 'min_improvement' must be a number, got '1_0.0'"),
    # Stranger trial 6: numbers were stripped, strings kept their blank; refused as KFP's --param refuses them.
    (["--cron-param", "steps= 40"], "--cron-param: parameter 'steps' value ' 40' has blanks around it"),
    (["--cron-param", "pvc_name=data", "--cron-param", "region=us-east-1 "],
     "--cron-param: parameter 'region' value 'us-east-1 ' has blanks around it"),
    (["--cron-param", "pvc_name=data", "--cron-param", "export=safetensors "], "value 'safetensors ' has blanks"),
    # Kubernetes' pod validation refuses tolerationSeconds without effect NoExecute (stranger trial 6).
    (["--cron-param", "pvc_name=data", "--cron-param", "launcher=pytorchjob", "--cron-param",
      "promote_to=s3://models/{run_id}", "--cron-param",
      'tolerations=[{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]'],
     "tolerationSeconds needs effect NoExecute"),
    (["--cron-param", 'task_args={"lr": "1", "lr": "2"}'], "key 'lr' is given twice"),
    # A shipped task is made with the schedule's task_args here, as each worker would make it (stranger trial).
    (["--cron-param", "pvc_name=data", "--cron-param", 'task_args={"d_model": "abc"}'],
     "--cron-param: task_args: task resilient_training.tasks.gpt:task raised while being created: ValueError: "
     "task argument d_model='abc' is not an integer"),
])
def test_compile_argo_refuses_bad_flags_with_one_line_and_writes_nothing(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["compile", "--format", "argo", *(["-o", "out"] if "-o" not in flags else []), *flags]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_concurrency_policy_replace_is_refused_its_runs_would_never_be_torn_down(tmp_path, capsys, monkeypatch):
    """Argo's cron controller terminates the running workflow for Replace, and a terminated workflow
    runs no onExit handler: teardown-storage would never delete the job, claim and FSx file system."""
    monkeypatch.chdir(tmp_path)
    assert cli(["compile", "--format", "argo", "-o", "out", "--concurrency-policy", "Replace"]) == 2
    out, err = capsys.readouterr()
    assert err == ("error: concurrency policy Replace terminates the running workflow, and a terminated workflow "
                   "runs no exit handler: teardown-storage would never delete its job, claim and FSx file system; "
                   "use Forbid (the default: skip a start while a run is active) or Allow\n")
    assert out == "" and list(tmp_path.iterdir()) == []


def test_launcher_local_is_scheduled_only_with_a_components_image_of_the_users_own(tmp_path, capsys, monkeypatch):
    """A stranger trial scheduled launcher=local on Argo: every night's launch step would have failed
    (the release's components image has no torch or NVRx). With RT_COMPONENTS_IMAGE set at compile
    (an image of the user's, which may have them) it is offered and may be scheduled.
    """
    from resilient_training.launch import images

    monkeypatch.chdir(tmp_path)
    flags = ["compile", "--format", "argo", "-o", "out", "--cron-param", "pvc_name=data",
             "--cron-param", "promote_to=s3://models/{run_id}", "--cron-param", "launcher=local"]
    assert cli(flags) == 2
    assert "launcher 'local' would train inside the launch step's pod" in capsys.readouterr().err
    # The release's image under another tag or a digest is still the release's: no torch, no NVRx.
    for release in (images.COMPONENTS_IMAGE, f"{images.RELEASE_COMPONENTS_REPOSITORY}:0.0.9@sha256:{'a' * 64}"):
        monkeypatch.setitem(images._FROM_ENV, images.COMPONENTS_ENV, release)
        assert cli(flags) == 2
        assert "launcher 'local' would train inside the launch step's pod" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setitem(images._FROM_ENV, images.COMPONENTS_ENV, "registry.example:5000/team/components:1")
    assert cli(flags) == 0
    template = yaml.safe_load(argo.output_paths(tmp_path / "out").workflow_template.read_text())
    launcher = next(p for p in template["spec"]["arguments"]["parameters"] if p["name"] == "launcher")
    assert launcher["enum"] == ["pytorchjob", "trainjob", "local"] and launcher["value"] == "pytorchjob"


@pytest.mark.parametrize(("flag", "message"), [
    ("efa_per_node=8", "efa_per_node places the worker pods of launcher=pytorchjob or trainjob"),
    ("memory=64Gi", "memory places the worker pods of launcher=pytorchjob or trainjob"),
    ('tolerations=[{"key": "a"}]', "tolerations places the worker pods"),
])
def test_launcher_local_with_pod_placement_is_refused(flag, message, tmp_path, capsys, monkeypatch):
    """Stranger trial: launcher=local dropped the worker pods' placement without a word (with a
    components image of the user's, where launcher=local may be scheduled at all).
    """
    from resilient_training.launch import images

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(images._FROM_ENV, images.COMPONENTS_ENV, "registry.example/team/components:1")
    assert cli(["compile", "--format", "argo", "-o", "out", "--cron-param", "pvc_name=data",
                "--cron-param", "launcher=local", "--cron-param", flag]) == 2
    err = capsys.readouterr().err
    assert f"--cron-param: {message}" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_cron_flags_are_refused_without_format_argo(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["compile", "-o", "out", "--timezone", "UTC", "--starting-deadline", "60", "--cron-param", "steps=1"]) == 2
    assert "--timezone, --starting-deadline, --cron-param: only with --format argo" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_compile_argo_prints_what_it_wrote(tmp_path, capsys):
    assert cli(["compile", "--format", "argo", "-o", str(tmp_path / "argo")]) == 0
    out = capsys.readouterr().out
    count = len(resilient_training.component_spec.inputs)
    assert f"WorkflowTemplate 'resilient-training', 7 steps + teardown-storage on exit, {count} parameter(s)" in out
    assert ("CronWorkflow 'resilient-training': 0 2 * * * UTC, concurrency Forbid, starting deadline none; "
            "parameters: the template's defaults") in out
    assert sorted(p.name for p in (tmp_path / "argo").iterdir()) == [
        "resilient-training.cronworkflow.yaml", "resilient-training.workflowtemplate.yaml"]


@pytest.mark.parametrize("faults", [None, "", "exception@5:0"])
def test_a_schedule_inheriting_the_demonstration_faults_is_said_to(faults, tmp_path, capsys):
    """A stranger trial's nightly schedule (docs/argo.md's) injected the demo's three faults into
    every production run, unsaid."""
    given = [] if faults is None else ["--cron-param", f"faults={faults}"]
    flags = ["--cron-param", "storage=pvc", "--cron-param", "pvc_name=data", "--cron-param",
             "promote_to=s3://models/m/{run_id}", *given]
    assert cli(["compile", "--format", "argo", "-o", str(tmp_path / "argo"), *flags]) == 0
    err = capsys.readouterr().err
    said = "note: the CronWorkflow's runs inherit the template's demonstration faults (sigkill@12:1,exception@22:0"
    assert (said in err) == (faults is None), err


@pytest.mark.parametrize("blocked", ["workflowtemplate", "cronworkflow"])
def test_compile_argo_writes_both_files_or_neither(blocked, tmp_path, capsys):
    """A stranger trial's CronWorkflow path was a directory: the template was written, then exit 2."""
    out = tmp_path / "argo"
    (out / f"resilient-training.{blocked}.yaml").mkdir(parents=True)
    assert cli(["compile", "--format", "argo", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {out}/resilient-training.{blocked}.yaml: Is a directory" in err and err.count("\n") == 1
    assert [p.name for p in out.iterdir()] == [f"resilient-training.{blocked}.yaml"]  # nothing else, no temporary


# --- the cluster side ---------------------------------------------------------------------------


def test_argo_overlay_builds_and_lets_the_steps_service_account_report_outputs():
    import shutil

    import kubernetes_validate

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(Path(__file__).resolve().parents[1] / "manifests/overlays/argo")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.32", strict=True)
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert ("ServiceAccount", argo.SERVICE_ACCOUNT) in by_kind_name  # the account the WorkflowTemplate names
    role = by_kind_name[("Role", "resilient-training-argo-executor")]
    assert role["rules"] == [{"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"],
                              "verbs": ["create", "patch"]}]
    binding = by_kind_name[("RoleBinding", "resilient-training-argo-executor")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": argo.SERVICE_ACCOUNT,
                                    "namespace": "resilient-training"}]


def test_the_docs_give_the_template_s_parameter_count():
    # Found by a stranger trial: docs/argo.md said 26 parameters after three were added.
    text = (Path(__file__).resolve().parent.parent / "docs" / "argo.md").read_text()
    found = re.findall(r"(\d+) parameter\(s\)\)|The (\d+) workflow parameters", text)
    counts = {int(listed or prose) for listed, prose in found}
    assert len(found) >= 3  # every place the docs give it
    assert counts == {len(argo.workflow_parameters())}, counts


def test_worker_pods_get_the_pipeline_s_service_account(compiled):
    # The pipeline passed none: PyTorchJob/TrainJob pods ran as the namespace's default (stranger trial).
    params = {p["name"]: p["value"] for p in compiled["template"]["spec"]["arguments"]["parameters"]}
    assert params["service_account"] == "resilient-training-trainer"
    task = dag_tasks(compiled["template"], argo.ENTRYPOINT)["launch-training"]
    arguments = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
    assert arguments["service_account"] == "{{workflow.parameters.service_account}}"


@pytest.mark.skipif(__import__("shutil").which("kubectl") is None, reason="needs kubectl (it reads the file offline)")
def test_parameter_values_kubectl_would_read_as_numbers_or_booleans_are_quoted(tmp_path: Path) -> None:
    """A stranger trial: --cron-param region=0o17 was written bare, and kubectl (go-yaml v2) read it
    as 15, which the CronWorkflow's CRD refuses (parameter values are strings)."""
    out = tmp_path / "argo"
    assert cli(["compile", "--format", "argo", "-o", str(out), "--cron-param", "region=0o17", "--cron-param", "faults=",
                "--cron-param", "pvc_name=y", "--cron-param", "promote_to=s3://models/x/{run_id}"]) == 0
    read = subprocess.run(["kubectl", "label", "--local", "-f", str(out / "resilient-training.cronworkflow.yaml"),
                           "checked=1", "-o", "json"], capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    arguments = json.loads(read.stdout)["spec"]["workflowSpec"]["arguments"]["parameters"]
    values = {p["name"]: p["value"] for p in arguments}
    assert (values["region"], values["pvc_name"]) == ("0o17", "y"), values
