"""The event log: the one source of truth every metric, gate and report is computed from.

Every process appends JSON lines to ``RUN/events/<writer>.jsonl``: ``rankN`` for rank N (no leading
zeros), ``launcher``, ``cluster`` or ``agent-HOST-PID`` for the launchers (rank -1); the reader
refuses a file of any other name (:func:`log_owner`). A line is one event::

    {"ts": 1764430000.123, "rank": 0, "attempt": 1, "iteration": 0, "event": "step",
     "step": 12, "loss": 5.41, "seconds": 0.21}

- ``ts``: wall-clock seconds (``time.time()``), comparable across processes on one machine
  and, with NTP, across nodes.
- ``rank``: global rank of the writer (-1 for the launcher and the simulated cluster).
- ``attempt``: launcher restart count (``TORCHELASTIC_RESTART_COUNT``); a pod replacement
  keeps counting from its own agent's view, so ``node`` (when set) tells pods apart.
- ``iteration``: in-process restart iteration inside this attempt (``CallWrapper.iteration``).
- ``event``: one of :data:`EVENT_TYPES`; ``step``: the training step it refers to (or null).
- any further keys are the event's fields (see :data:`EVENT_TYPES`).

Each writer owns its file and writes each line with a single ``write()`` on an
``O_APPEND`` descriptor, so a SIGKILL can lose at most the line being written, never
corrupt earlier ones. Readers merge all files and order by ``ts``.

Reading is strict: every complete line must be a JSON object with ``ts`` a finite number,
``rank``/``attempt``/``iteration`` integers, ``event`` a string and ``step`` an integer or
null; a ``step`` event carries an integer ``step`` and a JSON number ``loss`` (NaN and
Infinity included: the gates report them as not finite); in any event, the fields the metrics
compute with (:data:`NUMBER_FIELDS`, :data:`INT_FIELDS`, :data:`STRING_FIELDS`) are null or of
their kind. Anything else raises
:class:`EventLogError` naming the file and line; only a torn final line (no newline: its
writer was killed mid-write) is skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from resilient_training.run.layout import events_dir

# event name -> the fields it carries (beyond ts/rank/attempt/iteration/event/step).
EVENT_TYPES: dict[str, tuple[str, ...]] = {
    # node: simulated node (pod index) of the writer, null outside the simulated cluster.
    # agent: host:pid:start-time of the agent that started the worker (tells its restarts apart).
    # process_seconds: process start -> this event (interpreter start-up and imports).
    # spare: a warm spare took this worker's place (process_seconds then counts from its stub's start).
    "start": ("world_size", "pid", "host", "layers", "nvrx_version", "torch_version", "node", "agent", "local_rank",
              "process_seconds", "spare"),
    "step": ("loss", "seconds"),
    "ckpt_begin": ("mode", "tier", "retry"),  # tier: persistent | local; retry: the final step written again
    "ckpt_staged": ("seconds",),  # training blocked this long (staging or the whole sync save)
    # world_size: ranks whose chunks the checkpoint holds (what validation proves coverage against).
    # manifest_checksum: xxh3_128 of the committed manifest.json (validation's witness that the
    # checkpoint in the directory is the one this run committed).
    "ckpt_committed": ("bytes", "seconds", "path", "tier", "world_size", "manifest_checksum"),  # seconds: begin -> commit
    "ckpt_deferred": ("reason",),  # a save skipped: the previous one still writing, or buffers still being page-locked
    "ckpt_failed": ("reason",),
    # A save lost with a dead writer: every rank logs it at the same step; never committed. Also a
    # save an in-process restart drops ("save dropped at the in-process restart: ..."), or a
    # carried one (below) a later restart drops ("carried save dropped: ..."): every ckpt_begin
    # ends in a ckpt_committed (rank 0) or a ckpt_abandoned, unless its process died.
    "ckpt_abandoned": ("reason", "tier"),
    # A save in flight at an in-process restart, kept: committed once written (restored: the step
    # the restart restored, at or past it).
    "ckpt_carried": ("tier", "restored"),
    "fault_injected": ("fault",),
    # cause writer_died (the async writer process exited unasked, logged the moment it did) also
    # carries pid, exitcode and signal (e.g. SIGKILL) of that process.
    "failure_detected": ("cause", "message", "pid", "exitcode", "signal"),
    # The async writer process took its first job (seconds since it was asked for; off the critical path).
    "writer_ready": ("seconds", "pid"),
    # A new writer is ready in place of a dead one; training went on meanwhile (the `writer` layer).
    "writer_restarted": ("seconds", "pid", "restarts"),
    # the progress guard's allowance ran out (reason: for how long, at which phase or step
    # allowance, calibrated from what); where: step | collective (waiting for peers: likely a
    # symptom of a hung peer) | a phase (start, load, save, commit, calibrate).
    # failure_detected follows once the training thread is released.
    "hang_detected": ("reason", "where"),
    # layer pod: written by the simulated cluster (rank -1) when it kills a node (cause node-loss)
    # or finds an agent dead; node: the pod index concerned (null for other layers).
    "restart_begin": ("layer", "cause", "node"),
    "restart_done": ("layer", "node"),  # layer: inprocess | launcher | pod
    # step: restored (0 = fresh); source: memory (snapshot) | memory (staged, not yet committed) |
    # storage | storage (resharded); phases: seconds per start-up phase.
    "load_done": ("path", "source", "seconds", "phases"),
    # The bytes a restore read from storage, hashed behind it (this rank's share of the files):
    # problems lists what differs from the commit (empty: whole); damage stops the run.
    "restore_checked": ("path", "bytes", "seconds", "problems"),
    # --memory-snapshot-every was turned off for the run (reason: no memory for the second copy).
    "memory_snapshot_off": ("reason",),
    # GPUs: a background page-locking is over (what: staging | host_snapshot). failed_bytes: memory
    # CUDA refused to lock, whose copies are then synchronous (the training thread waits for them).
    "host_memory_locked": ("what", "bytes", "failed_bytes", "seconds"),
    # --host-snapshot was turned off for the run: its slots could not be made (reason: the error).
    "host_snapshot_off": ("reason",),
    "calibrated": ("timeouts",),
    # ft_launcher (NVRx 0.6+, written by the agent, rank -1): one of NVRx's own restart profiling
    # events (failure_detected, worker_terminated, rendezvous_started/_completed,
    # worker_start_started/_completed, ...), at the moment the agent recorded it.
    "launcher_phase": ("phase", "cycle", "node"),
    # ft_launcher (written by the agent, rank -1): a worker it found failed, once each. signal: the
    # one that killed it (SIGKILL for exitcode -9), null for a worker that exited with a code > 0.
    "worker_exit": ("global_rank", "local_rank", "pid", "exitcode", "signal", "state"),
    "end": ("status", "reason"),  # status: completed | failed | cancelled (SIGTERM, Ctrl-C)
}

RESTART_LAYERS = ("inprocess", "launcher", "pod")


class EventLogError(ValueError):
    """A line of the event log is not an event; the message names the file, the line and what is wrong."""


INT64_MAX = 2**63 - 1


def _is_int(value: Any) -> bool:
    # JSON true is no rank or step; one of 400 digits was an OverflowError in the report (stranger trial)
    return isinstance(value, int) and not isinstance(value, bool) and -INT64_MAX <= value <= INT64_MAX


def _is_number(value: Any) -> bool:
    """An int or float that converts to a float (NaN and infinities included), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)  # an int of 400 digits is JSON, but no loss or time
    except OverflowError:
        return False
    return True


