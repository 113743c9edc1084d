"""`resilient-training run` and `bench`: the pipelines end to end on this machine (kfp.local).

Both check their input before anything starts, run the real pipeline DAG through
``kfp.local.SubprocessRunner(use_venv=False)`` (every component in a subprocess of this
Python, the trainer under ft_launcher with gloo workers), show one line as each step starts and
ends and the components' own progress lines (the local runner's full output goes to a log file,
or to the console with ``--verbose``), and finish with where the results are, or the failing step
and its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resilient_training.cli import runner_log
from resilient_training.run.paths import has_control

DEFAULT_OUTPUT = "local_outputs"
# `run` exit codes: 0 promoted, 1 a step failed, 2 bad input, 3 the gates refused promotion.
EXIT_NOT_PROMOTED = 3
# After SIGTERM, how long the pipeline's processes get to stop in order (the training's launcher
# stops its workers, allowing them 10 s) before whatever is left gets SIGKILL.
STOP_GRACE_S = 30.0


class UsageError(ValueError):
    """Bad input, found before anything started."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the pipeline's processes were stopped; ``code`` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _check_training_input(output: Path, steps: int, checkpoint_every: int, faults: str, nproc: int,
                          overrides: dict[str, Any], task: str = "", task_args: list[str] | None = None,
                          strategy: dict[str, Any] | None = None) -> None:
    """The trainer's own checks (config fields, task, fault schedule against the world size, a writable output)."""
    from resilient_training.launch import local as launcher
    from resilient_training.run import config as cfg

    if "run_dir" in overrides:
        raise UsageError("--train-overrides cannot set run_dir: each run gets its own under --output-dir")
    try:
        # Runs live in OUTPUT/runs/<run id>: checking one such path checks the whole output tree.
        # A benchmark strategy's settings win over the shared ones, as in run_strategy.
        config = cfg.from_dict({**overrides, "run_dir": str(output / "runs" / "preflight"), "steps": steps,
                                "checkpoint_every": checkpoint_every, "faults": faults,
                                **_task_settings(task, task_args), **(strategy or {})})
        launcher.preflight(config, world_size=nproc)
    except (ValueError, launcher.LaunchError) as exc:
        from resilient_training.pipelines import defaults

        message = str(exc)
        if faults in (defaults.RUN_FAULTS, defaults.BENCH_FAULTS) and message.startswith("fault"):
            # The user gave --steps or --nproc, not this schedule (a stranger trial read it as theirs).
            message += f" (the default --faults {faults!r}: give --faults '' for none, or a schedule that fits)"
        raise UsageError(message) from None


def _task_settings(task: str, task_args: list[str] | None) -> dict[str, Any]:
    """``--task``/``--task-arg`` as trainer settings (only those given: the rest keep their defaults)."""
    from resilient_training.run import config as cfg

    settings: dict[str, Any] = {}
    if task:
        settings["task"] = cfg.absolute_task(task)
    if task_args:
        try:
            settings["task_args"] = cfg.task_args_from(list(task_args))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return settings


# --------------------------------------------------------------------------- executing a pipeline
#
# kfp.local runs each step as a subprocess of the process that calls the pipeline, and the
# training step starts ft_launcher under it. Called in this process, a SIGTERM or SIGKILL to
# `run` left the executor, the launcher and its workers training on, unwatched (stranger trial).
# So the pipeline runs in a host process of its own session: it dies with this one (the
# parent-death signal `train`'s launcher uses), reaps the whole tree it started (a child
# subreaper, so orphans come back to it), and on SIGTERM stops that tree in order.

# The host's command: ``python -c HOST SPEC`` (not ``-m``: this module is imported by the CLI too).
_HOST = "import sys; from resilient_training.cli.local import host_main; sys.exit(host_main(sys.argv[1]))"
_PR_SET_CHILD_SUBREAPER = 36
# ft_launcher makes unix sockets (at most 107 bytes of path) in TMPDIR, named like
# "/_ft_launcher<pid>_rmon<rank>.socket": the scratch directory becomes TMPDIR only where they fit.
_TMPDIR_MAX = 107 - 48


@dataclasses.dataclass(frozen=True)
class Execution:
    """What the host reports of a pipeline run: kfp.local's failure line, each step's state and,
    for a step that raised, its exception's line.
    """

    failure: str | None
    states: dict[str, str]
    reasons: dict[str, str]


