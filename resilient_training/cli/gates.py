"""Subcommands of the gates: validate-checkpoint, check-convergence, promote, export, report.

Exit codes, shared by all five: 0 the check passed (or the work was done), 1 the check ran
and failed (invalid checkpoint, gate failed, promotion or export refused), 2 the input could not be
used (missing path, not a run, bad flag, destination not writable); nothing is written on 2.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate-checkpoint",
        help="prove a run's latest checkpoint (or one step_N directory) is complete, intact and loadable",
        description="Re-read every byte of a committed checkpoint and prove it whole: checksums, steps, "
        "finite tensors, loads into a fresh model. Exit 0 valid, 1 invalid, 2 usage error.",
    )
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="run directory or checkpoints/step_N directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--all", action="store_true", help="validate every committed checkpoint, not only latest")
    p.add_argument("--no-load", dest="load", action="store_false", help="skip loading into a fresh model")
    p.add_argument("--threads", type=int, default=None, help="parallel file readers (default: CPU count)")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not write RUN/gates/validation.json (promotion needs it)")
    p.set_defaults(func=_reading_run("path", "validate it", _with_a_verdict("validate-checkpoint", validate_main)))

    p = subparsers.add_parser(
        "check-convergence",
        help="gate a run on its loss curve: finite, learned, continuous across every recovery",
        description="Judge a run from its event log: loss finite, final loss below a threshold, relative "
        "improvement, loss continuity across every restore, optionally a reference run. Exit 0 passed, 1 failed.",
    )
    p.add_argument("run_dir", metavar="RUN", help="run directory (holds events/)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    # Ranges are checked by ConvergenceConfig (one line, exit 2), which the component shares.
    p.add_argument("--max-final-loss", type=float, default=None,
                   help="final-window mean loss must be below this, finite and > 0 "
                   "(default: 0.8 x ln(vocab_size) when the manifest records it)")
    p.add_argument("--min-improvement", type=float, default=0.1,
                   help="relative loss improvement of the final window over the first, in [0, 1) (default: 0.1)")
    p.add_argument("--window", type=int, default=5, help="steps per first/final window, >= 1 (default: 5)")
    p.add_argument("--continuity-rtol", type=float, default=1e-3,
                   help="relative tolerance of a replayed step's loss after a restore, >= 0 (default: 1e-3)")
    p.add_argument("--jump-rtol", type=float, default=0.15,
                   help="tolerance when only the restored step's own loss is known, >= 0 (default: 0.15)")
    p.add_argument("--reference", metavar="RUN", default=None, help="a reference run whose loss curve to match")
    p.add_argument("--reference-rtol", type=float, default=0.05,
                   help="relative tolerance against the reference, >= 0 (default: 0.05)")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="do not write RUN/gates/convergence.json (promotion needs it)")
    p.set_defaults(func=_reading_run("run_dir", "judge it", convergence_main))

    p = subparsers.add_parser(
        "promote",
        help="copy a validated and gated checkpoint to a directory or s3://bucket/prefix",
        description="Copy a checkpoint that passed validate-checkpoint and check-convergence in its run, with its "
        "manifest and a record of both gates. Atomic and idempotent. Exit 0 promoted (or already), 1 refused, "
        "2 usage error. With --json the outcome is printed as JSON whatever it is ({\"promoted\": false, "
        "\"error\": ...} when refused or unusable).",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="RUN/checkpoints/step_N, or a run (its latest)")
    p.add_argument("dest", metavar="DEST",
                   help="destination directory or s3://bucket/prefix; {run_id} in it is the run directory's name")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON (a refusal too)")
    p.set_defaults(func=_reading_run("checkpoint", "promote it", promote_main, key="promoted"))

    p = subparsers.add_parser(
        "export",
        help="write a validated checkpoint as DCP, torch, safetensors or a Hugging Face model directory",
        description="Export a checkpoint that passed validate-checkpoint in its run, in a format other tools load: "
        "dcp (a copy of the step directory), torch (dcp_to_torch_save), safetensors (the model's full tensors), "
        "hf (save_pretrained, for transformers models). Atomic; never overwrites. Exit 0 exported (or already), "
        "1 refused, 2 usage error. With --json the outcome is printed as JSON whatever it is.",
    )
    p.add_argument("run", metavar="RUN", help="run directory (or RUN/checkpoints/step_N)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the run's latest)")
    # Checked by export() rather than argparse: a bad value is one line, not usage plus error.
    p.add_argument("--format", dest="fmt", default=None, metavar="{dcp,torch,safetensors,hf}", help="output format")
    p.add_argument("-o", "--output", default=None, metavar="PATH", help="file (torch, safetensors) or directory")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON (a refusal too)")
    p.set_defaults(func=_reading_run("run", "export it", _with_a_verdict("export", export_main), key="exported"))

    p = subparsers.add_parser(
        "report",
        help="write the resilience report (goodput, recoveries, checkpoints) of a run",
        description="Compute goodput, recovery times, rollback, checkpoint freshness and cost, restart causes "
        "and a Young/Daly checkpoint interval from the event log; write HTML and/or JSON.",
    )
    p.add_argument("run_dir", metavar="RUN", help="run directory (holds events/)")
    p.add_argument("-o", "--output", default=None, help="write the HTML report here (- : to stdout)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the metrics as JSON to FILE (or stdout)")
    p.set_defaults(func=report_main)


def _reading_run(attr: str, what: str, command: Callable[[argparse.Namespace], int], *,
                 key: str | None = None) -> Callable[[argparse.Namespace], int]:
    """``command`` holding the run's lock shared (gate_records.reading_run): refused while a training
    runs there, and no training starts in the run until it is done.
    """
    @functools.wraps(command)
    def guarded(args: argparse.Namespace) -> int:
        from resilient_training.run.gate_records import RunInUse, reading_run

        path = getattr(args, attr)
        if not isinstance(path, str) or _plain_path(path, attr):  # the command says what is wrong with it
            return command(args)
        try:
            with reading_run(path, what):
                return command(args)
        except RunInUse as exc:
            if key is None:
                return _fail_usage(str(exc))
            return _not_done(getattr(args, "json", False), key, "usage_error", str(exc), EXIT_USAGE)

    return guarded


def _with_a_verdict(name: str, command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command`` in a child process whose exit status counts only if it ended through Python's exit.

    These gates run the run's task code (validation loads the checkpoint into the task's model, an
    hf export builds it). ``runtime.task.cannot_exit`` turns its ``sys.exit``/``os._exit`` into a
    finding, but a task can still end the process below Python (the C library's ``exit`` through
    ctypes, an ``exec``): status 0, read as "valid". The child tells this process, at Python's own
    exit, that it got there; without that, its status is not a verdict (exit 2, one line). Only
    where the command owns the process (the command line, not ``main(argv)`` called in a program).
    """
    @functools.wraps(command)
    def guarded(args: argparse.Namespace) -> int:
        if not getattr(args, "owns_process", False):  # main(argv) called by other code: no fork under it
            return command(args)
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: the command itself, as if unwrapped
            _die_with(parent)
            os.close(read)
            atexit.register(os.write, write, b"exited")  # Python's own exit (sys.exit, a return from main)
            return command(args)
        os.close(write)
        # Ctrl-C reaches the child too (the terminal's process group): it says what it stopped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
        status = os.waitpid(pid, 0)[1]
        with os.fdopen(read, "rb") as said:
            exited = said.read() == b"exited"
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # killed by a signal, as a shell reports it
        if not exited and code == 0:  # any other status is not a "yes" (a signal, a failure)
            print(f"error: {name} ended without a verdict (exit status {code}): the run's task ended the process "
                  "below Python (the C library's exit or an exec) while it ran", file=sys.stderr)
            return EXIT_USAGE
        return code

    return guarded


