"""Promotion holes an adversary would try: racing promoters (real processes, directory and S3),
a marker without the model behind it, DEST inside the run, a half-validated checkpoint."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from resilient_training.cli.main import main
from resilient_training.gates import promote as promote_mod
from resilient_training.gates.promote import PROMOTION_NAME, S3_LOCK_NAME, PromotionRefused, PromotionUsageError, promote
from resilient_training.gates.validate import validate, write_validation_record
from resilient_training.run import checkpoint_format as cf
from resilient_training.run import gate_records
from tests.support.s3_server import keys, moto_s3_server

CKPT = "checkpoints/step_4"


def promote_cmd(source: Path, dest: str) -> list[str]:
    return [sys.executable, "-m", "resilient_training.cli", "promote", str(source), dest]


def latest(run: Path) -> Path:
    return cf.read_latest(run / "checkpoints")


def assert_local_copy_of(dest: Path, run: Path) -> None:
    """DEST holds exactly the run's latest checkpoint, byte for byte, under its marker."""
    source = latest(run)
    manifest = cf.read_manifest(source)
    assert (dest / "manifest.json").read_bytes() == (source / "manifest.json").read_bytes()
    for name, entry in manifest["files"].items():
        assert cf.checksum_file(dest / name) == (entry["bytes"], entry["checksum"])
    marker = json.loads((dest / PROMOTION_NAME).read_text())
    assert marker["source"]["manifest_checksum"] == gate_records.manifest_digest(source)
    assert sorted(p.name for p in dest.iterdir()) == sorted([*manifest["files"], "manifest.json", PROMOTION_NAME])


# --------------------------------------------------------------------------- item 5: what was checked