# Fields the gates and metrics compute with, whatever the event: null or of this kind. (A list
# in a commit's bytes, a cause or a layer was a traceback in the report: stranger trial.)
# Never NaN or infinite either, and never below 0 for a count (a NaN stall gave a checkpoint
# interval from nothing, a huge one goodput above 100 %: stranger trial).
NUMBER_FIELDS = ("seconds", "bytes", "failed_bytes", "process_seconds")
COUNT_FIELDS = ("bytes", "failed_bytes")
INT_FIELDS = ("world_size", "pid", "exitcode", "restarts", "restored")
STRING_FIELDS = ("cause", "message", "layer", "tier", "fault", "type", "where", "reason", "signal", "path", "source",
                 "status", "manifest_checksum", "what", "phase")


def _field_problem(fields: dict[str, Any]) -> str | None:
    for kinds, check, name in ((NUMBER_FIELDS, _is_number, "a JSON number"), (INT_FIELDS, _is_int, "an integer"),
                               (STRING_FIELDS, lambda v: isinstance(v, str), "a string")):
        for key in kinds:
            value = fields.get(key)
            if value is not None and not check(value):
                return f"{key} must be {name} or null, got {_shown(value)}"
    for key in NUMBER_FIELDS:
        value = fields.get(key)
        if value is not None and not (math.isfinite(value) and (value >= 0 or key not in COUNT_FIELDS)):
            return f"{key} must be a finite number{' >= 0' if key in COUNT_FIELDS else ''} or null, got {_shown(value)}"
    phases = fields.get("phases")
    if phases is not None and not (isinstance(phases, dict) and all(
            _is_number(v) and math.isfinite(v) for v in phases.values())):
        return f"phases must be an object of finite numbers (seconds per phase) or null, got {_shown(phases)}"
    return None