def _die_with(parent: int) -> None:
    """Have the (forked) process killed when ``parent`` dies, even by SIGKILL: a stranger trial's
    SIGKILLed `validate-checkpoint` left its child validating, which wrote a record afterwards.
    """
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child may outlive a killed parent
        return
    if os.getppid() != parent:  # it died before the line above
        os._exit(128 + signal.SIGKILL)


def _fail_usage(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _plain_path(value: str, name: str) -> str | None:
    """The one-line error for a path argument holding a control character (a pasted newline would
    split the error that names it over two lines), else None.
    """
    from resilient_training.run.paths import input_problem

    return input_problem(value, name)


def _json_text(data: Any) -> str:
    """Strict JSON: a NaN or infinite number (a NaN loss, a goodput of a log without steps) is
    null. ``NaN`` is no JSON token, and parsers that follow the standard refused the report's output
    (stranger trial).
    """
    def strict(value: Any) -> Any:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(v) for v in value]
        return value

    return json.dumps(strict(data), indent=1, sort_keys=True, allow_nan=False, default=str)


def _print_json(data: Any) -> None:
    print(_json_text(data))


def _not_done(as_json: bool, key: str, kind: str, message: str, code: int) -> int:
    """A refusal (exit 1) or usage error (exit 2): one line on stderr, and with ``--json`` the
    outcome on stdout as well, so a script reading stdout sees why rather than nothing.
    """
    print(f"{'refused' if code == EXIT_FAILED else 'error'}: {message}", file=sys.stderr)
    if as_json:
        _print_json({key: False, "outcome": kind, "error": message, "exit_code": code})
    return code


