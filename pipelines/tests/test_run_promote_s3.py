"""`run --promote-to s3://bucket/prefix/{run_id}` promotes to S3 (a moto server the pipeline's steps share)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_training.run import checkpoint_format as cf
from tests.support.s3_server import keys, moto_s3_server


@pytest.mark.slow
def test_run_promotes_to_s3_and_writes_no_local_s3_directory(tmp_path: Path) -> None:
    with moto_s3_server("models") as (env, client):
        proc = subprocess.run(
            [sys.executable, "-m", "resilient_training.cli", "run", "--output-dir", "out", "--steps", "16",
             "--checkpoint-every", "8", "--faults", "", "--train-overrides", '{"lr": 0.02}',
             "--promote-to", "s3://models/nightly/{run_id}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run_dir = Path(proc.stdout.split("run directory:")[1].split()[0])
        # {run_id}: the pipeline run's id, which names its run directory; the summary says where it went.
        v1 = f"nightly/{run_dir.name}"
        assert f"promoted model:     s3://models/{v1}\n" in proc.stdout
        source = cf.read_latest(run_dir / "checkpoints")
        manifest = cf.read_manifest(source)
        assert keys(client, "models") == sorted(
            f"{v1}/{name}" for name in [*manifest["files"], "manifest.json", "promotion.json"])
        for name, entry in manifest["files"].items():
            head = client.head_object(Bucket="models", Key=f"{v1}/{name}", ChecksumMode="ENABLED")
            assert head["ContentLength"] == entry["bytes"] and head["Metadata"]["xxh3-128"] == entry["checksum"]
            assert head["ChecksumCRC32"]
        record = json.loads(client.get_object(Bucket="models", Key=f"{v1}/promotion.json")["Body"].read())
        assert record["source"]["step"] == 16 and record["validation"]["full_check"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no directory named 's3:' anywhere
    assert not list(tmp_path.rglob("s3:*"))
