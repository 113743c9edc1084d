"""`compile --format argo --argo-artifact-repository REF`: the steps' records as Argo output artifacts.

On Argo the KFP artifacts (metrics, summaries, validation findings, the HTML resilience report, the
promotion record) are files on the run's claim, RUN/argo/<task>/<name>. With storage=fsx and
delete_file_system=true the exit handler deletes the claim's file system, and the records with it.
With the flag, each step that writes them also declares them as Argo ``outputs.artifacts`` (one per
artifact output of its component, at the file the step writes, optional), so Argo's executor saves them
to an artifact repository: Argo's default one (``default``) or ``spec.artifactRepositoryRef``
(``CONFIGMAP:KEY``). Without the flag the files are exactly what they were.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient_training.argo import step as argo_step
from resilient_training.argo import workflow as argo
from resilient_training.cli.main import main as cli
from tests.support import crd_schema, runs
from tests.test_argo import dag_tasks, run_argo_task, templates

FLAG = "--argo-artifact-repository"
# The steps that write records to the run (pipeline_steps(): those with a run_dir), and what each writes.
RECORDS = {
    "validate-checkpoint": ["metrics", "summary", "findings"],
    "check-convergence": ["metrics", "summary", "verdict"],
    "promote-model": ["model", "promotion"],
    "resilience-report": ["report", "metrics", "numbers"],
}


def compile_argo(out: Path, *flags: str) -> dict[str, Any]:
    assert cli(["compile", "--format", "argo", "-o", str(out), *flags]) == 0
    paths = argo.output_paths(out)
    return {"template": yaml.safe_load(paths.workflow_template.read_text()),
            "cron": yaml.safe_load(paths.cron_workflow.read_text()),
            "template_text": paths.workflow_template.read_text(), "cron_text": paths.cron_workflow.read_text()}


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The same compile without the flag, with ``default``, and with a ConfigMap and key."""
    base = tmp_path_factory.mktemp("argo-artifacts")
    return {name: compile_argo(base / name, *flags) for name, flags in (
        ("plain", ()), ("default", (FLAG, "default")),
        ("configmap", (FLAG, "artifact-repositories:s3-records")),
    )}


