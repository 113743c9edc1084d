"""The event log: the one source of truth every metric, gate and report is computed from.

Every process appends JSON lines to ``RUN/events/<writer>.jsonl``. A line is one event::

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
"""

from __future__ import annotations

import dataclasses
import json
import os
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
    "ckpt_committed": ("bytes", "seconds", "path", "tier", "world_size"),  # seconds: ckpt_begin -> commit
    "ckpt_deferred": ("reason",),  # a save skipped because the previous one is still writing
    "ckpt_failed": ("reason",),
    # A save lost with a dead writer: every rank logs it at the same step; never committed.
    "ckpt_abandoned": ("reason", "tier"),
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
    # --memory-snapshot-every was turned off for the run (reason: no memory for the second copy).
    "memory_snapshot_off": ("reason",),
    "calibrated": ("timeouts",),
    "end": ("status", "reason"),  # status: completed | failed
}

RESTART_LAYERS = ("inprocess", "launcher", "pod")


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
        record = json.loads(line)
        base = {k: record.pop(k) for k in ("ts", "rank", "attempt", "event", "step")}
        iteration = record.pop("iteration", 0)
        return cls(fields=record, iteration=iteration, **base)


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
        self.path = directory / f"{name}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

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
        # and in the kernel before a SIGKILL that follows (fault injection relies on it).
        os.write(self._fd, (record.to_json() + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_event_files(run_dir: str | os.PathLike[str]) -> Iterator[Path]:
    directory = events_dir(run_dir)
    if directory.is_dir():
        yield from sorted(directory.glob("*.jsonl"))


def read_events(run_dir: str | os.PathLike[str]) -> list[Event]:
    """All events of a run, ordered by time. A torn last line (killed writer) is skipped."""
    events: list[Event] = []
    for path in iter_event_files(run_dir):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if not line.endswith("\n"):
                    break  # torn final line of a writer killed mid-write
                line = line.strip()
                if line:
                    events.append(Event.from_json(line))
    events.sort(key=lambda e: e.ts)
    return events


def select(events: Iterable[Event], *names: str, rank: int | None = None) -> list[Event]:
    """Events with one of ``names`` (all if none given), optionally of one rank."""
    return [e for e in events if (not names or e.event in names) and (rank is None or e.rank == rank)]
