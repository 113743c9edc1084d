"""Gated promotion: copy a checkpoint that passed both gates of its run to a directory or S3.

Refuses unless ``RUN/gates/validation.json`` and ``RUN/gates/convergence.json`` both passed and
both name this checkpoint by the digest of its current ``manifest.json``; while copying,
every file is checksummed again against the manifest, so damage after validation is caught.

The promoted model is the checkpoint's files (a DCP directory with its ``manifest.json``) and ``DEST/promotion.json``
(the record of both gates and the source). Atomic and idempotent:

- local: files are written and fsynced into ``.tmp-promote-<name>-<pid>`` beside DEST, which
  is renamed to DEST in one step; a crash leaves only the hidden staging directory (removed by
  the next attempt), never a DEST that looks complete;
- S3: shards, then the manifest, then ``promotion.json`` last; ``promotion.json`` is the
  commit marker (as the manifest is for checkpoints): a prefix without it is not promoted,
  and a retry overwrites whatever a crashed attempt left;
- a second call for the same checkpoint finds DEST's ``promotion.json`` naming the same
  manifest digest and does nothing; DEST holding anything else is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from resilient_training.run import checkpoint_format as cf
from resilient_training.run import gate_records, layout

PROMOTION_NAME = "promotion.json"
STAGING_PREFIX = ".tmp-promote-"


class PromotionUsageError(ValueError):
    """The checkpoint or destination cannot be used as given (exit code 2); nothing was changed."""


class PromotionRefused(RuntimeError):
    """The checkpoint did not pass both gates of its run, or changed since (exit code 1)."""


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A step directory, or a run's latest checkpoint."""
    path = Path(path)
    if not path.exists():
        raise PromotionUsageError(f"{path} does not exist")
    if not path.is_dir():
        raise PromotionUsageError(f"{path} is not a directory")
    if (path / layout.CHECKPOINTS_DIRNAME).is_dir():
        try:
            latest = cf.read_latest(layout.checkpoints_dir(path))
        except cf.CheckpointError as exc:
            raise PromotionRefused(str(exc)) from None
        if latest is None:
            raise PromotionRefused(f"{path} has no committed checkpoint")
        return latest
    if (path / cf.MANIFEST_NAME).exists() or cf.parse_step_dirname(path.name) is not None:
        return path
    raise PromotionUsageError(f"{path} is neither a checkpoint (no {cf.MANIFEST_NAME}) nor a run (no checkpoints/)")


def check_validated(ckpt_dir: Path) -> dict[str, Any]:
    """Prove ``ckpt_dir`` passed validation in its run and is unchanged since (by its manifest digest).

    Returns what promotion and export record: ``source`` (run, checkpoint, step, digest), the
    ``validation`` record, the ``manifest`` and its ``files``. Raises PromotionRefused otherwise.
    """
    run_dir = gate_records.run_dir_of(ckpt_dir)
    if run_dir is None:
        raise PromotionRefused(f"{ckpt_dir} is not inside a run (RUN/checkpoints/step_N): it cannot have been gated")
    try:
        manifest = cf.read_manifest(ckpt_dir)
        digest = gate_records.manifest_digest(ckpt_dir)
        validation = gate_records.read_record(run_dir, gate_records.VALIDATION)
    except cf.CheckpointError as exc:
        raise PromotionRefused(str(exc)) from None
    rel = os.path.relpath(ckpt_dir.resolve(), run_dir.resolve())
    if validation is None:
        raise PromotionRefused(f"{rel} was never validated in {run_dir} (run validate-checkpoint first)")
    checkpoints = validation.get("checkpoints") if isinstance(validation, dict) else None
    entry = checkpoints.get(rel) if isinstance(checkpoints, dict) else None
    if validation.get("passed") is not True or not isinstance(entry, dict) or entry.get("valid") is not True:
        findings = validation.get("findings")
        why = "; ".join(map(str, findings[:3])) if isinstance(findings, list) and findings else \
            f"{rel} is not among the validated checkpoints"
        raise PromotionRefused(f"{rel} did not pass validation: {why}")
    if entry.get("manifest_checksum") != digest:
        raise PromotionRefused(f"{rel} changed since it was validated (manifest digest {digest}, validated "
                               f"{entry.get('manifest_checksum')})")
    return {
        "source": {"run_dir": str(run_dir), "checkpoint": rel, "step": manifest.get("step"),
                   "run_id": manifest.get("run_id"), "manifest_checksum": digest},
        "validation": validation,
        "manifest": manifest,
        "files": manifest["files"],
    }


