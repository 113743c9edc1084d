"""The node-local checkpoint tier in the cluster jobs: `--local-checkpoint-dir` under /dev/shm needs
nothing more, any other directory gets an emptyDir of its own (node disk) in the trainer container,
and one on the checkpoint claim (inside it, the mount itself, or above it) or over a system directory
is refused with one line (exit 2). Before, the directory got no volume: the tier went into the
container's writable layer, or onto the shared claim while called node-local.
"""

from __future__ import annotations

import re

import pytest
import yaml

from resilient_training.cli import main as cli
from resilient_training.launch import trainjob
from tests.support import crd_schema

BASE = ["render-job", "--name", "j", "--nodes", "2", "--gpus-per-node", "8", "--pvc", "claim"]
CRDS = {"pytorchjob": ("kubeflow.org_pytorchjobs.yaml", "v1"),
        "trainjob": ("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")}
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def render(capsys, kind: str, *extra: str) -> dict:
    code = cli.main([*BASE, "--kind", kind, *extra, "-o", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return yaml.safe_load(out)


def pod_spec(job: dict, kind: str) -> dict:
    """The pod spec the job carries (a TrainJob's: its runtime patch, whose node container gains the mounts)."""
    if kind == "pytorchjob":
        return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]["template"]["spec"]


def local_tier(pod: dict) -> tuple[str | None, dict | None]:
    """(mount path, volume source) of the node-local tier's own volume, after checking the pod's volumes
    and mounts hold together as the API server requires (unique names and paths, every mount's volume there).
    """
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names)) and all(DNS1123_LABEL.fullmatch(n) for n in names), names
    (container,) = pod["containers"]  # the one container that runs the trainer
    mounts = container["volumeMounts"]
    paths = [m["mountPath"] for m in mounts]
    assert len(paths) == len(set(paths)), paths
    assert {m["name"] for m in mounts} <= set(names), (mounts, names)
    assert {m["name"]: m["mountPath"] for m in mounts}.items() >= {"dshm": "/dev/shm", "run-storage": "/mnt/run"}.items()
    extra = [m for m in mounts if m["name"] not in ("dshm", "run-storage")]
    if not extra:
        assert names == ["dshm", "run-storage"], names
        return None, None
    (mount,) = extra
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount["mountPath"], {k: v for k, v in volume.items() if k != "name"}


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_the_local_tier_gets_a_volume_of_its_own_only_off_dev_shm(kind, shared_schemas, capsys):
    every = ["--local-checkpoint-every", "5"]
    cases = [
        # (flags, where the tier's own emptyDir is mounted; None: no volume more than /dev/shm and the claim)
        (["--local-checkpoint-dir", "/scratch/rt-local", *every], "/scratch/rt-local"),
        (["--local-checkpoint-dir", "/scratch/rt-local/", *every], "/scratch/rt-local"),
        # Shares the claim mount's prefix (/mnt/run), yet lies outside it: not refused, and node-local.
        (["--local-checkpoint-dir", "/mnt/runner/local", *every], "/mnt/runner/local"),
        # Inside the image's /opt (not at it): hides nothing the image has.
        (["--local-checkpoint-dir", "/opt/rt-local", *every], "/opt/rt-local"),
        (["--local-checkpoint-dir", "/tmp/rt", *every, "--memory-snapshot-every", "5", "--host-snapshot"], "/tmp/rt"),
        # No tier, yet the workers' pid records (worker_gpu_reclaim, on by default) are written there.
        (["--local-checkpoint-dir", "/scratch/rt-local"], "/scratch/rt-local"),
        # The pods never write it: nothing to mount.
        (["--local-checkpoint-dir", "/scratch/rt-local", "--no-worker-gpu-reclaim"], None),
        # Under /dev/shm (the pod's memory volume, sized by --shm-size) or the default: nothing more.
        ([*every], None),
        (["--local-checkpoint-dir", "/dev/shm/rt", *every], None),
        (["--local-checkpoint-dir", "/dev/shm", *every], None),
        (["--local-checkpoint-dir", "/dev/shm/", *every], None),
    ]
    crd, version = CRDS[kind]
    schema = crd_schema.load_crd_schema(shared_schemas / crd, version)
    runtime = trainjob.to_dict(trainjob.build_runtime())
    for flags, expected in cases:
        job = render(capsys, kind, *flags)
        assert crd_schema.schema_errors(job, schema) == [], flags
        if kind == "pytorchjob":
            assert crd_schema.webhook_errors(job) == [], flags
        else:
            assert crd_schema.trainjob_admission_errors(job, {trainjob.RUNTIME_NAME: runtime}) == [], flags
        mount, source = local_tier(pod_spec(job, kind))
        assert mount == expected, flags
        if expected:  # node disk: no medium (Memory would count against the pod's memory, as /dev/shm does)
            assert source == {"emptyDir": {}}, (flags, source)


