"""The pipeline's first step checks a run's arguments inside the run: a run made in the KFP UI, the
API or with ``argo submit -p`` (which no command of ours checked) stops there, before storage is made.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resilient_training.argo import workflow as argo
from resilient_training.pipelines import arguments
from resilient_training.pipelines.check_step import check_arguments, check_benchmark_arguments
from resilient_training.pipelines.recovery_benchmark import recovery_benchmark
from resilient_training.pipelines.resilient_training import resilient_training


@pytest.mark.parametrize(("step", "pipeline"), [(check_arguments, resilient_training),
                                               (check_benchmark_arguments, recovery_benchmark)],
                         ids=["resilient-training", "recovery-benchmark"])
def test_the_check_step_takes_every_pipeline_parameter_by_name_and_type(step, pipeline) -> None:
    step, pipeline = step.component_spec.inputs, pipeline.component_spec.inputs
    assert list(step) == list(pipeline)
    assert {n: s.type for n, s in step.items()} == {n: s.type for n, s in pipeline.items()}
    assert not any(s.optional for s in step.values())  # every one passed, none defaulted twice


@pytest.mark.parametrize(("pipeline", "arguments", "step", "message"), [
    ("resilient_training", "nodes=0, steps=4", "check-arguments",
     "error: nodes must be an integer from 1 to 4096, got 0"),
    ("recovery_benchmark", "strategies=[{'name': 'a', 'name2': 1}], steps=4", "check-benchmark-arguments",
     "error: strategy a: unknown trainer settings: name2 (known: "),
], ids=["resilient-training", "recovery-benchmark"])
def test_a_run_made_without_our_commands_stops_at_its_first_step(tmp_path: Path, pipeline, arguments, step,
                                                                  message) -> None:
    """kfp.local runs the pipeline as a KFP server would get it: no `run`/`submit` check before."""
    runs = tmp_path / "runs"
    script = textwrap.dedent(f"""
        from kfp import local
        from resilient_training.pipelines.{pipeline} import build
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root={str(tmp_path / "kfp")!r})
        build(retries=False)(local_root={str(runs)!r}, {arguments})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # the runner's colours
    assert proc.returncode != 0
    assert f"Inner task failed: '{step}'" in out, out[-3000:]
    assert message in out, out[-3000:]
    assert "Traceback" not in out.split("Executing task")[1].split("finished with status")[0]  # one line, no trace
    assert not runs.exists()  # nothing provisioned
    assert list((tmp_path / "kfp").glob("*/teardown-storage/executor_output.json")), "teardown did not run"
    assert not list((tmp_path / "kfp").glob("*/provision-storage"))


def _argo_defaults(**changes: str) -> list[str]:
    """The WorkflowTemplate's parameters as the step gets them (text, one argv element each)."""
    values = {p.name: p.value for p in argo.workflow_parameters()} | {"pvc_name": "team-claim"} | changes
    return [f"{name}={value}" for name, value in values.items()]


