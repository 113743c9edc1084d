"""Records of the gates a checkpoint passed, kept in the run so promotion can verify them.

``validate-checkpoint`` writes ``RUN/gates/validation.json`` and ``check-convergence`` writes
``RUN/gates/convergence.json``. Each names the checkpoint it judged by step and by the
xxh3_128 digest of its ``manifest.json`` (which in turn holds every file's checksum), so
``promote`` can prove the checkpoint it copies is the one both gates passed, in this run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from resilient_training.run import checkpoint_format as cf
from resilient_training.run import layout
from resilient_training.run.layout import gates_dir

VALIDATION = "validation"
CONVERGENCE = "convergence"


def record_path(run_dir: str | os.PathLike[str], gate: str) -> Path:
    return gates_dir(run_dir) / f"{gate}.json"


def manifest_digest(ckpt_dir: str | os.PathLike[str]) -> str:
    """xxh3_128 of the manifest's bytes: identifies a checkpoint's exact contents."""
    return xxhash.xxh3_128_hexdigest((Path(ckpt_dir) / cf.MANIFEST_NAME).read_bytes())


def recorded_commit(run_dir: str | os.PathLike[str], step: int) -> tuple[Any, int | None, str]:
    """Rank 0's last ``ckpt_committed`` of ``step`` (persistent tier) in the run's event log, the
    world size it records, and where that world size comes from (or why there is none).

    The world size is the event's; failing that (an older log), the last ``start`` of rank 0
    before that commit.
    """
    from resilient_training.run import events as ev

    try:
        events = ev.read_events(run_dir)
    except ev.EventLogError as exc:  # a forged or damaged log witnesses nothing
        return None, None, f"the run's event log cannot be read ({exc})"
    commits = [e for e in events if _commit_of(e, step)]
    if not commits:
        return None, None, f"the run's event log records no commit of step {step}"
    commit = commits[-1]
    if isinstance(commit.get("world_size"), int):
        return commit, commit["world_size"], "its ckpt_committed event"
    starts = [e for e in events if e.event == "start" and e.rank == 0 and e.ts <= commit.ts]
    if starts and isinstance(starts[-1].get("world_size"), int):
        return commit, starts[-1]["world_size"], "the start event of the workers that committed it"
    return commit, None, f"the run's event log records no world size for the commit of step {step}"


def _commit_of(event: Any, step: int) -> bool:
    """Rank 0's commit of ``step`` to the persistent tier (not a node-local one)."""
    return (event.event == "ckpt_committed" and event.step == step and event.rank == 0
            and event.get("tier", "persistent") == "persistent")


def logged_commit_digest(run_dir: str | os.PathLike[str], step: int) -> str | None:
    """The manifest digest rank 0 logged at its last commit of ``step`` (persistent tier): ``""``
    for a commit logged without one (an older version), None for no commit logged. Reads rank
    0's own log only and parses only its commit lines (a worker calls this behind training).
    """
    found: str | None = None
    for event in _rank0_events(run_dir, "ckpt_committed"):
        if _commit_of(event, step):
            digest = event.get("manifest_checksum")
            found = digest if isinstance(digest, str) else ""
    return found


def logged_save_open(run_dir: str | os.PathLike[str], step: int) -> bool:
    """Whether rank 0's last word on a persistent save of ``step`` is its ``ckpt_begin`` (written
    before any of that save's bytes), not a ``ckpt_abandoned`` (a save that was never committed):
    the one save whose commit rank 0 may have made and not lived to log.
    """
    last = None
    for event in _rank0_events(run_dir, "ckpt_begin", "ckpt_abandoned"):
        if event.step == step and event.rank == 0 and event.get("tier", "persistent") == "persistent":
            last = event.event
    return last == "ckpt_begin"


def _rank0_events(run_dir: str | os.PathLike[str], *names: str) -> Iterator[Any]:
    """Rank 0's events called one of ``names``, in order, parsing only their lines (cheap behind
    training); a line that is not a whole event is no witness and is passed over.
    """
    from resilient_training.run import events as ev

    markers = [f'"{name}"'.encode() for name in names]
    try:
        with open(layout.events_dir(run_dir) / "rank0.jsonl", "rb") as log:
            for line in log:
                if not line.endswith(b"\n") or not any(marker in line for marker in markers):
                    continue
                try:
                    event = ev.Event.from_json(line.decode())
                except (ev.EventLogError, UnicodeDecodeError):
                    continue
                if event.event in names:
                    yield event
    except OSError:
        return


