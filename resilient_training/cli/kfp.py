"""``resilient-training compile | upload | submit | schedule | runs | schedules``.

Everything that can be checked locally (pipeline name, ``--param`` values against the
compiled pipeline's inputs, cron, max concurrency, credentials, host URL) is checked before the
first request, and fails with exit code 2. Server problems exit 1 with one line naming the host.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# These modules import only the standard library at the top (kfp is imported inside their
# functions), so `resilient-training --help` stays instant.
from resilient_training.argo import cron as argo_cron
from resilient_training.argo import workflow as argo_workflow
from resilient_training.kfp import client as kfp_client
from resilient_training.kfp import compile as kfp_compile
from resilient_training.kfp import params as kfp_params
from resilient_training.kfp.client import AUTH_MODES, TOKEN_ENV, Auth, AuthError, Connection, KfpError, RunSource
from resilient_training.kfp.compile import DEFAULT_REGISTRY, CompiledPipeline, CompileError
from resilient_training.kfp.cron import CronError, validate_cron
from resilient_training.kfp.params import ParamError
from resilient_training.launch import images, jobshape, k8s_names
from resilient_training.run.paths import control_note, has_control

DEFAULT_EXPERIMENT = "resilient-training"
DEFAULT_COMPILE_DIR = "compiled"
ARGO_PIPELINE = argo_workflow.NAME  # the one pipeline --format argo writes
ARGO_DEFAULT_SCHEDULE = argo_workflow.Schedule()
MAX_CONCURRENCY_LIMIT = 10  # the KFP API server refuses recurring runs outside 1-10
# Longest name sent to the server: the KFP backend keeps names in varchar(255) columns (gorm's default) inside
# unique indexes, and the UI shows far less; a 2000-character experiment was created (stranger trial).
MAX_NAME_LENGTH = 128
# --timeout past this was an OverflowError traceback from the socket layer at 1e10 (stranger trial); a day is plenty.
MAX_TIMEOUT = 86400
# --limit is sent as page_size, an int32 in the KFP API (stranger trial: 99999999999999999999 was sent).
MAX_LIMIT = 2**31 - 1
# -o suffixes that name a file no command here writes (anything else but .yaml/.yml is a directory).
_FILE_SUFFIXES = (".json",)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the compile and KFP server subcommands."""
    p = subparsers.add_parser(
        "compile", help="compile the pipelines to KFP IR YAML, or to an Argo WorkflowTemplate and CronWorkflow",
        description="Compile the registered pipelines to KFP IR YAML and check each file loads back with kfp; "
        f"or, with --format argo, write the {ARGO_PIPELINE} pipeline as an Argo Workflows WorkflowTemplate and a "
        "CronWorkflow that starts it (for Argo users without KFP).",
    )
    p.add_argument("-o", "--output", default=DEFAULT_COMPILE_DIR, metavar="DIR_OR_FILE",
                   help=f"a directory (one NAME.yaml per pipeline; default {DEFAULT_COMPILE_DIR}/) "
                   "or a .yaml file (one pipeline); --format argo: a directory")
    p.add_argument("--format", choices=("kfp", "argo"), default="kfp",
                   help="kfp (default): KFP IR YAML; argo: NAME.workflowtemplate.yaml and NAME.cronworkflow.yaml")
    _add_pipeline_args(p)
    p.add_argument("--default", action="append", metavar="KEY=VALUE",
                   help="a parameter's default in the compiled KFP IR, what the KFP UI's Create run form starts "
                   "from (repeatable; typed by the pipeline's inputs; checked as submit checks a run's), "
                   "e.g. --default storage=pvc --default launcher=pytorchjob --default pvc_name=training-data")
    records = p.add_argument_group("Argo WorkflowTemplate (--format argo)")
    records.add_argument(
        argo_workflow.ARTIFACT_REPOSITORY_FLAG, metavar="REF",
        help="also save the steps' records (metrics, summaries, validation findings, the resilience report, the "
        "promotion record) as Argo output artifacts, which outlive the run's claim (with storage=fsx the exit handler "
        f"deletes the file system the run made, and the records on it): {argo_workflow.DEFAULT_ARTIFACT_REPOSITORY} "
        "(the cluster's default artifact repository) or CONFIGMAP:KEY (spec.artifactRepositoryRef); default: none, "
        "the records are only on the claim")
    cron = p.add_argument_group("Argo CronWorkflow (--format argo)")
    cron.add_argument("--schedule", action="append", metavar="CRON",
                      help=f"5-field cron (minute hour day-of-month month day-of-week) or @daily / @every 6h; "
                      f"repeatable (default {ARGO_DEFAULT_SCHEDULE.schedules[0]!r}: 02:00 every day)")
    cron.add_argument("--timezone", metavar="TZ",
                      help=f"IANA time zone of the schedule (default {ARGO_DEFAULT_SCHEDULE.timezone})")
    cron.add_argument("--concurrency-policy", metavar="POLICY",
                      help="Forbid (skip a start while a run is active) or Allow; not Replace, which "
                      "terminates the running workflow without its teardown "
                      f"(default {ARGO_DEFAULT_SCHEDULE.concurrency_policy})")
    cron.add_argument("--starting-deadline", type=int, metavar="SECONDS",
                      help="start a missed run only within this many seconds of its time (default: no limit)")
    cron.add_argument("--cron-param", action="append", metavar="KEY=VALUE",
                      help="a pipeline parameter the scheduled runs use (repeatable; typed by the pipeline's inputs), "
                      "e.g. --cron-param pvc_name=training-data")
    p.set_defaults(func=_compile)

    p = subparsers.add_parser(
        "upload", help="upload a pipeline to a KFP server, or add a version",
        description="Upload a pipeline to Kubeflow Pipelines, or add a version when a pipeline of that name exists. "
        "Content already uploaded is not uploaded again.",
    )
    _add_pipeline_args(p)
    p.add_argument("--name", help="pipeline name on the server (default: the pipeline's own name)")
    p.add_argument("--version",
                   help="version name (default: UTC timestamp + content hash, e.g. 20261129-154100-3f2a9c1b0d4e)")
    p.add_argument("--package", metavar="FILE", help="upload this compiled YAML instead of compiling --pipeline")
    _add_server_args(p)
    p.set_defaults(func=_upload)

    p = subparsers.add_parser(
        "submit", help="create a run on a KFP server",
        description="Create a run in an experiment (created when missing) from the uploaded pipeline "
        "(newest version, or --version) or from the package itself (--package).",
    )
    _add_run_args(p)
    p.add_argument("--run-name", help="run name (default: PIPELINE-YYYYmmdd-HHMMSS, UTC)")
    p.set_defaults(func=_submit)

    p = subparsers.add_parser(
        "schedule", help="create a recurring run (6-field cron) on a KFP server",
        description="Create a recurring run. KFP cron has 6 fields, seconds first: "
        "second minute hour day-of-month month day-of-week; '0 0 2 * * *' is 02:00:00 every day (UTC on the server).",
    )
    p.add_argument("--cron", required=True, help="6-field cron, seconds first, e.g. '0 0 2 * * *'")
    p.add_argument("--max-concurrency", type=int, default=1, metavar="N",
                   help=f"runs of this schedule allowed at once, 1-{MAX_CONCURRENCY_LIMIT} (default 1)")
    p.add_argument("--no-catchup", action="store_true",
                   help="after a pause, start only the latest missed run instead of every missed one")
    p.add_argument("--job-name", help="recurring run name (default: PIPELINE-schedule)")
    _add_run_args(p)
    p.set_defaults(func=_schedule)

    p = subparsers.add_parser("runs", help="list runs on a KFP server", description="List the newest runs.")
    p.add_argument("--experiment", help="only runs of this experiment")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    _add_server_args(p)
    p.set_defaults(func=_runs)

    p = subparsers.add_parser("schedules", help="list recurring runs on a KFP server", description="List recurring runs.")
    p.add_argument("--experiment", help="only recurring runs of this experiment")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    _add_server_args(p)
    p.set_defaults(func=_schedules)


