"""The run directory: the one place that names what lives in it.

RUN/
config.json      the run's TrainConfig (written by the launcher)
checkpoints/     step_N/ directories and the ``latest`` pointer (checkpoint_format)
events/          one JSONL file per writer (events)
gates/           validation.json, convergence.json (gate_records)
logs/            launcher and worker logs
.lock            held by the training that uses the run (launch.local.claim_run_dir); its pid inside
argo/            on Argo Workflows: each step's output artifacts, argo/<task>/<name> (resilient_training.argo)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
CHECKPOINTS_DIRNAME = "checkpoints"
EVENTS_DIRNAME = "events"
GATES_DIRNAME = "gates"
LOGS_DIRNAME = "logs"
ARGO_DIRNAME = "argo"
LOCK_NAME = ".lock"

PathLike = str | os.PathLike[str]


def config_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / CONFIG_NAME


def checkpoints_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIRNAME


def events_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / EVENTS_DIRNAME


def gates_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / GATES_DIRNAME


def logs_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / LOGS_DIRNAME


def lock_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / LOCK_NAME


def run_dir_around(path: PathLike) -> Path | None:
    """The run directory ``path`` is or lies in (an event log, and a config or checkpoints), else None;
    ``path`` as named, made absolute (not resolved).
    """
    here = Path(os.path.abspath(path))
    for candidate in (here, *here.parents):
        if events_dir(candidate).is_dir() and (config_path(candidate).is_file() or checkpoints_dir(candidate).is_dir()):
            return candidate
    return None


def evidence_holding(run_dir: PathLike, path: PathLike) -> str | None:
    """Which of the run's records (``events/``, ``checkpoints/``, ``gates/``, ``config.json``: the
    gates' evidence) ``path`` is or lies in, as ``name/rest`` (symlinks resolved on both sides: a
    link to one of them, or one of them a link, is no way in); None when it is in none.
    """
    target = Path(path).resolve()
    for record in (events_dir(run_dir), checkpoints_dir(run_dir), gates_dir(run_dir), config_path(run_dir)):
        where = record.resolve()
        if target == where or where in target.parents:
            return str(Path(record.name, target.relative_to(where)))
    return None


def local_tier_base(config: Any) -> Path:
    """The node-local tier's directory, which every run's folder is in (node-local by design)."""
    return Path(config.checkpoint.local_dir) if config.checkpoint.local_dir else Path("/dev/shm") / "resilient-training"


def run_key(run_dir: str) -> str:
    """A run directory's folders in the node-local tier are named ``<run key>-...``."""
    import hashlib

    return hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]


def worker_records(config: Any) -> Path:
    """Where the run's workers record their pids (runtime/gpu_reclaim.py), one folder per run."""
    return local_tier_base(config) / f"{run_key(config.run_dir)}-workers"


def held_exclusively(fd: int) -> bool:
    """Whether a training holds the lock file ``fd`` (exclusively: a shared lock is refused now); a
    file system without ``flock(2)`` says no. The shared lock taken to find out is let go again.
    """
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def lock_holder(fd: int) -> str:
    """The pid the training that last took the lock wrote into it ("unknown" if none)."""
    return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"


def names_lock(run_dir: PathLike, fd: int) -> bool:
    """Whether ``RUN/.lock`` is still the file ``fd`` holds: not removed or replaced since it was
    opened (a lock on a file no longer at that path keeps nobody out).
    """
    try:
        now = os.stat(lock_path(run_dir), follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


class LockFileError(ValueError):
    """``RUN/.lock`` is there but is no regular file (a symbolic link, a directory, a FIFO)."""


def open_lock(run_dir: PathLike, *, create: bool) -> int | None:
    """The run's lock file (``RUN/.lock``) opened, read-write and made if ``create``, else read-only
    (None when there is none). Never through a symbolic link (``train`` overwrote a link's target)
    and never blocking (a FIFO put there hung every gate and ``train``, silently): a stranger trial.

    Raises:
        LockFileError: it is not a regular file: it names it and says to remove it.
        OSError: it cannot be opened (or made).

    """
    import errno
    import stat

    path = lock_path(run_dir)
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            kind = "a symbolic link" if exc.errno == errno.ELOOP else "a directory"
            raise LockFileError(f"{path} is not a regular file ({kind}): it is the run's training lock; "
                                "remove it") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LockFileError(f"{path} is not a regular file: it is the run's training lock; remove it")
    return fd