def check_gates(ckpt_dir: Path) -> dict[str, Any]:
    """The records proving ``ckpt_dir`` passed validation and the convergence gate of its run."""
    validated = check_validated(ckpt_dir)
    run_dir, rel = Path(validated["source"]["run_dir"]), validated["source"]["checkpoint"]
    digest = validated["source"]["manifest_checksum"]
    try:
        convergence = gate_records.read_record(run_dir, gate_records.CONVERGENCE)
    except cf.CheckpointError as exc:
        raise PromotionRefused(str(exc)) from None
    if convergence is None:
        raise PromotionRefused(f"the convergence gate never ran in {run_dir} (run check-convergence first)")
    if not convergence.get("passed"):
        failed = [f"{n}: {c['reason']}" for n, c in convergence.get("checks", {}).items() if not c.get("passed")]
        raise PromotionRefused(f"the convergence gate failed: {'; '.join(failed)}")
    if convergence.get("manifest_checksum") != digest:
        raise PromotionRefused(f"the convergence gate judged {convergence.get('checkpoint')} "
                               f"(step {convergence.get('step')}), not {rel}")
    return {
        "source": validated["source"],
        "validation": validated["validation"],
        "convergence": convergence,
        "files": validated["files"],
    }


def promote(checkpoint: str | os.PathLike[str], dest: str, *, s3_client: Any = None) -> dict[str, Any]:
    """Copy a gated checkpoint to ``dest`` (directory or ``s3://bucket/prefix``); see the module doc."""
    if not str(dest).strip():
        raise PromotionUsageError("DEST is empty")
    ckpt_dir = resolve_checkpoint(checkpoint)
    record = check_gates(ckpt_dir)
    record["promoted_at"] = time.time()
    if str(dest).startswith("s3://"):
        outcome = _promote_s3(ckpt_dir, str(dest), record, s3_client)
    else:
        outcome = _promote_local(ckpt_dir, Path(dest), record)
    size = sum(int(e["bytes"]) for e in record["files"].values())
    return {"dest": str(dest), "step": record["source"]["step"], "bytes": size, **outcome}


def _files_to_copy(record: dict[str, Any]) -> list[str]:
    return sorted(record["files"]) + [cf.MANIFEST_NAME]


def _verify(name: str, size: int, digest: str, record: dict[str, Any], ckpt_dir: Path) -> None:
    if name == cf.MANIFEST_NAME:
        if digest != record["source"]["manifest_checksum"]:
            raise PromotionRefused(f"{ckpt_dir / name} changed while being promoted")
        return
    entry = record["files"][name]
    if size != entry["bytes"] or digest != entry["checksum"]:
        raise PromotionRefused(f"{ckpt_dir / name} no longer matches its manifest ({size} bytes, {digest}; manifest "
                               f"{entry['bytes']} bytes, {entry['checksum']}): damaged after validation")