def test_no_load_validation_is_recorded_as_partial_and_promotion_refuses_it(
        gated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate-checkpoint", "--no-load", str(gated_run)]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED load into a freshly built model (--no-load)" in out
    record = gate_records.read_record(gated_run, "validation")
    entry = record["checkpoints"][CKPT]
    assert record["passed"] is True and record["full_check"] is False
    assert entry["full_check"] is False and entry["skipped"] == ["load into a freshly built model (--no-load)"]
    assert "sizes and checksums" in " ".join(entry["checks"])
    assert main(["validate-checkpoint", "--no-load", "--json", "--no-record", str(gated_run)]) == 0
    (checked,) = json.loads(capsys.readouterr().out)["checkpoints"]
    assert checked["full_check"] is False and checked["skipped"] == entry["skipped"]
    assert main(["promote", str(gated_run), str(tmp_path / "dest")]) == 1
    err = capsys.readouterr().err
    assert "not fully validated" in err and "--no-load" in err and err.count("\n") == 1
    assert not (tmp_path / "dest").exists()
    assert main(["validate-checkpoint", str(gated_run)]) == 0  # the full check: now it promotes
    entry = gate_records.read_record(gated_run, "validation")["checkpoints"][CKPT]
    assert entry["full_check"] is True and entry["skipped"] == []
    assert any("loads strictly" in c for c in entry["checks"])
    assert main(["promote", str(gated_run), str(tmp_path / "dest")]) == 0


def test_a_record_that_does_not_say_what_was_checked_is_not_enough(gated_run: Path, tmp_path: Path) -> None:
    path = gated_run / "gates/validation.json"
    record = json.loads(path.read_text())
    for entry in record["checkpoints"].values():  # as written before records stated their checks
        for key in ("checks", "skipped", "full_check"):
            entry.pop(key)
    path.write_text(json.dumps(record))
    with pytest.raises(PromotionRefused, match="record does not say every check ran"):
        promote(gated_run, str(tmp_path / "dest"))


# --------------------------------------------------------------------------- item 4: re-promotion verifies


@pytest.mark.parametrize("damage", ["flip-a-byte", "delete-a-file", "only-the-marker", "extra-file", "swap-files",
                                    "links-to-the-source"])
def test_repromotion_verifies_the_content_not_the_marker(gated_run: Path, tmp_path: Path, damage: str) -> None:
    dest = tmp_path / "dest"
    promote(gated_run, str(dest))
    files = sorted(cf.read_manifest(dest)["files"])
    if damage == "flip-a-byte":
        data = bytearray((dest / files[-1]).read_bytes())
        data[len(data) // 2] ^= 1
        (dest / files[-1]).write_bytes(bytes(data))
    elif damage == "delete-a-file":
        (dest / files[0]).unlink()
    elif damage == "only-the-marker":
        marker = (dest / PROMOTION_NAME).read_bytes()
        shutil.rmtree(dest)
        dest.mkdir()
        (dest / PROMOTION_NAME).write_bytes(marker)
    elif damage == "extra-file":
        (dest / "payload.pt").write_bytes(b"not from this checkpoint")
    elif damage == "links-to-the-source":  # right bytes today, whatever the source holds tomorrow
        for name in files:
            (dest / name).unlink()
            (dest / name).symlink_to(latest(gated_run) / name)
    else:  # same names and sizes, contents exchanged: only checksums tell
        a, b = (dest / files[0]).read_bytes(), (dest / files[1]).read_bytes()
        (dest / files[0]).write_bytes(b)
        (dest / files[1]).write_bytes(a)
    before = {p.name: (p.is_symlink(), p.read_bytes()) for p in dest.iterdir()}
    with pytest.raises(PromotionRefused, match="marked as this checkpoint's promotion but"):
        promote(gated_run, str(dest))
    assert {p.name: (p.is_symlink(), p.read_bytes()) for p in dest.iterdir()} == before  # refused, not "repaired"


def test_a_symlink_planted_at_the_lock_name_is_not_followed(gated_run: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / ".tmp-promote-dest.lock").symlink_to(victim)
    with pytest.raises(PromotionUsageError, match="is not a regular file: it is the lock of promotions and exports"):
        promote(gated_run, str(tmp_path / "dest"))
    assert victim.read_text() == "precious" and not (tmp_path / "dest").exists()


# --------------------------------------------------------------------------- item 4: DEST inside the run


@pytest.mark.parametrize("where", ["checkpoints/step_4/model", "gates/model", "", "checkpoints", "..", "via-symlink"])
def test_dest_inside_or_containing_the_source_run_is_refused(gated_run: Path, tmp_path: Path, where: str) -> None:
    if where == "via-symlink":
        (tmp_path / "link").symlink_to(gated_run / "checkpoints")
        dest = str(tmp_path / "link" / "model")
    else:
        dest = str(gated_run / where) if where else str(gated_run)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(PromotionUsageError, match="the source run"):
        promote(gated_run / CKPT, dest)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


# --------------------------------------------------------------------------- item 2: racing promoters, directory


def test_racing_directory_promoters_one_wins_the_other_exits_1(big_gated_run: Path, other_gated_run: Path,
                                                             tmp_path: Path) -> None:
    """A promoter frozen mid-copy holds DEST: a second one is refused at once and writes nothing."""
    dest = tmp_path / "dest"
    first = subprocess.Popen(promote_cmd(big_gated_run, str(dest)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".tmp-promote-dest-*/*")) and time.monotonic() < deadline:
        time.sleep(0.0005)
    first.send_signal(signal.SIGSTOP)  # a live promoter, mid-copy, holding the lock
    try:
        second = subprocess.run(promote_cmd(other_gated_run, str(dest)), capture_output=True, text=True, timeout=120)
        listing = sorted(p.name for p in tmp_path.iterdir())
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert second.returncode == 1, second.stderr
    assert "another promotion or export to" in second.stderr and "in progress" in second.stderr
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
    assert listing == sorted([".tmp-promote-dest.lock", f".tmp-promote-dest-{first.pid}"])  # nothing of the loser's
    assert first.returncode == 0, err
    assert_local_copy_of(dest, big_gated_run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]  # no lock file, no staging left


def test_promoters_started_together_leave_one_consistent_model(gated_run: Path, other_gated_run: Path,
                                                               tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    procs = {run: subprocess.Popen(promote_cmd(run, str(dest)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for run in (gated_run, other_gated_run)}
    results = {run: (proc.wait(timeout=120), proc.stderr.read()) for run, proc in procs.items()}
    assert sorted(code for code, _ in results.values()) == [0, 1], results
    (winner,) = [run for run, (code, _) in results.items() if code == 0]
    (loser_err,) = [err for code, err in results.values() if code == 1]
    assert "Traceback" not in loser_err and loser_err.count("\n") == 1
    assert "in progress" in loser_err or "another promoted model" in loser_err
    assert_local_copy_of(dest, winner)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "run"]  # run: gated_run's private copy


# --------------------------------------------------------------------------- item 2: racing promoters, S3


@pytest.fixture
def s3_server() -> Iterator[tuple[dict[str, str], Any]]:
    """A moto S3 server that real promoter processes share, with bucket 'models'."""
    with moto_s3_server("models") as (env, client):
        yield env, client


def s3_keys(client: Any) -> list[str]:
    return keys(client, "models")


def assert_s3_copy_of(client: Any, prefix: str, run: Path) -> None:
    source = latest(run)
    manifest = cf.read_manifest(source)
    assert s3_keys(client) == sorted(f"{prefix}/{n}" for n in [*manifest["files"], "manifest.json", PROMOTION_NAME])
    for name, entry in manifest["files"].items():
        head = client.head_object(Bucket="models", Key=f"{prefix}/{name}")
        assert (head["ContentLength"], head["Metadata"]["xxh3-128"]) == (entry["bytes"], entry["checksum"])
    body = client.get_object(Bucket="models", Key=f"{prefix}/manifest.json")["Body"].read()
    assert body == (source / "manifest.json").read_bytes()
    marker = json.loads(client.get_object(Bucket="models", Key=f"{prefix}/{PROMOTION_NAME}")["Body"].read())
    assert marker["source"]["manifest_checksum"] == gate_records.manifest_digest(source)


def test_racing_s3_promoters_one_wins_the_other_exits_1_and_uploads_nothing(
        big_gated_run: Path, other_gated_run: Path, s3_server: tuple[dict[str, str], Any]) -> None:
    env, client = s3_server
    url = "s3://models/gpt/v1"
    first = subprocess.Popen(promote_cmd(big_gated_run, url), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    deadline = time.monotonic() + 60
    while f"gpt/v1/{S3_LOCK_NAME}" not in s3_keys(client) and time.monotonic() < deadline:
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # a live promoter holding the lock
    try:
        # A request the first promoter sent before it stopped may still land on the server: wait until the
        # listing holds still, so that `before` is all the first promoter wrote (CI once saw .metadata land late).
        before, settled = s3_keys(client), 0
        while settled < 5:
            time.sleep(0.1)
            now = s3_keys(client)
            settled, before = (settled + 1, before) if now == before else (0, now)
        second = subprocess.run(promote_cmd(other_gated_run, url), capture_output=True, text=True, env=env,
                                timeout=120)
        after = s3_keys(client)
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=180)
    assert second.returncode == 1, second.stderr
    assert "holds its lock" in second.stderr and "uploaded nothing" in second.stderr
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
    assert after == before  # the loser uploaded nothing
    assert first.returncode == 0, err
    assert_s3_copy_of(client, "gpt/v1", big_gated_run)  # the lock is gone, every object is the winner's


def test_s3_promoters_started_together_leave_one_consistent_model(
        gated_run: Path, other_gated_run: Path, s3_server: tuple[dict[str, str], Any]) -> None:
    env, client = s3_server
    procs = {run: subprocess.Popen(promote_cmd(run, "s3://models/m"), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
             for run in (gated_run, other_gated_run)}
    results = {run: (proc.wait(timeout=120), proc.stderr.read()) for run, proc in procs.items()}
    assert sorted(code for code, _ in results.values()) == [0, 1], results
    (winner,) = [run for run, (code, _) in results.items() if code == 0]
    (loser_err,) = [err for code, err in results.values() if code == 1]
    assert "Traceback" not in loser_err and loser_err.count("\n") == 1
    assert_s3_copy_of(client, "m", winner)


# --------------------------------------------------------------------------- S3, in process (moto)


@pytest.fixture
def s3() -> Iterator[Any]:
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="models")
        yield client


def test_s3_stale_lock_of_another_checkpoint_refuses_and_of_the_same_is_taken_over(
        gated_run: Path, other_gated_run: Path, s3: Any) -> None:
    # A promoter of another checkpoint died holding the lock: refused, with the key to delete.
    other = {"manifest_checksum": gate_records.manifest_digest(latest(other_gated_run)), "step": 4,
             "run_dir": str(other_gated_run), "host": "elsewhere", "pid": 7, "since": "2026-01-01T00:00:00Z"}
    s3.put_object(Bucket="models", Key=f"m/{S3_LOCK_NAME}", Body=json.dumps(other).encode())
    with pytest.raises(PromotionRefused, match=f"delete s3://models/m/{S3_LOCK_NAME}"):
        promote(gated_run, "s3://models/m", s3_client=s3)
    assert s3_keys(s3) == [f"m/{S3_LOCK_NAME}"]
    # A promoter of this very checkpoint died holding it: its retry takes over and finishes.
    mine = {**other, "manifest_checksum": gate_records.manifest_digest(latest(gated_run))}
    s3.put_object(Bucket="models", Key=f"m/{S3_LOCK_NAME}", Body=json.dumps(mine).encode())
    shard = sorted(cf.read_manifest(latest(gated_run))["files"])[-1]  # a file the retry uploads again
    s3.put_object(Bucket="models", Key=f"m/{shard}", Body=b"half an upload")
    assert promote(gated_run, "s3://models/m", s3_client=s3)["already_promoted"] is False
    assert_s3_copy_of(s3, "m", gated_run)  # the taken-over lock was released: only the model is left


class _TakenOverMidway:
    """An S3 client during whose first upload a retry of the same checkpoint takes the lock over."""

    def __init__(self, client: Any, prefix: str, lock: dict[str, Any]) -> None:
        self._client, self._prefix, self._lock, self._done = client, prefix, lock, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def upload_file(self, *args: Any, **kwargs: Any) -> Any:
        if not self._done:
            self._done = True
            self._client.put_object(Bucket="models", Key=f"{self._prefix}/{S3_LOCK_NAME}",
                                    Body=json.dumps(self._lock).encode())
        return self._client.upload_file(*args, **kwargs)


def test_s3_a_promoter_releases_only_a_lock_still_its_own(gated_run: Path, s3: Any) -> None:
    retry = {"manifest_checksum": gate_records.manifest_digest(latest(gated_run)), "token": "the-retry's"}
    assert promote(gated_run, "s3://models/m", s3_client=_TakenOverMidway(s3, "m", retry))["already_promoted"] is False
    held = json.loads(s3.get_object(Bucket="models", Key=f"m/{S3_LOCK_NAME}")["Body"].read())
    assert held == retry  # left for the retry that holds it now, which deletes it when it ends
    assert promote(gated_run, "s3://models/m", s3_client=s3)["already_promoted"] is True


@pytest.mark.parametrize("damage", ["overwrite-a-file", "delete-a-file", "only-the-marker"])
def test_s3_repromotion_verifies_the_objects(gated_run: Path, s3: Any, damage: str) -> None:
    promote(gated_run, "s3://models/m", s3_client=s3)
    names = sorted(cf.read_manifest(latest(gated_run))["files"])
    if damage == "overwrite-a-file":  # same size and metadata, other bytes
        head = s3.head_object(Bucket="models", Key=f"m/{names[0]}")
        s3.put_object(Bucket="models", Key=f"m/{names[0]}", Body=b"\0" * head["ContentLength"],
                      Metadata=head["Metadata"], ChecksumAlgorithm="CRC32")
    elif damage == "delete-a-file":
        s3.delete_object(Bucket="models", Key=f"m/{names[-1]}")
    else:
        marker = s3.get_object(Bucket="models", Key=f"m/{PROMOTION_NAME}")["Body"].read()
        for key in s3_keys(s3):
            s3.delete_object(Bucket="models", Key=key)
        s3.put_object(Bucket="models", Key=f"other/{PROMOTION_NAME}", Body=marker)
        with pytest.raises(PromotionRefused, match="is missing"):
            promote(gated_run, "s3://models/other", s3_client=s3)
        return
    with pytest.raises(PromotionRefused, match="marked as this checkpoint's promotion"):
        promote(gated_run, "s3://models/m", s3_client=s3)


class _SourceChangesDuringUpload:
    """An S3 client whose upload of one file finds the file changed since it was verified."""

    def __init__(self, client: Any, victim: Path) -> None:
        self._client, self._victim = client, victim

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def upload_file(self, filename: str, *args: Any, **kwargs: Any) -> Any:
        if Path(filename) == self._victim:
            data = bytearray(self._victim.read_bytes())
            data[len(data) // 3] ^= 0xFF
            self._victim.write_bytes(bytes(data))
        return self._client.upload_file(filename, *args, **kwargs)


class _FailsOnSecondUpload:
    """An S3 client whose second upload is refused by the service (as when throttled or cut off)."""

    def __init__(self, client: Any) -> None:
        self._client, self._uploads = client, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def upload_file(self, *args: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        self._uploads += 1
        if self._uploads == 2:
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}},
                              "PutObject")
        return self._client.upload_file(*args, **kwargs)


def test_s3_a_failure_midway_commits_nothing_and_a_retry_completes(gated_run: Path, s3: Any) -> None:
    with pytest.raises(PromotionRefused, match="failed midway .*SlowDown.*nothing was committed"):
        promote(gated_run, "s3://models/m", s3_client=_FailsOnSecondUpload(s3))
    assert f"m/{PROMOTION_NAME}" not in s3_keys(s3) and f"m/{S3_LOCK_NAME}" not in s3_keys(s3)
    assert promote(gated_run, "s3://models/m", s3_client=s3)["already_promoted"] is False
    assert_s3_copy_of(s3, "m", gated_run)


def test_s3_objects_are_verified_by_their_s3_checksum_after_upload(gated_run: Path, s3: Any) -> None:
    victim = latest(gated_run) / sorted(cf.read_manifest(latest(gated_run))["files"])[-1]
    with pytest.raises(PromotionRefused, match="after upload"):
        promote(gated_run, "s3://models/m", s3_client=_SourceChangesDuringUpload(s3, victim))
    assert f"m/{PROMOTION_NAME}" not in s3_keys(s3) and f"m/{S3_LOCK_NAME}" not in s3_keys(s3)


def test_s3_multipart_objects_are_verified_by_their_composite_checksum(
        big_gated_run: Path, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(promote_mod, "S3_PART_BYTES", 5 << 20)  # S3's smallest part: every shard goes multipart
    assert promote(big_gated_run, "s3://models/big", s3_client=s3)["already_promoted"] is False
    files = cf.read_manifest(latest(big_gated_run))["files"]
    name = max(files, key=lambda n: files[n]["bytes"])  # the largest file: over one part
    head = s3.head_object(Bucket="models", Key=f"big/{name}", ChecksumMode="ENABLED")
    assert head["ETag"].rstrip('"').split("-")[-1].isdigit() and "-" in head["ETag"]  # multipart
    assert promote(big_gated_run, "s3://models/big", s3_client=s3)["already_promoted"] is True


def test_run_records_validation_with_no_load_then_cli_names_the_refusal(gated_run: Path, tmp_path: Path) -> None:
    write_validation_record(gated_run, validate(gated_run, load=False))
    proc = subprocess.run(promote_cmd(gated_run, str(tmp_path / "d")), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("refused: ") and "--no-load" in proc.stderr