def declared(template: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {t["name"]: t["outputs"]["artifacts"] for t in template["spec"]["templates"]
            if "artifacts" in t.get("outputs", {})}


# --- the objects ----------------------------------------------------------------------------------


def test_every_step_that_writes_records_declares_each_as_an_optional_output_artifact(variants):
    for name in ("default", "configmap"):
        found = declared(variants[name]["template"])
        assert {task: [a["name"] for a in artifacts] for task, artifacts in found.items()} == RECORDS, name
        for task, artifacts in found.items():
            for artifact in artifacts:
                # The file the step writes: its --artifacts directory (its artifacts_dir input), then the name.
                assert artifact == {"name": artifact["name"], "optional": True,
                                    "path": "{{inputs.parameters.artifacts_dir}}/" + artifact["name"]}, (task, artifact)
            template = templates(variants[name]["template"])[task]
            assert "{{inputs.parameters.artifacts_dir}}" in template["container"]["command"]
            assert {"name": "artifacts_dir"} in template["inputs"]["parameters"]


def test_the_declared_artifacts_are_the_component_s_artifact_outputs_and_nothing_else(variants):
    """From the components' KFP specs (types with '@'); the output parameters stay parameters."""
    steps, teardown = argo.pipeline_steps()
    found = declared(variants["default"]["template"])
    for step in (*steps, teardown):
        outputs = argo_step.load_component(step.component).component_spec.outputs or {}
        artifacts = [name for name, spec in outputs.items() if "@" in spec.type]
        if step.run_dir is None:
            assert step.task not in found, step.task
            continue
        assert [a["name"] for a in found[step.task]] == artifacts, step.task
        parameters = templates(variants["default"]["template"])[step.task]["outputs"]["parameters"]
        assert [p["name"] for p in parameters] == [n for n in outputs if n not in artifacts]
    assert len(argo.output_artifacts()) == sum(len(v) for v in RECORDS.values())


def test_each_path_is_where_the_step_asks_kfp_s_executor_to_write_that_artifact(variants, tmp_path):
    """The Argo path, with the step's --artifacts directory put in, is the artifact's URI in the
    executor_input the step hands KFP's executor (so a change to the layout in step.py fails here).
    """
    directory = tmp_path / "run" / "argo"
    for task, artifacts in declared(variants["default"]["template"]).items():
        component = argo_step.load_component(templates(variants["default"]["template"])[task]["container"]["command"][3])
        request = argo_step.executor_input(component, {}, tmp_path / "outputs", directory)
        uris = {name: entry["artifacts"][0]["uri"] for name, entry in request["outputs"]["artifacts"].items()}
        assert uris == {a["name"]: a["path"].replace("{{inputs.parameters.artifacts_dir}}", str(directory))
                        for a in artifacts}, task


def test_default_uses_argo_s_configured_repository_and_configmap_key_sets_the_ref(variants):
    assert "artifactRepositoryRef" not in variants["default"]["template"]["spec"]
    assert variants["configmap"]["template"]["spec"]["artifactRepositoryRef"] == {
        "configMap": "artifact-repositories", "key": "s3-records"}
    # The CronWorkflow starts the template by reference, so its runs get the same declarations and ref.
    for name in ("default", "configmap"):
        assert variants[name]["cron_text"] == variants["plain"]["cron_text"]
        assert variants[name]["cron"]["spec"]["workflowSpec"]["workflowTemplateRef"] == {
            "name": variants[name]["template"]["metadata"]["name"]}


def test_both_variants_are_valid_against_the_argo_crds(variants, shared_schemas):
    template_schema = crd_schema.load_crd_schema(shared_schemas / "argoproj.io_workflowtemplates.yaml", "v1alpha1")
    cron_schema = crd_schema.load_crd_schema(shared_schemas / "argoproj.io_cronworkflows.yaml", "v1alpha1")
    for name in ("default", "configmap"):
        assert crd_schema.schema_errors(variants[name]["template"], template_schema) == [], name
        assert crd_schema.schema_errors(variants[name]["cron"], cron_schema) == [], name
    # Strict where the additions are: a misspelt field in either is caught.
    planted = yaml.safe_load(variants["configmap"]["template_text"])
    next(iter(declared(planted).values()))[0]["optionall"] = True
    planted["spec"]["artifactRepositoryRef"]["configmap"] = "x"
    errors = " ".join(crd_schema.schema_errors(planted, template_schema))
    assert "optionall" in errors and "'configmap'" in errors


def _without_additions(text: str) -> str:
    """The template's YAML without the blocks the flag adds: each ``artifacts:`` list under a
    template's ``outputs:`` and ``spec.artifactRepositoryRef`` (by indentation, as written).
    """
    lines, kept, skip_deeper_than = text.splitlines(keepends=True), [], None
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if skip_deeper_than is not None and (indent > skip_deeper_than or
                                             (indent == skip_deeper_than and line.lstrip().startswith("- "))):
            continue
        skip_deeper_than = None
        if re.fullmatch(r" {6}artifacts:\n| {2}artifactRepositoryRef:\n", line):
            skip_deeper_than = indent
            continue
        kept.append(line)
    return "".join(kept)


def test_without_the_flag_the_files_are_byte_for_byte_what_they_were(variants):
    """The flag only adds: the plain files hold neither addition, and taking the additions out of the
    flagged template gives the plain one byte for byte (the CronWorkflow is the same file either way).
    """
    plain = variants["plain"]["template_text"]
    assert "artifacts:" not in plain and "artifactRepositoryRef" not in plain
    assert declared(variants["plain"]["template"]) == {}
    for name in ("default", "configmap"):
        assert variants[name]["template_text"] != plain
        assert _without_additions(variants[name]["template_text"]) == plain, name
        assert variants[name]["cron_text"] == variants["plain"]["cron_text"]


# --- the command line ----------------------------------------------------------------------------


def test_compile_says_where_the_records_are_saved(tmp_path, capsys):
    assert cli(["compile", "--format", "argo", "-o", str(tmp_path / "a"), FLAG, "default"]) == 0
    out = capsys.readouterr().out
    assert "parameter(s), 11 output artifact(s) saved to Argo's default artifact repository)" in out
    assert cli(["compile", "--format", "argo", "-o", str(tmp_path / "b"), FLAG, "team-artifacts:s3.v2_records"]) == 0
    out = capsys.readouterr().out
    assert ("11 output artifact(s) saved to the artifact repository of ConfigMap team-artifacts, key s3.v2_records)"
            in out)
    spec = yaml.safe_load(argo.output_paths(tmp_path / "b").workflow_template.read_text())["spec"]
    assert spec["artifactRepositoryRef"] == {"configMap": "team-artifacts", "key": "s3.v2_records"}


@pytest.mark.parametrize(("ref", "message"), [
    ("", f"{FLAG} is empty: give default (Argo's configured default artifact repository) or CONFIGMAP:KEY"),
    ("  ", f"{FLAG} is empty"),
    ("default ", f"{FLAG} 'default ' contains whitespace: give default"),
    (" default", "contains whitespace"),
    ("artifact-repositories: s3", "contains whitespace"),
    ("artifact-repositories:s3\n", f"{FLAG} 'artifact-repositories:s3\\n' contains a control character"),
    ("artifact-repositories\n:s3", "contains a control character"),
    ("artifact-repositories:s3\t", "contains a control character"),
    ("artifact-repositories:s3\u00a0", "contains whitespace"),
    ("artifact-repositories:s\u202e3", "contains an invisible format character (U+202E"),
    ("Default", f"{FLAG} 'Default' is neither default nor CONFIGMAP:KEY"),
    ("artifact-repositories", "is neither default nor CONFIGMAP:KEY"),
    ("Artifact-Repositories:s3", f"{FLAG} 'Artifact-Repositories:s3': ConfigMap 'Artifact-Repositories' is not a "
                                 "DNS-1123 subdomain"),
    ("artifact_repositories:s3", "ConfigMap 'artifact_repositories' is not a DNS-1123 subdomain"),
    (":s3", "ConfigMap '' is not a DNS-1123 subdomain"),
    ("a" * 254 + ":s3", "is not a DNS-1123 subdomain"),
    ("artifact-repositories:", f"{FLAG} 'artifact-repositories:': key '' is not a ConfigMap key"),
    ("artifact-repositories:s3:v2", "key 's3:v2' is not a ConfigMap key"),
    ("artifact-repositories:s3/v2", "key 's3/v2' is not a ConfigMap key"),
    ("artifact-repositories:.", "key '.' is not a ConfigMap key: it must not be '.' or start with '..'"),
    ("artifact-repositories:..", "must not be '.' or start with '..'"),
    ("artifact-repositories:..s3", "must not be '.' or start with '..'"),
    ("artifact-repositories:" + "k" * 254, f"{FLAG}: key 'kkkkkkkkkkkkkkkkkkkkkkkk'... is 254 characters long: "
                                           "a ConfigMap key has at most 253"),
])
def test_a_bad_repository_is_refused_with_one_line_and_nothing_written(ref, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["compile", "--format", "argo", "-o", "out", FLAG, ref]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    assert list(tmp_path.iterdir()) == []


def test_the_longest_names_kubernetes_takes_are_taken(tmp_path):
    config_map = ".".join(["a" * 63] * 3) + "." + "b" * 61  # 253 characters, four DNS labels
    spec = compile_argo(tmp_path, FLAG, f"{config_map}:{'k' * 253}")["template"]["spec"]
    assert spec["artifactRepositoryRef"] == {"configMap": config_map, "key": "k" * 253}


def test_the_flag_is_refused_without_format_argo(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["compile", "-o", "out", FLAG, "default"]) == 2
    assert capsys.readouterr().err == f"error: {FLAG}: only with --format argo\n"
    assert list(tmp_path.iterdir()) == []


FSX = ["--cron-param", "storage=fsx", "--cron-param", "fsx_subnet_id=subnet-0123456789abcdef0",
       "--cron-param", "fsx_security_group_ids=sg-0123456789abcdef0",
       "--cron-param", "promote_to=s3://models/{run_id}", "--cron-param", "faults="]
NOTE = ("note: the CronWorkflow's runs make an FSx file system that teardown-storage deletes when the run ends "
        "(delete_file_system=true), and their records (metrics, summaries, the resilience report, the promotion "
        "record: RUN/argo/) go with it; compile with --argo-artifact-repository default (or CONFIGMAP:KEY) to save "
        "them as Argo output artifacts, or give --cron-param delete_file_system=false\n")


@pytest.mark.parametrize(("flags", "said"), [
    (FSX, True),
    ([*FSX, "--cron-param", "delete_file_system=true"], True),
    ([*FSX, FLAG, "default"], False),
    ([*FSX, "--cron-param", "delete_file_system=false"], False),
    # A file system the runs reuse is not deleted.
    (["--cron-param", "storage=fsx", "--cron-param", "fsx_file_system_id=fs-0123456789abcdef0",
      "--cron-param", "promote_to=s3://models/{run_id}", "--cron-param", "faults="], False),
    (["--cron-param", "storage=pvc", "--cron-param", "pvc_name=data", "--cron-param", "promote_to=s3://models/{run_id}",
      "--cron-param", "faults="], False),
])
def test_a_schedule_whose_records_go_with_the_file_system_is_said_to(flags, said, tmp_path, capsys):
    assert cli(["compile", "--format", "argo", "-o", str(tmp_path), *flags]) == 0
    err = capsys.readouterr().err
    assert (NOTE in err) is said, err


def test_the_docs_say_the_records_go_with_an_fsx_file_system_and_how_to_keep_them():
    text = " ".join((Path(__file__).resolve().parent.parent / "docs" / "argo.md").read_text().split())
    assert "storage=fsx" in text and "delete_file_system=true" in text
    for way in (f"{FLAG} default", f"{FLAG} CONFIGMAP:KEY", "delete_file_system=false", "storage=pvc"):
        assert way in text, way


# --- the paths are the files the steps write --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real, short run (8 steps, 2 ranks), this module's own copy: the steps write their records into it."""
    from tests.support.gates import copy_run

    return copy_run(runs.two_rank_gpt_run(tmp_path_factory.getbasetemp()),
                    tmp_path_factory.mktemp("argo-artifacts-run") / "run")


@pytest.mark.slow
def test_every_declared_artifact_is_a_file_the_step_wrote_and_every_record_is_declared(variants, tiny_run, tmp_path):
    """The four steps started as Argo starts them, against a real run: each declared path, with the
    task's artifacts_dir put in, is a file the step wrote (not a directory: Argo would tar it as one),
    and the step wrote nothing under RUN/argo/<task>/ that is not declared.
    """
    wt = variants["configmap"]["template"]
    context = {f"workflow.parameters.{p['name']}": p["value"] for p in wt["spec"]["arguments"]["parameters"]}
    context |= {"workflow.parameters.max_final_loss": "100.0", "workflow.parameters.min_improvement": "0.01",
                "workflow.parameters.promote_to": str(tmp_path / "promoted"),
                "tasks.launch-training.outputs.parameters.run_dir": str(tiny_run),
                "tasks.provision-storage.outputs.parameters.pvc_name": "run-claim"}
    for task in RECORDS:
        run_argo_task(wt, task, context, tmp_path)
    for task, artifacts in declared(wt).items():
        argument = next(p["value"] for p in dag_tasks(wt, "main")[task]["arguments"]["parameters"]
                        if p["name"] == "artifacts_dir")
        directory = Path(re.sub(r"\{\{([^}]+)\}\}", lambda m: context[m.group(1)], argument))
        assert directory == tiny_run / argo.ARTIFACTS_DIRNAME / task
        for artifact in artifacts:
            path = Path(artifact["path"].replace("{{inputs.parameters.artifacts_dir}}", str(directory)))
            assert path.is_file() and path.stat().st_size > 0, (task, artifact)
        assert sorted(p.name for p in directory.iterdir()) == sorted(a["name"] for a in artifacts), task
    report = tiny_run / argo.ARTIFACTS_DIRNAME / "resilience-report" / "report"
    assert report.read_text().lstrip().lower().startswith("<!doctype html")