def _argo_step(tmp_path: Path, items: list[str], *, in_a_pod: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    if in_a_pod:
        env["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"
    return subprocess.run([sys.executable, "-m", "resilient_training.argo.step", "check_arguments",
                           "--outputs", str(tmp_path / "out"), *items], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize(("changes", "message"), [
    ({"nodes": "0"}, "error: nodes must be an integer from 1 to 4096, got 0"),
    ({"faults": "sigkill@3:99"}, "error: faults: fault sigkill@3:99: rank 99 does not exist (world size 8)"),
    ({"promote_to": "promoted"}, "error: promote_to 'promoted' is relative"),
    ({"pvc_name": ""}, "error: storage 'pvc' needs pvc_name"),
    # Stranger trial (each passed, or was a traceback, before):
    ({"tolerations": "[" * 5000 + "]" * 5000}, "error: input 'tolerations' must be a JSON list"),
    ({"train_overrides": '{"lr": 1' + "0" * 400 + "}"}, "error: setting lr must be a finite number"),
    ({"promote_to": "/mnt/run/" + "a" * 300}, "has a name of 300 bytes (aaaaaaaaaaaaaaaaaaaa...), longer than the 255"),
    ({"storage": "fsx", "pvc_name": "", "fsx_file_system_id": "fs-0123456789abcdef0", "fsx_deployment_type": "BOGUS"},
     "error: fsx_file_system_id reuses a file system: fsx_deployment_type is for a new one and would be ignored"),
])
def test_argo_submit_p_values_are_refused_by_the_first_step_with_one_line(tmp_path, changes, message) -> None:
    proc = _argo_step(tmp_path, _argo_defaults(**changes))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_templates_defaults_pass_and_storage_local_passes_only_outside_a_pod(tmp_path) -> None:
    good = _argo_step(tmp_path, _argo_defaults(promote_to="/mnt/run/promoted"))
    assert good.returncode == 0, good.stderr
    local = _argo_defaults(storage="local", launcher="local", promote_to="promoted")
    in_pod = _argo_step(tmp_path, local)
    assert in_pod.returncode == 2 and "error: storage 'local' is a directory on one machine" in in_pod.stderr
    assert _argo_step(tmp_path, local, in_a_pod=False).returncode == 0  # kfp.local on a laptop


def test_launcher_local_in_a_pod_needs_torch_and_nvrx_in_the_steps_image(monkeypatch) -> None:
    values = {n: s.default for n, s in resilient_training.component_spec.inputs.items()}
    values |= {"storage": "pvc", "pvc_name": "team-claim", "promote_to": "/mnt/run/promoted", "launcher": "local"}
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        arguments.check_in_run(values)  # this environment has both: ft_launcher can run in the step's pod
    own = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "nvidia_resiliency_ext" else own(name, *a))
    with pytest.raises(ValueError, match="launcher 'local' would train inside the launch step's own pod"):
        arguments.check_in_run(values)


def test_in_the_components_image_without_torch_a_shipped_tasks_task_args_are_left_to_its_workers(monkeypatch) -> None:
    """Making the built-in task imports torch, which the components image has not: the step would
    fail on the import. There the trainer's workers check task_args, as they do a user's own task."""
    values = {n: s.default for n, s in resilient_training.component_spec.inputs.items()}
    values |= {"task_args": {"n_layers": "two"}}
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="task_args: .*n_layers"):
        arguments.check_in_run(values)
    own = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else own(name, *a))
    arguments.check_in_run(values)


