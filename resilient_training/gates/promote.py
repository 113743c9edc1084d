"""Gated promotion: copy a checkpoint that passed both gates of its run to a directory or S3.

Refuses unless ``RUN/gates/validation.json`` and ``RUN/gates/convergence.json`` both passed and
both name this checkpoint by the digest of its current ``manifest.json``, and the validation
record says the full check ran (``validate-checkpoint --no-load`` is not enough). While copying,
every file is checksummed again against the manifest, so damage after validation is caught.
The files copied are the manifest's file list and the manifest itself, whatever the checkpoint
format names them.

The promoted model is DEST holding those files (a DCP directory with its ``manifest.json``) and
``promotion.json`` (the record of both gates and the source). Atomic, idempotent and guarded
against concurrent promoters:

- local: one promoter per DEST at a time, by ``flock(2)`` on ``.tmp-promote-<name>.lock``
  beside DEST (released by the kernel when a promoter dies). Files are written and fsynced into
  ``.tmp-promote-<name>-<pid>`` beside DEST, which is renamed to DEST in one step; a crash leaves
  only the hidden staging directory (removed by the next attempt), never a DEST that looks
  complete;
- S3: the lock object ``PREFIX/.promotion.lock`` is created with a conditional put
  (``If-None-Match: *``), so of two promoters of different checkpoints one gets it and the other
  is refused before it uploads anything. Files go up with an S3 CRC32 checksum (S3 checks the
  bytes it received); each object's stored checksum and size are then compared with the ones
  computed from the verified source. ``promotion.json`` goes last, also conditionally: it is the
  commit marker, and a prefix without it is not promoted. A lock left by a crashed promoter of the
  same checkpoint is taken over by its retry; one of another checkpoint must be deleted by hand;
- a second call for the same checkpoint finds DEST's ``promotion.json`` naming the same manifest
  digest and verifies DEST's content (every file's size and checksum) before it reports
  "already promoted"; damaged or missing content is refused, never trusted. DEST holding anything
  else, or DEST inside the source run, is refused.

DEST may hold the field ``{run_id}``, replaced by the name of the checkpoint's run directory (in a
pipeline run, ``runs/<run id>``: the KFP run's id or the Argo workflow's uid), so that each run
of a schedule promotes to a place of its own (a fixed DEST already holds the first run's model,
and every later run would be refused). Any other ``{...}`` is refused as a misspelt field.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from resilient_training.run import checkpoint_format as cf
from resilient_training.run import gate_records, layout
from resilient_training.run.paths import check_writable

PROMOTION_NAME = "promotion.json"
STAGING_PREFIX = ".tmp-promote-"
S3_LOCK_NAME = ".promotion.lock"
# Files of this size or more go to S3 as multipart uploads of this part size (s3transfer may
# enlarge parts to stay within 10,000); the stored CRC32 is then the composite of the parts'.
S3_PART_BYTES = 64 << 20
# The one field DEST may hold: the run directory's name (see the module doc).
RUN_ID_FIELD = "{run_id}"
# What check_dest_text puts in RUN_ID_FIELD's place to check the rest (a run id's shape and length).
_SAMPLE_RUN_ID = "00000000-0000-0000-0000-000000000000"
_READ_CHUNK = 8 << 20
# Bounds on waiting for S3 (a stranger trial: an endpoint that accepted connections and never answered
# hung promote for 181 s under botocore's defaults, 60 s reads retried): each request is given up
# after S3_MAX_ATTEMPTS attempts of at most these many seconds to connect and between bytes read.
S3_CONNECT_TIMEOUT_S = 10.0
S3_READ_TIMEOUT_S = 30.0
S3_MAX_ATTEMPTS = 3
# S3 keys are at most 1024 bytes: a longer prefix leaves no room for the promoted files' names.
S3_MAX_PREFIX_BYTES = 900
# Bucket names S3 reserves (its bucket naming rules): these would be refused, or name something else.
_S3_RESERVED_PREFIXES = ("xn--", "sthree-")


class PromotionUsageError(ValueError):
    """The checkpoint or destination cannot be used as given (exit code 2); nothing was changed."""


class PromotionRefused(RuntimeError):
    """The checkpoint did not pass both gates of its run, changed since, or DEST is taken (exit code 1)."""


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
    """Prove ``ckpt_dir`` passed the full validation in its run and is unchanged since (by its manifest digest).

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
    rel = os.path.relpath(os.path.abspath(ckpt_dir), run_dir)  # as named (see run_dir_of)
    if validation is None:
        raise PromotionRefused(f"{rel} was never validated in {run_dir} (run validate-checkpoint first)")
    checkpoints = validation.get("checkpoints") if isinstance(validation, dict) else None
    entry = checkpoints.get(rel) if isinstance(checkpoints, dict) else None
    if validation.get("passed") is not True or not isinstance(entry, dict) or entry.get("valid") is not True:
        findings = validation.get("findings")
        why = "; ".join(map(str, findings[:3])) if isinstance(findings, list) and findings else \
            f"{rel} is not among the validated checkpoints"
        if isinstance(entry, dict) and entry.get("valid") is True and isinstance(findings, list) and findings:
            # Another checkpoint's findings (validate --all) failed the record, not this one's.
            raise PromotionRefused(f"the run's last validation failed elsewhere in the run ({why}), although "
                                   f"{rel} itself was valid: validate it alone (validate-checkpoint {run_dir}) "
                                   "and promote again")
        raise PromotionRefused(f"{rel} did not pass validation: {why}")
    if entry.get("manifest_checksum") != digest:
        raise PromotionRefused(f"{rel} changed since it was validated (manifest digest {digest}, validated "
                               f"{entry.get('manifest_checksum')})")
    if entry.get("full_check") is not True:
        skipped = "; ".join(entry.get("skipped") or []) or "the record does not say every check ran"
        raise PromotionRefused(f"{rel} was not fully validated (skipped: {skipped}); promotion needs the full check: "
                               "run validate-checkpoint without --no-load")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise PromotionRefused(f"{rel}/{cf.MANIFEST_NAME} lists no files")
    for name, listed in files.items():
        _check_member_name(name, rel)
        if not isinstance(listed, dict) or not _bounded(listed.get("bytes"), 1 << 62) \
                or not isinstance(listed.get("checksum"), str):
            raise PromotionRefused(f"{rel}/{cf.MANIFEST_NAME} lists {name!r} without its size (a non-negative "
                                   "integer) or checksum")
    # The records name this manifest by its digest, so they vouch for whatever the run's directory
    # holds under that name: a stranger trial copied another run's gated step_N and its gate records
    # into a run (nothing forged) and promoted it as that run's. The checkpoint must be this run's own.
    if problem := foreign_checkpoint_problem(run_dir, manifest, digest):
        raise PromotionRefused(f"{rel} {problem}: the gate records naming its manifest were not made for a "
                               "checkpoint of this run")
    return {
        "source": {"run_dir": str(run_dir), "checkpoint": rel, "step": manifest.get("step"),
                   "run_id": gate_records.run_id_of(run_dir, manifest), "manifest_checksum": digest},
        "validation": validation,
        "manifest": manifest,
        "files": manifest["files"],
    }


