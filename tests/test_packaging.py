"""The wheel holds every module of the tree under its import name, and no test double."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def expected_modules() -> set[str]:
    """Paths inside the wheel for every library, component and pipeline module (tests excluded)."""
    out = {str(p.relative_to(ROOT)) for p in (ROOT / "resilient_training").rglob("*.py")}
    for top in ("components", "pipelines"):
        for p in (ROOT / top).rglob("*.py"):
            rel = p.relative_to(ROOT / top)
            if "tests" not in rel.parts:
                out.add(f"resilient_training/{top}/{rel}")
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # A copy without build leftovers (a stale build/ would hide a package missing from the list).
    src = out / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "tests", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md", "resilient_training", "components", "pipelines"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name, **(
            {"ignore": ignore} if (ROOT / name).is_dir() else {}))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), "."], cwd=src, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = out.glob("resilient_training-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_the_wheel_holds_every_module(wheel_files):
    missing = sorted(expected_modules() - wheel_files)
    assert missing == [], f"pyproject.toml's package list misses: {missing}"


def test_the_wheel_holds_no_test_double(wheel_files):
    doubles = sorted(n for n in wheel_files if "/tests/" in n or n.startswith("tests/") or "/testing/" in n
                     or any(word in n for word in ("kube_api", "kfp_api_server", "fixture", "gates_testing")))
    assert doubles == []


def test_the_wheel_has_the_command(wheel: Path, wheel_files: set[str]):
    (entry_points,) = [n for n in wheel_files if n.endswith("entry_points.txt")]
    with zipfile.ZipFile(wheel) as zf:
        assert "resilient-training = resilient_training.cli.main:main" in zf.read(entry_points).decode()
