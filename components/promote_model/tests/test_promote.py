"""Gated, atomic, idempotent promotion to a directory and to S3 (moto)."""

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from resilient_training.gates.promote import (
    PROMOTION_NAME,
    PromotionRefused,
    PromotionUsageError,
    promote,
    read_promotion,
)
from resilient_training.gates.validate import validate, write_validation_record
from resilient_training.run import checkpoint_format as cf
from resilient_training.run import gate_records

CKPT = "checkpoints/step_4"


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_promotes_a_gated_checkpoint_and_a_second_call_is_a_noop(gated_run: Path, tmp_path: Path) -> None:
    dest = tmp_path / "models" / "gpt"
    outcome = promote(gated_run / CKPT, str(dest))
    assert outcome["already_promoted"] is False and outcome["step"] == 4
    assert sorted(p.name for p in dest.iterdir()) == sorted([
        ".metadata", "__0_0.distcp", "__1_0.distcp", "data_rank_0.pt", "data_rank_1.pt", "manifest.json",
        PROMOTION_NAME])
    manifest = cf.read_manifest(dest)
    for name, entry in manifest["files"].items():
        assert cf.checksum_file(dest / name) == (entry["bytes"], entry["checksum"])
    record = read_promotion(str(dest))
    assert record["source"]["step"] == 4 and record["source"]["checkpoint"] == CKPT
    assert record["validation"]["passed"] and record["convergence"]["passed"]
    assert record["source"]["manifest_checksum"] == gate_records.manifest_digest(dest)
    before = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    again = promote(gated_run, str(dest))  # the run's latest is the same checkpoint
    assert again["already_promoted"] is True
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == before
    assert not list(dest.parent.glob(".tmp-promote-*"))