def _bounded(value: Any, limit: int) -> bool:
    """An integer (not a boolean) from 0 to ``limit``: a manifest's number is bounded before use."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def run_uid_problem(run_dir: Path, manifest: dict[str, Any]) -> tuple[str, str] | None:
    """Why the manifest's ``run_uid`` says another run directory saved the checkpoint (what
    ``train`` refuses to resume), as (validation's finding code, what): it names another uid than
    ``RUN/run_uid`` (``not_committed_by_run``), or names one while that file is missing, empty or
    unreadable (``commit_unverified``); None when neither. A manifest without one (written before
    2026-12-04) is not checked here; the run's event log still is (:func:`foreign_checkpoint_problem`).
    """
    saved = manifest.get("run_uid")
    if saved is None:
        return None
    try:
        mine = cf.read_run_uid(run_dir)
    except cf.CheckpointError as exc:
        return "commit_unverified", f"names run uid {str(saved)[:40]!r}, but this run's is unreadable ({exc})"
    if not mine:
        return "commit_unverified", (f"names run uid {str(saved)[:40]!r}, but {run_dir / cf.RUN_UID_FILENAME} is "
                                     "missing or empty (cannot tell whether this run saved it)")
    if saved != mine:
        return "not_committed_by_run", f"was saved by another run (run uid {str(saved)[:40]!r}, this run's {mine!r})"
    return None


def foreign_checkpoint_problem(run_dir: Path, manifest: dict[str, Any], digest: str) -> str | None:
    """Why the checkpoint is not known to be the one this run committed, or None: its manifest
    names another run (:func:`run_uid_problem`), or the run's own event log records no commit of
    its step with this manifest's digest (what validation proves; re-checked here, since a gate
    record copied in with the checkpoint vouches for nothing about the run it lies in).
    """
    if problem := run_uid_problem(run_dir, manifest):
        return problem[1]
    step = manifest.get("step")
    if not _bounded(step, (1 << 63) - 1):
        return f"has no valid step in its manifest ({str(step)[:40]})"
    commit, _, why = gate_records.recorded_commit(run_dir, step)
    if commit is None:
        return f"is not known to be this run's ({why})"
    logged = commit.get("manifest_checksum")
    if not isinstance(logged, str):
        return (f"cannot be proven to be the checkpoint this run committed (the run's event log records the commit "
                f"of step {step} without its manifest digest: an older version)")
    if logged != digest:
        return (f"is not the checkpoint this run committed at step {step} (the run's event log records another "
                "manifest digest; copied from another run, or rewritten after its commit)")
    return None


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
    if not isinstance(convergence, dict) or convergence.get("passed") is not True:  # "false", 1, [...]: not a pass
        checks = convergence.get("checks") if isinstance(convergence, dict) else None
        failed = [f"{n}: {c.get('reason')}" for n, c in checks.items() if isinstance(c, dict)
                  and c.get("passed") is not True and not c.get("skipped")] if isinstance(checks, dict) else []
        raise PromotionRefused("the convergence gate failed: " + ("; ".join(failed) or "its record does not say it "
                               f"passed (passed: {convergence.get('passed') if isinstance(convergence, dict) else None!r})"))
    if convergence.get("manifest_checksum") != digest:
        if convergence.get("checkpoint") == rel:
            raise PromotionRefused(f"{rel} changed since the convergence gate judged it (manifest digest {digest}, "
                                   f"judged {convergence.get('manifest_checksum')}): run check-convergence again")
        raise PromotionRefused(f"the convergence gate judged {convergence.get('checkpoint')} "
                               f"(step {convergence.get('step')}), not {rel}")
    return {
        "source": validated["source"],
        "validation": validated["validation"],
        "convergence": convergence,
        "files": validated["files"],
    }


def _check_member_name(name: Any, rel: str) -> None:
    """A manifest entry must name a file inside the checkpoint, and none of promotion's own names."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if (not parts or PurePosixPath(name).is_absolute() or any(p in ("..", ".") for p in parts) or "\\" in name
            or name in (cf.MANIFEST_NAME, PROMOTION_NAME, S3_LOCK_NAME) or "\n" in name or "\0" in name):
        raise PromotionRefused(f"{rel}/{cf.MANIFEST_NAME} lists {name!r}, which is not a file inside the checkpoint")