def commit_problem(run_dir: str | os.PathLike[str], ckpt_dir: str | os.PathLike[str],
                   manifest: dict[str, Any]) -> str | None:
    """Why the checkpoint a worker restored is not known to be this run's, or None: rank 0 logged
    its commit with another manifest's digest, or logged no commit of it and either its manifest
    names no ``run_uid`` (one it names is compared with the run's by the resume check) or rank 0
    logged no save of it begun and not abandoned. A planted step with its ``run_uid`` deleted was resumed,
    validated and promoted (stranger trial); ``train``'s pre-flight refuses it, and this is the
    same for a cluster's workers, which no pre-flight sees. The one unlogged step accepted is one
    whose save rank 0 began and may have committed before dying without logging it.
    """
    step = manifest.get("step")
    logged = logged_commit_digest(run_dir, step) if isinstance(step, int) else None
    if logged is None:
        if manifest.get("run_uid") is None:
            return (f"the run's event log records no commit of step {step} and its manifest names no run_uid: "
                    "not known to be this run's (put there from elsewhere)")
        if not (isinstance(step, int) and logged_save_open(run_dir, step)):
            return (f"the run's event log records no commit of step {step}, nor a save of it begun and not abandoned: "
                    "not known to be this run's (put there from elsewhere, its run_uid copied in)")
        return None  # this run's save (run_uid compared at the restore), its commit's log line lost with rank 0
    if logged and logged != manifest_digest(ckpt_dir):
        return (f"its manifest is not the one the run committed at step {step} (the event log records another "
                "digest): copied from another run, or rewritten after its commit")
    return None