def test_refuses_what_was_not_validated(gated_run: Path, tmp_path: Path) -> None:
    (gated_run / "gates/validation.json").unlink()
    with pytest.raises(PromotionRefused, match="never validated"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_refuses_a_failed_validation(gated_run: Path, tmp_path: Path) -> None:
    (gated_run / CKPT / "stray.bin").write_bytes(b"x")
    write_validation_record(gated_run, validate(gated_run))
    with pytest.raises(PromotionRefused, match="unexpected_file"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_refuses_a_failed_or_missing_convergence_gate(gated_run: Path, tmp_path: Path) -> None:
    path = gated_run / "gates/convergence.json"
    record = json.loads(path.read_text())
    record["passed"] = False
    record["checks"]["continuity"] = {"passed": False, "reason": "restore broke the curve"}
    path.write_text(json.dumps(record))
    with pytest.raises(PromotionRefused, match="continuity: restore broke the curve"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    path.unlink()
    with pytest.raises(PromotionRefused, match="convergence gate never ran"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("passed", ["false", "true", 1, [False], {"x": 0}, None], ids=repr)
def test_a_convergence_record_whose_passed_is_not_the_json_true_is_refused(gated_run: Path, tmp_path: Path,
                                                                          passed: object) -> None:
    path = gated_run / "gates/convergence.json"
    record = json.loads(path.read_text())
    record["passed"] = passed
    path.write_text(json.dumps(record))
    with pytest.raises(PromotionRefused, match="the convergence gate failed"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_a_checkpoint_changed_after_the_convergence_gate_says_so(gated_run: Path, tmp_path: Path) -> None:
    path = gated_run / "gates/convergence.json"
    record = json.loads(path.read_text())
    record["manifest_checksum"] = "0" * 32
    path.write_text(json.dumps(record))
    with pytest.raises(PromotionRefused, match=f"{CKPT} changed since the convergence gate judged it"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))


def test_a_dangling_symlink_as_dest_is_refused_and_its_target_not_created(gated_run: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(PromotionUsageError, match="dangling symbolic link"):
        promote(gated_run / CKPT, str(tmp_path / "link"))
    assert not (tmp_path / "nowhere").exists()


def test_refuses_a_checkpoint_changed_after_validation(gated_run: Path, tmp_path: Path) -> None:
    manifest = gated_run / CKPT / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"run_id": "test-run"', '"run_id": "other"'))
    with pytest.raises(PromotionRefused, match="changed since it was validated"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))


def test_damage_after_validation_is_caught_while_copying(gated_run: Path, tmp_path: Path) -> None:
    shard = gated_run / CKPT / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(PromotionRefused, match="damaged after validation"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    assert sorted(os.listdir(tmp_path)) == ["run"]  # neither DEST nor a staging directory


def test_refuses_to_overwrite_another_model(gated_run: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "weights.bin").write_bytes(b"someone else's")
    with pytest.raises(PromotionRefused, match="not an empty directory"):
        promote(gated_run / CKPT, str(dest))
    assert snapshot(dest) == {"weights.bin": b"someone else's"}


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # writes past 20 kB fail with EFBIG


def test_a_failure_midway_leaves_nothing(gated_run: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "promote", str(gated_run / CKPT), str(dest)],
                          preexec_fn=_limit_file_size, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "File too large" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no DEST, no staging directory


def test_a_crash_midway_leaves_nothing_that_looks_promoted(big_gated_run: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    proc = subprocess.Popen([sys.executable, "-m", "resilient_training.cli", "promote", str(big_gated_run), str(dest)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".tmp-promote-dest-*/__0_0.distcp")) and time.monotonic() < deadline:
        time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)  # mid-copy: no cleanup code runs
    assert proc.wait() == -signal.SIGKILL
    (staging,) = tmp_path.glob(".tmp-promote-dest-*")  # the crashed attempt's partial copy
    assert "promotion.json" not in os.listdir(staging)
    assert not dest.exists() and read_promotion(str(dest)) is None
    assert promote(big_gated_run, str(dest))["already_promoted"] is False  # a retry completes and cleans up
    assert read_promotion(str(dest))["source"]["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


@pytest.mark.parametrize("case", ["missing", "file", "not-a-run"])
def test_bad_checkpoint_paths_are_usage_errors(tmp_path: Path, case: str) -> None:
    path = tmp_path / "x"
    if case == "file":
        path.write_text("")
    if case == "not-a-run":
        path.mkdir()
    with pytest.raises(PromotionUsageError, match=str(path)):
        promote(path, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_manifest_that_is_not_json_is_refused(gated_run: Path, tmp_path: Path) -> None:
    (gated_run / CKPT / "manifest.json").write_text("{oops")
    with pytest.raises(PromotionRefused, match="not valid JSON"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize(("where", "damage", "message"), [
    ("gates/validation.json", b"[]", "holds a JSON array, not an object"),
    ("gates/validation.json", b"null", "holds a JSON null, not an object"),
    ("gates/validation.json", b"\xff\xfe{}", "is not UTF-8 text"),
    ("gates/convergence.json", b"\xff{}", "is not UTF-8 text"),
    ("gates/validation.json", None, "cannot be read: Is a directory"),
    (f"{CKPT}/manifest.json", b"[]", "holds a JSON array, not an object"),
    (f"{CKPT}/manifest.json", b"\xff", "is not UTF-8 text"),
    ("checkpoints/latest", b"step_\xff\n", "is not UTF-8 text"),
], ids=["validation-array", "validation-null", "validation-not-utf8", "convergence-not-utf8", "validation-a-directory",
        "manifest-array", "manifest-not-utf8", "latest-not-utf8"])
def test_a_record_manifest_or_pointer_that_is_no_json_object_is_refused_in_one_line(
        gated_run: Path, tmp_path: Path, where: str, damage: bytes | None, message: str) -> None:
    # Found by a stranger trial: each was an AttributeError, UnicodeDecodeError or IsADirectoryError.
    target = gated_run / where
    if damage is None:
        target.unlink()
        target.mkdir()
    else:
        target.write_bytes(damage)
    with pytest.raises(PromotionRefused, match=message):
        promote(gated_run, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_dest_without_permission(gated_run: Path, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    # Tests run as root here, where mode bits do not stop writes: the immutable attribute does.
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        if os.geteuid() == 0:
            pytest.skip("chattr +i unsupported on this filesystem")
        locked.chmod(0o555)
    try:
        with pytest.raises(PromotionUsageError, match=r"locked.*(not writable|Operation not permitted|denied)"):
            promote(gated_run / CKPT, str(locked / "model"))
        assert os.listdir(locked) == []
    finally:
        subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
        locked.chmod(0o755)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(PromotionUsageError, match="a-file is a file, not a directory"):
        promote(gated_run / CKPT, str(tmp_path / "a-file" / "model"))  # parent is a file


@pytest.fixture
def s3():
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="models")
        yield client


def keys(client, bucket: str = "models") -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))


def test_promotes_to_s3_idempotently(gated_run: Path, s3) -> None:
    outcome = promote(gated_run / CKPT, "s3://models/gpt/v1", s3_client=s3)
    assert outcome["already_promoted"] is False
    assert keys(s3) == sorted(f"gpt/v1/{name}" for name in [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "data_rank_0.pt", "data_rank_1.pt", "manifest.json",
        PROMOTION_NAME])
    manifest = cf.read_manifest(gated_run / CKPT)
    for name, entry in manifest["files"].items():
        body = s3.get_object(Bucket="models", Key=f"gpt/v1/{name}")
        assert len(body["Body"].read()) == entry["bytes"]
        assert body["Metadata"]["xxh3-128"] == entry["checksum"]
    assert read_promotion("s3://models/gpt/v1", s3_client=s3)["source"]["step"] == 4
    versions = {k: s3.head_object(Bucket="models", Key=k)["LastModified"] for k in keys(s3)}
    assert promote(gated_run / CKPT, "s3://models/gpt/v1", s3_client=s3)["already_promoted"] is True
    assert {k: s3.head_object(Bucket="models", Key=k)["LastModified"] for k in keys(s3)} == versions


def test_promotes_through_an_s3_access_point_arn(gated_run: Path, s3) -> None:
    """A stranger trial: DEST s3://arn:aws:s3:REGION:ACCOUNT:accesspoint/NAME/PREFIX (as the AWS CLI
    takes it) was refused as no valid bucket, though boto3 takes the ARN wherever a bucket goes."""
    boto3.client("s3control", region_name="us-east-1").create_access_point(
        AccountId="123456789012", Name="models-ap", Bucket="models")
    dest = "s3://arn:aws:s3:us-east-1:123456789012:accesspoint/models-ap/gpt/v1"
    assert promote(gated_run / CKPT, dest, s3_client=s3)["already_promoted"] is False
    assert f"gpt/v1/{PROMOTION_NAME}" in keys(s3)  # in the bucket behind the access point
    assert read_promotion(dest, s3_client=s3)["source"]["step"] == 4
    assert promote(gated_run / CKPT, dest, s3_client=s3)["already_promoted"] is True
    for bad in ("s3://arn:aws:s3:us-east-1:123456789012:accesspoint/AP/x", "s3://arn:aws:s3:::models/x",
                "s3://arn:aws:s3:us-east-1:12345:accesspoint/models-ap/x"):
        with pytest.raises(PromotionUsageError, match="names no valid bucket .*an access point's ARN is"):
            promote(gated_run / CKPT, bad, s3_client=s3)


def test_s3_leftovers_of_a_crashed_upload_are_not_a_promotion(gated_run: Path, s3) -> None:
    s3.put_object(Bucket="models", Key="gpt/v1/__0_0.distcp", Body=b"half a shard")
    assert read_promotion("s3://models/gpt/v1", s3_client=s3) is None
    promote(gated_run / CKPT, "s3://models/gpt/v1", s3_client=s3)
    body = s3.get_object(Bucket="models", Key="gpt/v1/__0_0.distcp")["Body"].read()
    assert body == (gated_run / CKPT / "__0_0.distcp").read_bytes()


def test_s3_missing_bucket_is_a_usage_error(gated_run: Path, s3) -> None:
    with pytest.raises(PromotionUsageError, match="no such bucket"):
        promote(gated_run / CKPT, "s3://absent/gpt", s3_client=s3)
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["models"] and keys(s3) == []


def test_s3_refuses_when_the_gate_failed(gated_run: Path, s3) -> None:
    (gated_run / "gates/convergence.json").unlink()
    with pytest.raises(PromotionRefused):
        promote(gated_run / CKPT, "s3://models/gpt", s3_client=s3)
    assert keys(s3) == []


def test_run_id_in_dest_gives_each_run_of_a_schedule_its_own_place(gated_run: Path, other_gated_run: Path,
                                                                    tmp_path: Path) -> None:
    from tests.support.gates import copy_run

    second = copy_run(other_gated_run, tmp_path / "nightly-2")
    dest = str(tmp_path / "models" / "{run_id}" / "gpt")
    first = promote(gated_run / CKPT, dest)
    assert first["dest"] == str(tmp_path / "models" / "run" / "gpt")  # the run directory's name
    assert promote(second / CKPT, dest)["dest"] == str(tmp_path / "models" / "nightly-2" / "gpt")
    assert read_promotion(str(tmp_path / "models/run/gpt"))["source"]["run_id"] != read_promotion(
        str(tmp_path / "models/nightly-2/gpt"))["source"]["run_id"]
    assert promote(gated_run / CKPT, dest)["already_promoted"] is True  # a retry finds its own
    # A fixed DEST: the second run of a schedule is refused (what {run_id} is for).
    promote(gated_run / CKPT, str(tmp_path / "fixed"))
    with pytest.raises(PromotionRefused):
        promote(second / CKPT, str(tmp_path / "fixed"))


@pytest.mark.parametrize("dest", ["models/{runid}", "models/{run-id}", "models/{{run_id}}", "models/{run_id",
                                  "s3://models/{RUN_ID}", "s3://{run_id}/gpt"])
def test_a_misspelt_field_in_dest_is_refused_and_nothing_created(gated_run: Path, tmp_path: Path, dest: str) -> None:
    target = dest if dest.startswith("s3://") else str(tmp_path / dest)
    with pytest.raises(PromotionUsageError, match=r"\{run_id\}"):
        promote(gated_run / CKPT, target)
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_run_id_in_an_s3_prefix(gated_run: Path, s3) -> None:
    outcome = promote(gated_run / CKPT, "s3://models/nightly/{run_id}", s3_client=s3)
    assert outcome["dest"] == "s3://models/nightly/run"
    assert read_promotion("s3://models/nightly/run", s3_client=s3)["source"]["step"] == 4


def test_a_dest_inside_another_promoted_model_is_refused_and_that_model_stays_whole(
        gated_run: Path, other_gated_run: Path, tmp_path: Path) -> None:
    # Stranger trial: a second promotion inside the first one's directory made the first fail its
    # own repeat ("also holds ..."), and validation of it found an unexpected file.
    from tests.support.gates import copy_run

    first = promote(gated_run / CKPT, str(tmp_path / "models" / "{run_id}"))["dest"]
    before = snapshot(Path(first))
    second = copy_run(other_gated_run, tmp_path / "second")
    with pytest.raises(PromotionUsageError, match="lies inside the promoted model"):
        promote(second / CKPT, str(Path(first) / "nested"))
    assert snapshot(Path(first)) == before
    assert promote(gated_run / CKPT, str(tmp_path / "models" / "{run_id}"))["already_promoted"] is True


def test_a_step_linked_to_another_gated_run_is_refused(gated_run: Path, other_gated_run: Path, tmp_path: Path) -> None:
    """Found by a stranger trial: with ``step_N`` a link to another run's (gated) checkpoint, promote
    followed the link and promoted the other run's model on that run's records. The run named is
    the one whose records count: its validation names another manifest."""
    import shutil

    shutil.rmtree(gated_run / CKPT)
    (gated_run / CKPT).symlink_to(other_gated_run / CKPT, target_is_directory=True)
    with pytest.raises(PromotionRefused, match="changed since"):
        promote(gated_run, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_an_export_inside_dest_is_verified_on_a_repeat(gated_run: Path, other_gated_run: Path, tmp_path: Path) -> None:
    """Found by a stranger trial: a repeat promote said "already promoted" with another run's
    model.safetensors, or a made-up hf/, inside DEST: names of exports were never checked."""
    import shutil

    from resilient_training.gates.export import export, export_promoted

    dest = tmp_path / "dest"
    promote(gated_run / CKPT, str(dest))
    export_promoted(str(gated_run / CKPT), str(dest), "safetensors")
    assert promote(gated_run / CKPT, str(dest))["already_promoted"] is True  # its own export: fine
    foreign = tmp_path / "other.safetensors"
    export(other_gated_run, fmt="safetensors", out=foreign)
    shutil.copy(foreign, dest / "model.safetensors")
    with pytest.raises(PromotionRefused, match="its export is not this checkpoint's"):
        promote(gated_run / CKPT, str(dest))
    (dest / "model.safetensors").unlink()
    (dest / "hf").mkdir()
    (dest / "hf" / "config.json").write_text("{}")
    with pytest.raises(PromotionRefused, match="its export is not this checkpoint's"):
        promote(gated_run / CKPT, str(dest))


def test_an_export_into_a_promoted_model_is_refused_but_its_own(gated_run: Path, tmp_path: Path) -> None:
    """Found by a stranger trial: `export --format dcp -o DEST/inner` was accepted, and the
    promotion's verified no-op then refused DEST for the stranger files."""
    from resilient_training.gates.export import ExportUsageError, export

    dest = tmp_path / "dest"
    promote(gated_run / CKPT, str(dest))
    (dest / "sub").mkdir()  # (then removed: the promotion's no-op takes no stranger)
    for fmt, out in (("dcp", dest / "inner"), ("safetensors", dest / "sub" / "model.safetensors"),
                     ("torch", dest / "model.safetensors")):
        with pytest.raises(ExportUsageError, match="lies inside the promoted model"):
            export(gated_run, fmt=fmt, out=out)
    (dest / "sub").rmdir()
    export(gated_run, fmt="safetensors", out=dest / "model.safetensors")  # the name promotion expects
    assert promote(gated_run / CKPT, str(dest))["already_promoted"] is True


def test_a_run_validation_failed_on_another_checkpoint_says_so(gated_run: Path, tmp_path: Path) -> None:
    """Found by a stranger trial: after `validate --all` failed on step_10 only, the refusal said
    step_20 "did not pass validation" while quoting step_10's finding."""
    path = gated_run / "gates/validation.json"
    record = json.loads(path.read_text())
    record["passed"] = False
    record["findings"] = ["checksum_mismatch: checkpoints/step_2/__0_0.distcp"]
    path.write_text(json.dumps(record))
    with pytest.raises(PromotionRefused, match=r"failed elsewhere in the run \(checksum_mismatch: checkpoints/step_2"
                                               r".*although checkpoints/step_4 itself was valid: validate it alone"):
        promote(gated_run, str(tmp_path / "dest"))


def test_a_dest_inside_another_run_is_refused(gated_run: Path, other_gated_run: Path, tmp_path: Path) -> None:
    """Stranger trial: `promote SRC OTHER_RUN/checkpoints/step_50` wrote a "committed" step into another run."""
    from tests.support.gates import copy_run

    other = copy_run(other_gated_run, tmp_path / "other")
    for dest in (other / "checkpoints" / "step_50", other / "models"):
        with pytest.raises(PromotionUsageError, match=f"lies inside the run {other}"):
            promote(gated_run / CKPT, str(dest))
        assert not dest.exists()


@pytest.mark.parametrize("dest", ["{run_id}/../shared", "models/{run_id}/../../x", "s3://models/{run_id}/../x"])
def test_dot_dot_after_run_id_is_refused(gated_run: Path, tmp_path: Path, dest: str) -> None:
    """Stranger trial: `--promote-to '{run_id}/../x'` promoted to ./x, one place for every run."""
    target = dest if dest.startswith("s3://") else str(tmp_path / dest)
    with pytest.raises(PromotionUsageError, match=r"'\.\.' after \{run_id\}"):
        promote(gated_run / CKPT, target)


# --------------------------------------------------------------------------- a stranger trial: S3 endpoints


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """Credentials from the environment only (no config file, no instance metadata)."""
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_an_s3_endpoint_that_never_answers_fails_in_bounded_time_in_one_line(
        gated_run: Path, aws_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A stranger trial: an endpoint that accepts connections and never replies hung `promote` for 181 s
    (botocore's 60 s reads, retried), then crashed in _s3_code on an error without a response."""
    import socket
    import threading

    from resilient_training.cli.main import main
    from resilient_training.gates import promote as promote_mod

    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(silent.accept()[0])  # kept open, never answered

    threading.Thread(target=accept, daemon=True).start()
    aws_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    aws_env.setattr(promote_mod, "S3_READ_TIMEOUT_S", 1.0, raising=False)  # the defaults are tens of seconds
    started = time.monotonic()
    try:
        code = main(["promote", str(gated_run), "s3://models/x"])
    finally:
        silent.close()
        for conn in held:
            conn.close()
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "S3 did not answer for s3://models/x (ReadTimeoutError: Read timeout" in err, err
    assert "nothing was written" in err, err
    assert time.monotonic() - started < 30
    assert len(held) == promote_mod.S3_MAX_ATTEMPTS  # retried, a bounded number of times


@pytest.mark.parametrize("endpoint", ["not a url", "ftp://127.0.0.1:9"])
def test_an_invalid_aws_endpoint_url_is_a_usage_error_naming_it(
        gated_run: Path, aws_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], endpoint: str) -> None:
    """A stranger trial: AWS_ENDPOINT_URL='not a url' was a ValueError traceback."""
    from resilient_training.cli.main import main

    aws_env.setenv("AWS_ENDPOINT_URL", endpoint)
    code = main(["promote", str(gated_run), "s3://models/x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"AWS_ENDPOINT_URL {endpoint!r}" in err and "not an http(s) URL" in err, err


def test_s3_code_of_an_error_without_a_response() -> None:
    """A stranger trial's crash: a timeout carries ``response = None``; boto3's upload_file wraps the service's error."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError, ReadTimeoutError

    from resilient_training.gates.promote import _s3_code

    try:
        try:
            raise TimeoutError("timed out")
        except TimeoutError:  # as botocore raises it: while handling urllib3's timeout
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:9") from None
    except ReadTimeoutError as timeout:
        assert _s3_code(timeout) == "ReadTimeoutError"
    try:
        try:
            raise ClientError({"Error": {"Code": "SlowDown"}}, "PutObject")
        except ClientError as exc:
            raise S3UploadFailedError(f"Failed to upload: {exc}") from None  # as boto3's upload_file: no cause
    except S3UploadFailedError as wrapped:
        assert _s3_code(wrapped) == "SlowDown"


class _UploadThrottled:
    """An S3 client whose upload_file fails as boto3's does when S3 refuses it: S3UploadFailedError."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def upload_file(self, *args: Any, **kwargs: Any) -> Any:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import ClientError

        try:
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                               "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
        except ClientError as exc:
            raise S3UploadFailedError(f"Failed to upload {args[0]}: {exc}") from None


def test_an_upload_refused_by_s3_is_a_failure_midway_not_a_traceback(gated_run: Path, s3: Any) -> None:
    with pytest.raises(PromotionRefused, match=r"failed midway \(SlowDown: .*nothing was committed"):
        promote(gated_run / CKPT, "s3://models/m", s3_client=_UploadThrottled(s3))
    assert keys(s3) == []  # the lock released, nothing else uploaded


@pytest.mark.parametrize("dest", ["s3://models/x/{run_id}", "s3://models/{run_id}", "s3://models/x/",
                                  "s3://models", "s3://my.models-1/a/b", "s3://models/" + "p" * 850 + "/{run_id}",
                                  "./s3:models", "s3://my-ap-abc123-s3alias/x", "s3://my-ap--ol-s3/x"])
def test_dests_that_must_stay_accepted(dest: str) -> None:
    """What the stricter checks (bucket naming rules, '//', the key length) must keep: {run_id} fields too."""
    from resilient_training.gates.promote import check_dest_text

    assert check_dest_text(dest) == dest


@pytest.mark.parametrize(("dest", "why"), [
    ("s3://models//x", "empty, '.' or '..' part"), ("s3://models/x//y", "empty, '.' or '..' part"),
    ("s3://models//", "empty, '.' or '..' part"), ("s3://10.0.0.1/x", "an IP address"),
    ("s3://a..b/x", "two adjacent periods"), ("s3://xn--abc/x", "begins with 'xn--'"),
    ("s3://sthree-abc/x", "begins with 'sthree-'"), ("s3://Models/x", "names no valid bucket"),
    ("s3://models/" + "p" * 890 + "/{run_id}", "S3 keys are at most 1024 bytes"),
    ("s3:/models/x", "is not an s3://bucket/prefix URL"), ("s3:models", "is not an s3://bucket/prefix URL"),
    ("S3:/models/x", "is not an s3://bucket/prefix URL"),
])
def test_s3_dests_s3_would_refuse_are_usage_errors(dest: str, why: str) -> None:
    from resilient_training.gates.promote import check_dest_text

    with pytest.raises(PromotionUsageError, match=re.escape(why)):
        check_dest_text(dest)


def test_a_checkpoint_removed_while_it_is_copied_is_one_refusal(gated_run: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A fourth stranger trial removed the step mid-copy (as a resume's pruning would): a traceback."""
    import shutil

    from resilient_training.gates import promote as pm

    copy = pm._copy_hashing

    def pruned(src: Path, dst: Path) -> Any:
        shutil.rmtree(gated_run / CKPT, ignore_errors=True)
        return copy(src, dst)

    monkeypatch.setattr(pm, "_copy_hashing", pruned)
    dest = tmp_path / "dest"
    with pytest.raises(PromotionRefused, match=r"changed while it was copied \(.* is gone\): nothing was promoted"):
        promote(gated_run / CKPT, str(dest))
    assert not dest.exists() and not list(tmp_path.glob(".tmp-promote-*"))


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_destination_lock_that_is_no_regular_file_is_named(gated_run: Path, tmp_path: Path, kind: str) -> None:
    """A fourth stranger trial's re-trial: a FIFO there was a traceback; a directory or link said only
    "cannot write to PARENT", so every retry failed the same way with no way out given."""
    lock = tmp_path / ".tmp-promote-dest.lock"
    {"fifo": lambda: os.mkfifo(lock), "directory": lock.mkdir,
     "symlink": lambda: lock.symlink_to(tmp_path / "elsewhere")}[kind]()
    with pytest.raises(PromotionUsageError, match=re.escape(f"{lock} is not a regular file: it is the lock of "
                                                            "promotions and exports to") + ".*remove it"):
        promote(gated_run / CKPT, str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists() and not (tmp_path / "elsewhere").exists()


class _ServerError(_UploadThrottled):
    """An S3 endpoint that answers 501 (Not Implemented) to HEAD: an answer, a server error."""

    def head_bucket(self, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        raise ClientError({"Error": {"Code": "501", "Message": "Not Implemented"},
                           "ResponseMetadata": {"HTTPStatusCode": 501}}, "HeadBucket")


def test_a_server_error_is_said_to_be_one_not_silence(gated_run: Path, s3: Any) -> None:
    """A fourth stranger trial's re-trial: a 501 was "S3 did not answer"."""
    with pytest.raises(PromotionRefused, match=r"S3 answered with a server error for s3://models/m \(501: "):
        promote(gated_run / CKPT, "s3://models/m", s3_client=_ServerError(s3))
    assert keys(s3) == []


def _plant_gated_step_of(source: Path, other: Path, tmp_path: Path, how: str) -> Path:
    """The stranger's attack: a copy of run ``other`` given ``source``'s gated step_4 and its gate
    records, nothing forged ("as-found"); then with ``other``'s event log logging the planted
    manifest's commit as well ("commit-logged-too": only the run_uid tells), or with ``source``'s
    ``run_uid`` file copied along ("run_uid-copied-too": only the event log tells).
    """
    import shutil

    from tests.support.gates import copy_run, forge_commit_record

    run = copy_run(other, tmp_path / "b1")
    shutil.rmtree(run / CKPT)
    shutil.rmtree(run / "gates")
    shutil.copytree(source / CKPT, run / CKPT)
    (run / "gates").mkdir()
    for record in (source / "gates").glob("*.json"):
        shutil.copy(record, run / "gates")
    if how == "commit-logged-too":
        forge_commit_record(run / CKPT)
    elif how == "run_uid-copied-too":
        shutil.copy(source / cf.RUN_UID_FILENAME, run / cf.RUN_UID_FILENAME)
    return run


@pytest.mark.parametrize(("how", "said", "found"), [
    ("as-found", "was saved by another run (run uid", "this is not the checkpoint the run saved"),
    ("commit-logged-too", "was saved by another run (run uid", "the checkpoint was saved by another run (run uid"),
    ("run_uid-copied-too", "is not the checkpoint this run committed at step 4 (the run's event log records another",
     "this is not the checkpoint the run saved"),
])
def test_another_runs_gated_checkpoint_copied_in_with_its_gate_records_is_refused(
        gated_run: Path, other_gated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        how: str, said: str, found: str) -> None:
    """Found by a stranger trial: `cp -a runB b1`, runA's gated step_30 and runA's gate records copied
    into b1, nothing forged: `promote b1 DEST` promoted it (exit 0) and `validate-checkpoint DEST` said
    VALID, while validate-checkpoint b1 said not_committed_by_run and check-convergence b1 FAILED. The
    records name the manifest by its digest, which the copy keeps: promote now requires the
    checkpoint to be the run's own (its run_uid, its commit in the run's event log), as train does."""
    from resilient_training.cli.main import main
    from resilient_training.gates.export import ExportRefused, export

    run = _plant_gated_step_of(gated_run, other_gated_run, tmp_path, how)
    dest = tmp_path / "dest_b1"
    assert main(["promote", str(run), str(dest)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("refused: checkpoints/step_4 ") and said in err and err.count("\n") == 1, err
    assert "the gate records naming its manifest were not made for a checkpoint of this run" in err, err
    assert not dest.exists() and not list(tmp_path.glob(".tmp-promote-*"))
    with pytest.raises(ExportRefused, match=re.escape(said)):  # export trusts the validation record alike
        export(run, fmt="dcp", out=tmp_path / "exported")
    findings = validate(run, load=False).all_findings  # and validation of the run says why, once
    assert [(f.code, f.file) for f in findings] == [("not_committed_by_run", "checkpoints/step_4/manifest.json")]
    assert found in findings[0].message, findings[0].message
    assert promote(gated_run, str(tmp_path / "dest_a"))["already_promoted"] is False  # in its own run: promoted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["gates/convergence.json", "gates/validation.json", f"{CKPT}/manifest.json",
                                   "run_uid", f"{CKPT}/__0_0.distcp"])
def test_a_fifo_among_what_promote_reads_is_refused_in_one_line_not_waited_on(
        gated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    """Found by a stranger trial: a FIFO as RUN/gates/convergence.json made promote hang forever.
    Every file promote reads is opened without waiting and must be a regular file. (A shard swapped
    for a FIFO after validation: its record still passes, the copy refuses it.)"""
    from resilient_training.cli.main import main

    target = gated_run / where
    target.unlink()
    os.mkfifo(target)
    dest = tmp_path / "dest"
    assert main(["promote", str(gated_run / CKPT), str(dest)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("refused: ") and "not a regular file (a FIFO, socket or device)" in err, err
    assert err.count("\n") == 1 and where in err, err
    assert not dest.exists() and not list(tmp_path.glob(".tmp-promote-*"))


def test_a_record_with_an_integer_past_python_s_digit_limit_is_refused_in_one_line(gated_run: Path,
                                                                                   tmp_path: Path) -> None:
    """An integer of more than 4300 digits in a gate record (or manifest) is a ValueError that is no
    JSONDecodeError: it was a traceback."""
    path = gated_run / "gates" / "convergence.json"
    path.write_text(path.read_text().replace('"passed": true', '"passed": ' + "1" * 5000, 1))
    with pytest.raises(PromotionRefused, match="convergence.json is not valid JSON: Exceeds the limit"):
        promote(gated_run, str(tmp_path / "dest"))


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_validated_file_is_refused_by_export_not_waited_on(gated_run: Path,
                                                                                tmp_path: Path) -> None:
    """As promote's (stranger trial): export re-reads every file before exporting; a FIFO put in
    place of one after validation is refused in one line, never waited on."""
    from resilient_training.gates.export import ExportRefused, export

    (gated_run / CKPT / "__1_0.distcp").unlink()
    os.mkfifo(gated_run / CKPT / "__1_0.distcp")
    out = tmp_path / "m.safetensors"
    with pytest.raises(ExportRefused, match=r"__1_0\.distcp is not a regular file \(a FIFO, socket or device\)"):
        export(gated_run, fmt="safetensors", out=out)
    assert not out.exists() and not list(tmp_path.glob(".tmp-export-*"))
