"""The resilient-training pipeline for plain Argo Workflows: a WorkflowTemplate and a CronWorkflow.

Built with hera, the Argo SDK, from two sources that the KFP pipeline also uses, so the two
cannot drift:

- the parameters (names, defaults, descriptions) are the ``@dsl.pipeline`` function's inputs,
  as KFP parses them from its signature and docstring;
- every step runs a component's own function through KFP's executor
  (``python -m resilient_training.argo.step COMPONENT ...``, :mod:`resilient_training.argo.step`)
  in the components image;
- the retried steps and their retry policies are the KFP pipeline's (``pipelines/defaults.py``).

The graph is :func:`pipeline_steps`: the same tasks, inputs and conditions as
``pipelines/resilient_training.py`` (``tests/test_argo.py`` compares the two through the compiled
KFP IR). Argo runs each step in its own pod, so the run's storage must be shared: ``storage`` is
``pvc`` or ``fsx`` here (``local`` is refused by the parameter's enum at submit time).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

from resilient_training.launch import images
from resilient_training.run import layout

NAME = "resilient-training"
ENTRYPOINT = "main"
EXIT_HANDLER = "exit-handler"
# Where a step writes its output parameters inside its pod (Argo reads them by path).
OUTPUTS_DIR = "/tmp/outputs"
# Output artifacts (metrics, summaries, the HTML report) go to the run's shared storage, beside
# the run, so no Argo artifact repository is needed: RUN/argo/<task>/<artifact>. They go with that
# storage (an FSx file system the exit handler deletes): with an ArtifactRepository the steps also
# declare them as Argo output artifacts, which Argo saves there (compile --argo-artifact-repository).
ARTIFACTS_DIRNAME = layout.ARGO_DIRNAME
# The step's own input that names that directory (its --artifacts; each artifact is the file DIR/<name>).
ARTIFACTS_DIR_INPUT = "{{inputs.parameters.artifacts_dir}}"
# compile --argo-artifact-repository: the cluster's default repository, or CONFIGMAP:KEY.
DEFAULT_ARTIFACT_REPOSITORY = "default"
ARTIFACT_REPOSITORY_FLAG = "--argo-artifact-repository"
# The service account the steps run as (manifests/rbac; creates PyTorchJobs, PVCs, FSx).
SERVICE_ACCOUNT = "resilient-training-launcher"
CLAIM_VOLUME = "run-storage"
# KFP passes dsl.PIPELINE_JOB_ID_PLACEHOLDER (a UUID); the Argo counterpart is the workflow's UID.
# Object names and the FSx idempotency token derive from it, so a retried step finds its objects.
RUN_ID = "{{workflow.uid}}"
# Argo runs steps in separate pods: only shared storage works. The pipeline's default (local) is for kfp.local.
ARGO_STORAGE = ("pvc", "fsx")


def argo_launchers() -> tuple[str, ...]:
    """The launchers a run on Argo may use, the first the template's default. ``local`` trains inside
    the launch step's pod, so only when the components image is the user's own ($RT_COMPONENTS_IMAGE at
    compile): the release's has no torch or NVRx (a stranger trial scheduled launcher=local, and
    every night's run would have failed in its launch step).
    """
    from resilient_training.launch import images, jobshape

    return (*jobshape.KINDS, "local") if images.components_image_is_the_users() else tuple(jobshape.KINDS)


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """A workflow parameter (a pipeline input of the same name)."""

    name: str

    def expression(self) -> str:
        return f"{{{{workflow.parameters.{self.name}}}}}"


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """An output parameter of an earlier task."""

    task: str
    name: str

    def expression(self) -> str:
        return f"{{{{tasks.{self.task}.outputs.parameters.{self.name}}}}}"


@dataclasses.dataclass(frozen=True, slots=True)
class Const:
    """A value fixed at compile time."""

    value: str

    def expression(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class RunId:
    """The run's id (the KFP pipeline job id's counterpart)."""

    def expression(self) -> str:
        return RUN_ID


Source = Param | Output | Const | RunId
# KFP's set_retry arguments as pipelines/defaults.py keeps them: (retries, first backoff, factor, max duration).
Retry = tuple[int, str, float, str]


@dataclasses.dataclass(frozen=True, slots=True)
class ArtifactRepository:
    """Where the steps' records also go as Argo output artifacts (``compile --argo-artifact-repository``).

    The records are files on the run's claim (RUN/argo/<task>/<name>); with ``storage=fsx`` and
    ``delete_file_system=true`` the exit handler deletes the claim's file system and them with it.
    Declared as output artifacts, Argo's executor also saves them to an artifact repository.
    """

    config_map: str | None = None
    """The ConfigMap of ``spec.artifactRepositoryRef`` (None: Argo's default repository, no ref)."""
    key: str | None = None

    def describe(self) -> str:
        if self.config_map is None:
            return "Argo's default artifact repository"
        return f"the artifact repository of ConfigMap {self.config_map}, key {self.key}"


# A ConfigMap key as Kubernetes validates it (apimachinery's IsConfigMapKey).
_CONFIG_MAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_CONFIG_MAP_KEY_MAX = 253


def artifact_repository(ref: str) -> ArtifactRepository:
    """``default`` or ``CONFIGMAP:KEY``, checked as Kubernetes checks a ConfigMap's name and key.

    Raises:
        ValueError: one line naming the flag: empty, blanks or control characters, neither form,
            a ConfigMap that is not a DNS-1123 subdomain, a key outside ``[-._a-zA-Z0-9]``.

    """
    from resilient_training.launch import k8s_names
    from resilient_training.run.paths import control_note, has_control

    flag = ARTIFACT_REPOSITORY_FLAG
    usage = (f"give {DEFAULT_ARTIFACT_REPOSITORY} (Argo's configured default artifact repository) or CONFIGMAP:KEY "
             "(an artifact repository ConfigMap and its key, e.g. artifact-repositories:default-v1-s3-artifact-repository)")
    if not ref.strip():
        raise ValueError(f"{flag} is empty: {usage}")
    if has_control(ref):
        raise ValueError(f"{flag} {ref!r} contains {control_note(ref)}: {usage}")
    if any(c.isspace() for c in ref):
        raise ValueError(f"{flag} {ref!r} contains whitespace: {usage}")
    if ref == DEFAULT_ARTIFACT_REPOSITORY:
        return ArtifactRepository()
    config_map, sep, key = ref.partition(":")
    if not sep:
        raise ValueError(f"{flag} {ref!r} is neither {DEFAULT_ARTIFACT_REPOSITORY} nor CONFIGMAP:KEY: {usage}")
    k8s_names.check_dns1123_subdomain(config_map, f"{flag} {ref!r}: ConfigMap")
    if len(key) > _CONFIG_MAP_KEY_MAX:
        raise ValueError(f"{flag}: key {key[:24]!r}... is {len(key)} characters long: a ConfigMap key has at most "
                         f"{_CONFIG_MAP_KEY_MAX}")
    if not _CONFIG_MAP_KEY.fullmatch(key):
        raise ValueError(f"{flag} {ref!r}: key {key!r} is not a ConfigMap key: one or more letters, digits, '-', '_' "
                         "or '.'")
    if key in (".", "..") or key.startswith(".."):
        raise ValueError(f"{flag} {ref!r}: key {key!r} is not a ConfigMap key: it must not be '.' or start with '..'")
    return ArtifactRepository(config_map, key)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One task of the DAG: a component, where each of its inputs comes from, and when it runs."""

    task: str
    """The Argo task and template name (the KFP IR's task name for the same component)."""
    component: str
    inputs: dict[str, Source]
    claim: Source | None = None
    """The PVC every later step mounts at the pipeline's MOUNT_PATH (provision_storage's output)."""
    run_dir: Source | None = None
    """Where the step's output artifacts go (under RUN/argo/<task>); None keeps them in the pod."""
    depends: str = ""
    when: str = ""
    retry: Retry | None = None
    """The KFP pipeline's retry policy of this step (None: not retried)."""


def _params(*names: str) -> dict[str, Source]:
    return {name: Param(name) for name in names}


def _gate_passed(task: str) -> str:
    return f"{Output(task, 'Output').expression()} == true"


@functools.cache
def pipeline_steps() -> tuple[tuple[Step, ...], Step]:
    """The DAG's steps in order, and the exit handler's teardown step.

    A function, not a constant: it imports the KFP pipeline module (kfp), which ``--help`` must not.
    """
    from resilient_training.pipelines.check_step import check_arguments
    from resilient_training.pipelines.defaults import LAUNCH_RETRY, PROVISION_RETRY, TEARDOWN_RETRY
    from resilient_training.pipelines.resilient_training import MOUNT_PATH

    claim = Output("provision-storage", "pvc_name")
    run_dir = Output("launch-training", "run_dir")
    steps = (
        # `argo submit -p` values were checked by nothing of ours: every parameter, before anything is made.
        Step("check-arguments", "check_arguments", _params(*check_arguments.component_spec.inputs)),
        Step("provision-storage", "provision_storage", {
            "run_id": RunId(), **_params("storage", "namespace"), "mount_path": Const(MOUNT_PATH),
            **_params("local_root", "pvc_name", "fsx_file_system_id", "fsx_subnet_id", "fsx_security_group_ids",
                      "fsx_capacity_gib", "fsx_deployment_type", "fsx_per_unit_throughput", "region"),
        }, depends="check-arguments", retry=PROVISION_RETRY),
        # Retried like KFP's: the job's name derives from run_id ({{workflow.uid}}, the same in every
        # attempt), so a retry attaches to the job its earlier attempt started instead of starting another.
        Step("launch-training", "launch_training", {
            "storage_ref": Output("provision-storage", "storage_ref"), "run_id": RunId(),
            **_params("launcher", "steps", "checkpoint_every", "faults", "async_checkpoint", "inprocess",
                      "ft_launcher", "train_overrides", "task", "task_args", "export", "nodes", "gpus_per_node",
                      "procs_per_node", "efa_per_node", "node_selector", "tolerations", "cpu", "memory",
                      "shm_size"),
            "image": Param("trainer_image"), "service_account": Param("service_account"),
        }, claim=claim, depends="provision-storage", retry=LAUNCH_RETRY),
        Step("validate-checkpoint", "validate_checkpoint", {"run_dir": run_dir},
             claim=claim, run_dir=run_dir, depends="launch-training"),
        Step("check-convergence", "check_convergence", {"run_dir": run_dir, **_params("max_final_loss", "min_improvement")},
             claim=claim, run_dir=run_dir, depends="validate-checkpoint"),
        # Promotion only when both gates returned true (the KFP pipeline's two nested dsl.If).
        Step("promote-model", "promote_model",
             {"checkpoint": run_dir, "dest": Param("promote_to"), "export": Param("export")},
             claim=claim, run_dir=run_dir, depends="validate-checkpoint && check-convergence",
             when=f"{_gate_passed('validate-checkpoint')} && {_gate_passed('check-convergence')}"),
        Step("resilience-report", "resilience_report", {"run_dir": run_dir},
             claim=claim, run_dir=run_dir, depends="check-convergence"),
    )
    teardown = Step("teardown-storage", "teardown_storage", {
        "run_id": RunId(), **_params("storage", "namespace", "pvc_name", "fsx_file_system_id", "region",
                                     "delete_file_system"),
    }, retry=TEARDOWN_RETRY)
    return steps, teardown


@dataclasses.dataclass(frozen=True, slots=True)
class WorkflowParameter:
    name: str
    value: str
    description: str
    enum: tuple[str, ...] = ()


def argo_value(value: Any) -> str:
    """A pipeline default as Argo parameter text (what the step parses back by the component's types)."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, bool | dict | list):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


def workflow_parameters() -> list[WorkflowParameter]:
    """The pipeline's inputs, in signature order, with KFP's parsed defaults and descriptions."""
    from resilient_training.pipelines.resilient_training import resilient_training

    out = []
    for name, spec in resilient_training.component_spec.inputs.items():
        description = " ".join((spec.description or "").split())
        if name == "storage":
            out.append(WorkflowParameter(name, ARGO_STORAGE[0], description + " Argo: pvc or fsx (steps run in "
                                         "separate pods and share the run through the claim).", ARGO_STORAGE))
        elif name == "launcher":
            launchers = argo_launchers()
            why = ("local needs this components image to hold torch and NVRx" if "local" in launchers else
                   "not local: the components image has no torch or NVRx")
            out.append(WorkflowParameter(name, launchers[0], f"{description} Argo: {' or '.join(launchers)} "
                                         f"({why}).", launchers))
        else:
            out.append(WorkflowParameter(name, argo_value(spec.default), description))
    return out


def _component_outputs(component: str, *, artifacts: bool = False) -> list[str]:
    """The component's output parameters (not artifacts), as its KFP spec declares them; with
    ``artifacts``, its output artifacts instead (``system.Metrics@0.0.1``, ...).
    """
    from resilient_training.argo.step import load_component

    outputs = load_component(component).component_spec.outputs or {}
    return [name for name, spec in outputs.items() if ("@" in spec.type) == artifacts]


def artifact_path(name: str) -> str:
    """Where a step writes its output artifact ``name``: a file (metrics as JSON, the rest as the
    component wrote it) in the directory its ``--artifacts`` names (:func:`resilient_training.argo.step.run_step`).
    """
    return f"{ARTIFACTS_DIR_INPUT}/{name}"


def output_artifacts() -> list[tuple[str, str]]:
    """``(task, artifact)`` for each output artifact a template declares with an artifact repository:
    every artifact output of every step that writes its records to the run (a ``run_dir``).
    """
    steps, teardown = pipeline_steps()
    return [(step.task, name) for step in (*steps, teardown) if step.run_dir is not None
            for name in _component_outputs(step.component, artifacts=True)]


def retry_strategy(retry: Retry) -> Any:
    """Argo's ``retryStrategy`` for a KFP retry policy: the same count, first backoff, factor and window.

    ``Always``, not Argo's default ``OnFailure``: a retried step is idempotent, so an attempt whose
    pod was lost (deleted, its node gone: an Argo *Error*) is retried too, not only one that failed.

    Raises:
        ValueError: a backoff factor that is not a whole number (Argo's ``backoff.factor`` is an integer).

    """
    from hera.workflows import RetryPolicy, RetryStrategy
    from hera.workflows.models import Backoff

    num_retries, backoff, factor, max_duration = retry
    if factor != int(factor):
        raise ValueError(f"retry backoff factor {factor}: Argo takes a whole number")
    return RetryStrategy(limit=num_retries, retry_policy=RetryPolicy.always,
                         backoff=Backoff(duration=backoff, factor=int(factor), max_duration=max_duration))


def _template(step: Step, repository: ArtifactRepository | None = None) -> Any:
    from hera.workflows import Artifact, Container, ExistingVolume, Parameter
    from hera.workflows.models import ValueFrom

    from resilient_training.pipelines.resilient_training import MOUNT_PATH

    extra = {}
    command = ["python", "-m", "resilient_training.argo.step", step.component, "--outputs", OUTPUTS_DIR]
    artifacts = []
    if step.run_dir is not None:
        extra["artifacts_dir"] = f"{step.run_dir.expression()}/{ARTIFACTS_DIRNAME}/{step.task}"
        command += ["--artifacts", ARTIFACTS_DIR_INPUT]
        if repository is not None:
            # Optional: a step that fails before writing one (a refused argument, a failed gate) stays
            # that failure, not an artifact error.
            artifacts = [Artifact(name=name, path=artifact_path(name), optional=True)
                         for name in _component_outputs(step.component, artifacts=True)]
    volumes = None
    if step.claim is not None:
        extra["claim"] = step.claim.expression()
        volumes = [ExistingVolume(name=CLAIM_VOLUME, claim_name="{{inputs.parameters.claim}}", mount_path=MOUNT_PATH)]
    return Container(
        name=step.task,
        image=images.COMPONENTS_IMAGE,
        command=command,
        # One argv element per input, no shell: a parameter value is never parsed as a command.
        args=[f"{name}={{{{inputs.parameters.{name}}}}}" for name in step.inputs],
        inputs=[Parameter(name=name) for name in [*step.inputs, *extra]],
        outputs=[*(Parameter(name=name, value_from=ValueFrom(path=f"{OUTPUTS_DIR}/{name}"))
                   for name in _component_outputs(step.component)), *artifacts],
        volumes=volumes,
        retry_strategy=retry_strategy(step.retry) if step.retry is not None else None,
    ), extra


def _arguments(step: Step, extra: dict[str, str]) -> dict[str, str]:
    return {**{name: source.expression() for name, source in step.inputs.items()}, **extra}


def workflow_template(repository: ArtifactRepository | None = None) -> Any:
    """The resilient-training pipeline as a hera ``WorkflowTemplate``.

    ``repository``: the steps that write records also declare them as output artifacts, saved to that
    Argo artifact repository (None: only on the run's claim, as without ``--argo-artifact-repository``).
    """
    from hera.workflows import DAG, Task, WorkflowTemplate
    from hera.workflows.models import ArtifactRepositoryRef
    from hera.workflows.models import Parameter as ModelParameter

    from resilient_training.pipelines.resilient_training import resilient_training

    arguments = [
        ModelParameter(name=p.name, value=p.value, description=p.description, enum=list(p.enum) or None)
        for p in workflow_parameters()
    ]
    with WorkflowTemplate(
        name=NAME,
        annotations={"workflows.argoproj.io/description": resilient_training.component_spec.description or ""},
        entrypoint=ENTRYPOINT,
        on_exit=EXIT_HANDLER,
        service_account_name=SERVICE_ACCOUNT,
        arguments=arguments,
        artifact_repository_ref=ArtifactRepositoryRef(config_map=repository.config_map, key=repository.key)
        if repository is not None and repository.config_map is not None else None,
    ) as template:
        steps, teardown = pipeline_steps()
        built = {step.task: _template(step, repository) for step in (*steps, teardown)}
        with DAG(name=ENTRYPOINT):
            for step in steps:
                container, extra = built[step.task]
                Task(name=step.task, template=container, arguments=_arguments(step, extra),
                     depends=step.depends or None, when=step.when or None)
        with DAG(name=EXIT_HANDLER):
            container, extra = built[teardown.task]
            Task(name=teardown.task, template=container, arguments=_arguments(teardown, extra))
    return template


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """The CronWorkflow's schedule fields (checked by :mod:`resilient_training.argo.cron`)."""

    schedules: tuple[str, ...] = ("0 2 * * *",)
    timezone: str = "UTC"
    concurrency_policy: str = "Forbid"
    starting_deadline_seconds: int | None = None
    arguments: tuple[tuple[str, str], ...] = ()
    """Parameter values the scheduled runs use instead of the template's defaults (:func:`cron_arguments`)."""


def cron_arguments(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` items checked against the pipeline's inputs (name, type, the storage enum), as Argo text.

    Raises:
        StepError: an unknown or repeated name, a value of the wrong type, or storage not pvc/fsx.

    """
    from resilient_training.argo.step import StepError, parse_arguments
    from resilient_training.kfp.params import refuse_blanks
    from resilient_training.pipelines.resilient_training import resilient_training

    values = parse_arguments(resilient_training, items)
    inputs = resilient_training.component_spec.inputs
    for item in items:  # here, not in parse_arguments: a step's inputs also carry earlier steps' outputs as text
        name, _, raw = item.partition("=")
        try:
            refuse_blanks(name, raw, json_value=inputs[name].type in ("Dict", "List"))
        except ValueError as exc:
            raise StepError(str(exc)) from None
    if "storage" in values and values["storage"] not in ARGO_STORAGE:
        raise StepError(f"storage must be one of {', '.join(ARGO_STORAGE)} on Argo, got {values['storage']!r}")
    if values.get("launcher") == "local" and "local" not in argo_launchers():
        raise StepError("launcher 'local' would train inside the launch step's pod, and the components image has no "
                        "torch or NVRx: use launcher=pytorchjob or trainjob, or compile with RT_COMPONENTS_IMAGE set "
                        "to an image of yours that has them")
    if values:
        check_scheduled_run(values)
    return tuple((name, argo_value(value)) for name, value in values.items())


def check_scheduled_run(values: dict[str, Any]) -> None:
    """Refuse what a scheduled run's steps would refuse: ``values`` over the WorkflowTemplate's defaults.

    Raises:
        StepError: one line naming the parameter (``nodes=-1``, ``launcher=bogus``, a bad claim name...).

    """
    from resilient_training.argo.step import StepError
    from resilient_training.pipelines import arguments
    from resilient_training.pipelines.resilient_training import resilient_training

    merged = {name: spec.default for name, spec in resilient_training.component_spec.inputs.items()}
    merged["storage"] = ARGO_STORAGE[0]  # the template's defaults (workflow_parameters)
    merged["launcher"] = argo_launchers()[0]
    merged.update(values)
    try:
        arguments.check(merged, cluster=True, recurring=True)
    except ValueError as exc:
        raise StepError(str(exc)) from None


def cron_workflow(schedule: Schedule) -> Any:
    """A hera ``CronWorkflow`` that starts the WorkflowTemplate :data:`NAME` on ``schedule``."""
    from hera.workflows import CronWorkflow
    from hera.workflows.models import Parameter as ModelParameter
    from hera.workflows.models import WorkflowTemplateRef

    return CronWorkflow(
        name=NAME,
        schedules=list(schedule.schedules),
        timezone=schedule.timezone,
        concurrency_policy=schedule.concurrency_policy,
        starting_deadline_seconds=schedule.starting_deadline_seconds,
        workflow_template_ref=WorkflowTemplateRef(name=NAME),
        arguments=[ModelParameter(name=name, value=value) for name, value in schedule.arguments] or None,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ArgoFiles:
    workflow_template: Path
    cron_workflow: Path


def output_paths(directory: Path) -> ArgoFiles:
    return ArgoFiles(directory / f"{NAME}.workflowtemplate.yaml", directory / f"{NAME}.cronworkflow.yaml")


def write(directory: Path, schedule: Schedule, repository: ArtifactRepository | None = None) -> ArgoFiles:
    """Write both objects as YAML under ``directory`` (created), both or neither: a target that
    is a directory is refused before either is written, and each is written under a temporary
    name, then renamed (a stranger trial's blocked CronWorkflow left the template written).
    ``repository``: :func:`workflow_template`'s (the CronWorkflow only names the template).
    """
    import errno
    import os

    paths = output_paths(directory)
    from resilient_training.launch.jobshape import kubectl_dumper

    # Quoted as kubectl reads them: a parameter value 0o17 or y was written bare and read back a number
    # or a boolean, which the CRD refuses (a stranger trial).
    dumper = kubectl_dumper()
    documents = {paths.workflow_template: workflow_template(repository).to_yaml(Dumper=dumper),
                 paths.cron_workflow: cron_workflow(schedule).to_yaml(Dumper=dumper)}
    directory.mkdir(parents=True, exist_ok=True)
    for path in documents:
        if path.is_dir() or (path.exists() and not path.is_file()):
            raise OSError(errno.EISDIR if path.is_dir() else errno.EEXIST,
                          "Is a directory" if path.is_dir() else "not a regular file", str(path))
    staged: dict[Path, Path] = {}
    try:
        for path, text in documents.items():
            staged[path] = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            staged[path].write_text(text)
        for path, tmp in staged.items():
            tmp.replace(path)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    return paths