def promote(checkpoint: str | os.PathLike[str], dest: str, *, s3_client: Any = None) -> dict[str, Any]:
    """Copy a gated checkpoint to ``dest`` (directory or ``s3://bucket/prefix``); see the module doc."""
    dest = check_dest_text(str(dest))
    to_s3 = dest.startswith("s3://")
    if to_s3 and s3_client is None:  # its settings' problems (AWS_ENDPOINT_URL) before the gates are read
        s3_client = new_s3_client()
    ckpt_dir = resolve_checkpoint(checkpoint)
    run_dir = gate_records.run_dir_of(ckpt_dir)
    if RUN_ID_FIELD in dest:
        if run_dir is None:
            raise PromotionUsageError(f"DEST {dest!r} holds {RUN_ID_FIELD}, but {ckpt_dir} is not in a run "
                                      "directory (RUN/checkpoints/step_N) to name it")
        dest = dest.replace(RUN_ID_FIELD, run_dir.name)
    # DEST's own problems (inside the run, not creatable) are usage errors, found before the gates are read.
    local = _local_dest(dest, run_dir) if not to_s3 and run_dir is not None else None
    record = check_gates(ckpt_dir)  # refuses a checkpoint outside a run, too
    record["promoted_at"] = time.time()
    if to_s3:
        outcome = _promote_s3(ckpt_dir, dest, record, s3_client)
    else:
        assert local is not None  # check_gates refused a checkpoint without a run
        outcome = _promote_local(ckpt_dir, local, record)
    size = sum(int(e["bytes"]) for e in record["files"].values())
    return {"dest": dest, "step": record["source"]["step"], "bytes": size, **outcome}


def check_dest_text(dest: str) -> str:
    """DEST's own spelling, checked without touching anything (also before a pipeline run exists).

    Raises:
        PromotionUsageError: empty, whitespace around it, a NUL byte, an invalid s3:// URL, a
            ``{...}`` other than ``{run_id}``.

    """
    if not dest.strip():
        raise PromotionUsageError("DEST is empty")
    if dest != dest.strip() or "\0" in dest:
        raise PromotionUsageError(f"DEST {dest!r} has leading or trailing whitespace or a NUL byte")
    # `{run_id}/..` undoes the field: every run would promote to the same place (a stranger trial).
    parts = dest.removeprefix("s3://").split("/")
    if any(RUN_ID_FIELD in part and ".." in parts[i + 1:] for i, part in enumerate(parts)):
        raise PromotionUsageError(f"DEST {dest!r} has '..' after {RUN_ID_FIELD}, which makes every run's place the "
                                  "same: name the place without it")
    # A misspelt field ({runid}, {run-id}, {{run_id}}) would otherwise become a literal directory
    # name, the same for every run: refused, as is a brace anywhere else.
    rest = dest.replace(RUN_ID_FIELD, "")
    if "{" in rest or "}" in rest:
        raise PromotionUsageError(f"DEST {dest!r} has a '{{' or '}}' that is not the field {RUN_ID_FIELD} (the name "
                                  "of the run's directory; the only field)")
    if "://" in dest and not dest.startswith("s3://"):
        raise PromotionUsageError(f"DEST {dest!r}: only a directory or s3://bucket/prefix (lowercase s3://)")
    if dest[:3].lower() == "s3:" and not dest.startswith("s3://"):  # a stranger trial: made ./s3:/bucket/x
        raise PromotionUsageError(f"DEST {dest} is not an s3://bucket/prefix URL (for a local directory whose "
                                  f"name starts with s3:, write ./{dest})")
    if dest.startswith("s3://"):  # a bad URL is a usage error before the checkpoint is even read
        if RUN_ID_FIELD in dest.removeprefix("s3://").partition("/")[0]:
            raise PromotionUsageError(f"DEST {dest!r}: {RUN_ID_FIELD} belongs in the prefix, not the bucket name")
        sample = dest.replace(RUN_ID_FIELD, _SAMPLE_RUN_ID)
        try:
            parse_s3(sample)
        except PromotionUsageError as exc:  # name DEST as given, not with the sample id in it
            raise PromotionUsageError(str(exc).replace(sample, dest)) from None
    return dest


