"""`resilient-training run` and `bench`: the pipelines end to end on this machine (kfp.local).

Both check their input before anything starts, run the real pipeline DAG through
``kfp.local.SubprocessRunner(use_venv=False)`` (every component in a subprocess of this
Python, the trainer under ft_launcher with gloo workers), show each step's output as it runs,
and finish with where the results are, or the failing step and its reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT = "local_outputs"
# `run` exit codes: 0 promoted, 1 a step failed, 2 bad input, 3 the gates refused promotion.
EXIT_NOT_PROMOTED = 3


class UsageError(ValueError):
    """Bad input, found before anything started."""


def _check_training_input(steps: int, checkpoint_every: int, faults: str, nproc: int,
                          overrides: dict[str, Any], task: str = "", task_args: list[str] | None = None) -> None:
    """The trainer's own checks (config fields, fault schedule against the world size)."""
    from resilient_training.launch import local as launcher
    from resilient_training.run import config as cfg

    try:
        config = cfg.from_dict({**overrides, "run_dir": "/nonexistent-preflight", "steps": steps,
                                "checkpoint_every": checkpoint_every, "faults": faults,
                                **_task_settings(task, task_args)})
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


def _failure_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    from resilient_training.run import gate_records

    output = Path(args.output_dir).resolve()
    overrides = json.loads(args.train_overrides) if args.train_overrides else {}
    if not isinstance(overrides, dict):
        raise UsageError("--train-overrides must be a JSON object")
    _check_training_input(args.steps, args.checkpoint_every, args.faults, args.nproc, overrides, args.task,
                          args.task_arg)
    task = _task_settings(args.task, args.task_arg)
    kfp_root = _init_local(output)
    from resilient_training.pipelines import PIPELINES

    started = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    promote_to = Path(args.promote_to).resolve() if args.promote_to else output / "promoted" / stamp
    runs_root = output / "runs"  # provision_storage puts each run in <local_root>/runs/<run id>
    print(f"running the resilient-training pipeline locally: outputs in {output}", flush=True)
    failure = None
    try:
        PIPELINES["resilient-training"](
            storage="local", launcher="local", steps=args.steps, checkpoint_every=args.checkpoint_every,
            faults=args.faults, procs_per_node=args.nproc, local_root=str(output),
            promote_to=str(promote_to), train_overrides=overrides, min_improvement=args.min_improvement, **task,
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
    promoted = (promote_to / "promotion.json").is_file()
    if promoted:
        print(f"promoted model:     {promote_to}")
    else:
        print("promoted model:     none (promotion runs only when both gates pass)")
    if failure is not None:
        print(f"\nFAILED: {failure}", file=sys.stderr)
        return 1
    return 0 if promoted else EXIT_NOT_PROMOTED


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
    output = Path(args.output_dir).resolve()
    strategies = json.loads(args.strategies) if args.strategies else None
    if strategies is not None and not (isinstance(strategies, list) and all(isinstance(s, dict) for s in strategies)):
        raise UsageError("--strategies must be a JSON list of objects")
    if strategies is not None:
        from resilient_training.bench.strategy import parse_strategy

        for strategy in strategies:
            try:
                parse_strategy(strategy)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    _check_training_input(args.steps, args.checkpoint_every, args.faults, args.nproc, {}, args.task, args.task_arg)
    kfp_root = _init_local(output)
    from resilient_training.pipelines import PIPELINES

    started = time.time()
    print(f"running the recovery-benchmark pipeline locally: outputs in {output}", flush=True)
    kwargs: dict[str, Any] = {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "faults": args.faults,
                              "procs_per_node": args.nproc, "local_root": str(output)}
    if strategies is not None:
        kwargs["strategies"] = strategies
    kwargs.update(_task_settings(args.task, args.task_arg))
    try:
        PIPELINES["recovery-benchmark"](**kwargs)
    except Exception as exc:
        print(f"\nFAILED: {_failure_reason(exc)}", file=sys.stderr)
        return 1
    table = _task_output(kfp_root, started, "compare-strategies", "table")
    page = _task_output(kfp_root, started, "compare-strategies", "comparison")
    rows = _task_output(kfp_root, started, "compare-strategies", "rows")
    if rows is not None:
        from resilient_training.bench.compare import text_table

        print("\n=== recovery benchmark\n" + text_table(json.loads(rows.read_text())))
    print(f"\ncomparison (HTML):  {page}\ncomparison (table): {table}")
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
    parser.add_argument("--promote-to", default="", help="promotion directory (default OUTPUT/promoted/<time>)")
    parser.add_argument("--min-improvement", type=float, default=0.1, help="convergence gate: relative improvement")
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
    parser.add_argument("--task", default="", help="training task MODULE:ATTR or path/to/file.py:ATTR "
                        "(default: the built-in GPT task)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting passed to the task (repeatable)")


def _guard(func: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (UsageError, json.JSONDecodeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return wrapped