def _shown(value: Any) -> str:
    text = repr(value)  # repr: a newline in a value stays on the message's one line
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One line of the event log."""

    ts: float
    rank: int
    attempt: int
    iteration: int
    event: str
    step: int | None
    fields: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def to_json(self) -> str:
        record: dict[str, Any] = {
            "ts": self.ts,
            "rank": self.rank,
            "attempt": self.attempt,
            "iteration": self.iteration,
            "event": self.event,
            "step": self.step,
        }
        record.update(self.fields)
        return json.dumps(record, separators=(",", ":"), allow_nan=True)

    @classmethod
    def from_json(cls, line: str) -> Event:
        """One line parsed and checked (see the module docstring); EventLogError saying what is wrong."""
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise EventLogError(f"not JSON ({exc})") from None
        except RecursionError:  # '[' nested past the interpreter's limit (a stranger trial's traceback)
            raise EventLogError("not JSON (nested too deeply)") from None
        if not isinstance(record, dict):
            raise EventLogError(f"not a JSON object but {type(record).__name__}")
        missing = [k for k in ("ts", "rank", "attempt", "event", "step") if k not in record]
        if missing:
            raise EventLogError(f"no {', '.join(missing)}")
        record.setdefault("iteration", 0)  # logs written before in-process restarts were counted
        ts = record["ts"]
        if not _is_number(ts) or not math.isfinite(ts):  # a NaN time would scramble the order of the log
            raise EventLogError(f"ts must be a finite number, got {_shown(ts)}")
        for key in ("rank", "attempt", "iteration"):
            if not _is_int(record[key]):
                raise EventLogError(f"{key} must be an integer, got {_shown(record[key])}")
        if not isinstance(record["event"], str):
            raise EventLogError(f"event must be a string, got {_shown(record['event'])}")
        if record["event"] not in EVENT_TYPES:  # a rank's "End" was passed over, its run left without an end
            raise EventLogError(f"event {_shown(record['event'])} is none of the event log's (an edited log, or a "
                                "newer version's)")
        step = record["step"]
        if step is not None and not _is_int(step):
            raise EventLogError(f"step must be an integer or null, got {_shown(step)}")
        if record["event"] == "step":
            # The gates judge these: a loss that is "0.01" or true must not pass for a number.
            if step is None:
                raise EventLogError("a step event must name its step, got null")
            if not _is_number(record.get("loss")):
                raise EventLogError(f"a step event's loss must be a JSON number, got {_shown(record.get('loss'))}")
            if record.get("seconds") is not None and not (_is_number(record["seconds"])
                                                          and math.isfinite(record["seconds"])):
                raise EventLogError(f"a step event's seconds must be a finite number, got {_shown(record['seconds'])}")
        base = {k: record.pop(k) for k in ("ts", "rank", "attempt", "iteration", "event", "step")}
        problem = _field_problem(record)
        if problem:
            raise EventLogError(f"a {base['event']} event's {problem}")
        return cls(fields=record, **base)


class EventLog:
    """Appends events of one writer (a rank, a launcher, a checkpoint writer) to its file."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        rank: int,
        attempt: int = 0,
        writer: str | None = None,
    ) -> None:
        self.rank = rank
        self.attempt = attempt
        self.iteration = 0
        directory = events_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        name = writer or (f"rank{rank}" if rank >= 0 else "launcher")
        if log_owner(f"{name}.jsonl") != max(rank, -1):  # a file the reader would refuse, or read as another's
            raise ValueError(f"an event log of rank {rank} cannot be named {name}.jsonl: the reader takes "
                             f"{LOG_NAMES} only")
        self.path = directory / f"{name}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _drop_torn_tail(self.path)

    def emit(self, event: str, step: int | None = None, **fields: Any) -> Event:
        if event not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event!r}; known: {sorted(EVENT_TYPES)}")
        record = Event(
            ts=time.time(),
            rank=self.rank,
            attempt=self.attempt,
            iteration=self.iteration,
            event=event,
            step=step,
            fields=fields,
        )
        # One write() per line on an O_APPEND fd: atomic with respect to other writers,
        # and in the kernel before a SIGKILL that follows (fault injection relies on it). A short
        # write (a full disk, some network file systems) is finished, not left torn.
        data = memoryview((record.to_json() + "\n").encode())
        while data:
            data = data[os.write(self._fd, data):]
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


