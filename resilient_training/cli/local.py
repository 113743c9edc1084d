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
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from resilient_training.cli import runner_log
from resilient_training.run.paths import has_control

DEFAULT_OUTPUT = "local_outputs"
# `run` exit codes: 0 promoted, 1 a step failed, 2 bad input, 3 the gates refused promotion.
EXIT_NOT_PROMOTED = 3


class UsageError(ValueError):
    """Bad input, found before anything started."""


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
        raise UsageError(str(exc)) from None


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


def _init_local(output: Path) -> Path:
    from kfp import local

    root = output / "kfp"
    root.mkdir(parents=True, exist_ok=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    return root


def _newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda p: p.stat().st_mtime) if paths else None


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
    if args.export not in ("", "dcp", "torch", "safetensors", "hf"):
        raise UsageError(f"--export {args.export!r}: choose safetensors, torch or hf")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    promote_to = _promotion_dest(args.promote_to, output / "promoted" / stamp, runs_root=output / "runs")
    kfp_root = _init_local(output)
    from resilient_training.pipelines import LOCAL_PIPELINES as PIPELINES

    started = time.time()
    runs_root = output / "runs"  # provision_storage puts each run in <local_root>/runs/<run id>
    print(f"running the resilient-training pipeline locally: outputs in {output}", flush=True)
    failure = None
    log_path = _log_path(output, "resilient-training", stamp)
    with runner_log.capture(log_path, verbose=args.verbose):
        try:
            PIPELINES["resilient-training"](
                storage="local", launcher="local", steps=args.steps, checkpoint_every=args.checkpoint_every,
                faults=args.faults, procs_per_node=args.nproc, local_root=str(output),
                promote_to=str(promote_to), export=args.export, train_overrides=overrides,
                min_improvement=args.min_improvement,
                max_final_loss=-1.0 if args.max_final_loss is None else args.max_final_loss,
                **task,
            )
        except Exception as exc:  # kfp.local raises when a task fails; teardown has run by then
            failure = _failure_reason(exc)
    run_dir = _newest([p.parent for p in runs_root.glob("**/events") if p.stat().st_mtime >= started])
    report = _task_output(kfp_root, started, "resilience-report", "report")
    print("\n=== resilient-training: summary")
    if run_dir is not None:
        print(f"run directory:      {run_dir}")
        for gate in ("validation", "convergence"):
            record = gate_records.read_record(run_dir, gate)
            path = gate_records.record_path(run_dir, gate)
            if record is not None:
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
    from resilient_training.gates.export import PROMOTED_NAMES
    from resilient_training.gates.promote import RUN_ID_FIELD

    if RUN_ID_FIELD in promote_to and run_dir is not None:  # as the promote step filled it in
        promote_to = promote_to.replace(RUN_ID_FIELD, run_dir.name)
    promoted = _promoted(promote_to)
    if promoted:
        print(f"promoted model:     {promote_to}")
        if args.export in PROMOTED_NAMES:
            print(f"exported model:     {promote_to.rstrip('/')}/{PROMOTED_NAMES[args.export]}")
    else:
        print("promoted model:     none (promotion runs only when both gates pass)")
    print(f"local runner log:   {log_path}")
    if failure is not None:
        print(f"\nFAILED: {failure}", file=sys.stderr)
        return 1
    return 0 if promoted else EXIT_NOT_PROMOTED


def _json_flag(text: str, flag: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} is not valid JSON: {exc}") from None


def _output_dir(given: str) -> Path:
    from resilient_training.run.paths import check_writable

    try:
        return check_writable(given, "--output-dir", directory=True).resolve()
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
    return str(path)


def _promoted(dest: str) -> bool:
    from resilient_training.gates.promote import read_promotion

    try:
        return read_promotion(dest) is not None
    except Exception:  # noqa: BLE001 (the summary says "none" when the store cannot be read; the step's own error is shown)
        return False


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
    kfp_root = _init_local(output)
    from resilient_training.pipelines import LOCAL_PIPELINES as PIPELINES

    started = time.time()
    print(f"running the recovery-benchmark pipeline locally: outputs in {output}", flush=True)
    kwargs: dict[str, Any] = {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "faults": args.faults,
                              "procs_per_node": args.nproc, "local_root": str(output)}
    if strategies is not None:
        kwargs["strategies"] = strategies
    kwargs.update(_task_settings(args.task, args.task_arg))
    log_path = _log_path(output, "recovery-benchmark", time.strftime("%Y%m%d-%H%M%S"))
    failure = None
    with runner_log.capture(log_path, verbose=args.verbose):
        try:
            PIPELINES["recovery-benchmark"](**kwargs)
        except Exception as exc:  # kfp.local raises when a task fails
            failure = _failure_reason(exc)
    if failure is not None:
        print(f"local runner log:   {log_path}")
        print(f"\nFAILED: {failure}", file=sys.stderr)
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
                        help="also export the promoted model: safetensors, torch or hf (inside the promotion directory)")
    parser.add_argument("--min-improvement", type=float, default=0.1, help="convergence gate: relative improvement")
    parser.add_argument("--max-final-loss", type=float, default=None,
                        help="convergence gate: the final window's mean loss must be below this (default: derived "
                        "from the task's vocab_size, 0.8 x ln(vocab_size); for a task without one the check is "
                        "skipped, and the summary says so, unless this flag sets it)")
    parser.add_argument("--train-overrides", default="", help='trainer settings as JSON, e.g. \'{"nan_guard": false}\'')
    parser.set_defaults(func=_guard(run))
    parser = subparsers.add_parser(
        "bench", help="run the recovery benchmark pipeline locally and print the comparison",
        description="Train the same run under each recovery strategy and compare goodput and recovery time.",
    )
    _add_common(parser, steps=defaults.BENCH_STEPS, every=defaults.BENCH_CHECKPOINT_EVERY,
                faults=defaults.BENCH_FAULTS)
    parser.add_argument("--strategies", default="", help='JSON list, e.g. \'[{"name": "sync", "async_checkpoint": false}]\'')
    parser.set_defaults(func=_guard(bench))


def _add_common(parser: argparse.ArgumentParser, *, steps: int, every: int, faults: str) -> None:
    parser.add_argument("--steps", type=int, default=steps, help=f"target training step (default {steps})")
    parser.add_argument("--checkpoint-every", type=int, default=every, help=f"steps between checkpoints ({every})")
    parser.add_argument("--faults", default=faults, help=f"fault schedule TYPE@STEP:RANK,... (default {faults!r})")
    parser.add_argument("--nproc", type=int, default=2, help="CPU worker processes (default 2)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT, help=f"where everything goes ({DEFAULT_OUTPUT}/)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the local runner's full output (executor inputs, outputs, warnings) as it runs; "
                        "without it, that goes to OUTPUT/logs/PIPELINE-TIME.log")
    parser.add_argument("--task", default="", help="training task MODULE:ATTR or path/to/file.py:ATTR "
                        "(default: the built-in GPT task)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting passed to the task (repeatable)")


def _guard(func: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return wrapped