def test_the_check_runs_in_the_components_image_which_has_no_torch_nvrx_or_numpy() -> None:
    """images/components installs the package without its dependencies: the check must import
    without torch, and then say in one line that validate-checkpoint, in the same image, needs it
    (the run would otherwise train, then fail there)."""
    script = textwrap.dedent("""
        import os, sys
        for name in ("torch", "nvidia_resiliency_ext", "safetensors", "numpy"):
            sys.modules[name] = None  # absent: importing it raises, find_spec says None
        os.environ["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"
        from resilient_training.pipelines.resilient_training import resilient_training
        from resilient_training.pipelines import arguments
        values = {n: s.default for n, s in resilient_training.component_spec.inputs.items()}
        values |= {"storage": "pvc", "pvc_name": "team-claim", "promote_to": "/mnt/run/promoted",
                   "launcher": "pytorchjob", "task_args": {"n_layers": "3"}}
        for bad in ({}, {"nodes": 0}, {"launcher": "local"}):
            try:
                arguments.check_in_run(values | bad)
            except ValueError as exc:
                print("refused:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("refused: ") for line in lines), proc.stdout
    assert lines[0] == ("refused: the components image has no torch (validate-checkpoint reads the checkpoint with "
                        "it): build it with --build-arg EXTRA_PACKAGES (images/components/Dockerfile) and compile "
                        "with RT_COMPONENTS_IMAGE naming it")
    assert "nodes must be an integer from 1 to 4096" in lines[1]  # the value the user typed comes first
    assert "launcher 'local' would train inside the launch step's own pod" in lines[2]


@pytest.mark.parametrize(("export", "absent", "refused"), [
    ("safetensors", "safetensors", "no safetensors (promote-model's export 'safetensors' writes with it)"),
    ("hf", "transformers", "no transformers (promote-model's export 'hf' writes with it)"),
    ("", "safetensors", None), ("torch", "safetensors", None), ("dcp", "transformers", None),
])
def test_in_a_pod_the_export_needs_its_libraries_in_the_components_image(monkeypatch, export, absent, refused) -> None:
    values = {n: s.default for n, s in resilient_training.component_spec.inputs.items()}
    values |= {"storage": "pvc", "pvc_name": "team-claim", "promote_to": "/mnt/run/promoted",
               "launcher": "pytorchjob", "export": export}
    if export == "hf":
        values |= {"task": "resilient_training.tasks.llama:task", "task_args": {}}
    own = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else own(name, *a))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    arguments.check_in_run(values)  # on a laptop (kfp.local) the promote step runs here: nothing to say
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    if refused is None:
        arguments.check_in_run(values)
    else:
        with pytest.raises(ValueError, match=re.escape(f"the components image has {refused}")):
            arguments.check_in_run(values)


def test_the_benchmarks_parameters_are_not_overwritten_silently_by_its_train_overrides(capsys) -> None:
    """Stranger trial: train_overrides {"steps": 1000} passed, and every strategy ran the steps parameter's 30."""
    values = {n: s.default for n, s in recovery_benchmark.component_spec.inputs.items()}
    arguments.check_step(values, benchmark=True)
    for overrides, parameter in (({"steps": 1000}, "steps"), ({"checkpoint": {"every": 3}}, "checkpoint_every"),
                                 ({"task": "mine:task"}, "task")):
        with pytest.raises(SystemExit) as exited:
            arguments.check_step(values | {"train_overrides": overrides}, benchmark=True)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"which the pipeline's {parameter} parameter overwrites" in err, err


def _local_values(**changes) -> dict:
    values = {n: s.default for n, s in resilient_training.component_spec.inputs.items()}
    return values | changes


def test_storage_local_refuses_a_promote_to_in_or_around_where_runs_get_directories(tmp_path, monkeypatch,
                                                                                      capsys) -> None:
    """kfp.local without `run`: promotion refused such a DEST after the training (stranger trial)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "out"
    for dest in (f"{root}/runs/promoted", f"{root}/runs", str(root), "out", "out/runs/{run_id}", str(tmp_path)):
        with pytest.raises(SystemExit) as exited:
            arguments.check_step(_local_values(local_root=str(root), promote_to=dest))
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is inside or around {root / 'runs'}" in err, (dest, err)
    for dest in (f"{root}/promoted", "out/promoted/{run_id}", "elsewhere"):  # beside the runs: passes
        arguments.check_step(_local_values(local_root=str(root), promote_to=dest))
    # relative local_root: resolved in the same working directory as the steps resolve it
    with pytest.raises(ValueError, match="inside or around"):
        arguments.check_in_run(_local_values(local_root="out", promote_to=f"{root}/runs/x"))


def test_a_fault_schedule_file_is_read_by_the_check_when_the_steps_run_here(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"faults: fault schedule file missing.yaml does not exist \(relative to "
                                         rf"{re.escape(str(tmp_path))}, where the steps run\)"):
        arguments.check_in_run(_local_values(faults="missing.yaml"))
    (tmp_path / "bad.yaml").write_text("faults:\n  - {type: sigkill, step: 12, rank: 5}\n")
    with pytest.raises(ValueError, match="faults: .*rank 5"):
        arguments.check_in_run(_local_values(faults=str(tmp_path / "bad.yaml")))
    (tmp_path / "broken.yml").write_text("faults: [\n")
    with pytest.raises(ValueError, match="faults: fault schedule .*broken.yml is not valid YAML"):
        arguments.check_in_run(_local_values(faults="broken.yml"))
    (tmp_path / "good.yaml").write_text("faults:\n  - {type: sigkill, step: 12, rank: 1}\n")
    arguments.check_in_run(_local_values(faults="good.yaml"))
    # launcher=local in a pod of its own: the launch pod's files are not this pod's, so not read here
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    values = _local_values(storage="pvc", pvc_name="team-claim", promote_to="/mnt/run/promoted",
                           faults="/mnt/run/faults.yaml")
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        arguments.check_in_run(values)


@pytest.mark.parametrize("task", ["my-pkg.tasks:make", "pkg..mod:make", "pkg.mod:make.task", "tasks/mine:make",
                                  "pkg.mod:1make"])
def test_a_task_that_could_never_be_imported_stops_the_run_at_its_first_step(task, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        arguments.check_step(_local_values(task=task))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: task {task!r}: "), err


def test_storage_local_needs_a_local_root_that_can_be_a_directory(tmp_path, monkeypatch) -> None:
    """Stranger trial: local_root=/etc/passwd passed the check; provisioning then raised NotADirectoryError."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    for root, message in ((str(tmp_path / "a-file"), "exists and is not a directory"), ("   ", "local_root is empty"),
                          ("", "local_root is empty"), (str(tmp_path / "a-file" / "runs"), "is a file, not a directory")):
        with pytest.raises(ValueError, match=message):
            arguments.check_in_run(_local_values(local_root=root, promote_to=str(tmp_path / "promoted")))
    arguments.check_in_run(_local_values(local_root=str(tmp_path / "new" / "root"), promote_to=str(tmp_path / "p")))