def _local_dest(dest: str, run_dir: Path) -> Path:
    """DEST as an absolute real path, refused (usage) inside or around the source run or where it cannot be made."""
    from resilient_training.run.paths import input_problem

    if problem := input_problem(dest, "DEST"):
        raise PromotionUsageError(problem)
    if Path(dest).is_symlink() and not Path(dest).exists():  # resolve() would follow it to wherever it points
        raise PromotionUsageError(f"DEST {dest} is a dangling symbolic link (to {os.readlink(dest)}): promote to a "
                                  "directory, or a link to an existing one")
    path = Path(dest).resolve()  # symlinks and '..' resolved: the inside-the-run check sees the real place
    if not path.name:
        raise PromotionUsageError(f"DEST {dest} is the file system root")
    run_dir = run_dir.resolve()
    if path == run_dir or run_dir in path.parents:
        raise PromotionUsageError(f"DEST {dest} lies inside the source run {run_dir}: promote to a place outside it")
    if path in run_dir.parents:
        raise PromotionUsageError(f"DEST {dest} contains the source run {run_dir}: promote to a place outside it")
    if (other := layout.run_dir_around(path)) is not None:  # a stranger trial made another run's step_50 so
        raise PromotionUsageError(f"DEST {dest} lies inside the run {other}: promote to a place outside any run")
    # Inside another promoted model: its files would gain a stranger's, and its own check (and an
    # idempotent repeat of its promotion) would then refuse it (stranger trial).
    if (parent := promoted_model_above(path)) is not None:
        raise PromotionUsageError(f"DEST {dest} lies inside the promoted model {parent}: promote beside it")
    try:  # DEST, and the staging directory beside it, can be created: found out before anything is written
        check_writable(path, "DEST", directory=True)
        check_writable(path.parent / f"{STAGING_PREFIX}{path.name}-{os.getpid()}", "DEST (its staging name)",
                       directory=True)
    except ValueError as exc:
        raise PromotionUsageError(str(exc)) from None
    return path


def occupied(dest: Path) -> bool:
    """DEST holds something promotion will not overwrite: a file, or a directory that is not empty."""
    return dest.exists() and (not dest.is_dir() or any(dest.iterdir()))


def promoted_model_above(path: Path) -> Path | None:
    """The promoted model (a directory holding ``promotion.json``) that ``path`` lies inside, if any."""
    return next((parent for parent in path.parents if (parent / PROMOTION_NAME).is_file()), None)


def _files_to_copy(record: dict[str, Any]) -> list[str]:
    return sorted(record["files"]) + [cf.MANIFEST_NAME]


def _expected(name: str, record: dict[str, Any]) -> tuple[int | None, str]:
    """(bytes or None, xxh3_128) a promoted copy of ``name`` must have."""
    if name == cf.MANIFEST_NAME:
        return None, record["source"]["manifest_checksum"]
    entry = record["files"][name]
    return int(entry["bytes"]), entry["checksum"]


def _verify(name: str, size: int, digest: str, record: dict[str, Any], where: Path | str) -> None:
    want_size, want_digest = _expected(name, record)
    if name == cf.MANIFEST_NAME:
        if digest != want_digest:
            raise PromotionRefused(f"{where} changed while being promoted")
        return
    if size != want_size or digest != want_digest:
        raise PromotionRefused(f"{where} no longer matches its manifest ({size} bytes, {digest}; manifest "
                               f"{want_size} bytes, {want_digest}): damaged after validation")


def open_source(path: Path) -> Any:
    """``path`` opened to read, unbuffered, without waiting: a FIFO, device or socket put in place
    of a checkpoint's file after validation is refused (PromotionRefused), never waited on.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PromotionRefused(f"{path} is {cf.NOT_REGULAR}: not the checkpoint's file it was when validated")
    return open(fd, "rb", buffering=0, closefd=True)


def _copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy with large reads, hashing what is written, then fsync."""
    hasher = cf.new_hasher()  # xxh3_128: the manifest's files and the manifest digest alike
    size = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open_source(src) as fin, open(dst, "wb", buffering=0) as fout:
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


def _promotion_of(record_text: str, record: dict[str, Any], where: str) -> bool:
    """True when the marker at ``where`` names this very checkpoint; refuses when it names another."""
    try:
        existing = json.loads(record_text)
        same = existing["source"]["manifest_checksum"] == record["source"]["manifest_checksum"]
    except (json.JSONDecodeError, RecursionError, KeyError, TypeError, UnicodeDecodeError):
        raise PromotionRefused(f"{where} holds an unreadable {PROMOTION_NAME}: refusing to overwrite it") from None
    if not same:
        raise PromotionRefused(f"{where} already holds another promoted model (step {existing['source'].get('step')} "
                               f"of {existing['source'].get('run_dir')}); choose another DEST")
    return True


# --------------------------------------------------------------------------- local


