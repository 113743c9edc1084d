"""One way to turn SIGTERM into an exception while a launcher waits.

KFP cancels a step, and Kubernetes deletes a pod, with SIGTERM. A launcher that is waiting on
workers or on a job must then stop what it started (the workers' process group, the
PyTorchJob) instead of leaving GPUs running, so the signal becomes :class:`Cancelled`, raised in
the main thread wherever the wait is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Cancelled(SystemExit):
    """SIGTERM arrived; exits 128 + SIGTERM if nobody handles it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(128 + signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Cancelled` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Cancelled(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interruption(exc: BaseException) -> tuple[str, int] | None:
    """How ``exc`` stopped a command, when a signal did: ("Ctrl-C" or the signal's name, exit code)."""
    if isinstance(exc, KeyboardInterrupt):
        return "Ctrl-C", 128 + signal.SIGINT
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code > 128:
        try:
            return signal.Signals(exc.code - 128).name, exc.code
        except ValueError:
            return f"exit {exc.code}", exc.code
    return None
