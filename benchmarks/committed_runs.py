"""The run directories inside committed benchmark tarballs (``benchmarks/results/*/*.tar.gz``)."""

from __future__ import annotations

import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path


def run_dirs(paths: list[str]) -> Iterator[tuple[str, Path]]:
    """(label, run directory) of every run with an event log in ``paths``, extracted to a temporary folder."""
    work = Path(tempfile.mkdtemp(prefix="committed-runs-"))
    for n, path in enumerate(paths):
        with tarfile.open(path) as tar:
            tar.extractall(work / str(n), filter="data")
        for run in sorted({p.parent.parent for p in (work / str(n)).glob("**/events/*.jsonl")}):
            yield f"{Path(path).parent.name}/{run.relative_to(work / str(n))}", run