YEAR = 365.25 * 86400.0
DECADE = 10 * YEAR


def _drop_torn_tail(path: Path, window: int = 1 << 16) -> None:
    """Cut a torn last line (its writer killed mid-write) before appending: the next writer's first
    line was glued onto it, and the whole log could no longer be read (a second stranger trial).
    Lines are written whole by one write() each, so a tail without its newline is nobody's line
    in progress.
    """
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return
        start = max(0, size - window)
        handle.seek(start)
        tail = handle.read()
    if tail.endswith(b"\n"):
        return
    newline = tail.rfind(b"\n")
    if newline < 0 and start > 0:
        return  # no line end in the last 64 KiB: not a torn line of ours, left as it is
    os.truncate(path, start + newline + 1)


# The writers' file names, exactly: rank N's log is ``rankN.jsonl`` (N in ASCII digits, without
# leading zeros: ``\d`` took ``rank00.jsonl``, or a rank of Unicode digits, for rank 0's own log, and a
# forged commit in it for rank 0's: a stranger trial); the launchers' (rank -1) are ``launcher``,
# ``cluster`` (the simulated cluster) and ``agent-HOST-PID`` (an ft_launcher agent). Any other
# ``*.jsonl`` in events/ is no writer's log, and the reader refuses it by name.
RANK_LOG_NAME = re.compile(r"rank(0|[1-9][0-9]*)\.jsonl")
LAUNCHER_LOG_NAME = re.compile(r"(launcher|cluster|agent-.+)\.jsonl", re.DOTALL)
LOG_NAMES = "rankN.jsonl (rank N's, N without leading zeros), launcher.jsonl, cluster.jsonl, agent-HOST-PID.jsonl"


