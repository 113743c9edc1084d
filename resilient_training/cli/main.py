"""The `resilient-training` command line: one subcommand per module, registered below.

Each module in COMMANDS defines `register(subparsers)`, which adds its subparser and sets
`func` (taking the parsed args, returning an exit code). Heavy imports stay inside `func`
so `resilient-training --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings
from typing import NoReturn

from resilient_training.run import config as cfg

# Add one line per subcommand module; order is the order shown in --help.
COMMANDS: tuple[str, ...] = (
    "resilient_training.cli.local",  # run, bench
    "resilient_training.cli.train",  # train
    "resilient_training.cli.render",  # render-job
    "resilient_training.cli.kfp",  # compile, upload, submit, schedule, runs, schedules
    "resilient_training.cli.gates",  # validate-checkpoint, check-convergence, promote, export, report
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (the usage block is what --help is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="resilient-training",
        description="Resilient FSDP training with NVIDIA Resiliency Extension, on a laptop or on Kubeflow.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS:
        importlib.import_module(module_name).register(subparsers)
    _strict_numbers(parser)
    return parser


def _strict_numbers(parser: argparse.ArgumentParser) -> None:
    """Every ``type=int``/``float`` flag of every command refuses surrounding blanks (a trailing newline)."""
    for action in parser._actions:
        if action.type is int:
            action.type = cfg.strict_int
        elif action.type is float:
            action.type = cfg.strict_float
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict_numbers(sub)


def main(argv: list[str] | None = None) -> int:
    # torch.cuda imports pynvml, which warns about its own deprecation on every import; the commands
    # that import torch (task preflight, validation) would print it on every run.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.owns_process = argv is None  # the process's own command line (see gates._with_a_verdict)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit, where a broken pipe could not be caught
        return code
    except KeyboardInterrupt:
        # Commands that start something say what they stopped; this is Ctrl-C anywhere else (a
        # stranger trial pressed it while the first command's modules were importing: a traceback).
        sys.stderr.write("interrupted (Ctrl-C)\n")
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader went away (`| head -1`): as a Unix tool killed by SIGPIPE would, stop quietly
        # (a stranger trial got a traceback); stdout goes to /dev/null so the exit's flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