def validate_main(args: argparse.Namespace) -> int:
    from resilient_training.gates.validate import UsageError, format_validation, validate, write_validation_record

    if args.threads is not None and args.threads < 1:
        return _fail_usage(f"--threads must be at least 1, got {args.threads}")
    if problem := _plain_path(args.path, "RUN_OR_CHECKPOINT"):
        return _fail_usage(problem)
    from resilient_training.gates.validate import check_recordable
    from resilient_training.run.gate_records import RecordError

    try:
        if args.record:
            check_recordable(args.path)  # before the validation's time is spent
        report = validate(args.path, all_checkpoints=args.all, load=args.load, threads=args.threads)
    except UsageError as exc:
        return _fail_usage(str(exc))
    if args.record:
        from resilient_training.run.checkpoint_format import CheckpointError

        try:
            write_validation_record(args.path, report)
        except CheckpointError as exc:  # found by a stranger trial: a live run pruned the checkpoint meanwhile
            print(f"error: the validation cannot be recorded: {exc} (is a training still running in "
                  f"{args.path}?)", file=sys.stderr)
            return EXIT_FAILED
        except RecordError as exc:
            return _fail_usage(str(exc))
    if args.json:
        _print_json(report.to_dict())
    else:
        print(format_validation(report))
    return EXIT_OK if report.valid else EXIT_FAILED


def convergence_main(args: argparse.Namespace) -> int:
    from resilient_training.gates.convergence import (
        ConvergenceConfig,
        RunError,
        check_and_record,
        check_convergence,
    )
    from resilient_training.run.events import EventLogError

    for value, name in ((args.run_dir, "RUN"), (args.reference, "--reference")):
        if value is not None and (problem := _plain_path(value, name)):
            return _fail_usage(problem)

    try:
        config = ConvergenceConfig(
            max_final_loss=args.max_final_loss,
            min_improvement=args.min_improvement,
            window=args.window,
            continuity_rtol=args.continuity_rtol,
            jump_rtol=args.jump_rtol,
            reference_rtol=args.reference_rtol,
        )
        if args.record:  # RecordError is a ValueError
            verdict = check_and_record(args.run_dir, config, reference_dir=args.reference)
        else:
            verdict = check_convergence(args.run_dir, config, reference_dir=args.reference)
    except (RunError, EventLogError, ValueError) as exc:  # EventLogError: FILE:LINE: what is wrong
        return _fail_usage(str(exc))
    if args.json:
        _print_json(verdict.to_dict())
    else:
        print(verdict.format())
    return EXIT_OK if verdict.passed else EXIT_FAILED