def log_owner(name: str) -> int | None:
    """The rank whose events the events/ file ``name`` holds (-1: the launchers'), None when no
    writer writes a file of that name.
    """
    if named := RANK_LOG_NAME.fullmatch(name):
        return int(named.group(1))
    return -1 if LAUNCHER_LOG_NAME.fullmatch(name) else None


def iter_event_files(run_dir: str | os.PathLike[str]) -> Iterator[Path]:
    directory = events_dir(run_dir)
    if directory.is_dir():
        yield from sorted(directory.glob("*.jsonl"))


def _open_log(path: Path) -> Any:
    """``path`` opened for reading in binary, when it is a regular file: a FIFO blocked the reader
    for good, a directory or a device is no log (EventLogError, naming it).
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise EventLogError(f"{path}: not a file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # no wait for a writer, should it be swapped for a FIFO
    except OSError as exc:
        raise EventLogError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise EventLogError(f"{path}: not a file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")  # bytes: a line that is not UTF-8 is named like any other bad line


def read_events(run_dir: str | os.PathLike[str]) -> list[Event]:
    """All events of a run, ordered by time. A torn last line (killed writer) is skipped;
    any other line that is not an event raises EventLogError (``FILE:LINE: what is wrong``).
    """
    events: list[Event] = []
    # Each line's digest and where it was: no writer writes one line twice (each carries its own
    # ts), and a log appended to itself, or a launcher file copied, counted its events twice.
    seen: dict[bytes, str] = {}
    for path in iter_event_files(run_dir):
        # Whose events the file holds: rankN.jsonl rank N's, the launchers' files rank -1's (see
        # log_owner). A copy of rank0.jsonl beside it counted every step, save and fault twice, and
        # a rank00.jsonl was read as rank 0's (stranger trials): a file of no writer's name is refused.
        owner = log_owner(path.name)
        if owner is None:
            raise EventLogError(f"{path}: no writer's event log (put there by hand, or a copy?): events/ holds "
                                f"{LOG_NAMES} only; move it out of events/")
        named = owner >= 0
        latest = -math.inf  # a file's writers append in time: one line far out of it is no time (below)
        future = time.time() + 86400.0
        handle = _open_log(path)
        with handle:
            for number, raw in enumerate(handle, start=1):
                if not raw.endswith(b"\n"):
                    break  # torn final line of a writer killed mid-write
                try:
                    line = raw.decode("utf-8").strip()
                    if line:
                        event = Event.from_json(line)
                        if event.rank != owner:
                            raise EventLogError(
                                f"rank {event.rank} in {path.name}, which holds "
                                + (f"rank {owner}'s events only" if named else "the launchers' (rank -1) only"))
                        # One edited ts made the run's wall time 1e308 s, or 57 years, and its
                        # goodput 100 % (stranger trial); a clock stepped back goes back seconds.
                        if event.ts > future:
                            raise EventLogError(f"ts {event.ts!r} lies more than a day in the future")
                        if event.ts < latest - DECADE:
                            raise EventLogError(f"ts {event.ts!r} goes back {(latest - event.ts) / YEAR:.0f} years "
                                                "from an earlier line of this file (no clock step does)")
                        latest = max(latest, event.ts)
                        digest = hashlib.blake2b(raw.strip(), digest_size=16).digest()
                        if digest in seen:
                            raise EventLogError(f"repeats {seen[digest]} exactly (a copied or concatenated log: "
                                                "each of its events would count twice)")
                        seen[digest] = f"{path.name}:{number}"
                        events.append(event)
                except (EventLogError, UnicodeDecodeError) as exc:
                    raise EventLogError(f"{path}:{number}: not an event: {exc}") from None
    events.sort(key=lambda e: e.ts)
    return events


def select(events: Iterable[Event], *names: str, rank: int | None = None) -> list[Event]:
    """Events with one of ``names`` (all if none given), optionally of one rank."""
    return [e for e in events if (not names or e.event in names) and (rank is None or e.rank == rank)]
