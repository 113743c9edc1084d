"""The ``alone`` marker (tests/support/alone.py) under real pytest-xdist workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

INNER = '''
import json, os, time, pytest

def record(name):
    start = time.time()
    time.sleep(0.5)
    with open(os.environ["ALONE_LOG"], "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")

@pytest.mark.parametrize("i", range(3))
def test_shared_before(i):
    record(f"shared{i}")

@pytest.mark.alone
def test_alone():
    record("alone")

@pytest.mark.parametrize("i", range(3, 8))
def test_shared_after(i):
    record(f"shared{i}")
'''


def test_an_alone_test_runs_while_no_other_does_and_the_others_share(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: runs alone\n")
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "ALONE_LOG": str(log), "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this suite may itself run under xdist
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "load", "-p", "tests.support.alone",
                           "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    spans = {name: (start, end) for name, start, end in map(json.loads, log.read_text().splitlines())}
    assert len(spans) == 9

    def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[0] < b[1] and b[0] < a[1]

    alone = spans.pop("alone")
    assert not [name for name, span in spans.items() if overlap(alone, span)]
    shared = list(spans.values())
    assert any(overlap(a, b) for i, a in enumerate(shared) for b in shared[i + 1:]), "the workers never ran together"