def _copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy with large reads, hashing what is written, then fsync."""
    hasher = cf.new_hasher()  # xxh3_128: the manifest's files and the manifest digest alike
    size = 0
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while block := fin.read(16 << 20):
            hasher.update(block)
            view = memoryview(block)
            while view:  # a raw write may write less (e.g. at a file size limit): never drop the rest
                view = view[fout.write(view):]
            size += len(block)
        os.fsync(fout.fileno())
        landed = os.fstat(fout.fileno()).st_size
    if landed != size:
        raise OSError(f"{dst} holds {landed} bytes after copying {size}")
    return size, hasher.hexdigest()


def _existing_promotion(record_text: str | None, record: dict[str, Any], where: str) -> bool:
    """True when ``where`` already holds this very checkpoint; refuses when it holds another."""
    if record_text is None:
        return False
    try:
        existing = json.loads(record_text)
        same = existing["source"]["manifest_checksum"] == record["source"]["manifest_checksum"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise PromotionRefused(f"{where} holds an unreadable {PROMOTION_NAME}: refusing to overwrite it") from None
    if not same:
        raise PromotionRefused(f"{where} already holds another promoted model (step {existing['source'].get('step')} "
                               f"of {existing['source'].get('run_dir')}); choose another DEST")
    return True


def _promote_local(ckpt_dir: Path, dest: Path, record: dict[str, Any]) -> dict[str, Any]:
    marker = dest / PROMOTION_NAME
    if _existing_promotion(marker.read_text() if marker.is_file() else None, record, str(dest)):
        return {"already_promoted": True, "files": _files_to_copy(record) + [PROMOTION_NAME]}
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PromotionRefused(f"{dest} exists and is not an empty directory: refusing to overwrite it")
    parent = dest.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f"{STAGING_PREFIX}{dest.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed attempt: never visible as DEST
        staging = parent / f"{STAGING_PREFIX}{dest.name}-{os.getpid()}"
        staging.mkdir()
    except OSError as exc:
        raise PromotionUsageError(f"cannot write to {parent}: {exc.strerror or exc}") from None
    try:
        for name in _files_to_copy(record):
            size, digest = _copy_hashing(ckpt_dir / name, staging / name)
            _verify(name, size, digest, record, ckpt_dir)
        (staging / PROMOTION_NAME).write_text(json.dumps(record, indent=1, sort_keys=True, allow_nan=True))
        with open(staging / PROMOTION_NAME, "rb") as handle:
            os.fsync(handle.fileno())
        cf.fsync_dir(staging)
        staging.rename(dest)  # atomic: DEST appears complete or not at all
        cf.fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"already_promoted": False, "files": _files_to_copy(record) + [PROMOTION_NAME]}


def parse_s3(url: str) -> tuple[str, str]:
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise PromotionUsageError(f"{url} names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def _promote_s3(ckpt_dir: Path, url: str, record: dict[str, Any], client: Any) -> dict[str, Any]:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_s3(url)
    client = client or boto3.client("s3")

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    def usage(exc: Exception) -> PromotionUsageError:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
        hint = {"404": "no such bucket", "NoSuchBucket": "no such bucket", "403": "permission denied",
                "AccessDenied": "permission denied"}.get(str(code), str(code))
        return PromotionUsageError(f"cannot write to {url}: {hint} ({exc})")

    try:
        client.head_bucket(Bucket=bucket)
        try:
            body = client.get_object(Bucket=bucket, Key=key(PROMOTION_NAME))["Body"].read().decode()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404"):
                raise
            body = None
    except (ClientError, BotoCoreError) as exc:
        raise usage(exc) from None
    if _existing_promotion(body, record, url):
        return {"already_promoted": True, "files": _files_to_copy(record) + [PROMOTION_NAME]}
    # Verify every byte against the manifest before anything lands (a reread of cached pages).
    for name in _files_to_copy(record):
        size, digest = cf.checksum_file(ckpt_dir / name)
        _verify(name, size, digest, record, ckpt_dir)
    try:
        for name in _files_to_copy(record):  # shards first, manifest after them
            checksum = record["source"]["manifest_checksum"] if name == cf.MANIFEST_NAME \
                else record["files"][name]["checksum"]
            client.upload_file(str(ckpt_dir / name), bucket, key(name),
                               ExtraArgs={"Metadata": {"xxh3-128": checksum}})
        client.put_object(Bucket=bucket, Key=key(PROMOTION_NAME),  # last: the commit marker
                          Body=json.dumps(record, indent=1, sort_keys=True, allow_nan=True).encode(),
                          ContentType="application/json")
    except (ClientError, BotoCoreError) as exc:
        raise usage(exc) from None
    return {"already_promoted": False, "files": _files_to_copy(record) + [PROMOTION_NAME]}


def read_promotion(dest: str, *, s3_client: Any = None) -> dict[str, Any] | None:
    """The promotion record at ``dest``, or None when nothing (complete) was promoted there."""
    if dest.startswith("s3://"):
        import boto3
        from botocore.exceptions import ClientError

        bucket, prefix = parse_s3(dest)
        client = s3_client or boto3.client("s3")
        try:
            body = client.get_object(Bucket=bucket, Key=f"{prefix}/{PROMOTION_NAME}" if prefix else PROMOTION_NAME)
        except ClientError:
            return None
        return json.loads(body["Body"].read())
    marker = Path(dest) / PROMOTION_NAME
    return json.loads(marker.read_text()) if marker.is_file() else None