@contextlib.contextmanager
def _flock(path: Path, what: str, holder: dict[str, Any]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed, removed on release).

    The kernel releases it when the holder dies, so a crashed promoter never blocks a retry.
    A lock file unlinked by its previous holder while we waited for it is not the lock any
    more: take the one now at ``path``.
    """
    while True:
        try:
            # O_NOFOLLOW: a symlink planted at the lock's name must not make us truncate what it points to.
            # O_NONBLOCK: a FIFO planted there blocked (or, opened, was a traceback: a stranger trial).
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):
                raise PromotionUsageError(f"{path} is not a regular file: it is the lock of promotions and exports "
                                          f"to {what}; remove it") from None
            raise PromotionUsageError(f"cannot write to {path.parent}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise PromotionUsageError(f"{path} is not a regular file: it is the lock of promotions and exports to "
                                      f"{what}; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            held = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PromotionRefused(f"another promotion or export to {what} is in progress "
                                       f"({held or 'holder unknown'}); this one stopped without writing anything") from None
            raise PromotionUsageError(f"cannot lock {path}: {exc.strerror or exc} (promotion to a directory needs "
                                      "flock(2); on Lustre mount with -o flock)") from None
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder, sort_keys=True).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # still holding it: a waiter that opened this file re-checks and retries
        os.close(fd)


def destination_lock(dest: Path, record: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """The lock of a local destination, one for promotions and exports to it alike: two exports to
    one file both said "exported" while one replaced the other, and two to one directory left one's
    files in the other's (a stranger trial). Refused (PromotionRefused) while another holds it.
    """
    return _flock(dest.absolute().parent / f"{STAGING_PREFIX}{dest.name}.lock", str(dest), _holder(record))


def _holder(record: dict[str, Any]) -> dict[str, Any]:
    """Who holds a lock: shown to the promoter that is refused; ``token`` tells holders apart."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ",
            time.gmtime()), "step": record["source"]["step"], "run_dir": record["source"]["run_dir"],
            "manifest_checksum": record["source"]["manifest_checksum"], "token": uuid.uuid4().hex}


# Names promote_model's export option writes inside DEST; gates/export.py's PROMOTED_NAMES uses these.
EXPORTS_INSIDE_DEST = ("model.pt", "model.safetensors", "hf")


def _verify_exports(dest: Path, ckpt_dir: Path) -> None:
    """The exports inside DEST (``EXPORTS_INSIDE_DEST``) are this checkpoint's, byte for byte."""
    from resilient_training.gates.export import ExportRefused, verify_promoted_exports

    try:
        verify_promoted_exports(dest, ckpt_dir)
    except ExportRefused as exc:
        raise PromotionRefused(f"{dest} is marked as this checkpoint's promotion but its export is not this "
                               f"checkpoint's: {exc}") from None


def _verify_local_copy(dest: Path, record: dict[str, Any]) -> None:
    """DEST holds exactly the files of this checkpoint, byte for byte, and its marker."""
    expected = set(_files_to_copy(record)) | {PROMOTION_NAME}
    links = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_symlink())
    if links:  # a link to the source (or anywhere) is not a copy: it changes when its target does
        raise PromotionRefused(f"{dest} is marked as this checkpoint's promotion but {', '.join(links[:5])} "
                               "is a symbolic link, not a copy; remove DEST and promote again")
    present = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if not p.is_dir()}
    # An export of this checkpoint that promote_model's export option wrote inside DEST (export.py
    # PROMOTED_NAMES) is not foreign content: export verifies its own record on a repeat.
    # So is what such an export killed midway left (its lock, its staging): the next export removes it.
    leftovers = tuple(f"{prefix}{name}" for name in EXPORTS_INSIDE_DEST for prefix in (STAGING_PREFIX, ".tmp-export-"))
    extra = sorted(name for name in present - expected if name.split("/", 1)[0] not in EXPORTS_INSIDE_DEST
                   and not name.split("/", 1)[0].startswith(leftovers))
    if extra:
        raise PromotionRefused(f"{dest} is marked as this checkpoint's promotion but also holds {', '.join(extra[:5])}; "
                               "remove DEST and promote again")
    for name in _files_to_copy(record):
        path = dest / name
        if not path.is_file():
            raise PromotionRefused(f"{dest} is marked as this checkpoint's promotion but {name} is missing; "
                                   "remove DEST and promote again")
        size, digest = cf.checksum_file(path)
        want_size, want_digest = _expected(name, record)
        if digest != want_digest or (want_size is not None and size != want_size):
            raise PromotionRefused(f"{dest} is marked as this checkpoint's promotion but {name} is damaged "
                                   f"({size} bytes, {digest}; expected {want_size or 'any'} bytes, {want_digest}); "
                                   "remove DEST and promote again")


def _staging_dirs(parent: Path, name: str) -> list[Path]:
    pattern = re.compile(re.escape(f"{STAGING_PREFIX}{name}-") + r"\d+")
    return [p for p in parent.iterdir() if pattern.fullmatch(p.name)]


