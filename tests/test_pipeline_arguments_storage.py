"""pipelines/arguments.py's storage rules, through every way a run or a schedule is made: Argo's
``compile --format argo --cron-param``, KFP's ``compile --default``, ``submit``/``schedule --param``
(the real CLI against the in-test KFP server) and the pipeline's own first step (a run made in
the UI or with ``argo submit -p``).

- A schedule with storage=fsx and a fixed ``pvc_name``: every run creates that claim; overlapping
  runs (or the run after a failed teardown) find it taken.
- storage=fsx deletes the run's file system after the run (``delete_file_system``, default on):
  a ``promote_to`` on the claim would be deleted minutes after promotion.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient_training.cli.main import main
from resilient_training.pipelines import arguments
from resilient_training.pipelines.resilient_training import resilient_training
from tests.support.kfp_api_server import FakeKfpServer

FSX = ["storage=fsx", "fsx_subnet_id=subnet-0123456789abcdef0", "fsx_security_group_ids=sg-0123456789abcdef0"]
FIXED_CLAIM = ("error: {flag}: pvc_name 'nightly-claim' is the claim every scheduled run would create (storage=fsx): "
               "a run that overlaps another, or follows one whose teardown failed, finds it taken and fails; leave "
               "pvc_name empty (each run's claim is then named from its run id)\n")
ON_THE_CLAIM = ("promote_to '{dest}' is not in S3, and with storage=fsx the run's file system (the claim at /mnt/run) "
                "is deleted when the run ends, the promoted model with it: promote to s3://bucket/prefix, or keep the "
                "file system (delete_file_system=false)\n")


@pytest.fixture(autouse=True)
def _no_endpoint(monkeypatch, tmp_path):
    # The developer's own endpoint, token or pod credentials must not leak into these tests.
    for name in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_TOKEN", "KUBECONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-such-token"))


@pytest.fixture
def server() -> Iterator[FakeKfpServer]:
    with FakeKfpServer() as fake:
        yield fake


def _cli(capsys, *args: object) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def _argo_cron(capsys, tmp_path: Path, params: list[str]) -> tuple[int, str]:
    return _cli(capsys, "compile", "--format", "argo", "-o", tmp_path / "argo", "--concurrency-policy", "Allow",
                "--schedule", "0 */4 * * *", *[a for p in params for a in ("--cron-param", p)])


# Finding: run B's claim creation met run A's claim (409), and B's teardown deleted A's claim.
def test_argo_refuses_a_schedule_whose_runs_would_all_create_one_fsx_claim(capsys, tmp_path) -> None:
    base = [*FSX, "promote_to=s3://models/n/{run_id}", "faults="]
    code, err = _argo_cron(capsys, tmp_path, [*base, "pvc_name=nightly-claim"])
    assert (code, err) == (2, FIXED_CLAIM.format(flag="--cron-param"))
    assert not (tmp_path / "argo").exists()
    code, err = _argo_cron(capsys, tmp_path, base)  # empty: each run's claim is named from its run id
    assert code == 0, err
    # storage=pvc's pvc_name is the user's claim, which every run mounts and none creates.
    code, err = _argo_cron(capsys, tmp_path, ["storage=pvc", "pvc_name=nightly-claim", "promote_to=/mnt/run/p/{run_id}",
                                              "faults="])
    assert code == 0, err


def test_kfp_schedule_refuses_a_fixed_fsx_claim_and_submit_takes_it(capsys, server) -> None:
    params = [*FSX, "pvc_name=nightly-claim", "launcher=pytorchjob", "promote_to=s3://models/n/{run_id}"]
    code, err = _cli(capsys, "schedule", "--host", server.url, "--package", "--cron", "0 0 */4 * * *",
                     "--max-concurrency", "3", *[a for p in params for a in ("--param", p)])
    assert (code, err) == (2, FIXED_CLAIM.format(flag="--param"))
    assert server.requests == []
    # One run: the claim is its own (a claim that exists already fails provisioning, and nothing else).
    code, err = _cli(capsys, "submit", "--host", server.url, "--package", *[a for p in params for a in ("--param", p)])
    assert code == 0, err


def _values(**changes: object) -> dict:
    values = {name: spec.default for name, spec in resilient_training.component_spec.inputs.items()}
    return values | changes


def test_only_a_schedule_is_refused_a_fixed_fsx_claim() -> None:
    values = _values(storage="fsx", fsx_subnet_id="subnet-0123456789abcdef0", launcher="pytorchjob",
                     fsx_security_group_ids="sg-0123456789abcdef0", pvc_name="nightly-claim",
                     promote_to="s3://models/n/{run_id}")
    with pytest.raises(ValueError, match="pvc_name 'nightly-claim' is the claim every scheduled run would create"):
        arguments.check(values, cluster=True, recurring=True)
    arguments.check(values, cluster=True)
    arguments.check(values | {"pvc_name": ""}, cluster=True, recurring=True)


# Finding: promote_to on the claim was accepted, and teardown deleted the file system under the model.
def test_argo_refuses_promoting_onto_a_file_system_teardown_deletes(capsys, tmp_path) -> None:
    dest = "/mnt/run/promoted/{run_id}"
    code, err = _argo_cron(capsys, tmp_path, [*FSX, f"promote_to={dest}", "faults="])
    assert (code, err) == (2, "error: --cron-param: " + ON_THE_CLAIM.format(dest=dest))
    assert not (tmp_path / "argo").exists()


@pytest.mark.parametrize("kept", [
    ["promote_to=s3://models/n/{run_id}"],  # off the claim
    ["promote_to=/mnt/run/promoted/{run_id}", "delete_file_system=false"],  # the file system stays
    ["promote_to=/mnt/run/promoted/{run_id}", "fsx_file_system_id=fs-0123456789abcdef0"],  # reused: never deleted
], ids=["s3", "delete_file_system=false", "reused-file-system"])
def test_argo_takes_a_promoted_model_that_outlives_the_run(capsys, tmp_path, kept) -> None:
    network = [] if any(k.startswith("fsx_file_system_id") for k in kept) else FSX[1:]
    code, err = _argo_cron(capsys, tmp_path, ["storage=fsx", *network, *kept, "faults="])
    assert code == 0, err


def test_kfp_compile_default_and_submit_refuse_promoting_onto_a_deleted_file_system(capsys, server, tmp_path) -> None:
    dest = "/mnt/run/promoted"
    given = [*FSX, "launcher=pytorchjob", f"promote_to={dest}"]
    code, err = _cli(capsys, "compile", "--pipeline", "resilient-training", "-o", tmp_path / "p.yaml",
                     *[a for p in given for a in ("--default", p)])
    assert (code, err) == (2, "error: --default: " + ON_THE_CLAIM.format(dest=dest))
    assert not (tmp_path / "p.yaml").exists()
    code, err = _cli(capsys, "submit", "--host", server.url, "--package", *[a for p in given for a in ("--param", p)])
    assert (code, err) == (2, "error: --param: " + ON_THE_CLAIM.format(dest=dest))
    assert server.requests == []
    code, err = _cli(capsys, "compile", "--pipeline", "resilient-training", "-o", tmp_path / "p.yaml",
                     *[a for p in [*given, "delete_file_system=false"] for a in ("--default", p)])
    assert code == 0, err
    code, err = _cli(capsys, "submit", "--host", server.url, "--package",
                     *[a for p in [*given[:-1], "promote_to=s3://models/n"] for a in ("--param", p)])
    assert code == 0, err


def test_the_runs_first_step_refuses_it_too(capsys, monkeypatch) -> None:
    """A run made in the KFP UI or with `argo submit -p`: no command of ours checked it."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # in a pod, as the step runs
    values = _values(storage="fsx", fsx_subnet_id="subnet-0123456789abcdef0", launcher="pytorchjob",
                     fsx_security_group_ids="sg-0123456789abcdef0", promote_to="/mnt/run/promoted")
    with pytest.raises(SystemExit) as exited:
        arguments.check_step(values)
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: " + ON_THE_CLAIM.format(dest="/mnt/run/promoted")
    on_pvc = {"storage": "pvc", "pvc_name": "team-claim", "fsx_subnet_id": "", "fsx_security_group_ids": ""}
    for kept in ({"delete_file_system": False}, {"promote_to": "s3://models/n"}, on_pvc):
        arguments.check_step(values | kept)
