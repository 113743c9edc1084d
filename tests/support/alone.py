"""The ``alone`` marker: with pytest-xdist workers, a test so marked runs while no other does.

Loaded by the root conftest.py. Without xdist it does nothing.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With pytest-xdist workers (``make test TEST_WORKERS=2``): a test marked ``alone`` runs
    with no other test running; the others share the machine. A few tests need a checkpoint
    writer (a process importing torch) up by a given step, and beside another test's training
    on two cores it was not (docs/benchmarks.md#suite).

    A readers-writer lock over the whole protocol (setup, including wider fixtures, to
    teardown), on files in the run's shared temporary root; a turnstile in front so that a
    waiting ``alone`` test is not starved by the other worker's next tests.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    root = item.config._tmp_path_factory.getbasetemp().parent  # the run's, shared by its workers
    mode = fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH
    with open(root / "turnstile.lock", "a") as turnstile, open(root / "cpu.lock", "a") as cpu:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(cpu, mode)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(cpu, fcntl.LOCK_UN)
