"""What the images install: a wheel of this package (not the editable tree) carries the cluster components,
and the Dockerfiles install it without letting pip replace torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


IMAGE_UID = "1000"  # both images: files on the shared run storage have one owner


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    joined = dockerfile.replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("image", ["trainer", "components"])
def test_images_run_as_a_fixed_non_root_numeric_user(image):
    steps = _instructions((ROOT / "images" / image / "Dockerfile").read_text())
    users = [arg for op, arg in steps if op == "USER"]
    assert users, f"{image}: runs as root (no USER)"
    assert re.fullmatch(r"(\d+):(\d+)", users[-1]), f"{image}: USER {users[-1]} is not numeric UID:GID"
    uid, gid = users[-1].split(":")
    assert uid == gid == IMAGE_UID, image
    # Nothing after the last USER switches back or installs as that user.
    after = steps[[i for i, (op, _) in enumerate(steps) if op == "USER"][-1] + 1:]
    assert all(op in ("WORKDIR", "CMD", "ENTRYPOINT", "ENV", "LABEL", "EXPOSE") for op, _ in after), after


DIGEST = "@sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize("image", ["trainer", "components"])
def test_the_base_image_takes_a_digest_build_arg(image):
    steps = _instructions((ROOT / "images" / image / "Dockerfile").read_text())
    args = {arg.split("=", 1)[0]: (arg.split("=", 1) + [""])[1].strip('"') for op, arg in steps if op == "ARG"}
    [base] = [arg for op, arg in steps if op == "FROM"]
    assert base.endswith("${BASE_DIGEST}") and args["BASE_DIGEST"] == "", base  # declared before FROM, empty
    resolved = base.replace("${BASE_IMAGE}", args.get("BASE_IMAGE", "")).replace("${BASE_DIGEST}", DIGEST)
    # name:tag@sha256:<64 hex>: Docker pulls by the digest (the tag stays for people reading it).
    assert re.fullmatch(r"[a-z0-9./-]+:[\w.-]+@sha256:[0-9a-f]{64}", resolved), resolved
    assert "latest" not in base and "latest" not in resolved