def _execute(pipeline: str, kwargs: dict[str, Any], *, output: Path, kfp_root: Path, log_path: Path,
             verbose: bool, overrides: dict[str, Any]) -> Execution:
    """Run ``pipeline`` with kfp.local in a host process (see above), its outputs under
    ``kfp_root`` (this invocation's own: see :func:`_invocation`); raises :class:`Interrupted`
    after Ctrl-C or SIGTERM, once everything it started is gone.
    """
    from resilient_training.launch import cancel
    from resilient_training.runtime.ft_launch import PARENT_ENV

    # kfp.local's `mktemp -d` per step (and the workers' temporary files) land here, removed at
    # the end: they piled up in /tmp, one directory per step per run (stranger trial).
    scratch = Path(tempfile.mkdtemp(prefix="rt-local-"))
    spec = {"pipeline": pipeline, "kwargs": kwargs, "output": str(output), "kfp_root": str(kfp_root), "log": str(log_path),
            "verbose": verbose, "overrides": overrides, "started": time.time(), "scratch": str(scratch)}
    (scratch / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    if len(os.fsencode(str(scratch))) <= _TMPDIR_MAX:
        env["TMPDIR"] = str(scratch)
    try:
        proc = subprocess.Popen([sys.executable, "-c", _HOST, str(scratch / "spec.json")], env=env,
                                start_new_session=True)
        try:
            with cancel.sigterm_raises():
                code = proc.wait()
        except (KeyboardInterrupt, cancel.Cancelled) as exc:
            _stop_host(proc)
            how = ("Ctrl-C", 128 + signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else ("SIGTERM", exc.code)
            wrote = f"what it wrote so far is in {output}" if output.exists() else "it had written nothing yet"
            raise Interrupted(f"interrupted ({how[0]}): stopped the pipeline and the training it started; {wrote}",
                              int(how[1] or 1)) from None
        result = scratch / "result.json"
        if result.is_file():
            return Execution(**json.loads(result.read_text()))
        return Execution(f"the local runner exited with code {code} before it finished (see {log_path})", {}, {})
    finally:
        _clean_leftovers(spec)
        _RAN.append(output)  # a Ctrl-C from here on is not "before anything started"


def _stop_host(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the host, which stops its tree; SIGKILL to its group if it takes too long."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S + 15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _clean_leftovers(spec: dict[str, Any]) -> None:
    """Remove what the run owns and nothing reads any more: the scratch directory, and the worker
    pid records (``<node-local tier>/<run key>-workers``) and node-local tier folders of the runs it
    made, which a worker removes only at a completed end (killed or failed runs left them in /dev/shm).
    """
    shutil.rmtree(spec["scratch"], ignore_errors=True)
    from resilient_training.run import config as cfg
    from resilient_training.run.layout import local_tier_base, run_key

    runs = Path(spec["output"]) / "runs"
    for events in runs.glob("**/events") if runs.is_dir() else []:
        run_dir = events.parent
        with contextlib.suppress(OSError, ValueError):
            if run_dir.stat().st_mtime < spec["started"] or _in_use(run_dir):
                continue
            config = cfg.from_dict({**spec["overrides"], "run_dir": str(run_dir)})
            # The workers' records, and the node-local tier's folders (<key>-<lineage>: copies of saves
            # whose persistent checkpoints are in the run directory), which only a completed end removed.
            for folder in local_tier_base(config).glob(f"{run_key(str(run_dir))}-*"):
                shutil.rmtree(folder, ignore_errors=True)


def _in_use(run_dir: Path) -> bool:
    """True while a training holds the run directory's lock (another `run` into the same --output-dir)."""
    import fcntl

    from resilient_training.run import layout

    try:
        fd = layout.open_lock(run_dir, create=False)
    except (OSError, ValueError):  # (LockFileError: no training holds what is not a lock)
        return False
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def host_main(spec_path: str) -> int:
    """The host process: run the pipeline under kfp.local, then write ``result.json`` beside the spec."""
    global _HOST_SPEC
    spec = _HOST_SPEC = json.loads(Path(spec_path).read_text())
    signal.signal(signal.SIGTERM, _host_stop)  # first: the parent-death check below may send it at once
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    from resilient_training.runtime import ft_launch

    ft_launch.die_with_parent()  # SIGTERM here when `run` dies, even by SIGKILL (as `train`'s launcher)
    from kfp import local

    root = Path(spec["kfp_root"])
    root.mkdir(parents=True, exist_ok=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    from resilient_training.pipelines import LOCAL_PIPELINES as PIPELINES

    failure = None
    with runner_log.capture(Path(spec["log"]), verbose=spec["verbose"]) as digest:
        try:
            PIPELINES[spec["pipeline"]](**spec["kwargs"])
        except Exception as exc:  # kfp.local raises when a task fails; teardown has run by then
            failure = _failure_reason(exc)
    Path(spec_path).with_name("result.json").write_text(json.dumps(
        {"failure": failure, "states": digest.states, "reasons": digest.reasons}))
    return 0


_HOST_SPEC: dict[str, Any] | None = None


def _host_stop(signum: int, frame: Any) -> None:
    """SIGTERM in the host: SIGTERM to its process group (kfp.local's step processes; the training
    step then stops its launcher, which stops its workers), reap everything that was started
    (orphans included) for up to STOP_GRACE_S, SIGKILL what is left, clean up, exit.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while _reap_children():
        if time.monotonic() > deadline:
            for pid in _children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline + 10:
                break  # unkillable (D state): nothing more to do from here
        time.sleep(0.1)
    with contextlib.suppress(Exception):
        sys.stdout.flush()  # the runner log (capture's stream)
    if _HOST_SPEC is not None:
        _clean_leftovers(_HOST_SPEC)
    os._exit(128 + signum)


def _reap_children() -> bool:
    """Reap the children that have ended; True while some remain."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _children() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(entry))
    return found


def _newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda p: p.stat().st_mtime) if paths else None


def _invocation(output: Path, stamp: str) -> Path:
    """The kfp.local pipeline root of one invocation, ``OUTPUT/kfp/STAMP-PID``: two ``run``s sharing
    an output directory read back only their own steps' outputs (a stranger trial's summary named
    the other run's run directory, records and report when both looked for the newest).
    """
    return output / "kfp" / f"{stamp}-{os.getpid()}"


def _run_dir_of(kfp_root: Path) -> Path | None:
    """The run directory this invocation's provision step made (its output parameter)."""
    for found in kfp_root.glob("*/provision-storage/executor_output.json"):
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError, RecursionError):
            run_dir = json.loads(found.read_text())["parameterValues"]["run_dir"]
            if isinstance(run_dir, str) and run_dir:
                return Path(run_dir)
    return None


def _task_output(kfp_root: Path, since: float, task: str, output: str) -> Path | None:
    """An output artifact of a task of the newest pipeline run under ``kfp_root``."""
    found = [p for p in kfp_root.glob(f"*/{task}/{output}") if p.stat().st_mtime >= since]
    return _newest(found)


def _log_path(output: Path, pipeline: str, stamp: str) -> Path:
    return output / "logs" / f"{pipeline}-{stamp}.log"


def _failure_reason(exc: BaseException) -> str:
    # kfp.local colours the task name in its exception text: shown raw in a stranger trial's summary.
    text = runner_log.strip_ansi(str(exc)).strip().splitlines()
    return text[-1] if text else type(exc).__name__


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    from resilient_training.run import config as cfg
    from resilient_training.run import gate_records

    args.faults = cfg.absolute_faults(args.faults)  # the steps run elsewhere
    args.task = _not_empty(args.task, "--task", "a task MODULE:ATTR or path/to/file.py:ATTR")
    args.train_overrides = _not_empty(args.train_overrides, "--train-overrides", "a JSON object")

    output = _output_dir(args.output_dir)
    overrides = _json_flag(args.train_overrides, "--train-overrides") if args.train_overrides else {}
    if not isinstance(overrides, dict):
        raise UsageError("--train-overrides must be a JSON object")
    if not math.isfinite(args.min_improvement):
        raise UsageError(f"--min-improvement must be a finite number, got {args.min_improvement}")
    if args.max_final_loss is not None and not (math.isfinite(args.max_final_loss) and args.max_final_loss > 0):
        raise UsageError(f"--max-final-loss must be a finite number > 0, got {args.max_final_loss}")
    _check_training_input(output, args.steps, args.checkpoint_every, args.faults, args.nproc, overrides, args.task,
                          args.task_arg)
    from resilient_training.gates.convergence import ConvergenceConfig, check_reachable

    try:
        check_reachable(args.steps, ConvergenceConfig(max_final_loss=args.max_final_loss,
                                                      min_improvement=args.min_improvement))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    task = _task_settings(args.task, args.task_arg)
    from resilient_training.gates.export import FORMATS

    if args.export not in ("", *FORMATS):
        raise UsageError(f"--export {args.export!r}: choose {', '.join(FORMATS)} (dcp: the checkpoint as promoted)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    promote_to = _promotion_dest(args.promote_to, output / "promoted" / stamp, runs_root=output / "runs")
    kwargs: dict[str, Any] = dict(
        storage="local", launcher="local", steps=args.steps, checkpoint_every=args.checkpoint_every,
        faults=args.faults, procs_per_node=args.nproc, local_root=str(output), promote_to=promote_to,
        export=args.export, train_overrides=overrides, min_improvement=args.min_improvement,
        max_final_loss=-1.0 if args.max_final_loss is None else args.max_final_loss,
        inprocess=args.inprocess, async_checkpoint=args.async_checkpoint, ft_launcher=args.ft_launcher, **task)
    _check_pipeline_arguments(kwargs)
    _probe_outputs(output, promote_to)
    kfp_root = _invocation(output, stamp)
    started = time.time()
    print(f"running the resilient-training pipeline locally: outputs in {output}", flush=True)
    log_path = _log_path(output, "resilient-training", kfp_root.name)
    execution = _execute("resilient-training", kwargs, output=output, kfp_root=kfp_root, log_path=log_path,
                         verbose=args.verbose, overrides=overrides)
    run_dir = _run_dir_of(kfp_root)
    if run_dir is not None and not (run_dir / "events").is_dir():
        run_dir = None  # provisioned, never trained: no records to show
    report = _task_output(kfp_root, started, "resilience-report", "report")
    print("\n=== resilient-training: summary")
    gates: dict[str, bool] = {}
    if run_dir is not None:
        print(f"run directory:      {run_dir}")
        for gate in ("validation", "convergence"):
            record = gate_records.read_record(run_dir, gate)
            path = gate_records.record_path(run_dir, gate)
            if record is not None:
                gates[gate] = bool(record.get("passed"))
                print(f"{gate + ':':19} {'PASSED' if record.get('passed') else 'FAILED'}  ({path})")
                if not record.get("passed"):
                    for reason in _reasons(record):
                        print(f"                    - {reason}")
                for name, check in (record.get("checks") or {}).items():
                    # A pass without one of its checks says which (a stranger trial's task had no
                    # vocab_size, so no final-loss threshold, and saw only PASSED).
                    if isinstance(check, dict) and check.get("skipped") and name != "continuity":
                        why = str(check.get("reason", "")).removeprefix("skipped: ")
                        print(f"                    (skipped {name}: {why})")
    if report is not None:
        print(f"resilience report:  {report}")
    numbers = _task_output(kfp_root, started, "resilience-report", "numbers")
    if numbers is not None:
        m = json.loads(numbers.read_text())
        recovery = m["recovery_seconds"]["all"]
        print(f"report numbers:     {numbers}")
        print(f"                    goodput: training {m['training_goodput']:.1%}, infrastructure "
              f"{m['infrastructure_goodput']:.1%}; {recovery['count']} recoveries, mean "
              f"{recovery['mean'] or 0:.1f} s, max {recovery['max'] or 0:.1f} s")
    from resilient_training.gates.promote import RUN_ID_FIELD

    if RUN_ID_FIELD in promote_to and run_dir is not None:  # as the promote step filled it in
        promote_to = promote_to.replace(RUN_ID_FIELD, run_dir.name)
    lines, promoted = _promotion_summary(execution, kfp_root, started, promote_to, run_dir, args.export, gates)
    for line in lines:
        print(line)
    print(f"local runner log:   {log_path}")
    if execution.failure is not None:
        print(f"\nFAILED: {_failed_line(execution, log_path)}", file=sys.stderr)
        return 1
    return 0 if promoted else EXIT_NOT_PROMOTED


def _check_pipeline_arguments(kwargs: dict[str, Any]) -> None:
    """The rules the cluster paths (submit, schedule, Argo) apply to the same pipeline arguments,
    from their one owner: a ``train_overrides`` key that a parameter overwrites (``steps``,
    ``checkpoint_every``, ``faults``, ...), ``export=hf`` for a task that is no transformers model.
    """
    from resilient_training.pipelines import arguments
    from resilient_training.pipelines.resilient_training import resilient_training

    values = {name: spec.default for name, spec in resilient_training.component_spec.inputs.items()}
    values.update(kwargs)
    try:
        arguments.check(values)
    except ValueError as exc:
        # The rule names the pipeline's parameter (`give it as steps=...`); here it is a flag of `run`.
        raise UsageError(re.sub(r"give it as (\w+)=\.\.\.", lambda m: f"give it as {RUN_FLAGS.get(m[1], m[0])}",
                                str(exc))) from None


# The pipeline parameters `run` sets, by the flag that sets each.
RUN_FLAGS = {"steps": "--steps N", "checkpoint_every": "--checkpoint-every N", "faults": "--faults SCHEDULE",
             "task": "--task", "task_args": "--task-arg KEY=VALUE", "export": "--export FORMAT",
             "inprocess": "--inprocess / --no-inprocess", "async_checkpoint": "--async-checkpoint / --no-async-checkpoint",
             "ft_launcher": "--ft-launcher / --no-ft-launcher"}


def _failed_line(execution: Execution, log_path: Path) -> str:
    """One line for a failed run: the failed step, its exception's line, where its output is."""
    failed = [name for name, state in execution.states.items() if state != "SUCCESS"]
    if not failed:
        return f"{execution.failure} (the local runner's output: {log_path})"
    name = failed[0]
    reason = execution.reasons.get(name, f"it finished with status {execution.states[name]}")
    return f"step {name} failed: {reason} (its output: {log_path})"


def _promotion_summary(execution: Execution, kfp_root: Path, started: float, dest: str, run_dir: Path | None,
                       export: str, gates: dict[str, bool]) -> tuple[list[str], bool]:
    """The summary's lines on promotion, from what the promote step did; True when this run's model
    is at DEST (a stranger trial saw "promoted model: DEST" for another run's model there).
    """
    pad = " " * 20
    state = execution.states.get("promote-model")
    if state == "SUCCESS":
        artifact = _task_output(kfp_root, started, "promote-model", "promotion")
        result = json.loads(artifact.read_text()) if artifact is not None else {}
        outcome = result.get("outcome") or {}
        lines = [f"promoted model:     {outcome.get('dest', dest)}"
                 + ("  (already promoted there: verified, not copied again)" if outcome.get("already_promoted") else "")]
        if (result.get("export") or {}).get("out"):
            lines.append(f"exported model:     {result['export']['out']}")
        return lines, True
    if state is not None:
        reason = execution.reasons.get("promote-model", f"it finished with status {state}")
        lines = [f"promoted model:     none: the promote step failed: {reason}"]
        record = _promotion_record(dest)
        if record is not None:
            source = record.get("source") or {}
            if run_dir is not None and str(source.get("run_dir")) == str(run_dir):
                # Promoted, then the export failed: the checkpoint is there, the export is not.
                lines.append(f"{pad}{dest} holds this run's checkpoint (step {source.get('step')}, promoted "
                             f"before the failure){f', without the {export} export' if export else ''}")
            else:
                lines.append(f"{pad}{dest} holds another run's model (step {source.get('step')} of "
                             f"{source.get('run_dir')}), left as it was")
        return lines, False
    if len(gates) == 2 and all(gates.values()):
        return ["promoted model:     none (the run stopped before the promote step)"], False
    if gates and not all(gates.values()):
        return ["promoted model:     none (promotion runs only when both gates pass)"], False
    return ["promoted model:     none (the run stopped before the gates)"], False


def _json_flag(text: str, flag: str) -> Any:
    """A JSON flag, a key given twice refused as ``submit --param`` does (json.loads kept the last:
    a stranger trial's ``{"lr": 1, "lr": 2}`` trained at 2 without a word).
    """
    from resilient_training.kfp.params import parse_json

    try:
        return parse_json(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} is not valid JSON: {exc}") from None
    except ValueError as exc:
        if "nested too deeply" in str(exc):
            raise UsageError(f"{flag} is JSON nested too deeply") from None
        raise UsageError(f"{flag}: {exc} (JSON would keep only the last): give it once") from None


def _output_dir(given: str) -> Path:
    from resilient_training.run.paths import check_writable

    try:
        output = check_writable(given, "--output-dir", directory=True).resolve()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from resilient_training.run import layout

    if (run := layout.run_dir_around(output)) is not None:  # its runs, logs and kfp would nest in a run's evidence
        raise UsageError(f"--output-dir {given} is inside the run directory {run}: name a directory outside any run")
    return output


def _probe_outputs(output: Path, promote_to: str) -> None:
    """Make (and remove) a file where the run writes first and where promotion writes last: the
    last checks, after every check that writes nothing. ``access()`` says yes to root on /proc,
    where nothing can be made (a traceback, and a promotion refused after training, in a stranger trial).
    """
    from resilient_training.gates.promote import RUN_ID_FIELD
    from resilient_training.run.paths import probe_writable

    try:
        probe_writable(output / "logs" if output.is_dir() else output, "--output-dir")
        if not promote_to.startswith("s3://"):  # promotion's lock and staging directory go beside DEST
            probe_writable(Path(promote_to.replace(RUN_ID_FIELD, "run")), "--promote-to")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _promotion_dest(given: str | None, default: Path, *, runs_root: Path) -> str:
    """Where `run` promotes to: ``s3://bucket/prefix`` as given, a directory made absolute; refused
    inside or around ``runs_root`` (where each run's directory is made), before anything trains.
    """
    from resilient_training.gates.promote import RUN_ID_FIELD, PromotionUsageError, check_dest_text

    if given is None:
        return str(default)
    # An empty value (an unset variable in a script) is not "the default": `promote` refuses it too.
    if not given.strip():
        raise UsageError("--promote-to is empty: name a directory or s3://bucket/prefix, or leave the flag out "
                         "(OUTPUT/promoted/<time>)")
    if has_control(given):
        raise UsageError(f"--promote-to {given!r} contains a control character (a newline?): remove it")
    if given != given.strip():
        raise UsageError(f"--promote-to {given!r} has leading or trailing whitespace: remove it")
    try:
        check_dest_text(given)  # s3:// URL, and no field but {run_id}
    except PromotionUsageError as exc:
        raise UsageError(f"--promote-to: {exc}") from None
    if given.startswith("s3://"):  # check_dest_text refused any other URL
        _check_aws_credentials(given)
        return given
    from resilient_training.run.paths import check_writable

    try:  # checked as the run will name it; {run_id} kept for the promote step to fill in
        check_writable(given.replace(RUN_ID_FIELD, time.strftime("%Y%m%d-%H%M%S")), "--promote-to", directory=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    path = Path(given).resolve()
    runs = runs_root.resolve()
    sample = Path(str(path).replace(RUN_ID_FIELD, "run"))
    if sample == runs or runs in sample.parents or sample in runs.parents:
        raise UsageError(f"--promote-to {given!r} is inside or around {runs}, where each run gets its directory "
                         f"(promotion refuses a place in its own run): promote beside it, e.g. {runs.parent}/promoted")
    # The run fills these itself (the runner's logs, kfp.local's outputs): promotion would find them
    # not empty after training (a stranger trial).
    for filled in (runs.parent / "logs", runs.parent / "kfp"):
        if sample == filled or filled in sample.parents:
            raise UsageError(f"--promote-to {given!r} is inside {filled}, which the run fills itself: promote "
                             f"beside it, e.g. {runs.parent}/promoted")
    _check_dest_free(given)
    return str(path)


def _check_aws_credentials(dest: str) -> None:
    """The promote step on this machine will need AWS credentials for an s3:// DEST: none found is
    known now, not after the training (a stranger trial). Nothing is sent: the chain only looks
    (variables, profiles, SSO cache, instance or container metadata).
    """
    import boto3
    import botocore.exceptions

    try:
        found = boto3.Session().get_credentials() is not None
    except botocore.exceptions.BotoCoreError as exc:  # a broken profile or config file
        raise UsageError(f"--promote-to {dest}: the AWS configuration cannot be read: {exc}") from None
    if not found:
        raise UsageError(f"--promote-to {dest}: no AWS credentials found (environment, profile or instance role), "
                         "which the promote step needs: set them, or promote to a directory")


def _promotion_record(dest: str) -> dict[str, Any] | None:
    from resilient_training.gates.promote import read_promotion

    try:
        record = read_promotion(dest)
    except Exception:  # noqa: BLE001 (the summary names the step's own error; an unreadable store adds nothing)
        return None
    return record if isinstance(record, dict) else None


def _check_dest_free(given: str) -> None:
    """What promotion would refuse about a local DEST at the end of the run, found before it trains
    (a stranger trial trained 30 s, then had each refused): DEST already a promoted model, a
    non-empty directory, inside a promoted model (a place where no file can be made: :func:`_probe_outputs`).
    """
    from resilient_training.gates.promote import RUN_ID_FIELD, occupied, promoted_model_above

    path = Path(given.replace(RUN_ID_FIELD, "run")).resolve()  # {run_id}: a directory not made yet
    if RUN_ID_FIELD not in given:
        record = _promotion_record(str(path))
        if record is not None:
            source = record.get("source") or {}
            raise UsageError(f"--promote-to {given} already holds a promoted model (step {source.get('step')} of "
                             f"{source.get('run_dir')}), and promotion never replaces one: choose another place, "
                             f"or put {RUN_ID_FIELD} in it")
        if occupied(path):
            raise UsageError(f"--promote-to {given} exists and is not an empty directory, which promotion refuses "
                             "to overwrite: choose another place")
    if (parent := promoted_model_above(path)) is not None:
        raise UsageError(f"--promote-to {given} lies inside the promoted model {parent}: promote beside it")


def _reasons(record: dict[str, Any]) -> list[str]:
    """Why a gate failed, from its record (findings or failed checks)."""
    reasons = []
    for finding in record.get("findings") or []:
        reasons.append(finding if isinstance(finding, str) else
                       " ".join(str(finding.get(k, "")) for k in ("file", "message", "problem") if finding.get(k)))
    for name, check in (record.get("checks") or {}).items():
        if isinstance(check, dict) and not check.get("passed", True):
            reasons.append(f"{name}: {check.get('reason', '')}")
    return reasons[:10]


# --------------------------------------------------------------------------- bench


def bench(args: argparse.Namespace) -> int:
    from resilient_training.run import config as cfg

    args.faults = cfg.absolute_faults(args.faults)  # the steps run elsewhere
    args.task = _not_empty(args.task, "--task", "a task MODULE:ATTR or path/to/file.py:ATTR")
    output = _output_dir(args.output_dir)
    strategies = _json_flag(args.strategies, "--strategies") if args.strategies else None
    if strategies is not None and not (isinstance(strategies, list) and all(isinstance(s, dict) for s in strategies)):
        raise UsageError("--strategies must be a JSON list of objects")
    _check_training_input(output, args.steps, args.checkpoint_every, args.faults, args.nproc, {}, args.task,
                          args.task_arg)
    if strategies is not None:
        from resilient_training.bench.strategy import parse_strategy

        names = []
        for strategy in strategies:
            try:
                name, settings = parse_strategy(strategy)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            try:  # each strategy's settings must make a valid trainer config, as the pipeline will build it
                _check_training_input(output, args.steps, args.checkpoint_every, args.faults, args.nproc, {},
                                      args.task, args.task_arg, strategy=settings)
            except UsageError as exc:
                raise UsageError(f"strategy {name}: {exc}") from None
            names.append(name)
        if not names or len(set(names)) != len(names):
            raise UsageError("--strategies needs at least one strategy, with unique names")
    _probe_outputs(output, "s3://")  # bench promotes nothing
    kfp_root = _invocation(output, time.strftime("%Y%m%d-%H%M%S"))
    started = time.time()
    print(f"running the recovery-benchmark pipeline locally: outputs in {output}", flush=True)
    kwargs: dict[str, Any] = {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "faults": args.faults,
                              "procs_per_node": args.nproc, "local_root": str(output)}
    if strategies is not None:
        kwargs["strategies"] = strategies
    kwargs.update(_task_settings(args.task, args.task_arg))
    log_path = _log_path(output, "recovery-benchmark", kfp_root.name)
    execution = _execute("recovery-benchmark", kwargs, output=output, kfp_root=kfp_root, log_path=log_path,
                         verbose=args.verbose, overrides={})
    if execution.failure is not None:
        print(f"local runner log:   {log_path}")
        print(f"\nFAILED: {_failed_line(execution, log_path)}", file=sys.stderr)
        return 1
    table = _task_output(kfp_root, started, "compare-strategies", "table")
    page = _task_output(kfp_root, started, "compare-strategies", "comparison")
    rows = _task_output(kfp_root, started, "compare-strategies", "rows")
    if rows is not None:
        from resilient_training.bench.compare import text_table

        print("\n=== recovery benchmark\n" + text_table(json.loads(rows.read_text())))
    print(f"\ncomparison (HTML):  {page}\ncomparison (table): {table}\nlocal runner log:   {log_path}")
    return 0


# --------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    from resilient_training.pipelines import defaults

    parser = subparsers.add_parser(
        "run", help="run the resilient-training pipeline locally (the main job)",
        description="Provision a local run directory, train 2 CPU workers under ft_launcher with injected "
        "faults, validate the checkpoint, check convergence, promote if both pass, write the report.",
    )
    _add_common(parser, steps=defaults.RUN_STEPS, every=defaults.RUN_CHECKPOINT_EVERY, faults=defaults.RUN_FAULTS)
    parser.add_argument("--promote-to", default=None, help="promotion directory or s3://bucket/prefix "
                        "({run_id} in it: the run's id; default OUTPUT/promoted/<time>)")
    parser.add_argument("--export", default="", metavar="FORMAT",
                        help="also export the promoted model: safetensors, torch or hf (inside the promotion directory; "
                             "dcp: the promoted checkpoint itself, nothing more)")
    parser.add_argument("--min-improvement", type=float, default=0.1, help="convergence gate: relative improvement")
    parser.add_argument("--max-final-loss", type=float, default=None,
                        help="convergence gate: the final window's mean loss must be below this (default: derived "
                        "from the task's vocab_size, 0.8 x ln(vocab_size); for a task without one the check is "
                        "skipped, and the summary says so, unless this flag sets it)")
    # The pipeline's recovery parameters (train_overrides may not set what a parameter sets: a stranger
    # trial found `run` could not turn them off at all).
    for flag, what in (("inprocess", "NVRx in-process restarts"), ("async-checkpoint", "asynchronous checkpoints"),
                       ("ft-launcher", "ft_launcher (off: torchrun)")):
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=True,
                            help=f"{what} (default: on)")
    parser.add_argument("--train-overrides", default=None, help='trainer settings as JSON, e.g. \'{"nan_guard": false}\'')
    parser.set_defaults(func=_guard(run))
    parser = subparsers.add_parser(
        "bench", help="run the recovery benchmark pipeline locally and print the comparison",
        description="Train the same run under each recovery strategy and compare goodput and recovery time.",
    )
    _add_common(parser, steps=defaults.BENCH_STEPS, every=defaults.BENCH_CHECKPOINT_EVERY,
                faults=defaults.BENCH_FAULTS)
    parser.add_argument("--strategies", default="", help='JSON list, e.g. \'[{"name": "sync", "async_checkpoint": false}]\'')
    parser.set_defaults(func=_guard(bench))


def _not_empty(value: str | None, flag: str, what: str) -> str:
    """A flag's value ("" when not given): given empty it was a mistake, not the default (a stranger
    trial's `run --task ''` trained the built-in task).
    """
    if value is None:
        return ""
    if not value.strip():
        raise UsageError(f"{flag} is empty: give {what}, or leave the flag out")
    return value


def _add_common(parser: argparse.ArgumentParser, *, steps: int, every: int, faults: str) -> None:
    parser.add_argument("--steps", type=int, default=steps, help=f"target training step (default {steps})")
    parser.add_argument("--checkpoint-every", type=int, default=every, help=f"steps between checkpoints ({every})")
    parser.add_argument("--faults", default=faults, help=f"fault schedule TYPE@STEP:RANK,... (default {faults!r})")
    parser.add_argument("--nproc", type=int, default=2, help="CPU worker processes (default 2)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT, help=f"where everything goes ({DEFAULT_OUTPUT}/)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the local runner's full output (executor inputs, outputs, warnings) as it runs; "
                        "without it, that goes to OUTPUT/logs/PIPELINE-TIME.log")
    parser.add_argument("--task", default=None, help="training task MODULE:ATTR or path/to/file.py:ATTR "
                        "(default: the built-in GPT task)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting passed to the task (repeatable)")


_RAN: list[Path] = []  # the output directories of the pipelines this process has run


def _guard(func: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except Interrupted as exc:
            print(str(exc), file=sys.stderr)
            return exc.code
        except KeyboardInterrupt:  # in the checks, or once the pipeline had ended (the summary)
            if _RAN:
                print(f"interrupted (Ctrl-C) after the pipeline had ended: its outputs are in {_RAN[-1]} (the "
                      "summary was not printed)", file=sys.stderr)
            else:
                print("interrupted (Ctrl-C): nothing was started", file=sys.stderr)
            return 128 + signal.SIGINT

    return wrapped
