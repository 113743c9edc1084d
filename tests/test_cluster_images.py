"""What the images install: a wheel of this package (not the editable tree) carries the cluster components,
and the Dockerfiles install it without letting pip replace torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_the_cluster_components(tmp_path):
    # Only what images/*/Dockerfile copy into the build context.
    for name in ("pyproject.toml", "resilient_training", "components", "pipelines"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".",
                          "-w", str(tmp_path / "dist")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("storage/provision.py", "storage/fsx.py", "storage/volumes.py", "launch/watch.py",
                   "launch/backends.py", "storage/teardown.py", "components/launch_training/component.py",
                   "launch/pytorchjob.py", "run/storage_ref.py", "cli/render.py", "launch/kube_client.py"):
        assert f"resilient_training/{module}" in names, module


def _pip_installs(dockerfile: str) -> list[list[str]]:
    """The package arguments of every ``pip install`` RUN (continuation lines joined)."""
    joined = dockerfile.replace("\\\n", " ")
    runs = []
    for line in joined.splitlines():
        if line.startswith("RUN python -m pip install"):
            command = line.split("&&")[0].split()[5:]
            runs.append([arg for arg in command if not arg.startswith("-")])
    return runs


def test_dockerfiles_pin_every_package_and_install_this_one_without_dependencies():
    for image in ("trainer", "components"):
        text = (ROOT / "images" / image / "Dockerfile").read_text()
        runs = _pip_installs(text)
        # Last: this package, --no-deps, so pip never swaps the base image's torch.
        assert runs[-1] == ["."] and "pip install --no-deps ." in text, image
        for args in runs[:-1]:
            for arg in args:
                assert "==" in arg or arg == "${EXTRA_PACKAGES}", f"{image}: {arg} is not pinned"
    trainer = _pip_installs((ROOT / "images" / "trainer" / "Dockerfile").read_text())
    assert "nvidia-resiliency-ext==0.7.0" in trainer[0]
    assert not any(arg.split("==")[0] == "torch" for args in trainer for arg in args)
    assert "torchdata==0.11.0" in trainer[0] and "transformers==5.24.0" in trainer[0]
    # torchdata and NVRx depend on torch: the base image's torch is pinned before anything is installed.
    text = (ROOT / "images" / "trainer" / "Dockerfile").read_text()
    assert text.index("ENV PIP_CONSTRAINT=") < text.index("RUN python -m pip install")