def _promote_local(ckpt_dir: Path, dest: Path, record: dict[str, Any]) -> dict[str, Any]:
    files = _files_to_copy(record) + [PROMOTION_NAME]
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PromotionUsageError(f"cannot write to {parent}: {exc.strerror or exc}") from None
    if not parent.is_dir():
        raise PromotionUsageError(f"cannot write to {parent}: not a directory")
    with destination_lock(dest, record):
        marker = dest / PROMOTION_NAME
        if marker.is_file():
            try:
                text = cf.read_regular_bytes(marker).decode()  # never waited on (a FIFO put there)
            except (OSError, UnicodeDecodeError) as exc:
                raise PromotionRefused(f"{dest}: cannot read {PROMOTION_NAME}: {exc}") from None
            _promotion_of(text, record, str(dest))
            _verify_local_copy(dest, record)
            _verify_exports(dest, ckpt_dir)
            return {"already_promoted": True, "files": files}
        if occupied(dest):
            raise PromotionRefused(f"{dest} exists and is not an empty directory: refusing to overwrite it")
        try:
            for stale in _staging_dirs(parent, dest.name):
                shutil.rmtree(stale, ignore_errors=True)  # left by a crashed attempt (we hold the lock)
            staging = parent / f"{STAGING_PREFIX}{dest.name}-{os.getpid()}"
            staging.mkdir()
        except OSError as exc:
            raise PromotionUsageError(f"cannot write to {parent}: {exc.strerror or exc}") from None
        try:
            for name in _files_to_copy(record):
                size, digest = _copy_hashing(ckpt_dir / name, staging / name)
                _verify(name, size, digest, record, ckpt_dir / name)
            (staging / PROMOTION_NAME).write_text(json.dumps(record, indent=1, sort_keys=True, allow_nan=True))
            with open(staging / PROMOTION_NAME, "rb") as handle:
                os.fsync(handle.fileno())
            cf.fsync_dir(staging)
            staging.rename(dest)  # atomic: DEST appears complete or not at all (an empty DEST is replaced)
            cf.fsync_dir(parent)
        except FileNotFoundError as exc:  # a traceback (a stranger trial removed the step mid-copy)
            shutil.rmtree(staging, ignore_errors=True)
            raise PromotionRefused(f"{ckpt_dir} changed while it was copied ({exc.filename} is gone): nothing "
                                   "was promoted") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return {"already_promoted": False, "files": files}


# --------------------------------------------------------------------------- S3


# An S3 access point's ARN, which boto3 takes wherever a bucket name goes (as the AWS CLI takes
# s3://arn:aws:s3:REGION:ACCOUNT:accesspoint/NAME/KEY); names are 3-50 of a-z 0-9 -.
_ACCESS_POINT_ARN = re.compile(r"arn:aws(?:-cn|-us-gov)?:s3:[a-z]{2}(?:-[a-z]+)+-\d:\d{12}:accesspoint/"
                               r"[a-z0-9][a-z0-9-]{1,48}[a-z0-9]")