def test_on_a_claim_promote_to_may_not_lie_among_the_runs_directories() -> None:
    """Stranger trial: /mnt/run/runs/x passed on pvc; `run` refuses that place on a laptop."""
    values = _local_values(storage="pvc", pvc_name="team-claim", launcher="pytorchjob")
    for dest in ("/mnt/run/runs/x", "/mnt/run/runs/{run_id}-model"):
        with pytest.raises(ValueError, match="is inside /mnt/run/runs, where each run gets its directory"):
            arguments.check(values | {"promote_to": dest}, cluster=True)
    arguments.check(values | {"promote_to": "/mnt/run/promoted/{run_id}"}, cluster=True)


@pytest.mark.parametrize("changes", [{"nodes": "1"}, {"train_overrides": "x"}, {"export": 5},
                                     {"max_final_loss": "nan"}])
def test_a_value_of_the_wrong_type_is_one_line_not_a_traceback(changes, capsys) -> None:
    """KFP and Argo type the inputs; a caller of the step's function past them got a traceback (stranger trial)."""
    with pytest.raises(SystemExit) as exited:
        arguments.check_step(_local_values(**changes))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err


def test_the_steps_error_is_its_only_line_even_when_the_check_imports_torch(tmp_path) -> None:
    """task_args of a shipped task make it, importing torch, whose pynvml warned in two more lines."""
    code = ("from resilient_training.pipelines import arguments\n"
            "from resilient_training.pipelines.resilient_training import resilient_training as p\n"
            "v = {n: s.default for n, s in p.component_spec.inputs.items()}\n"
            "arguments.check_step(v | {'task_args': {'d_model': 'abc'}})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "KUBERNETES_SERVICE_HOST")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr


def test_with_the_steps_on_this_machine_a_task_that_does_not_import_stops_the_run(tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    """Stranger trial: task=nonexistent.module:task passed the step (launcher=local), while `run --task` refused it."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SystemExit) as exited:
        arguments.check_step(_local_values(task="nonexistent_module_for_a_test:task"))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: task: task module nonexistent_module_for_a_test failed to import" in err
    (tmp_path / "mytask.py").write_text("def make():\n    return object()\n")
    with pytest.raises(ValueError, match="task: task .*mytask.py:make lacks build_model"):
        arguments.check_in_run(_local_values(task=f"{tmp_path}/mytask.py:make"))