def checkpoint_identity(run_dir: str | os.PathLike[str], ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What a record says about the checkpoint it judged."""
    ckpt_dir = Path(ckpt_dir)
    manifest = cf.read_manifest(ckpt_dir)
    return {
        # As named (see run_dir_of): a checkpoints/ linked to another volume keeps its run's names.
        "checkpoint": os.path.relpath(os.path.abspath(ckpt_dir), os.path.abspath(run_dir)),
        "step": manifest.get("step"),
        "run_id": run_id_of(run_dir, manifest),
        "manifest_checksum": manifest_digest(ckpt_dir),
    }


def run_id_of(run_dir: str | os.PathLike[str], manifest: dict[str, Any]) -> str:
    """The run's id: the manifest's, else the run directory's name (what the trainer's runs have,
    and what a ``{run_id}`` in a promotion DEST becomes; a stranger trial found ``null`` in every
    export's metadata).
    """
    return str(manifest.get("run_id") or Path(os.path.abspath(run_dir)).name)


class RecordError(ValueError):
    """A gate's record cannot be written where it belongs (RUN/gates/GATE.json): one line, no traceback."""


def check_recordable(run_dir: str | os.PathLike[str], gate: str) -> None:
    """Refuse, before a gate spends its time, a run whose record could not be written: ``gates``
    or the record is something else than a directory and a file (found by a stranger trial:
    a traceback after the whole validation, and a temporary file left behind).
    """
    directory, path = gates_dir(run_dir), record_path(run_dir, gate)
    if directory.exists() and not directory.is_dir():
        raise RecordError(f"{directory} is not a directory: the {gate} record cannot be written (move it away)")
    if path.is_dir():
        raise RecordError(f"{path} is a directory: the {gate} record cannot be written (move it away)")


def write_record(run_dir: str | os.PathLike[str], gate: str, record: dict[str, Any]) -> Path:
    """Replace the gate's record atomically (a crash leaves the old record or the new one); refused
    when the run's lock was lost while the gate read it (:func:`_lock_lost`).
    """
    check_recordable(run_dir, gate)
    if problem := _lock_lost():
        raise RecordError(problem)
    directory = gates_dir(run_dir)
    path = record_path(run_dir, gate)
    body = {"gate": gate, "created": time.time(), **record}
    tmp = path.with_name(f"{cf.TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(body, indent=1, sort_keys=True, allow_nan=True))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RecordError(f"the {gate} record cannot be written to {path}: {exc.strerror or exc}") from None
    return path


class RunInUse(ValueError):
    """A training holds the run directory (:func:`reading_run`)."""


GATES = (VALIDATION, CONVERGENCE)


@contextlib.contextmanager
def reading_run(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Hold the lock of the run ``path`` is or lies in (``RUN/.lock``) shared while a gate reads the run
    and writes its record. A training holds it exclusively from before its first write until its
    workers are gone, and withdraws the gates' records when it takes it (``launch.local.claim_run_dir``).

    A stranger trial promoted step 20 while a resume trained on (the convergence gate said no 0.7 s
    later), and validated a checkpoint that the training pruned meanwhile ("metadata_invalid").
    Raises :class:`RunInUse` while a training runs there. A run no local training held (a cluster's)
    is read as it is.
    """
    import fcntl

    run_dir = layout.run_dir_around(path)
    fd = None
    if run_dir is not None:
        # Read-only, never made here (a gate refusing bad input writes nothing): every run a local
        # training ever held has the file, which the training makes and keeps.
        try:
            fd = layout.open_lock(run_dir, create=False)
        except layout.LockFileError as exc:
            raise RunInUse(str(exc)) from None
        except OSError:
            pass
    guard = (run_dir, fd, what)
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunInUse(f"run directory {run_dir} is training (pid {layout.lock_holder(fd)}, or the workers "
                               f"it started): {what} once the training has ended") from None
            except OSError:  # a file system without flock: as the training does, go on unguarded
                guard = None
        _guards.append(guard)
        yield
    finally:
        if guard in _guards:
            _guards.remove(guard)
        if fd is not None:
            os.close(fd)


# What reading_run holds in this process: (run directory, lock fd or None, what the gate does).
_guards: list[tuple[Path | None, int | None, str] | None] = []


def _lock_lost() -> str | None:
    """Why the run a gate reads may have been taken by a training since the gate locked it, or None:
    ``RUN/.lock`` was removed or replaced (the training makes it again, see launch.local.LockKeeper),
    or it was absent and a training holds one now.
    """
    for guard in _guards:
        if guard is None or guard[0] is None:
            continue
        run_dir, fd, what = guard
        if fd is not None:
            if layout.names_lock(run_dir, fd):
                continue
        else:
            try:
                now = layout.open_lock(run_dir, create=False)
            except (layout.LockFileError, OSError):
                now = None
            if now is None:
                continue
            try:
                if not layout.held_exclusively(now):
                    continue
            finally:
                os.close(now)
        return (f"{layout.lock_path(run_dir)} was removed or replaced while this gate read the run: a training "
                f"may have taken it meanwhile; {what} again once no training runs there")
    return None


def withdraw(run_dir: str | os.PathLike[str], gate: str) -> None:
    """Remove the gate's record: the gate ran again and could not judge the run (its event log no
    longer reads, say), so an earlier verdict must not stand for it (a stranger trial's promotion
    went on from a PASS that a later, crashed gate had left in place).
    """
    if not Path(run_dir).is_dir():  # no record can be there; the gate's own error says what is wrong
        return
    try:
        record_path(run_dir, gate).unlink(missing_ok=True)
    except OSError as exc:
        raise RecordError(f"the earlier {gate} record {record_path(run_dir, gate)} cannot be removed: "
                          f"{exc.strerror or exc}") from None


def read_record(run_dir: str | os.PathLike[str], gate: str) -> dict[str, Any] | None:
    """The gate's record, or None when the gate never ran in this run."""
    path = record_path(run_dir, gate)
    try:
        return cf.read_json_object(path)
    except FileNotFoundError:
        return None


def run_dir_of(ckpt_dir: str | os.PathLike[str]) -> Path | None:
    """The run holding ``RUN/checkpoints/step_N``, or None for a checkpoint outside a run.

    Read from the path as named, not where its links lead: a ``step_N`` (or ``checkpoints/``)
    that is a symbolic link to another run's belongs to the run named, whose event log and gate
    records then disown it (a stranger trial had a swapped-in link judged by its target's log).
    """
    ckpt_dir = Path(os.path.abspath(ckpt_dir))
    if ckpt_dir.parent.name == layout.CHECKPOINTS_DIRNAME:
        return ckpt_dir.parent.parent
    return None