def promote_main(args: argparse.Namespace) -> int:
    from resilient_training.gates.promote import PromotionRefused, PromotionUsageError, promote

    if problem := _plain_path(args.checkpoint, "CHECKPOINT"):  # DEST: promote() checks it
        return _not_done(args.json, "promoted", "usage_error", problem, EXIT_USAGE)
    try:
        outcome = promote(args.checkpoint, args.dest)
    except PromotionUsageError as exc:
        return _not_done(args.json, "promoted", "usage_error", str(exc), EXIT_USAGE)
    except PromotionRefused as exc:
        return _not_done(args.json, "promoted", "refused", str(exc), EXIT_FAILED)
    if args.json:
        _print_json({"promoted": True, **outcome})
    else:
        state = "already promoted (no-op)" if outcome["already_promoted"] else "promoted"
        print(f"{state}: step {outcome['step']} -> {outcome['dest']} ({outcome['bytes']} bytes)")
    return EXIT_OK


def _refuse_inside_run(run_dir: str, outputs: list[str]) -> None:
    """A report written over the run's own evidence (event log, checkpoints, gate records, config) would destroy it."""
    from resilient_training.run import layout

    for output in outputs:
        if inside := layout.evidence_holding(run_dir, output):
            raise ValueError(f"{output} lies in the run's own records ({inside}): write the report elsewhere")


def export_main(args: argparse.Namespace) -> int:
    from resilient_training.gates.export import ExportRefused, ExportUsageError, export

    if args.fmt is None or args.output is None:
        return _not_done(args.json, "exported", "usage_error", "give --format dcp|torch|safetensors|hf and -o PATH",
                         EXIT_USAGE)
    if problem := _plain_path(args.run, "RUN"):
        return _not_done(args.json, "exported", "usage_error", problem, EXIT_USAGE)
    try:
        outcome = export(args.run, fmt=args.fmt, out=args.output, step=args.step)
    except ExportUsageError as exc:
        return _not_done(args.json, "exported", "usage_error", str(exc), EXIT_USAGE)
    except ExportRefused as exc:
        return _not_done(args.json, "exported", "refused", str(exc), EXIT_FAILED)
    if args.json:
        _print_json({"exported": True, **outcome})
    else:
        state = "already exported (no-op)" if outcome["already_exported"] else "exported"
        print(f"{state}: step {outcome['step']} as {outcome['format']} -> {outcome['out']} ({outcome['bytes']} bytes)")
    return EXIT_OK


def report_main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from resilient_training.gates.metrics import RunError, compute_metrics
    from resilient_training.gates.report import write_report
    from resilient_training.run.paths import check_writable, probe_writable

    if args.output is None and args.json is None:
        return _fail_usage("give -o report.html and/or --json [FILE]")
    if problem := _plain_path(args.run_dir, "RUN"):
        return _fail_usage(problem)
    try:
        if args.output not in (None, "-"):
            check_writable(args.output, "-o", directory=False)
        if args.json not in (None, "-"):
            check_writable(args.json, "--json", directory=False)
        if args.output is not None and args.output == args.json:
            raise ValueError(f"-o and --json both name {args.output}")
        _refuse_inside_run(args.run_dir, [p for p in (args.output, args.json) if p not in (None, "-")])
    except ValueError as exc:
        return _fail_usage(str(exc))
    try:
        metrics = compute_metrics(args.run_dir)
        # Last, as it makes (and removes) a file: the outputs' directories take files (not /proc).
        for path, flag in ((args.output, "-o"), (args.json, "--json")):
            if path not in (None, "-"):
                probe_writable(path, flag)
    except (RunError, ValueError) as exc:
        return _fail_usage(str(exc))
    if args.output:
        if write_report(args.run_dir, args.output, metrics=metrics) is not None:
            print(f"wrote {args.output}", file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        _print_json(metrics)
    elif args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # as write_report does for -o
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(_json_text(metrics))
    return EXIT_OK