def _add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", metavar="NAME", help="registered pipeline (default: all for compile, else the first)")
    parser.add_argument("--registry", default=DEFAULT_REGISTRY, metavar="MODULE:ATTR",
                        help=f"pipeline registry, a dict of name -> @dsl.pipeline (default {DEFAULT_REGISTRY})")


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server and credentials")
    server.add_argument("--host", default=os.environ.get("KF_PIPELINES_ENDPOINT"), metavar="URL",
                        help="KFP API endpoint, e.g. http://localhost:8080 (default $KF_PIPELINES_ENDPOINT)")
    server.add_argument("--token", help=f"bearer token (default ${TOKEN_ENV})")
    server.add_argument("--auth", choices=AUTH_MODES, default="auto",
                        help="auto (default): --token, $KF_PIPELINES_TOKEN, the kubeconfig when --kubeconfig/--context "
                        "is given, the in-cluster token file, else none")
    server.add_argument("--kubeconfig", metavar="FILE", help="send this kubeconfig user's bearer token")
    server.add_argument("--context", help="kubeconfig context (default: current)")
    server.add_argument("--namespace", help="Kubernetes namespace of experiments and runs (multi-user deployments)")
    server.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help=f"seconds to wait for the server to answer each request, at most {MAX_TIMEOUT} "
                        "(default 10)")


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    _add_pipeline_args(parser)
    parser.add_argument("--name", help="pipeline name on the server (default: the pipeline's own name)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--version", help="run this uploaded version (default: the newest)")
    source.add_argument("--package", nargs="?", const="", type=str, metavar="FILE",
                        help="send the pipeline itself with the run, no upload needed: FILE, or --pipeline compiled now")
    parser.add_argument("--experiment", default=DEFAULT_EXPERIMENT,
                        help=f"experiment (default {DEFAULT_EXPERIMENT}; created when missing)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="pipeline parameter, repeatable; typed by the pipeline's inputs (JSON for lists and dicts)")
    parser.add_argument("--service-account", metavar="NAME", default=None,
                        help="Kubernetes service account the run's steps run as (default: the KFP server's, "
                        "pipeline-runner on a single-user install, which manifests/ grants nothing; "
                        "resilient-training-launcher is the one manifests/base binds)")
    _add_server_args(parser)


class _InputError(ValueError):
    """Bad input found before any request: exit code 2."""


def _run(body: Callable[[], int]) -> int:
    """Run a command body; print errors on one line; 2 for bad input, 1 for server problems."""
    try:
        return body()
    except (_InputError, AuthError, CompileError, CronError, ParamError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KfpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _check_name(value: str | None, flag: str) -> None:
    """A name sent to the server as typed: refused, as ``--host`` and ``--param`` values are, when empty,
    with a control character (a pasted newline, C1's U+0085), an invisible format character (a bidi
    override, a zero-width space), bytes that are not UTF-8, blanks around it, or past
    :data:`MAX_NAME_LENGTH` characters (stranger trials: a newline-ended experiment was created, then
    `runs --experiment team-a` could not find it; 'r\u202eevil' showed in the UI as another name).
    """
    if value is None:
        return
    if not value.strip():
        raise _InputError(f"{flag} is empty")
    if has_control(value):
        raise _InputError(f"{flag} {value!r} contains {control_note(value)}")
    if value != value.strip():
        raise _InputError(f"{flag} {value!r} has blanks around it")
    if len(value) > MAX_NAME_LENGTH:
        raise _InputError(f"{flag} is {len(value)} characters long: give at most {MAX_NAME_LENGTH} "
                          f"({value[:24]!r}...)")


def _check_images() -> None:
    """The images a compile bakes in, from $RT_COMPONENTS_IMAGE and $RT_TRAINER_IMAGE, by render-job's
    --image rule (stranger trial: '' compiled executors without an image, or an Argo traceback).
    """
    for variable, value in images.from_environment().items():
        try:
            jobshape.check_image(value, f"${variable}")
        except ValueError as exc:
            raise _InputError(str(exc)) from None


def _compile(args: argparse.Namespace) -> int:
    if args.format == "argo":
        return _compile_argo(args)
    cron_flags = [flag for flag, value in (("--schedule", args.schedule), ("--timezone", args.timezone),
                                           ("--concurrency-policy", args.concurrency_policy),
                                           ("--starting-deadline", args.starting_deadline),
                                           ("--cron-param", args.cron_param),
                                           (argo_workflow.ARTIFACT_REPOSITORY_FLAG, args.argo_artifact_repository))
                  if value is not None]
    if cron_flags:
        print(f"error: {', '.join(cron_flags)}: only with --format argo", file=sys.stderr)
        return 2
    if args.default and not args.pipeline:
        print("error: --default: name the pipeline it is for with --pipeline NAME", file=sys.stderr)
        return 2

    def body() -> int:
        _check_images()
        if Path(args.output).suffix.lower() in _FILE_SUFFIXES:
            # Anything but .yaml/.yml reads as a directory: `-o x.json` made a directory (stranger trial).
            raise _InputError(f"-o {args.output}: KFP IR is written as YAML: give a .yaml file or a directory")
        _check_output(args.output, directory=Path(args.output).suffix.lower() not in (".yaml", ".yml"))
        registry = kfp_compile.load_registry(args.registry)
        selected = kfp_compile.select(registry, args.pipeline)
        paths = kfp_compile.output_paths(list(selected), Path(args.output))
        for key, pipeline in selected.items():
            if args.default:
                compiled = _writing(args.output, _compile_with_defaults, key, pipeline, paths[key], args.default)
            else:
                compiled = _writing(args.output, kfp_compile.compile_pipeline, key, pipeline, paths[key])
            print(f"{key}: {compiled.path} (pipeline {compiled.name!r}, {compiled.num_tasks} top-level task(s), "
                  f"{len(compiled.inputs)} parameter(s), sha256 {compiled.content_hash[:12]})")
            if not args.default:
                _note_laptop_defaults(compiled)
        return 0

    return _run(body)


def _compile_argo(args: argparse.Namespace) -> int:
    def body() -> int:
        if args.default:
            raise _InputError("--default: KFP IR only; the CronWorkflow's runs take --cron-param KEY=VALUE, and a "
                              "run submitted from the WorkflowTemplate takes its own arguments")
        if args.registry != DEFAULT_REGISTRY or args.pipeline not in (None, ARGO_PIPELINE):
            raise _InputError(f"--format argo writes the {ARGO_PIPELINE!r} pipeline only "
                              f"(got --pipeline {args.pipeline!r}, --registry {args.registry!r})")
        _check_images()
        output = Path(args.output)
        if output.suffix.lower() in (".yaml", ".yml", *_FILE_SUFFIXES):
            raise _InputError(f"--format argo writes two files; -o must be a directory, got {output}")
        _check_output(args.output, directory=True)
        if args.starting_deadline is not None and args.starting_deadline < 1:
            # 0 would read as "no deadline" to some and "never late" to others: leave it out instead.
            raise _InputError(f"--starting-deadline must be a positive number of seconds, got {args.starting_deadline}")
        if args.starting_deadline is not None and args.starting_deadline > 2**63 - 1:
            raise _InputError(f"--starting-deadline {args.starting_deadline} is past the CRD's int64")
        repository = _artifact_repository(args.argo_artifact_repository)
        default = ARGO_DEFAULT_SCHEDULE
        schedules = [argo_cron.validate_schedule(s) for s in args.schedule or default.schedules]
        if repeated := next((s for i, s in enumerate(schedules) if s in schedules[:i]), None):
            raise _InputError(f"--schedule {repeated!r} is given twice")
        schedule = argo_workflow.Schedule(
            schedules=tuple(schedules),
            timezone=argo_cron.validate_timezone(args.timezone if args.timezone is not None else default.timezone),
            concurrency_policy=argo_cron.validate_concurrency_policy(
                default.concurrency_policy if args.concurrency_policy is None else args.concurrency_policy),
            starting_deadline_seconds=args.starting_deadline,
            arguments=_cron_arguments(args.cron_param or []),
        )
        paths = _writing(args.output, argo_workflow.write, output, schedule, repository)
        steps, teardown = argo_workflow.pipeline_steps()
        saved = "" if repository is None else (
            f", {len(argo_workflow.output_artifacts())} output artifact(s) saved to {repository.describe()}")
        print(f"{ARGO_PIPELINE}: {paths.workflow_template} (WorkflowTemplate {argo_workflow.NAME!r}, "
              f"{len(steps)} steps + {teardown.task} on exit, "
              f"{len(argo_workflow.workflow_parameters())} parameter(s){saved})")
        deadline = "none" if schedule.starting_deadline_seconds is None else f"{schedule.starting_deadline_seconds}s"
        overrides = ", ".join(f"{k}={v}" for k, v in schedule.arguments) or "the template's defaults"
        print(f"{ARGO_PIPELINE}: {paths.cron_workflow} (CronWorkflow {argo_workflow.NAME!r}: "
              f"{'; '.join(schedule.schedules)} {schedule.timezone}, concurrency {schedule.concurrency_policy}, "
              f"starting deadline {deadline}; parameters: {overrides})")
        if not schedule.arguments:
            _note_default_schedule()
        _note_demo_faults(dict(schedule.arguments))
        if repository is None:
            _note_records_deleted_with_the_file_system(dict(schedule.arguments))
        return 0

    return _run(body)


def _artifact_repository(ref: str | None) -> argo_workflow.ArtifactRepository | None:
    if ref is None:
        return None
    try:
        return argo_workflow.artifact_repository(ref)
    except ValueError as exc:
        raise _InputError(str(exc)) from None


def _note_records_deleted_with_the_file_system(given: dict[str, str]) -> None:
    """Scheduled runs on a file system each run makes and the exit handler deletes: their records
    (the report among them) are on it, so they go with it unless saved to an artifact repository.
    """
    if (given.get("storage") == "fsx" and not given.get("fsx_file_system_id")
            and given.get("delete_file_system", "true") != "false"):
        print("note: the CronWorkflow's runs make an FSx file system that teardown-storage deletes when the run ends "
              "(delete_file_system=true), and their records (metrics, summaries, the resilience report, the promotion "
              f"record: RUN/{argo_workflow.ARTIFACTS_DIRNAME}/) go with it; compile with "
              f"{argo_workflow.ARTIFACT_REPOSITORY_FLAG} {argo_workflow.DEFAULT_ARTIFACT_REPOSITORY} (or CONFIGMAP:KEY) "
              "to save them as Argo output artifacts, or give --cron-param delete_file_system=false", file=sys.stderr)


def _check_output(output: str, *, directory: bool) -> None:
    """-o refused in one line before anything is compiled: empty, blank, a control character, a
    file where a directory must be (found by a stranger trial: '' wrote into the current directory,
    ' ' made a directory named by a space, an existing file was a FileExistsError traceback).
    """
    from resilient_training.run.paths import check_writable

    try:
        check_writable(output, "-o", directory=directory)
    except ValueError as exc:
        raise _InputError(str(exc)) from None


def _writing(output: str, write: Callable[..., Any], *args: Any) -> Any:
    """``write(*args)``, with what the file system refuses (/proc, /dev/full) as one line."""
    try:
        return write(*args)
    except OSError as exc:
        raise _InputError(f"-o {output}: cannot write {exc.filename or output}: {exc.strerror or exc}") from None


def _cron_arguments(items: list[str]) -> tuple[tuple[str, str], ...]:
    from resilient_training.argo.step import StepError

    try:
        return argo_workflow.cron_arguments(items)
    except StepError as exc:
        raise _InputError(f"--cron-param: {exc}") from None


def _note_demo_faults(given: dict[str, str]) -> None:
    """A schedule's runs that inherit the template's fault schedule (the demonstration's: every run
    made to fail and recover) are said to (stranger trial: the documented nightly schedule did).
    """
    faults = next((p.value for p in argo_workflow.workflow_parameters() if p.name == "faults"), "")
    if "faults" not in given and faults:
        print(f"note: the CronWorkflow's runs inherit the template's demonstration faults ({faults}): each "
              "run is made to fail and recover; give --cron-param faults= for none, or your own schedule",
              file=sys.stderr)


def _note_default_schedule() -> None:
    """The CronWorkflow without --cron-param starts runs with the template's defaults; say when those fail."""
    from resilient_training.argo.step import StepError

    try:
        argo_workflow.check_scheduled_run({})
    except StepError as exc:
        print(f"note: the CronWorkflow starts runs with the template's defaults, which a run's steps refuse "
              f"({exc}); give the schedule's values with --cron-param KEY=VALUE", file=sys.stderr)


def _compile_with_defaults(key: str, pipeline: Any, path: Path, items: list[str]) -> CompiledPipeline:
    """``compile --default``: parsed, checked as ``submit`` checks a run's arguments, compiled and read
    back in a scratch directory; only a file whose defaults are exactly the ones checked replaces ``path``
    (a refused default leaves an existing file as it was).
    """
    import dataclasses
    import shutil

    with tempfile.TemporaryDirectory(prefix="rt-compile-") as tmp:
        plain = kfp_compile.compile_pipeline(key, pipeline, Path(tmp) / "plain.yaml")
        defaults = kfp_params.parse_params(items, plain.inputs, flag="--default")
        for name, value in defaults.items():
            # kfp writes a string default into the file's header comment as it is: a line break there
            # broke the YAML (stranger trial); the IR holds numbers as doubles.
            if isinstance(value, str) and has_control(value):
                raise ParamError(f"--default: {name} {value!r} contains {control_note(value)}: a compiled default "
                                 "cannot hold one")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
                raise ParamError(f"--default: {name} {value} is past what the IR holds exactly (numbers are doubles: "
                                 f"at most {2**53})")
        _check_arguments(plain, defaults, recurring=False, flag="--default")
        compiled = kfp_compile.compile_pipeline(key, pipeline, Path(tmp) / "defaults.yaml", defaults)
        held = {name: _ir_default(spec) for name, spec in compiled.inputs.items() if name in defaults}
        if held != defaults:  # what the form shows is what was checked (a JSON number past 2**53, say)
            wrong = sorted(name for name in defaults if held.get(name) != defaults[name])
            raise ParamError(f"--default: {', '.join(wrong)}: the IR would hold {[held.get(n) for n in wrong]}, not the "
                             f"given {[defaults[n] for n in wrong]} (numbers are doubles)")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(compiled.path, path)
    return dataclasses.replace(compiled, path=path)


def _note_laptop_defaults(compiled: CompiledPipeline) -> None:
    """The IR's defaults are the laptop's (storage=local, launcher=local): a KFP UI's Create run form
    starts from them and, unlike ``submit``, checks nothing; say so, and how to compile a cluster's.
    """
    problem = _argument_problem(compiled, {}, recurring=False)
    if problem:
        print(f"note: {compiled.key}'s compiled defaults are a laptop's, which submit refuses for a KFP server "
              f"({problem}); the KFP UI's Create run form starts from them: compile the cluster's with "
              f"--pipeline {compiled.key} --default KEY=VALUE", file=sys.stderr)


def _check_arguments(compiled: CompiledPipeline, params: dict[str, Any], *, recurring: bool,
                     flag: str = "--param") -> None:
    """For this project's two pipelines: what their steps would refuse, refused before the run exists."""
    problem = _argument_problem(compiled, params, recurring=recurring)
    if problem:
        raise ParamError(f"{flag}: {problem}")


def _argument_problem(compiled: CompiledPipeline, params: dict[str, Any], *, recurring: bool) -> str | None:
    """What the steps of this project's two pipelines would refuse in the compiled defaults with
    ``params`` over them, as a KFP server runs them (None: nothing, or not one of ours).
    """
    from resilient_training.pipelines import arguments
    from resilient_training.pipelines.recovery_benchmark import recovery_benchmark
    from resilient_training.pipelines.resilient_training import resilient_training

    ours = {arguments.PIPELINE_NAME: resilient_training, arguments.BENCHMARK_NAME: recovery_benchmark}
    pipeline = ours.get(compiled.name)
    if pipeline is None or set(compiled.inputs) != set(pipeline.component_spec.inputs):
        return None  # another pipeline (or another version of one of these): its steps check their own inputs
    values = {name: _ir_default(spec) for name, spec in compiled.inputs.items()}
    values.update(params)
    try:
        # A KFP server runs every step in a pod of its own, launch_training's in the components image.
        if compiled.name == arguments.PIPELINE_NAME:
            arguments.check(values, cluster=True, recurring=recurring, local_launcher=False)
        else:
            arguments.check_benchmark(values, cluster=True, local_launcher=False)
    except ValueError as exc:
        return str(exc)
    return None


def _ir_default(spec: kfp_params.PipelineInput) -> Any:
    # The IR keeps every number as a double: an integer parameter's default 40 reads back as 40.0.
    if spec.type == "NUMBER_INTEGER" and isinstance(spec.default, float) and spec.default.is_integer():
        return int(spec.default)
    return spec.default


def _local_pipeline(args: argparse.Namespace, workdir: Path, package: str | Path | None) -> CompiledPipeline:
    """The CompiledPipeline a server command works on: a given package file, or --pipeline compiled now."""
    if package:
        compiled = kfp_compile.load_package(Path(package))
        # --package FILE with another --pipeline sent FILE's pipeline without a word (stranger trial).
        if args.pipeline is not None and args.pipeline != compiled.name:
            raise _InputError(f"--pipeline {args.pipeline}: --package {package} holds pipeline {compiled.name!r} "
                              "(drop one of them)")
        return compiled
    _check_images()
    key, pipeline = kfp_compile.default_pipeline(kfp_compile.load_registry(args.registry), args.pipeline)
    return kfp_compile.compile_pipeline(key, pipeline, workdir / f"{key}.yaml")


def _auth(args: argparse.Namespace) -> Auth:
    if not args.host:
        raise _InputError("--host URL is required (or set KF_PIPELINES_ENDPOINT)")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise _InputError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.timeout > MAX_TIMEOUT:
        raise _InputError(f"--timeout must be at most {MAX_TIMEOUT} seconds (a day), got {args.timeout:g}")
    if args.namespace is not None:
        try:
            k8s_names.check_dns1123_label(args.namespace, "--namespace")
        except ValueError as exc:
            raise _InputError(str(exc)) from None
    kfp_client.check_host(args.host)
    return kfp_client.resolve_auth(args.auth, token=args.token, kubeconfig=args.kubeconfig, context=args.context)


def _connect(args: argparse.Namespace, auth: Auth) -> Connection:
    return kfp_client.connect(args.host, auth, namespace=args.namespace, timeout=args.timeout)


def _upload(args: argparse.Namespace) -> int:
    def body() -> int:
        _check_name(args.name, "--name")
        _check_name(args.version, "--version")
        if args.package is not None and not args.package.strip():  # it read as '.': "Is a directory" (stranger trial)
            raise _InputError("--package is empty: give the compiled pipeline's YAML file")
        with tempfile.TemporaryDirectory(prefix="rt-upload-") as tmp:
            compiled = _local_pipeline(args, Path(tmp), args.package)
            auth = _auth(args)
            conn = _connect(args, auth)
            result = kfp_client.upload(conn, compiled, name=args.name, version=args.version)
        if result.created_pipeline:
            print(f"created pipeline {result.pipeline_name!r} (id {result.pipeline_id})")
        if result.created_version:
            print(f"uploaded version {result.version_name!r} of {result.pipeline_name!r} (id {result.version_id}, "
                  f"sha256 {compiled.content_hash[:12]})")
        else:
            print(f"unchanged: version {result.version_name!r} of {result.pipeline_name!r} already holds this content "
                  f"(id {result.version_id}, sha256 {compiled.content_hash[:12]})")
        print(f"{conn.host}/#/pipelines/details/{result.pipeline_id}/version/{result.version_id}")
        return 0

    return _run(body)


def _prepare_run(args: argparse.Namespace, workdir: Path, *, recurring: bool = False,
                 ) -> tuple[CompiledPipeline, dict[str, Any], Auth]:
    """Local checks shared by submit and schedule (``recurring``): names, the pipeline, typed params, credentials."""
    for flag in ("--name", "--version", "--experiment", "--run-name", "--job-name"):
        _check_name(getattr(args, flag[2:].replace("-", "_"), None), flag)
    compiled = _local_pipeline(args, workdir, args.package)
    params = kfp_params.parse_params(args.param, compiled.inputs)
    _check_arguments(compiled, params, recurring=recurring)
    if args.service_account is not None:
        from resilient_training.launch import k8s_names

        try:
            k8s_names.check_dns1123_subdomain(args.service_account, "--service-account")
        except ValueError as exc:
            raise _InputError(str(exc)) from None
    return compiled, params, _auth(args)


def _note_inherited_faults(compiled: CompiledPipeline, params: dict[str, Any], *, recurring: bool) -> None:
    """A run without ``--param faults`` gets the pipeline's demonstration faults: said on stderr, as
    Argo's compile says it for a CronWorkflow (a stranger trial: KFP runs were made to fail and
    recover with no word).
    """
    faults = compiled.inputs.get("faults")
    if faults is not None and "faults" not in params and faults.default:
        runs = "each scheduled run inherits" if recurring else "the run inherits"
        print(f"note: {runs} the pipeline's demonstration faults ({faults.default}): made to fail and recover; "
              "give --param faults= for none, or your own schedule", file=sys.stderr)


def _source(args: argparse.Namespace, conn: Connection, compiled: CompiledPipeline) -> RunSource:
    if args.package is not None:
        return RunSource(label=f"package {compiled.path.name} (sent with the run)", package_path=compiled.path)
    return kfp_client.resolve_version(conn, args.name or compiled.name, args.version)


def _submit(args: argparse.Namespace) -> int:
    def body() -> int:
        with tempfile.TemporaryDirectory(prefix="rt-submit-") as tmp:
            compiled, params, auth = _prepare_run(args, Path(tmp))
            run_name = args.run_name or f"{compiled.name}-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}"
            conn = _connect(args, auth)
            source = _source(args, conn, compiled)
            experiment_id, created = kfp_client.ensure_experiment(conn, args.experiment)
            run = kfp_client.submit(conn, experiment_id=experiment_id, run_name=run_name, source=source, params=params,
                                    service_account=args.service_account)
        print(f"{'created' if created else 'using'} experiment {args.experiment!r} (id {experiment_id})")
        print(f"run {run_name!r} created (id {run.run_id}) from {source.label}")
        print(f"parameters: {_format_params(params)}")
        print(compiled.caching_summary())
        print(kfp_client.ui_link(conn, "runs", run.run_id))
        _note_inherited_faults(compiled, params, recurring=False)
        return 0

    return _run(body)


def _schedule(args: argparse.Namespace) -> int:
    def body() -> int:
        cron = validate_cron(args.cron)
        if not 1 <= args.max_concurrency <= MAX_CONCURRENCY_LIMIT:
            raise _InputError(
                f"--max-concurrency must be 1-{MAX_CONCURRENCY_LIMIT} (the KFP API's range), got {args.max_concurrency}"
            )
        with tempfile.TemporaryDirectory(prefix="rt-schedule-") as tmp:
            compiled, params, auth = _prepare_run(args, Path(tmp), recurring=True)
            job_name = args.job_name or f"{compiled.name}-schedule"
            conn = _connect(args, auth)
            source = _source(args, conn, compiled)
            experiment_id, created = kfp_client.ensure_experiment(conn, args.experiment)
            job = kfp_client.schedule(
                conn, experiment_id=experiment_id, job_name=job_name, cron=cron, max_concurrency=args.max_concurrency,
                no_catchup=args.no_catchup, source=source, params=params, service_account=args.service_account,
            )
        print(f"{'created' if created else 'using'} experiment {args.experiment!r} (id {experiment_id})")
        print(f"recurring run {job_name!r} created (id {job.recurring_run_id}) from {source.label}")
        print(f"cron {cron!r}, max concurrency {args.max_concurrency}, catchup {'off' if args.no_catchup else 'on'}")
        print(f"parameters: {_format_params(params)}")
        print(compiled.caching_summary())
        print(kfp_client.ui_link(conn, "recurringrun", job.recurring_run_id))
        _note_inherited_faults(compiled, params, recurring=True)
        return 0

    return _run(body)


def _runs(args: argparse.Namespace) -> int:
    def body() -> int:
        _check_limit(args.limit)
        _check_name(args.experiment, "--experiment")
        conn = _connect(args, _auth(args))
        experiment_id = kfp_client.find_experiment(conn, args.experiment) if args.experiment else None
        runs = kfp_client.list_runs(conn, experiment_id=experiment_id, limit=args.limit)
        rows = [[r.run_id, r.display_name, r.state or "", _when(r.created_at), _when(r.finished_at)] for r in runs]
        print(format_table(["RUN ID", "NAME", "STATE", "CREATED", "FINISHED"], rows) if rows else "no runs")
        return 0

    return _run(body)


def _schedules(args: argparse.Namespace) -> int:
    def body() -> int:
        _check_limit(args.limit)
        _check_name(args.experiment, "--experiment")
        conn = _connect(args, _auth(args))
        experiment_id = kfp_client.find_experiment(conn, args.experiment) if args.experiment else None
        jobs = kfp_client.list_recurring_runs(conn, experiment_id=experiment_id, limit=args.limit)
        rows = [
            [j.recurring_run_id, j.display_name, _trigger(j), j.mode or "", str(j.max_concurrency or ""),
             "off" if j.no_catchup else "on", _when(j.created_at)]
            for j in jobs
        ]
        headers = ["RECURRING RUN ID", "NAME", "SCHEDULE", "MODE", "MAX CONC", "CATCHUP", "CREATED"]
        print(format_table(headers, rows) if rows else "no recurring runs")
        return 0

    return _run(body)


def _check_limit(limit: int) -> None:
    if limit < 1:
        raise _InputError(f"--limit must be at least 1, got {limit}")
    if limit > MAX_LIMIT:
        raise _InputError(f"--limit must be at most {MAX_LIMIT} (the KFP API's page size is an int32), got {limit}")


def _trigger(job: Any) -> str:
    trigger = job.trigger
    if trigger is not None and trigger.cron_schedule is not None:
        return f"cron {trigger.cron_schedule.cron}"
    if trigger is not None and trigger.periodic_schedule is not None:
        return f"every {trigger.periodic_schedule.interval_second}s"
    return ""


def _when(value: datetime.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _format_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items()) or "(pipeline defaults)"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart, header first."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in (headers, *rows)]
    return "\n".join(lines)