def parse_s3(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://BUCKET/PREFIX``; BUCKET may be an access point's ARN (or alias)."""
    rest = url.removeprefix("s3://")
    arn = _ACCESS_POINT_ARN.match(rest)
    if arn and rest[arn.end():arn.end() + 1] in ("", "/"):
        bucket, after = arn.group(), rest[arn.end() + 1:]
    else:
        bucket, _, after = rest.partition("/")
        if rest.startswith("arn:"):
            raise PromotionUsageError(f"{url!r} names no valid bucket (an access point's ARN is "
                                      "arn:aws:s3:REGION:ACCOUNT:accesspoint/NAME, NAME 3-50 of a-z 0-9 -)")
        if problem := _bucket_problem(bucket):
            raise PromotionUsageError(f"{url!r} names no valid bucket ({problem})")
    # One trailing '/' is a spelling of the same prefix; '//' elsewhere is an empty part (a stranger
    # trial: s3://bucket//x was promoted to s3://bucket/x), refused as '..' is.
    prefix = after.removesuffix("/")
    bad_part = after != "" and any(part in ("", ".", "..") for part in prefix.split("/"))
    if bad_part or any(c in prefix for c in "\n\r\0"):
        raise PromotionUsageError(f"{url!r}: the prefix has an empty, '.' or '..' part or a control character")
    if len(prefix.encode()) > S3_MAX_PREFIX_BYTES:
        raise PromotionUsageError(f"{url!r}: the prefix is {len(prefix.encode())} bytes; S3 keys are at most 1024 "
                                  f"bytes, and the promoted files' names need room after it: keep it within "
                                  f"{S3_MAX_PREFIX_BYTES}")
    return bucket, prefix


def _bucket_problem(bucket: str) -> str | None:
    """Why S3's bucket naming rules refuse ``bucket`` (a stranger trial: s3://192.168.1.1/x passed), else None."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        return ("expected s3://bucket/prefix, bucket 3-63 of a-z 0-9 . -, beginning and ending with a letter "
                "or digit")
    if ".." in bucket:
        return f"{bucket!r} has two adjacent periods"
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket):
        return f"{bucket!r} is formatted as an IP address"
    if reserved := next((p for p in _S3_RESERVED_PREFIXES if bucket.startswith(p)), None):
        return f"{bucket!r} begins with {reserved!r}, which S3 reserves"
    # (Names ending -s3alias or --ol-s3 are access point aliases, which S3 takes wherever a bucket is.)
    return None


def new_s3_client() -> Any:
    """A boto3 S3 client whose every request is bounded in time (S3_*_TIMEOUT_S, S3_MAX_ATTEMPTS).

    Raises:
        PromotionUsageError: the endpoint it is given (AWS_ENDPOINT_URL) is not an http(s) URL, or
            the AWS settings cannot be read.

    """
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    config = Config(connect_timeout=S3_CONNECT_TIMEOUT_S, read_timeout=S3_READ_TIMEOUT_S,
                    retries={"total_max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"})
    source = next((name for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(name)),
                  "the AWS config's endpoint_url")
    try:
        client = boto3.client("s3", config=config)
    except ValueError as exc:  # a stranger trial: "Invalid endpoint: not a url" was a traceback
        given = f" {os.environ[source]!r}" if source in os.environ else ""
        raise PromotionUsageError(f"{source}{given} is not an http(s) URL ({exc})") from None
    except BotoCoreError as exc:  # a missing AWS_PROFILE, a config file that does not parse
        raise PromotionUsageError(f"cannot use the AWS settings for S3: {exc}") from None
    endpoint = str(client.meta.endpoint_url)
    if not re.match(r"https?://", endpoint):  # ftp://host passes boto3.client, to fail at the first request
        raise PromotionUsageError(f"{source} {endpoint!r} is not an http(s) URL")
    return client


@dataclasses.dataclass(frozen=True, slots=True)
class _S3Expect:
    """What S3 must report for one promoted object, computed from the verified source."""

    size: int
    xxh3: str
    crc32: str  # base64, as S3 reports it: the object's CRC32, or for a multipart upload the CRC32 of its parts'

    def matches(self, head: dict[str, Any]) -> bool:
        stored = str(head.get("ChecksumCRC32") or "").split("-")[0]  # a composite carries "-<parts>"
        return head.get("ContentLength") == self.size and stored == self.crc32


def _b64_crc(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def _read_source(path: Path) -> _S3Expect:
    """One read: size, xxh3_128 and the CRC32 S3 will store (whole object, or composite of the parts)."""
    from s3transfer.utils import ChunksizeAdjuster

    size = path.stat().st_size
    # upload_file goes multipart from S3_PART_BYTES on, in parts of this size (enlarged past 10,000 parts).
    part = ChunksizeAdjuster().adjust_chunksize(S3_PART_BYTES, size) if size >= S3_PART_BYTES else size + 1
    hasher, crc, fill, parts, read = cf.new_hasher(), 0, 0, bytearray(), 0
    with open_source(path) as handle:
        while block := handle.read(_READ_CHUNK):
            hasher.update(block)
            read += len(block)
            view = memoryview(block)
            while view:
                take = min(len(view), part - fill)
                crc = zlib.crc32(view[:take], crc)
                fill += take
                view = view[take:]
                if fill == part:
                    parts += crc.to_bytes(4, "big")
                    crc, fill = 0, 0
    if size < S3_PART_BYTES:
        return _S3Expect(read, hasher.hexdigest(), _b64_crc(crc))
    if fill:
        parts += crc.to_bytes(4, "big")
    return _S3Expect(read, hasher.hexdigest(), _b64_crc(zlib.crc32(bytes(parts))))


def _s3_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)  # None on a timeout (a stranger trial's crash), absent on most
    if response is None and isinstance(getattr(exc.__context__, "response", None), dict):
        return _s3_code(exc.__context__)  # boto3's S3UploadFailedError, raised while handling S3's error
    error = response.get("Error") if isinstance(response, dict) else None
    return str((error.get("Code") if isinstance(error, dict) else None) or type(exc).__name__)


def _s3_unavailable(exc: BaseException) -> bool:
    """S3, or the way to it, failed (no answer, a cut connection, a 5xx after retries): exit 1, not bad input."""
    from botocore.exceptions import ConnectionError as S3ConnectionError
    from botocore.exceptions import HTTPClientError

    if isinstance(exc, (S3ConnectionError, HTTPClientError)):
        return True
    response = getattr(exc, "response", None)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    return isinstance(status, int) and status >= 500


def _promote_s3(ckpt_dir: Path, url: str, record: dict[str, Any], client: Any) -> dict[str, Any]:
    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_s3(url)
    client = client or new_s3_client()
    files = _files_to_copy(record) + [PROMOTION_NAME]

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    def unwritable(exc: Exception) -> PromotionUsageError | PromotionRefused:
        if _s3_unavailable(exc):
            # A 5xx is an answer: a server error, not silence (a stranger trial's 501 was "did not answer").
            said = "answered with a server error" if isinstance(getattr(exc, "response", None), dict) \
                else "did not answer"
            return PromotionRefused(f"S3 {said} for {url} ({_s3_code(exc)}: {exc}; tried {S3_MAX_ATTEMPTS} "
                                    "times); nothing was written: promote again when S3 is reachable")
        code = _s3_code(exc)
        hint = {"404": "no such bucket", "NoSuchBucket": "no such bucket", "403": "permission denied",
                "AccessDenied": "permission denied"}.get(code, code)
        return PromotionUsageError(f"cannot write to {url}: {hint} ({exc})")

    def get_text(name: str) -> str | None:
        try:
            return client.get_object(Bucket=bucket, Key=key(name))["Body"].read().decode(errors="replace")
        except ClientError as exc:
            if _s3_code(exc) in ("NoSuchKey", "404"):
                return None
            raise

    def conditional_put(name: str, body: bytes) -> bool:
        """Create ``name`` only if absent; False when it exists (or a concurrent create won)."""
        try:
            client.put_object(Bucket=bucket, Key=key(name), Body=body, IfNoneMatch="*",
                              ContentType="application/json", ChecksumAlgorithm="CRC32")
        except ClientError as exc:
            if _s3_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise
        return True

    def verify_objects(expect: dict[str, _S3Expect], damaged: str) -> None:
        for name, want in expect.items():
            try:
                head = client.head_object(Bucket=bucket, Key=key(name), ChecksumMode="ENABLED")
            except ClientError as exc:
                if _s3_code(exc) in ("NoSuchKey", "404"):
                    raise PromotionRefused(f"{url}: {name} is missing{damaged}") from None
                raise
            if not want.matches(head) or head.get("Metadata", {}).get("xxh3-128") != want.xxh3:
                raise PromotionRefused(
                    f"{url}: {name} does not match the source ({head.get('ContentLength')} bytes, CRC32 "
                    f"{head.get('ChecksumCRC32')}, xxh3-128 {head.get('Metadata', {}).get('xxh3-128')}; expected "
                    f"{want.size} bytes, CRC32 {want.crc32}, xxh3-128 {want.xxh3}){damaged}")

    try:
        client.head_bucket(Bucket=bucket)
    except (ClientError, BotoCoreError) as exc:
        raise unwritable(exc) from None
    # Verify every byte against the manifest before anything is locked or lands (a reread of cached pages).
    expect: dict[str, _S3Expect] = {}
    for name in _files_to_copy(record):
        expect[name] = _read_source(ckpt_dir / name)
        _verify(name, expect[name].size, expect[name].xxh3, record, ckpt_dir / name)
    holder = _holder(record)
    lock_taken = False
    try:
        for _attempt in range(3):  # the lock may vanish between a refused put and our read of it
            if conditional_put(S3_LOCK_NAME, json.dumps(holder, sort_keys=True).encode()):
                break
            held = get_text(S3_LOCK_NAME)
            if held is None:
                continue
            try:
                other = json.loads(held)
            except (json.JSONDecodeError, RecursionError):
                other = {}
            if not isinstance(other, dict) or other.get("manifest_checksum") != holder["manifest_checksum"]:
                other = other if isinstance(other, dict) else {}
                raise PromotionRefused(
                    f"another promotion to {url} holds its lock (step {other.get('step')} of {other.get('run_dir')}, "
                    f"{other.get('host')} pid {other.get('pid')}, since {other.get('since')}); this one uploaded "
                    f"nothing. If that promotion died, delete s3://{bucket}/{key(S3_LOCK_NAME)}")
            # Ours: a crashed or concurrent attempt of this very checkpoint, whose objects are the same bytes.
            # Take it over by name, so that attempt (if alive) finds it is no longer its lock and leaves it be.
            client.put_object(Bucket=bucket, Key=key(S3_LOCK_NAME), Body=json.dumps(holder, sort_keys=True).encode(),
                              ContentType="application/json", ChecksumAlgorithm="CRC32")
            break
        else:
            raise PromotionRefused(f"the lock of {url} keeps changing hands: another promoter is busy there")
        lock_taken = True
        marker = get_text(PROMOTION_NAME)
        if marker is not None:
            _promotion_of(marker, record, url)
            verify_objects(expect, "; it is marked as this checkpoint's promotion: delete the prefix and promote again")
            return {"already_promoted": True, "files": files}
        config = TransferConfig(multipart_threshold=S3_PART_BYTES, multipart_chunksize=S3_PART_BYTES)
        for name in _files_to_copy(record):  # the checkpoint's files, then its manifest
            # S3 checks the CRC32 botocore computes from the bytes it sends; verify_objects then compares
            # what S3 stored with the CRC32 of the source bytes verified above.
            client.upload_file(str(ckpt_dir / name), bucket, key(name), Config=config,
                               ExtraArgs={"ChecksumAlgorithm": "CRC32", "Metadata": {"xxh3-128": expect[name].xxh3}})
        verify_objects(expect, " after upload: the source changed while it was uploaded, or the upload was damaged")
        body = json.dumps(record, indent=1, sort_keys=True, allow_nan=True).encode()
        if not conditional_put(PROMOTION_NAME, body):  # a concurrent attempt of this checkpoint committed first
            _promotion_of(get_text(PROMOTION_NAME) or "", record, url)
            return {"already_promoted": True, "files": files}
    except (ClientError, BotoCoreError, S3UploadFailedError) as exc:
        if not lock_taken:
            raise unwritable(exc) from None  # nothing written: the destination is unusable as given
        raise PromotionRefused(f"promotion to {url} failed midway ({_s3_code(exc)}: {exc}); nothing was committed "
                               f"(no {PROMOTION_NAME}): promote again to complete it") from None
    finally:
        if lock_taken:  # release only a lock still ours (a retry of this checkpoint may have taken it over)
            with contextlib.suppress(ClientError, BotoCoreError, json.JSONDecodeError, TypeError, AttributeError):
                if json.loads(get_text(S3_LOCK_NAME) or "{}").get("token") == holder["token"]:
                    client.delete_object(Bucket=bucket, Key=key(S3_LOCK_NAME))
    return {"already_promoted": False, "files": files}


def read_promotion(dest: str, *, s3_client: Any = None) -> dict[str, Any] | None:
    """The promotion record at ``dest``, or None when nothing (complete) was promoted there."""
    if dest.startswith("s3://"):
        from botocore.exceptions import ClientError

        bucket, prefix = parse_s3(dest)
        client = s3_client or new_s3_client()
        try:
            body = client.get_object(Bucket=bucket, Key=f"{prefix}/{PROMOTION_NAME}" if prefix else PROMOTION_NAME)
        except ClientError:
            return None
        return json.loads(body["Body"].read())
    marker = Path(dest) / PROMOTION_NAME
    return json.loads(marker.read_text()) if marker.is_file() else None