@pytest.mark.parametrize(("argv", "reason"), [
    (["--local-checkpoint-dir", "/mnt/run/local"], "'/mnt/run/local' lies inside the checkpoint claim's mount '/mnt/run'"),
    (["--local-checkpoint-dir", "/mnt/run/local", "--local-checkpoint-every", "5"], "lies inside the checkpoint claim"),
    (["--local-checkpoint-dir", "/mnt/run/runs/j/local"], "lies inside the checkpoint claim"),  # in the run dir
    (["--local-checkpoint-dir", "/mnt/run"], "'/mnt/run' is the checkpoint claim's mount '/mnt/run'"),
    (["--local-checkpoint-dir", "/mnt/run/"], "'/mnt/run/' is the checkpoint claim's mount"),
    (["--local-checkpoint-dir", "/mnt"], "'/mnt' contains the checkpoint claim's mount '/mnt/run'"),
    (["--local-checkpoint-dir", "/"], "'/' contains the checkpoint claim's mount"),
    # A leading '//' (which normpath keeps) is refused by the path rule before the claim's is asked.
    (["--local-checkpoint-dir", "//mnt/run/local"], "'//mnt/run/local' must be an absolute directory"),
    (["--local-checkpoint-dir", "//mnt"], "'//mnt' must be an absolute directory"),
    (["--mount-path", "//mnt/run", "--local-checkpoint-dir", "/mnt/run/local"], "'//mnt/run' must be an absolute"),
    # The claim's mount path spelt otherwise.
    (["--mount-path", "/mnt/run/", "--local-checkpoint-dir", "/mnt/run/local"], "lies inside the checkpoint claim"),
    (["--mount-path", "/data/ckpt", "--local-checkpoint-dir", "/data"], "'/data' contains the checkpoint claim's mount"),
    (["--kind", "trainjob", "--local-checkpoint-dir", "/mnt/run/local"], "lies inside the checkpoint claim"),
    # Off /dev/shm the directory is mounted over: never over (or above) a system directory.
    (["--local-checkpoint-dir", "/etc/rt"], "'/etc/rt' collides with /etc"),
    (["--local-checkpoint-dir", "/dev/shm-local"], "'/dev/shm-local' collides with /dev"),
    (["--local-checkpoint-dir", "/dev/"], "'/dev/' collides with /dev"),
    (["--local-checkpoint-dir", "/var/run/secrets/rt"], "collides with /var/run"),
    # A stranger trial: links into /usr on the image's Ubuntu (an emptyDir at /lib64 hid the loader), /var/run's
    # target, and the image's own trees (accepted, each hidden by the emptyDir).
    (["--local-checkpoint-dir", "/lib64"], "'/lib64' collides with /lib64"),
    (["--local-checkpoint-dir", "/sbin", "--kind", "trainjob"], "'/sbin' collides with /sbin"),
    (["--local-checkpoint-dir", "/run"], "'/run' collides with /run"),
    (["--local-checkpoint-dir", "/opt"], "'/opt' would hide the image's /opt"),
    (["--local-checkpoint-dir", "/home/"], "'/home/' would hide the image's /home"),
    # Kubernetes expands $(VAR) in args but not in a mountPath: the trainer would write beside the volume.
    (["--local-checkpoint-dir", "/scratch/$(RT_RUN_ID)"], "contains '$': Kubernetes expands $(VAR)"),
    (["--local-checkpoint-dir", "/scratch/$$x"], "contains '$'"),
    (["--run-dir", "/mnt/run/$(RT_RUN_ID)"], "run_dir '/mnt/run/$(RT_RUN_ID)' contains '$'"),
    (["--mount-path", "/opt"], "mount path '/opt' would hide the image's /opt"),
    (["--local-checkpoint-dir", "/proc/rt", "--local-checkpoint-every", "5"], "collides with /proc"),
])
def test_a_local_dir_on_the_claim_or_a_system_directory_is_refused(argv, reason, tmp_path, capsys):
    if "--mount-path" in argv:
        argv = [*argv, "--run-dir", argv[argv.index("--mount-path") + 1].rstrip("/") + "/runs/j"]
    out = tmp_path / "job.yaml"
    code = cli.main([*BASE, *argv, "-o", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert reason in err and err.count("\n") == 1, err
    assert not out.exists()


def test_no_spelling_of_a_path_on_the_claim_gets_through(tmp_path, capsys):
    """Every way to write a directory on the claim is refused: the ones the kernel resolves to it
    (``//``, a trailing ``/``: the claim's rule) and the non-normal ones (``.``, ``..``, inner ``//``:
    refused as before, by the path rule).
    """
    out = tmp_path / "job.yaml"
    for local in ("//mnt/run/x", "//mnt/run/x/", "/mnt/run/x/", "//mnt/run/", "/mnt/run/./x", "/mnt/x/../run/y",
                  "/mnt//run/x", "/mnt/run/x/..", "/mnt/run/.", "/./mnt/run", "/mnt/runner/../run/x"):
        code = cli.main([*BASE, "--local-checkpoint-dir", local, "--local-checkpoint-every", "5", "-o", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (local, err)
        assert "checkpoint claim's mount" in err or "without '.', '..', '//'" in err, (local, err)
        assert not out.exists()
