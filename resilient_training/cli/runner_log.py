"""What a person sees while ``kfp.local`` runs a pipeline (``run``, ``bench``).

The local runner prints every task's executor input as JSON, its outputs, its warnings and the
component's own lines, about 500 lines for one run. :func:`capture` sends all of that to a log
file and shows on the console only a line when each step starts and ends (or is skipped) and the
lines the components print themselves (the trainer's steps, checkpoints, faults and restarts).
With ``verbose`` the console gets the runner's full output as before (the log file still does).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour and cursor codes (kfp.local colours what it prints)."""
    return _ANSI.sub("", text)


# kfp.local's own log lines (kfp/local/task_dispatcher.py, orchestrator), after the timestamp.
_STARTED = re.compile(r" - INFO - Executing task '([^']+)'$")
_FINISHED = re.compile(r" - (?:INFO|ERROR) - Task '([^']+)' finished with status (\w+)$")
_SKIPPED = re.compile(r" - INFO - Skipping (?:conditional )?task (\S+?):? (?:\((.*)\)|(.*))$")
_STREAM_START = " - INFO - Streamed logs:"
_STREAM_INDENT = "    "  # kfp.local indents a task's own output by four spaces
_EXECUTOR = "[KFP Executor "
_PY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")
# A component's uncaught exception: the traceback goes to the log only, its last line (the
# exception) becomes the step's reason (a stranger trial saw 25 lines of frames per failed step).
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))")


class RunnerOutput(io.TextIOBase):
    """A text stream for kfp.local's stdout: everything to ``log``, a readable digest to ``console``."""

    def __init__(self, log: TextIO, console: TextIO, *, verbose: bool = False) -> None:
        self._log, self._console, self._verbose = log, console, verbose
        self._pending = ""
        self._in_task = False  # between "Streamed logs:" and the task's end
        self._in_json = False  # inside the executor input JSON a task prints first
        self._after_warning = False  # the source line Python prints under a warning
        self._in_traceback = False
        self._current: str | None = None  # the task whose output is streaming
        self._started: dict[str, float] = {}
        self.failed: list[str] = []
        self.states: dict[str, str] = {}  # task -> SUCCESS, FAILURE, ... (kfp.local's word)
        self.reasons: dict[str, str] = {}  # task -> its uncaught exception's line

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._log.write(text)
        if self._verbose:
            self._console.write(text)
            return len(text)
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._line(_ANSI.sub("", line))
        return len(text)

    def flush(self) -> None:
        self._log.flush()
        self._console.flush()

    def _say(self, text: str) -> None:
        self._console.write(text + "\n")
        self._console.flush()

    def _line(self, line: str) -> None:
        if match := _STARTED.search(line):
            self._started[match.group(1)] = time.monotonic()
            self._current = match.group(1)
            self._say(f"{time.strftime('%H:%M:%S')} ▶ {match.group(1)}")
        elif match := _FINISHED.search(line):
            name, state = match.groups()
            seconds = time.monotonic() - self._started.get(name, time.monotonic())
            self._in_task = self._in_json = self._in_traceback = False
            self.states[name] = state
            if state == "SUCCESS":
                self._say(f"{time.strftime('%H:%M:%S')} ✓ {name} ({seconds:.1f} s)")
            else:
                self.failed.append(name)
                reason = f": {self.reasons[name]}" if name in self.reasons else ""
                self._say(f"{time.strftime('%H:%M:%S')} ✗ {name} {state} ({seconds:.1f} s){reason}")
        elif match := _SKIPPED.search(line):
            self._say(f"{time.strftime('%H:%M:%S')} – {match.group(1)} skipped: {match.group(2) or match.group(3)}")
        elif line.endswith(_STREAM_START):
            self._in_task = True
        elif self._in_task and line.startswith(_STREAM_INDENT):
            self._task_line(line[len(_STREAM_INDENT):])

    def _task_line(self, text: str) -> None:
        """A line a task printed: the component's own ones pass, the executor's plumbing does not."""
        if self._in_json:
            self._in_json = text != "}"
            return
        if text.startswith((_TRACEBACK, *_CHAINED)):
            self._in_traceback = True
            return
        if self._in_traceback:
            if text.startswith(" ") or not text.strip():
                return  # a frame, its source line, or the blank line before a chained one
            self._in_traceback = False
            if self._current is not None:  # the last exception of a chain is the one that ended the task
                self.reasons[self._current] = _QUALIFIED.sub("", text.strip())
            return
        if text.startswith(_EXECUTOR):
            self._in_json = text.endswith("Got executor_input:")
            return
        if _PY_WARNING.match(text):
            self._after_warning = True
            return
        if self._after_warning and text.startswith(" "):
            self._after_warning = False
            return
        self._after_warning = False
        if text.strip():
            self._say(_STREAM_INDENT + text)


@contextlib.contextmanager
def capture(log_path: Path, *, verbose: bool = False) -> Iterator[RunnerOutput]:
    """Route this process's stdout and stderr through a :class:`RunnerOutput` writing ``log_path``.

    stderr carries the local runner's Python warnings (settings it ignores, the image it does not
    pull): into the log only, unless ``verbose``.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console_out, console_err = sys.stdout, sys.stderr
    with log_path.open("w", encoding="utf-8") as log:
        out = RunnerOutput(log, console_out, verbose=verbose)
        err = RunnerOutput(log, console_err, verbose=verbose) if verbose else log
        sys.stdout, sys.stderr = out, err
        try:
            yield out
        finally:
            sys.stdout, sys.stderr = console_out, console_err
            log.flush()
