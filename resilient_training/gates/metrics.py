"""The goodput maths: every number the report, the gates and the benchmarks show, from the event log.

Definitions (reference: the NVRx/ML Goodput benchmarks):

- **wall**: first event to last event of the run (every worker and writer, every attempt; the
  agents' own `launcher_phase` profile is not counted).
- **steps completed**: distinct steps the surviving trajectory holds; a step executed again
  after a rollback counts once, its earlier executions are *replayed* work.
- **training goodput** = productive step time / wall, where productive step time is the
  ``step.seconds`` of each step's last (surviving) execution.
- **fault episode**: opens at a ``fault_injected``, ``failure_detected`` or ``restart_begin``
  outside an open episode; closes at the first completed step after the first ``load_done``
  that follows it, or at that ``load_done`` when none came and the run completed (a restore at
  the final step, whose checkpoint is then written again; triggers inside an open episode join
  it, but a fault a rank injects after its own restore and a step completed since closes the
  episode at that step and opens its own). An episode of peers' reports only (``peer_failure``,
  ``restart_requested``) with no restore after it and training going on is no fault (a report
  logged late). Its **recovery seconds** run from the opening event to that step (for a fault nobody
  injected, from when it struck as far as the log tells, as an injected one from its injection: a
  hung rank's last progress, a silently dead rank's last event; see root cause); its **layer** is the
  outermost ``restart_done`` layer inside it (pod > launcher > inprocess), else inferred from the
  attempt/iteration change;
  its **rollback distance** is the last step completed before the restore minus the step
  restored. A trigger after which training went on in the same attempt and iteration with
  no restore is a fault absorbed without restart (layer ``none``, 0 s); not a NaN the training
  went on with (every later loss NaN: ``unrecovered``).
- **writer layer**: the async checkpoint writer process died and was replaced while training
  went on (``writer_restarted``, no restore). Such an episode runs from the death (its
  ``failure_detected``, logged the moment the process exited) to **steady state**: the
  reference rank's first step (or its ``end``) after the new writer is ready, i.e. once saves
  can be written again. Training never stopped, so it is recovery time but not downtime, and
  it does not count as a failure for the suggested interval (no work was lost). One cut short by
  another fault before its new writer was ready runs to that readiness.
- **root cause** of an episode (what happened, not what the other ranks saw): the injected
  fault (type, rank, step), else the first ``failure_detected`` whose cause is not a symptom of
  another rank's failure (``peer_failure``, ``restart_requested``: exception type and message,
  ``nan``, timeouts), else a rank whose progress guard ran out outside a collective
  (``hang_detected`` near the failure: kind ``hang``; the episode then starts when that rank
  stopped making progress), else a hang report (of several, the one stalled outside a
  collective), else a pod/node restart cause, else — when every reporting rank only saw a
  peer fail — the training rank that reported nothing (it died without a word: a signal or a
  crash; the episode starts at its last event), else the ranks NVRx names in a restart request
  (``Interruption.UNRESPONSIVE on ranks={0}``: kind ``unresponsive``, ``rank``/``ranks``).
  A peer's failed collective (``DistBackendError``) is the root cause only when no rank says
  more. The other ranks' reports are the episode's **symptoms**, linked to it and never counted
  as faults of their own. An injected fault that only shows later (a killed checkpoint writer is
  found at the next save) is linked to the failure it caused: one fault, with the seconds until it
  was detected.
- **recovery phases** of an episode: where its recovery time went, in order, adding up to it
  (:func:`recovery_phases`): ft_launcher's own restart profile, the new process's start-up, the
  phases the restore reports (``nvrx_*`` after an in-process restart), the first step.
- **infrastructure goodput** = (wall − downtime) / wall, downtime = union of the spans of
  episodes that stopped training (every layer but ``none`` and ``writer``; an episode never
  closed runs to the end of the log).
- **checkpoint freshness** at a step = that step minus the newest step committed before it
  (either tier: the persistent one and the node-local one both restore).
- **checkpoint stall** per save = ``ckpt_staged.seconds`` (training blocked by the save).
- **suggested interval** (Young/Daly): C = mean stall per save, M = wall / episodes that
  restarted; Young ``sqrt(2CM)``, Daly ``sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) − C`` (C < 2M),
  in seconds and in steps of the median productive step time.

Losses and steps are read from one *reference rank*: the lowest rank that logged steps
(training steps are collective, so every rank logs the same step numbers).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import os
import re
import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from resilient_training.run import events as ev
from resilient_training.run import faults as flt
from resilient_training.run import layout

TRIGGERS = ("fault_injected", "failure_detected", "restart_begin")
# What a rank reports when *another* rank failed or a restart was requested of it: never a root cause.
SYMPTOMS = ("peer_failure", "restart_requested")
# A collective that failed because a peer went away: the root cause only when no rank says more.
COMM_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
# Injected faults whose failure shows later (the writer is found dead at the next save), by the cause
# the trainer then reports: the later episode is that fault's, not a fault of its own.
DELAYED = {"writer_died": "writer-kill"}
# Injected faults that end their rank's process whatever the layers do (see _absorbed).
ALWAYS_KILLS = frozenset({"sigkill", "ckpt-kill"})
LAYER_ORDER = {"none": 0, "writer": 1, "reload": 2, "inprocess": 3, "launcher": 4, "pod": 5}
# Layers that recover without stopping training: their episodes are recovery time, not downtime.
NON_STOPPING = ("none", "writer")


class RunError(ValueError):
    """The directory is not a run with an event log (a usage error for the commands)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepRun:
    """One execution of one step on one rank."""

    ts: float
    rank: int
    attempt: int
    iteration: int
    step: int
    loss: float
    seconds: float


@dataclasses.dataclass(slots=True)
class Episode:
    """One fault and the recovery from it."""

    start: float
    end: float | None = None
    fault: str | None = None
    cause: str | None = None
    layer: str = "none"
    restored_step: int | None = None
    restored_at: float | None = None  # the reference rank's load_done
    last_step_before: int | None = None
    fault_step: int | None = None
    context: tuple[int, int] | None = None
    writer_ready: float | None = None  # a new writer was ready in place of a dead one (writer_restarted)
    symptom_only: bool = True  # every trigger so far is a rank reporting another's failure (see episodes)
    replaced_at: float | None = None  # a writer episode cut by another fault: when its new writer was ready
    writer_rank: int | None = None  # the rank whose writer died (a writer episode)
    never_replaced: bool = False  # a writer episode cut by another fault, and no new writer was ready after
    # A fault nobody injected: when it struck as far as the log tells (a hung rank's last progress, a
    # silent rank's last sign of life), the episode's start in place of the first report (see _attribute)
    struck_at: float | None = None
    session_end: float | None = None  # the last event of the launch it struck in (see sessions)
    triggers: list[str] = dataclasses.field(default_factory=list)
    root_cause: dict[str, Any] = dataclasses.field(default_factory=dict)
    symptoms: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # (cause, ts, message) of a delayed fault's failure found inside this episode (see _link_delayed)
    surfaced: list[tuple[str, float, str]] = dataclasses.field(default_factory=list)

    @property
    def recovered(self) -> bool:
        return self.end is not None

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def rollback(self) -> int | None:
        if self.restored_step is None or self.last_step_before is None:
            return None
        return max(0, self.last_step_before - self.restored_step)


# Events about the launcher, not the training: they do not stretch the run's wall time.
AGENT_DIAGNOSTICS = frozenset({"launcher_phase", "worker_exit"})


def is_agent_diagnostic(e: ev.Event) -> bool:
    """Written by a launcher agent (rank -1) about itself; a rank's event of that name still counts."""
    return e.event in AGENT_DIAGNOSTICS and e.rank < 0


def duration(e: ev.Event, key: str = "seconds") -> float:
    """An event's seconds (or bytes): 0 when null or absent, and never below 0 (the trainer times
    some of them with the wall clock, which a clock step can turn back; a negative save stall was a
    math domain error in the interval suggestion: stranger trial).
    """
    value = e.get(key)
    return max(0.0, float(value)) if value is not None else 0.0


def _ts(e: ev.Event) -> float:
    return e.ts


def _within(events: list[ev.Event], start: float, end: float) -> list[ev.Event]:
    """The events with ``start <= ts <= end``, of a list in time order: a slice, not a scan (each
    episode scanned the whole log: 77 s for a log of 4,000 faults, a second stranger trial).
    """
    return events[bisect.bisect_left(events, start, key=_ts):bisect.bisect_right(events, end, key=_ts)]


def load_events(run_dir: str | os.PathLike[str]) -> list[ev.Event]:
    """The run's events; RunError when there is no run or no event log."""
    path = Path(run_dir)
    if not path.exists():
        raise RunError(f"{path} does not exist")
    if not path.is_dir():
        raise RunError(f"{path} is not a directory")
    if not layout.events_dir(path).is_dir():
        raise RunError(f"{path} is not a run: it has no {layout.EVENTS_DIRNAME}/ directory")
    events = ev.read_events(path)
    if not events:
        raise RunError(f"{path}/{layout.EVENTS_DIRNAME}/ holds no events")
    return events


def reference_rank(events: Iterable[ev.Event]) -> int | None:
    ranks = sorted({e.rank for e in events if e.event == "step" and e.rank >= 0})
    return ranks[0] if ranks else None


def step_runs(events: Iterable[ev.Event], rank: int | None = None) -> list[StepRun]:
    """Every step execution (of one rank, or all), in time order."""
    out = []
    for e in events:
        if e.event == "step" and e.step is not None and (rank is None or e.rank == rank):
            out.append(StepRun(e.ts, e.rank, e.attempt, e.iteration, int(e.step), float(e.get("loss", math.nan)),
                               duration(e)))
    return out


def surviving(runs: Iterable[StepRun]) -> dict[int, StepRun]:
    """The trajectory the final model went through: each step's last execution, without the steps
    a rollback went back past that were never executed again (a stranger trial's run stopped at
    step 40, resumed from step 30 with ``--steps 35``: steps 36-40 counted as trained, and its
    convergence gate said the log was cut).
    """
    trajectory: list[StepRun] = []
    for run in runs:
        while trajectory and trajectory[-1].step >= run.step:
            trajectory.pop()
        trajectory.append(run)
    return {run.step: run for run in trajectory}


def restores(events: Iterable[ev.Event]) -> list[ev.Event]:
    """``load_done`` events that recovered a rank which had already trained (not its first start)."""
    trained: set[int] = set()
    out = []
    for e in events:
        if e.event == "step":
            trained.add(e.rank)
        elif e.event == "load_done" and e.rank in trained:
            out.append(e)
    return out


def episodes(events: list[ev.Event]) -> list[Episode]:
    """Group triggers into fault episodes and measure each (see the module docstring)."""
    events = sorted(events, key=_ts)  # (in time order already when read: a check of a few ms)
    ref = reference_rank(events)
    found: list[Episode] = []
    current: Episode | None = None
    context: tuple[int, int] | None = None  # (attempt, iteration) of the reference rank's last step
    last_step: int | None = None
    writer_only = False  # the current episode is a dead writer being replaced while training goes on
    cut_writer: Episode | None = None  # a writer episode cut by another fault before its new writer was ready
    restored: dict[int, ev.Event] = {}  # rank -> its load_done in the current episode
    stepped: dict[int, ev.Event] = {}  # rank -> its first step after that load_done
    spans = sessions(events)
    launched = [start for start, _ in spans[1:]]
    last_seen: dict[int, tuple[float, int]] = {}  # training rank -> (ts, attempt) of its latest event
    for e in events:
        if (current is None and e.event == "start" and e.rank == ref and context is not None
                and e.attempt != context[0] and not any(last_seen.get(ref, (e.ts,))[0] < b <= e.ts for b in launched)):
            # The workers were restarted and no rank logged why (the launcher stopped the survivors
            # before they could: a worker's kill -9 was no fault at all in the report, a stranger
            # trial). From the earliest last sign of life of the old workers.
            old = [ts for ts, attempt in last_seen.values() if attempt == context[0]]
            current = Episode(start=min(old) if old else e.ts, fault_step=(last_step or 0) + 1, context=context,
                              cause="died")
            current.triggers.append("unlogged_restart")
            current.symptom_only, writer_only, restored, stepped = False, False, {}, {}
            found.append(current)
        if e.rank >= 0:
            last_seen[e.rank] = (e.ts, e.attempt)
        if e.event in TRIGGERS:
            if current is not None and e.event == "fault_injected" and e.rank in stepped:
                # The injecting rank restored and completed a step since (steps are collective: so
                # did its peers, whose step lines may come a moment later): the recovery is over, and
                # this is a fault of its own (a stranger trial's exception@6:1x3 on rank 1 was folded
                # into the previous one, and the next recovery blamed on rank 1 dying without a word).
                first = stepped[e.rank]
                if current.restored_step is None:
                    current.restored_step, current.restored_at = int(restored[e.rank].step or 0), restored[e.rank].ts
                    current.last_step_before = last_step
                current.end, current = first.ts, None
            if current is None:
                restored, stepped = {}, {}
            if current is not None and writer_only and e.event == "fault_injected":
                # Another fault while the writer is being replaced: its own episode, not a part
                # of the writer's, which is cut here, and measured to its new writer's readiness
                # when that comes (a stranger trial's writer-kill x3 said 0.02 s for a 1.46 s
                # replacement); until then, up to this fault.
                if current.writer_ready is None:
                    cut_writer = current
                current.writer_ready = current.writer_ready or e.ts
                current.end, current = e.ts - 1e-6, None  # just before: the new fault is not in it
            if current is None:
                current = Episode(start=e.ts, fault_step=e.step, context=context)
                found.append(current)
                writer_only = False
            if e.event == "failure_detected" and e.get("cause") == "writer_died" and "restart_begin" not in current.triggers:
                writer_only = True
                current.writer_rank = e.rank if current.writer_rank is None else current.writer_rank
            elif e.event == "restart_begin" or (e.event == "failure_detected" and e.get("cause") != "writer_died"):
                writer_only = False
            current.triggers.append(e.event)
            if not (e.event == "failure_detected" and e.get("cause") in SYMPTOMS):
                current.symptom_only = False
            if e.event == "fault_injected" and current.fault is None:
                current.fault = e.get("fault")
            if e.event in ("failure_detected", "restart_begin") and current.cause is None:
                current.cause = e.get("cause")
            continue
        if e.event in ("writer_restarted", "writer_ready") and cut_writer is not None \
                and e.rank == cut_writer.writer_rank:
            # Replaced in the same process (writer_restarted), or by a new process's writer after a
            # launcher restart (writer_ready): a stranger trial's cut episode said 0.97 s, recovered,
            # while no writer was ready for 11 s.
            cut_writer.replaced_at, cut_writer = e.ts, None
        if current is not None and e.event == "writer_restarted" and current.writer_ready is None:
            current.writer_ready = e.ts
        if current is not None and e.event == "load_done":
            restored[e.rank] = e
            stepped.pop(e.rank, None)
        elif current is not None and e.event == "step" and e.rank in restored:
            stepped.setdefault(e.rank, e)
        if current is not None and e.rank == ref:
            if (e.event in ("step", "end") and current.restored_step is None and current.writer_ready is not None
                    and e.ts >= current.writer_ready):
                current.end = e.ts  # steady state again: saves can be written (see the module docstring)
                current = None
            elif e.event == "load_done" and current.restored_step is None:
                current.restored_step, current.restored_at = int(e.step or 0), e.ts
                current.last_step_before = last_step
            elif e.event == "end" and current.symptom_only and current.restored_step is None \
                    and e.get("status") == "completed":
                current.end, current = current.start, None  # a peer's late report: nothing failed, see below
            elif e.event == "end" and current.restored_step is not None and e.get("status") == "completed":
                # Restored at the final step (its save had failed) and the run then completed:
                # recovered when the restore was done. What followed is the final save, which a run
                # without the fault makes too (a failed end leaves the fault unrecovered).
                current.end, current = current.restored_at, None
            elif e.event == "step" and e.step is not None:
                if current.restored_step is not None:
                    current.end = e.ts
                elif _absorbed(current, e):
                    current.end = current.start
                if current.end is not None:
                    current = None
        if e.event == "step" and e.rank == ref and e.step is not None:
            last_step, context = int(e.step), (e.attempt, e.iteration)
    if cut_writer is not None:  # cut by another fault, and no new writer was ever ready on its rank
        cut_writer.never_replaced = True
    # Only ranks reporting another's failure, and training went on without a restart: a report
    # logged late (a rank that finished first seen as gone by its peer; a clock a little ahead),
    # not a fault. (A stranger trial's late peer_failure was an unrecovered fault, blamed on rank 0,
    # in a run that completed.)
    last = next((e for e in reversed(events) if e.rank == ref), None)  # the run ended so, nothing after
    completed = last is not None and last.event == "end" and last.get("status") == "completed"
    found = [p for p in found if not (p.symptom_only and p.restored_step is None
                                      and (p.end == p.start or (p.end is None and completed)))]
    previous: Episode | None = None
    for episode in found:
        _classify(episode, events, ref)
        _attribute(episode, events)
        if episode.layer == "writer":  # measured from the writer's death, not from its injection
            died = next((e for e in _within(events, episode.start, episode.end or math.inf)
                         if e.event == "failure_detected" and e.get("cause") == "writer_died"), None)
            episode.start = died.ts if died is not None else episode.start
            if episode.replaced_at is not None:  # named and classified up to the fault that cut it
                episode.writer_ready = episode.end = episode.replaced_at
            elif episode.never_replaced:
                episode.end = None  # not recovered: no writer took the dead one's place
        elif episode.struck_at is not None and episode.struck_at < episode.start:
            # A fault nobody injected runs from when it struck, as an injected one runs from its
            # injection: not from the first peer to time out waiting for the rank (a stranger's
            # kill -STOP of rank 0 counted from rank 1's collective timeout, 3 s late).
            floor = -math.inf if previous is None else (previous.end if previous.end is not None else previous.start)
            episode.start = max(episode.struck_at, floor)
        previous = episode
    for episode in found:
        episode.session_end = next((end for start, end in spans if start <= episode.start <= end), spans[-1][1])
        if episode.end is not None and episode.end > episode.session_end:
            # Closed by a later `train` of the run (a resume): the run's own layers gave up on it
            # (a third stranger trial's resumed run turned its unrecovered fault into "inprocess").
            episode.end, episode.layer = None, "unrecovered"
        if episode.restored_at is not None and episode.restored_at > episode.session_end:
            # Nor is that resume's restore this fault's: it gave the fault a rollback and phases
            # that ran through the idle time between the two launches (a stranger trial: 106 s).
            episode.restored_step = episode.restored_at = episode.last_step_before = None
    return _link_delayed(found)


def sessions(events: list[ev.Event]) -> list[tuple[float, float]]:
    """The (first, last) event times of each launch of the run (a ``train`` and the restarts it
    made), in order. A new ``train`` of the run starts the reference rank at attempt 0 under
    another agent; a healthy node's agent re-joining a rendezvous starts its ranks at attempt 0
    under the same agent, and a replaced pod under a new agent after a pod ``restart_begin``:
    both the same launch. The time between two launches is nobody's: neither wall time nor
    downtime (a resume 226 s later counted as uptime: a third stranger trial).
    """
    ref = reference_rank(events)
    boundaries: list[float] = []
    agent, pod_restart, last_ref = None, False, None
    for e in events:
        if e.event == "restart_begin" and e.get("layer") == "pod":
            pod_restart = True
        if e.rank != ref:
            continue
        if e.event == "start":
            new_agent = e.get("agent")
            if (agent is not None and new_agent is not None and new_agent != agent and e.attempt == 0
                    and not pod_restart and last_ref is not None):
                # From the first start of the new launch on any rank (its ranks start together).
                boundaries.append(min(x.ts for x in _within(events, last_ref, e.ts) if x.event == "start"))
            agent, pod_restart = new_agent or agent, False
        last_ref = e.ts
    spans: list[tuple[float, float]] = []
    timed = [e for e in events if not is_agent_diagnostic(e)] or events
    if not timed:
        return [(0.0, 0.0)]
    cuts = [*boundaries, math.inf]
    first, last, k = timed[0].ts, timed[0].ts, 0
    for e in timed:
        if e.ts >= cuts[k]:
            spans.append((first, last))
            while e.ts >= cuts[k]:
                k += 1
            first = e.ts
        last = e.ts
    spans.append((first, last))
    return spans


def _link_delayed(found: list[Episode]) -> list[Episode]:
    """An injected fault absorbed without a restart whose failure showed later is one fault, not two."""
    out: list[Episode] = []
    for episode in found:
        injected = DELAYED.get(str(episode.root_cause.get("kind")))
        earlier = next((e for e in reversed(out) if e.layer == "none" and e.root_cause.get("injected")
                        and e.root_cause.get("kind") == injected), None) if injected else None
        if earlier is not None and not episode.root_cause.get("injected"):
            out.remove(earlier)
            found_as = episode.root_cause
            episode.fault, episode.fault_step = earlier.fault, earlier.fault_step  # (not the step it was found at)
            signal = {"signal": found_as["signal"]} if found_as.get("signal") else {}
            episode.root_cause = {**earlier.root_cause, **signal, "detail": f"{earlier.root_cause.get('detail')}: "
                                  f"{found_as.get('detail')}", "detected_seconds_after_fault": episode.start - earlier.start}
            episode.cause = str(episode.root_cause["kind"])
        # Or its failure showed while another fault was being recovered (the writer killed during
        # an in-process restart): that recovery dealt with both, so both are named there.
        for cause, ts, message in episode.surfaced:
            earlier = next((e for e in reversed(out) if e.layer == "none" and e.root_cause.get("injected")
                            and e.root_cause.get("kind") == DELAYED[cause]), None)
            if earlier is None:
                continue
            out.remove(earlier)
            root = episode.root_cause
            root["also_injected"] = [*root.get("also_injected", []), earlier.fault]
            root["surfaced"] = (f"{earlier.fault}: {message}, found {ts - earlier.start:.1f} s after the fault was logged, "
                                "during this recovery")
        out.append(episode)
    return out


def _attribute(episode: Episode, events: list[ev.Event]) -> None:
    """Name the episode's root cause and link the other ranks' reports to it as symptoms."""
    end = episode.end if episode.end is not None else math.inf
    inside = [e for e in _within(events, episode.start, end) if e.event in TRIGGERS]
    injections = [e for e in inside if e.event == "fault_injected"]
    injected = injections[0] if injections else None
    if len(injections) > 1 and (episode.restored_step is not None or "restart_begin" in episode.triggers):
        # A fault whose failure shows only later (a killed writer) did not stop training: of
        # several injected, the restart is another's (a stranger trial's exception one step after a
        # writer-kill was blamed on the writer).
        injected = next((e for e in injections if str(e.get("fault", "")).split("@")[0] not in DELAYED.values()),
                        injected)
    reports = [e for e in inside if e.event == "failure_detected" and e.get("cause") not in SYMPTOMS]
    primary = next((e for e in reports if e.get("cause") not in COMM_ERRORS), reports[0] if reports else None)
    if primary is not None and primary.get("cause") == "hang":
        primary = _stalled_outside_a_collective(reports, events) or primary
    # A rank's progress guard that found it stalled outside a collective: the hang is that rank's
    # whoever reported first (a kill -STOP of rank 0 was "peer_failure, rank null": the guard's
    # hang_detected was read only for a hang the schedule injected). A rank that says what failed in
    # it (an exception, an OOM) still says more.
    hung = None if injected is not None or (primary is not None and primary.get("cause") not in ("hang", *COMM_ERRORS)) \
        else next((e for e in _hangs_near(episode, events) if e.get("where") != "collective"), None)
    pod = next((e for e in inside if e.event == "restart_begin" and e.get("layer") == "pod"), None)
    root: dict[str, Any]
    if injected is not None:
        root = {"kind": injected.get("type") or str(injected.get("fault", "")).split("@")[0], "rank": injected.rank,
                "step": injected.step, "injected": True, "detail": injected.get("fault")}
        episode.fault = injected.get("fault")  # the root one: the first logged may be a delayed one, also injected
        interrupted = root["kind"] in HANGS and "RankShouldRestart" in str(primary.get("message") if primary else "")
        if primary is not None and primary.rank == injected.rank and not interrupted:
            # (Not a hung rank's RankShouldRestart: what NVRx raised in it to end the hang, naming the
            # peers that interrupted it, read as the peer's exception. How it was found is said below.)
            root["detail"] = f"{injected.get('fault')}: {primary.get('message') or primary.get('cause')}"
        # Another fault that struck while this one was being recovered (e.g. a load-hang in the
        # restore): named too, not counted as an episode of its own.
        also = [e.get("fault") for e in inside if e.event == "fault_injected" and e is not injected]
        if also:
            root["also_injected"] = also
        scheduled = flt.step_of(str(injected.get("fault")))
        if root["kind"] in flt.CHECKPOINT_FAULTS and scheduled is not None and scheduled != injected.step:
            # It acts at the first save at or after its step: deferred saves put a stranger trial's
            # ckpt-kill@10 and writer-kill@20 both at step 30, with no word of it.
            root["scheduled_step"] = scheduled
            root["detail"] = (f"{root['detail']} (scheduled at step {scheduled}; a checkpoint fault acts at the first "
                              f"save at or after it: step {injected.step})")
        if root["kind"] in HANGS:  # which guard or timeout found it, on which rank, at which step
            found = _hang_found(inside, events, episode)
            if found:
                root["detected_by"] = found
                root["detail"] = f"{root['detail']}: detected by {found}"
        if root["kind"] == "node-loss":  # the node's every rank was lost, not one
            node, ranks = _node_of(injected.rank, events, episode.start)
            if node is not None:
                root["node"], root["ranks"] = node, ranks
                root["detail"] = f"{injected.get('fault')}: node {node} (ranks {', '.join(map(str, ranks))}) lost"
    elif hung is not None:
        primary = next((e for e in reports if e.rank == hung.rank), None)  # its own report is no symptom
        root = {"kind": "hang", "rank": hung.rank, "step": hung.step, "injected": False, "where": hung.get("where"),
                "detail": f"rank {hung.rank}'s progress guard at step {hung.step}: {hung.get('reason')}"}
        first = next((e for e in inside if e.event == "failure_detected" and e.rank != hung.rank), None)
        if first is not None and first.ts < hung.ts:  # a peer's collective timed out waiting for it first
            root["detected_by"] = (f"rank {first.rank} at step {first.step}: {first.get('cause')}"
                                   + (f" ({first.get('message')})" if first.get("message") else ""))[:300]
            root["detail"] += f" (first seen by rank {first.rank} at step {first.step}: {first.get('cause')})"
        else:
            root["detected_by"] = f"rank {hung.rank}'s progress guard at step {hung.step}"
        episode.struck_at = _struck_at(hung, events)
    elif primary is not None:
        root = {"kind": primary.get("cause"), "rank": primary.rank, "step": primary.step, "injected": False,
                "detail": primary.get("message") or primary.get("cause")}
    elif pod is not None:
        root = {"kind": "node", "rank": None, "node": pod.get("node"), "step": pod.step, "injected": False,
                "detail": pod.get("cause")}
    else:
        reporters = {e.rank for e in inside if e.event == "failure_detected"}
        world = {e.rank for e in events if e.event == "step" and e.rank >= 0 and e.ts <= episode.start}
        silent = sorted(world - reporters - _went_on(world, episode, events))
        named = _interruption(inside)
        if reporters and len(silent) == 1:
            root = {"kind": "died", "rank": silent[0], "step": episode.fault_step, "injected": False,
                    "detail": f"rank {silent[0]} stopped without reporting a failure (killed by a signal or crashed)"}
            # It died after its last sign of life, before its peers' first report (which a collective
            # timeout can put seconds or minutes later): from that sign, as the silent restart below.
            last = _last_event(events, silent[0], episode.start, lookback=3600.0)  # (NCCL's timeout: 10 min)
            episode.struck_at = last.ts if last is not None else None
            if named is not None and silent[0] in named[1]:
                root["detail"] += f"; NVRx: {named[3].split(': ', 1)[-1]}"  # what NVRx's monitor said of it
        elif named is not None:
            # Every rank was asked to restart by NVRx's in-process layer, which names the ranks it
            # acted on ("Interruption.UNRESPONSIVE on ranks={0}": a stranger's kill -9 of rank 0's
            # monitor process was "restart_requested, rank null").
            kind, ranks, label, message = named
            root = {"kind": kind, "rank": ranks[0] if len(ranks) == 1 else None, "ranks": ranks,
                    "step": episode.fault_step, "injected": False,
                    "detail": f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {label}: {message}"}
            if len(ranks) == 1:  # the named rank's own report of the request is no symptom
                primary = next((e for e in inside if e.event == "failure_detected" and e.rank == ranks[0]), None)
        elif "unlogged_restart" in episode.triggers:
            root = {"kind": "died", "rank": None, "step": episode.fault_step, "injected": False,
                    "detail": "the workers were restarted with no failure logged: a process killed or crashed "
                              "before any rank could say which"}
            # ... unless the launcher agent saw which (worker_exit): one rank, killed by a signal
            killed = {e.get("global_rank"): str(e.get("signal")) for e in _within(events, episode.start, end)
                      if e.event == "worker_exit" and e.rank < 0 and ev._is_int(e.get("global_rank"))
                      and isinstance(e.get("signal"), str)}
            if len(killed) == 1:
                ((rank, signal),) = killed.items()
                root.update(rank=rank, signal=signal, detail=f"rank {rank} killed by {signal}: the workers were "
                            "restarted before any rank logged a failure")
        else:
            root = {"kind": episode.cause or "unknown", "rank": None, "step": episode.fault_step, "injected": False,
                    "detail": episode.cause or "unknown"}
    episode.surfaced = [(str(e.get("cause")), e.ts, str(e.get("message") or e.get("cause"))) for e in reports
                        if e.get("cause") in DELAYED and DELAYED[str(e.get("cause"))] != root.get("kind")]
    if primary is not None and primary.get("signal") and root.get("rank") == primary.rank:
        root["signal"] = primary.get("signal")  # e.g. the writer process killed by SIGKILL
    # How the rank's process ended, where that is the fault: not for a hang or an exception whose
    # process the launcher killed afterwards (its SIGKILL is the recovery, not the cause).
    exit_signal = None if root.get("signal") or root["kind"] not in ("died", *ALWAYS_KILLS) \
        else _exit_signal(root.get("rank"), episode, events)
    if exit_signal is not None:  # the agent saw the worker of that rank killed by it
        root["signal"] = exit_signal
        if root["kind"] == "died" and not root.get("injected"):
            root["detail"] = str(root["detail"]).replace("(killed by a signal or crashed)", f"(killed by {exit_signal})")
    episode.root_cause = root
    if root["kind"]:
        episode.cause = str(root["kind"])
    # A rank whose own fault was injected too (also_injected) reports that fault, not a symptom.
    own = {e.rank: str(e.get("fault", "")).split("@")[0] for e in inside
           if e.event == "fault_injected" and e is not injected}
    episode.symptoms = [
        {"rank": e.rank, "event": e.event, "cause": e.get("cause"), "step": e.step}
        for e in inside
        if e.event in ("failure_detected", "restart_begin") and e is not primary
        and not (e.rank == root.get("rank") and e.event == "restart_begin")
        and not (e.rank in own and (e.event == "failure_detected" and e.get("cause") not in SYMPTOMS
                                    or e.event == "restart_begin" and e.get("cause") == own[e.rank]))
    ]


HANGS = ("hang", "ckpt-hang", "load-hang")
# How far before the failure that opened an episode a progress guard's hang_detected is still its cause
# (the guard runs out and tells NVRx; its rank's failure_detected follows once NVRx has released the
# training thread: seconds).
HANG_LOOKBACK_SECONDS = 30.0
# The progress guard's reason: "no progress for 9.5 s in step; allowance 3.0 s (...)".
NO_PROGRESS = re.compile(r"no progress for (\d+(?:\.\d+)?) s")
# NVRx's RankShouldRestart names what it acted on: "Interruption.UNRESPONSIVE on ranks={0}" (0.4),
# "Interruption.SOFT_TIMEOUT affecting ranks {0, 1}" (later); several are joined by ", ".
INTERRUPTION = re.compile(r"Interruption\.([A-Z_]+)\s+(?:on ranks\s*=\s*|affecting ranks\s*)\{([0-9,\s]*)\}")
# Interruption -> (root cause kind, what it says of the ranks named). UNRESPONSIVE: the rank's
# heartbeat to NVRx's store went stale (why is not said: a stopped, killed or starved process,
# or its monitor gone).
INTERRUPTIONS = {
    "UNRESPONSIVE": ("unresponsive", "unresponsive (NVRx in-process monitor)"),
    "SOFT_TIMEOUT": ("hang", "made no progress: soft timeout (NVRx in-process monitor)"),
    "HARD_TIMEOUT": ("hang", "made no progress: hard timeout (NVRx in-process monitor)"),
    "EXCEPTION": ("exception", "raised an exception (NVRx in-process restart)"),
    "BASE_EXCEPTION": ("exception", "raised an exception (NVRx in-process restart)"),
    "TERMINATED": ("terminated", "terminated (NVRx in-process restart)"),
    "MONITOR_PROCESS_EXCEPTION": ("monitor_exception", "NVRx monitor process failed"),
}


def _interruption(inside: list[ev.Event]) -> tuple[str, list[int], str, str] | None:
    """(kind, ranks, label, message) of the first restart request whose message names the ranks NVRx
    acted on (its first interruption: one event names one in practice), else None.
    """
    for e in inside:
        if e.event != "failure_detected" or e.get("cause") not in SYMPTOMS:
            continue
        message = str(e.get("message") or "")
        found = INTERRUPTION.search(message)
        if found is None:
            continue
        ranks = sorted({int(r) for r in re.findall(r"\d+", found.group(2))})
        if not ranks:
            continue
        name = found.group(1)
        kind, label = INTERRUPTIONS.get(name, (name.lower(), f"{name} (NVRx in-process restart)"))
        return kind, ranks, label, message[:300]
    return None


def _hangs_near(episode: Episode, events: list[ev.Event]) -> list[ev.Event]:
    """The ``hang_detected`` of the failure that opened ``episode``, in time order: logged in the
    attempt and iteration it struck in (after it opened, or up to HANG_LOOKBACK_SECONDS before by a
    rank that made no step since: its guard ran out first) up to its end.
    """
    end = episode.end if episode.end is not None else math.inf
    near = [e for e in _within(events, episode.start - HANG_LOOKBACK_SECONDS, end) if e.event == "hang_detected"]
    out = []
    for h in near:
        if episode.context is not None and (h.attempt, h.iteration) != episode.context:
            continue
        if h.ts < episode.start and (episode.context is None or any(
                e.event == "step" and e.rank == h.rank and e.ts > h.ts for e in _within(events, h.ts, episode.start))):
            continue  # a stall it got over (or no step to tell which attempt the failure struck in)
        out.append(h)
    return out


def _exit_signal(rank: Any, episode: Episode, events: list[ev.Event]) -> str | None:
    """The signal that killed ``rank``'s worker in this episode, from the launcher agent's
    ``worker_exit`` (logged when it next polled its workers: after the rank's last sign of life,
    before the episode's end).
    """
    if not ev._is_int(rank) or rank < 0:
        return None
    last = _last_event(events, rank, episode.start, lookback=3600.0)  # its last sign of life: the exit is after
    start = last.ts if last is not None else episode.start - 60.0
    end = episode.end if episode.end is not None else math.inf
    return next((str(e.get("signal")) for e in _within(events, start, end) if e.event == "worker_exit"
                 and e.rank < 0 and e.get("global_rank") == rank and isinstance(e.get("signal"), str)), None)


def _last_event(events: list[ev.Event], rank: int, before: float, names: tuple[str, ...] = (),
                context: tuple[int, int] | None = None, lookback: float = 600.0) -> ev.Event | None:
    """``rank``'s last event (of ``names``, in attempt and iteration ``context``, when given) before
    ``before``, looking back ``lookback`` seconds at most.
    """
    for i in range(bisect.bisect_left(events, before, key=_ts) - 1, -1, -1):
        e = events[i]
        if e.ts < before - lookback:
            break
        if e.rank == rank and (not names or e.event in names) and (context is None or (e.attempt, e.iteration) == context):
            return e
    return None


def _struck_at(hung: ev.Event, events: list[ev.Event]) -> float:
    """When the rank of ``hung`` (its ``hang_detected``) stopped making progress: the later of its
    last step (or restore, or start) before it in that attempt and iteration, and the guard's own
    "no progress for N s" back from it (not its last event of any kind: the writer's thread logs on
    while the training thread is stuck).
    """
    marks = [events[0].ts]
    found = NO_PROGRESS.search(str(hung.get("reason") or ""))
    silent = float(found.group(1)) if found else math.nan
    if math.isfinite(silent):
        marks.append(hung.ts - silent)
    last = _last_event(events, hung.rank, hung.ts, ("step", "load_done", "start"), (hung.attempt, hung.iteration),
                       lookback=600.0 + (silent if math.isfinite(silent) else 0.0))
    if last is not None:
        marks.append(last.ts)
    return min(hung.ts, max(marks))


def _hang_found(inside: list[ev.Event], events: list[ev.Event], episode: Episode) -> str | None:
    """How an injected hang was found, by whichever came first: a progress guard running out
    (its rank, step and reason: for how long, where, from which allowance) or a rank reporting a
    failure (a peer's collective timing out, say), e.g. ``rank 0's progress guard at step 9: no
    progress for 3.1 s in step``.
    """
    end = episode.end if episode.end is not None else math.inf
    guard = next((e for e in _within(events, episode.start, end) if e.event == "hang_detected"), None)
    report = next((e for e in inside if e.event == "failure_detected"), None)
    if guard is not None and (report is None or guard.ts <= report.ts):
        return f"rank {guard.rank}'s progress guard at step {guard.step}: {guard.get('reason')}"
    if report is not None:
        return (f"rank {report.rank} at step {report.step}: {report.get('cause')}"
                + (f" ({report.get('message')})" if report.get("message") else ""))[:300]
    return None


def _node_of(rank: int, events: list[ev.Event], before: float) -> tuple[Any, list[int]]:
    """The node ``rank`` ran on (its last ``start`` before ``before``) and every rank started there."""
    starts: dict[int, Any] = {}
    for e in events:
        if e.event == "start" and e.rank >= 0 and e.ts <= before:
            starts[e.rank] = e.get("node")
    node = starts.get(rank)
    if node is None:
        return None, []
    return node, sorted(r for r, n in starts.items() if n == node)


def _went_on(ranks: set[int], episode: Episode, events: list[ev.Event]) -> set[int]:
    """Of ``ranks``, those that logged a step or their end after the episode opened, in the
    attempt and iteration of their last step before it: they did not die there.
    """
    context: dict[int, tuple[int, int]] = {}
    alive: set[int] = set()
    for e in events:
        if e.rank not in ranks:
            continue
        if e.ts <= episode.start:
            if e.event == "step":
                context[e.rank] = (e.attempt, e.iteration)
        elif e.event in ("step", "end") and context.get(e.rank) == (e.attempt, e.iteration):
            alive.add(e.rank)
    return alive


def _stalled_outside_a_collective(reports: list[ev.Event], events: list[ev.Event]) -> ev.Event | None:
    """Of several ranks reporting a hang, the one whose progress guard found it stalled outside a
    collective (its ``hang_detected`` before the report), when exactly one did: the others were
    waiting in a collective for it, whichever reported first.
    """
    hangs = [r for r in reports if r.get("cause") == "hang"]
    where: dict[int, Any] = {}
    for report in hangs:
        found = [e for e in events if e.event == "hang_detected" and e.rank == report.rank and e.ts <= report.ts
                 and (e.attempt, e.iteration) == (report.attempt, report.iteration)]
        if found:
            where[id(report)] = found[-1].get("where")
    outside = [r for r in hangs if id(r) in where and where[id(r)] != "collective"]
    return outside[0] if len(outside) == 1 and len(where) > 1 else None


def _absorbed(episode: Episode, step_event: ev.Event) -> bool:
    """Training went on past the injected fault in the same attempt and iteration: no restart.

    Past means a later step: a fault injected at a save (after its step) on one rank can be
    logged before a peer logs that same step (seen on 2 GPUs: a ckpt-kill taken for absorbed).
    A NaN the training went on with is not absorbed either. A fault that always kills its rank,
    some time after it is logged, is never absorbed: on one
    GPU the killed rank is the reference rank, and it logged a step between the injection and
    its death (an async ckpt-kill dies once the writer holds its shard): that launcher restart
    was reported as layer ``none``, 0 s, and left out of the downtime (H200, 2026-12-02).
    """
    kind = str(episode.fault or "").split("@")[0]
    if kind == "nan" and not math.isfinite(float(step_event.get("loss", math.nan))):
        # Training went on, on NaN weights (--no-nan-guard): not absorbed but never recovered
        # (a stranger trial's report said recovered, 0 s, with every later loss NaN).
        return False
    return (
        kind not in ALWAYS_KILLS
        and (set(episode.triggers) == {"fault_injected"} or episode.symptom_only)
        and episode.fault_step is not None
        and step_event.step is not None
        and step_event.step > episode.fault_step
        and (step_event.attempt, step_event.iteration) == episode.context
    )


def _classify(episode: Episode, events: list[ev.Event], ref: int | None) -> None:
    """Layer: the outermost restart_done inside the episode, else what changed on the reference rank."""
    end = episode.end if episode.end is not None else math.inf
    layers = [e.get("layer") for e in _within(events, episode.start, end) if e.event == "restart_done"]
    layers = [layer for layer in layers if layer in LAYER_ORDER]
    if layers:
        episode.layer = max(layers, key=LAYER_ORDER.__getitem__)
    elif episode.restored_step is None and episode.writer_ready is not None:
        episode.layer = "writer"  # replaced while training went on
    elif episode.restored_step is not None:
        after = next((e for e in _within(events, end, math.inf) if e.event == "step" and e.rank == ref), None)
        if after is None or episode.context is None:
            episode.layer = "reload"
        elif after.attempt != episode.context[0]:
            episode.layer = "launcher"
        elif after.iteration != episode.context[1]:
            episode.layer = "inprocess"
        else:
            episode.layer = "reload"  # rolled back in place (e.g. the NaN guard) without a restart
    elif episode.end is None:
        episode.layer = "unrecovered"  # the log ends inside it: the run died of this fault
    if episode.cause is None:
        episode.cause = episode.fault or "unknown"


def mean(values: Iterable[float]) -> float:
    """The arithmetic mean, never an error for floats: ``statistics.fmean`` (exact ``math.fsum``)
    raised OverflowError on huge finite values (two commits of 1e308 bytes, losses of 1.7e308:
    stranger trials); those are summed scaled down by their count instead, which cannot overflow.
    NaN when empty or given a NaN (or both infinities); an infinity when given one.
    """
    data = [float(v) for v in values]
    if not data:
        return math.nan
    if not all(math.isfinite(v) for v in data):
        if any(math.isnan(v) for v in data) or (math.inf in data and -math.inf in data):
            return math.nan
        return math.inf if math.inf in data else -math.inf
    try:
        return statistics.fmean(data)
    except OverflowError:  # the sum is past the largest float; the mean is not
        return math.fsum(v / len(data) for v in data)


def _between(lo: float, hi: float, frac: float) -> float:
    """``lo + (hi - lo) * frac`` without the difference overflowing (values of opposite signs near
    the largest float).
    """
    if frac == 0 or lo == hi:
        return lo
    span = hi - lo
    return lo + span * frac if math.isfinite(span) else lo * (1 - frac) + hi * frac


def percentiles(values: list[float]) -> dict[str, float | None]:
    """count, mean, p50, p95, max (linear interpolation between order statistics)."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "max": None}
    ordered = sorted(values)

    def q(frac: float) -> float:
        pos = frac * (len(ordered) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return _between(ordered[lo], ordered[hi], pos - lo)

    return {"count": len(ordered), "mean": mean(ordered), "p50": q(0.5), "p95": q(0.95),
            "max": ordered[-1]}


def _union_seconds(spans: list[tuple[float, float]]) -> float:
    total, cursor = 0.0, -math.inf
    for start, end in sorted(spans):
        start = max(start, cursor)
        if end > start:
            total += end - start
            cursor = end
    return total


def young_daly(cost: float | None, mtbf: float | None) -> dict[str, float | None]:
    """Optimal checkpoint interval in seconds for save cost C and mean time between failures M."""
    if not cost or not mtbf or not math.isfinite(mtbf):
        return {"young_seconds": None, "daly_seconds": None}
    young = math.sqrt(2 * cost * mtbf)
    if cost < 2 * mtbf:
        ratio = cost / (2 * mtbf)
        daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost
    else:
        daly = mtbf
    return {"young_seconds": young, "daly_seconds": daly}


def checkpoint_commits(events: Iterable[ev.Event], tier: str | None = "persistent") -> list[ev.Event]:
    """One ``ckpt_committed`` per committed step and tier (the first writer to report it).

    ``tier``: "persistent" (shared storage; events without a tier are persistent), "local"
    (the node-local tier), or None for both.
    """
    seen: set[tuple[str, int | None]] = set()
    out = []
    for e in events:
        if e.event != "ckpt_committed":
            continue
        this = e.get("tier") or "persistent"
        if (tier is None or this == tier) and (this, e.step) not in seen:
            seen.add((this, e.step))
            out.append(e)
    return out


def saves_lost(events: list[ev.Event], ref: int | None) -> list[tuple[int, str]]:
    """(step, tier) of each save the reference rank began that was never committed: abandoned (an
    in-process restart or a writer death dropped it) or lost with its process. "Failed" counted an
    event nothing logs, so it said 0 whatever was lost (a stranger trial).
    """
    def saves(name: str, rank: int | None = None) -> set[tuple[int, str]]:
        return {(int(e.step), str(e.get("tier", "persistent"))) for e in events
                if e.event == name and e.step is not None and (rank is None or e.rank == rank)}

    return sorted(saves("ckpt_begin", ref) - saves("ckpt_committed"))


def freshness(runs: list[StepRun], commits: list[ev.Event]) -> list[tuple[float, int, int]]:
    """(ts, step, steps since the newest committed checkpoint) at every reference-rank step."""
    out = []
    ordered = sorted(commits, key=lambda e: e.ts)
    newest, i = 0, 0
    for run in runs:
        while i < len(ordered) and ordered[i].ts <= run.ts:
            newest = max(newest, int(ordered[i].step or 0))
            i += 1
        out.append((run.ts, run.step, max(0, run.step - newest)))
    return out


def launches(events: list[ev.Event]) -> list[int]:
    """Launch index of every event. A new ``train`` invocation on the same run dir restarts the
    attempt count at 0: a rank starting attempt 0 again opens the next launch.
    """
    out, launch, started = [], 0, set()
    for e in events:
        if e.event == "start" and e.attempt == 0 and e.rank >= 0:
            if e.rank in started:
                launch, started = launch + 1, set()
            started.add(e.rank)
        out.append(launch)
    return out


def segments(events: list[ev.Event]) -> list[dict[str, Any]]:
    """The run's timeline: one entry per (launch, attempt, iteration) of the training ranks."""
    spans: dict[tuple[int, int, int], dict[str, Any]] = {}
    for e, launch in zip(events, launches(events), strict=True):
        if e.rank < 0:
            continue
        key = (launch, e.attempt, e.iteration)
        span = spans.setdefault(key, {"launch": launch, "attempt": e.attempt, "iteration": e.iteration, "start": e.ts,
                                      "end": e.ts, "first_step": None, "last_step": None})
        span["end"] = max(span["end"], e.ts)
        if e.event == "step" and e.step is not None:
            span["first_step"] = e.step if span["first_step"] is None else min(span["first_step"], e.step)
            span["last_step"] = e.step if span["last_step"] is None else max(span["last_step"], e.step)
    return sorted(spans.values(), key=lambda s: s["start"])


CONFIG_MAX_BYTES = 16 << 20  # a run's config.json is a few KiB


def read_config(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's ``config.json`` as written by the launcher, None when there is none, it cannot be
    read, or it is no JSON object (a YAML file elsewhere, an older or damaged one). RunError, naming
    it, when it is there but no regular file (a FIFO in its place made the report wait forever: a
    stranger trial; it is looked at before it is opened, and opened without waiting for a writer),
    or larger than any config.
    """
    import json
    import stat

    path = layout.config_path(run_dir)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if not stat.S_ISREG(mode):
        raise RunError(f"{path} is not a regular file ({_file_kind(mode)}): a run's config.json is one")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped since the look
            raise RunError(f"{path} is not a regular file ({_file_kind(mode)}): a run's config.json is one")
        os.set_blocking(fd, True)
        try:
            data = handle.read(CONFIG_MAX_BYTES + 1)
        except OSError:
            return None
    if len(data) > CONFIG_MAX_BYTES:
        raise RunError(f"{path} is over {CONFIG_MAX_BYTES >> 20} MiB: no run's config.json is")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    return config if isinstance(config, dict) else None


def _file_kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def target_step(run_dir: str | os.PathLike[str], end: ev.Event) -> int | None:
    """The step a ``completed`` end says the run reached: its own ``step`` (the trainer logs its
    target step there), else the target of the run's config.json (``steps``); None when neither
    says. An end whose step was nulled out said completed for a log cut after step 22 of 30 (a
    stranger trial).
    """
    if isinstance(end.step, int):
        return end.step
    steps = (read_config(run_dir) or {}).get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def faults_not_injected(run_dir: str | os.PathLike[str], events: list[ev.Event]) -> list[str]:
    """Scheduled faults (the run's config.json) that never fired, or fewer times than scheduled
    (said after them), e.g. a ``load-hang`` whose rank only
    ever restored from a memory snapshot (H200, 2026-12-02): a run that completed did not prove
    recovery from those. Empty when the schedule cannot be read (no config, a YAML file elsewhere).
    """
    from resilient_training.run import faults as flt

    config = read_config(run_dir)  # (RunError for a config.json that is no regular file)
    try:
        spec = (config or {}).get("faults") or ""
        schedule = flt.parse(str(spec))
    except (ValueError, RecursionError):  # FaultSpecError is a ValueError
        return []
    fired = Counter(e.get("fault") for e in events if e.event == "fault_injected")
    # One that fired fewer times than scheduled says so (a stranger trial's x5 that fired 3 times
    # was listed as never fired).
    return [str(f) + (f" (fired {fired[f.key]} of {f.count} times)" if fired.get(f.key) else "")
            for f in schedule if fired.get(f.key, 0) < f.count]


def compute_metrics(run_dir: str | os.PathLike[str], events: list[ev.Event] | None = None) -> dict[str, Any]:
    """Every number of the resilience report, as plain JSON-able values."""
    events = load_events(run_dir) if events is None else sorted(events, key=_ts)
    # The run spans its workers' events: an agent logs its own profile from before the first
    # worker started (interpreter and imports), which earlier rounds' figures never counted.
    spanning = [e for e in events if not is_agent_diagnostic(e)] or events
    t0, t1 = spanning[0].ts, spanning[-1].ts
    spans = sessions(events)
    wall = sum(end - start for start, end in spans)  # (one launch: t1 - t0)
    ref = reference_rank(events)
    runs = step_runs(events, ref)
    survivors = surviving(runs)
    # A step on non-finite weights (the NaN guard off) trained nothing (a stranger trial counted it).
    productive = sum(r.seconds for r in survivors.values() if math.isfinite(r.loss))
    if productive > wall + 1.0:  # steps run one after another: their time fits in the run's
        # (one edited step's seconds gave a training goodput of 838 %: stranger trial)
        raise RunError(f"{run_dir}: the event log does not add up: its steps took {productive:.1f} s, more than the "
                       f"{wall:.1f} s from its first event to its last (an edited log?)")
    found = episodes(events)
    restarted = [p for p in found if p.layer != "none"]
    stopped = [p for p in restarted if p.layer not in NON_STOPPING]  # training stood still
    downtime = _union_seconds([(p.start, p.end if p.end is not None else (p.session_end or t1)) for p in stopped])
    by_layer: dict[str, list[float]] = {}
    for p in restarted:
        if p.seconds is not None:
            by_layer.setdefault(p.layer, []).append(p.seconds)
    commits = checkpoint_commits(events)
    stalls = [duration(e) for e in events if e.event == "ckpt_staged" and e.rank == ref]
    fresh = freshness(runs, checkpoint_commits(events, tier=None))  # either tier can be restored
    steps_per_save = [b - a for a, b in zip(sorted({int(c.step or 0) for c in commits}),
                                            sorted({int(c.step or 0) for c in commits})[1:], strict=False)]
    step_seconds = [r.seconds for r in survivors.values() if r.seconds > 0]
    mtbf = wall / len(stopped) if stopped else None
    cost = mean(stalls) if stalls else None
    interval = young_daly(cost, mtbf)
    median_step = statistics.median(step_seconds) if step_seconds else None
    for key in ("young", "daly"):
        secs = interval[f"{key}_seconds"]
        interval[f"{key}_steps"] = round(secs / median_step, 1) if secs and median_step else None
    launch_of = launches(events)
    launch_at = {e.ts: launch for e, launch in zip(events, launch_of, strict=True) if e.event == "step"}
    ends = [e for e in events if e.event == "end"]
    final = next((e for e in reversed(ends) if e.rank <= 0), ends[-1] if ends else None)
    status, end_reason = (final.get("status"), final.get("reason")) if final else ("unknown", None)
    if final is not None and any(e.rank == ref and e.event in ("start", "step") for e in _within(events, final.ts, t1)
                                 if e.ts > final.ts):
        # The end of an earlier launch does not end a later one still running or killed (as the
        # convergence gate says; the report kept the earlier status: a stranger trial).
        status, end_reason = "unknown", (f"the last launch logged no end (still running, or killed); an earlier "
                                         f"one ended {final.get('status')}")
    elif status == "completed" and runs and (target := target_step(run_dir, final)) is not None \
            and target != runs[-1].step:
        # The trainer ends completed at its target step, the last it trained (as the convergence gate says).
        status, end_reason = "unknown", (f"the run's end says completed at step {target}, but its last logged step "
                                         f"is {runs[-1].step} (the event log was cut or edited)")
    return {
        "run_dir": str(Path(run_dir).resolve()),  # as typed (".") it named nothing once copied elsewhere
        "reference_rank": ref,
        "wall_seconds": wall,
        "status": status,
        "end_reason": end_reason,
        # The last launch's (the final model's); a stranger trial's run resumed from 1 rank at 3 said 1.
        "world_size": next((e.get("world_size") for e in reversed(events) if e.event == "start"), None),
        "world_sizes": _in_turn(e.get("world_size") for e in events if e.event == "start" and e.rank == ref),
        # launcher attempts of all launches (each launch numbers its own from 0)
        "attempts": len({(launch, e.attempt) for e, launch in zip(events, launch_of, strict=True)}),
        "launches": len(spans),
        "steps": {
            "completed": len(survivors),
            "last": max(survivors) if survivors else None,
            "executed": len(runs),
            "replayed": len(runs) - len(survivors),
        },
        "productive_step_seconds": productive,
        "downtime_seconds": downtime,
        "training_goodput": productive / wall if wall > 0 else None,
        "infrastructure_goodput": (wall - downtime) / wall if wall > 0 else None,
        "faults": [_episode_dict(p, t0, runs, events, ref) for p in found],
        "lost_seconds_per_fault": percentiles([lost_seconds(p, runs) for p in restarted if p.seconds is not None]),
        "recovery_seconds": {
            "all": percentiles([p.seconds for p in restarted if p.seconds is not None]),
            "by_layer": {layer: percentiles(v) for layer, v in sorted(by_layer.items())},
        },
        "unrecovered_faults": sum(1 for p in restarted if not p.recovered),
        "rollback_steps": percentiles([float(p.rollback) for p in restarted if p.rollback is not None]),
        "restart_causes": dict(Counter(p.cause for p in restarted)),
        "faults_injected": dict(Counter(e.get("fault") for e in events if e.event == "fault_injected")),
        "faults_not_injected": faults_not_injected(run_dir, events),
        # Recoveries: the faults' episodes by the layer that recovered them, not the restarts in them.
        "restarts_by_layer": dict(Counter(p.layer for p in restarted)),
        # Every restart itself (see restart_counts): a fault struck during another's recovery (a
        # load-hang in its restore) is one episode of two restarts, and a fault the launcher restarted
        # the workers for until it gave up (a worker failing at start-up each time) one of six.
        "restarts": restart_counts(events, ref),
        "checkpoints": {
            "committed": len(commits),
            "committed_local_tier": len(checkpoint_commits(events, tier="local")),
            "steps": [int(c.step or 0) for c in commits],
            "failed": len(saves_lost(events, ref)),
            "deferred": sum(1 for e in events if e.event == "ckpt_deferred" and e.rank == ref),
            "stall_seconds": percentiles(stalls),
            "stall_total_seconds": sum(stalls),
            "commit_seconds": percentiles([duration(c) for c in commits]),
            "bytes": percentiles([duration(c, "bytes") for c in commits]),
            # The achieved interval: the mean gap between persistent commits (deferred saves lengthen
            # it; the median hid them, a stranger trial), and the largest gap.
            "interval_steps": mean(steps_per_save) if steps_per_save else None,
            "interval_steps_max": max(steps_per_save) if steps_per_save else None,
        },
        "freshness_steps": {
            **percentiles([float(f) for _, _, f in fresh]),
            "series": [[round(ts - t0, 3), step, f] for ts, step, f in fresh],
        },
        "step_seconds": percentiles(step_seconds),
        "suggested_checkpoint_interval": {
            "save_cost_seconds": cost,
            "mtbf_seconds": mtbf,
            **interval,
        },
        "timeline": [{**s, "start": s["start"] - t0, "end": s["end"] - t0} for s in segments(events)],
        # [seconds, step, loss, attempt, iteration, launch] of every reference-rank step execution.
        "loss": [[round(r.ts - t0, 3), r.step, r.loss, r.attempt, r.iteration, launch_at[r.ts]] for r in runs],
        # [seconds, step restored] of every restore after training had begun (reference rank).
        "restores": [[round(e.ts - t0, 3), int(e.step or 0)] for e in restores(events) if e.rank == ref],
    }


def restart_counts(events: list[ev.Event], ref: int | None) -> dict[str, int]:
    """Restarts by layer: of each layer, the most ``restart_done`` any training rank logged (every
    rank logs each restart it came back from; one whose new process failed before it logged anything
    logs none of that restart: a stranger's six launcher restarts, the last four of which rank 0 never
    started from, were counted two from the reference rank); a pod's by its launcher (and the
    reference rank), as before.
    """
    per_rank: dict[str, Counter[int]] = {}
    pods = 0
    for e in events:
        if e.event != "restart_done":
            continue
        layer = str(e.get("layer"))
        if layer == "pod":
            pods += e.rank == ref or e.rank < 0
        elif e.rank >= 0:
            per_rank.setdefault(layer, Counter())[e.rank] += 1
    counts = {layer: max(ranks.values()) for layer, ranks in per_rank.items()}
    if pods:
        counts["pod"] = pods
    return dict(sorted(counts.items()))


# ft_launcher's own restart profile (event launcher_phase): each phase is named after the
# profiling event that ends it.
AGENT_PHASES = (("agent_detect", "failure_detected"), ("agent_stop_workers", "workers_gone"),
                ("agent_gpu_memory_wait", "worker_terminated"), ("agent_rendezvous", "rendezvous_completed"),
                ("agent_start_workers", "worker_start_completed"))


def recovery_phases(p: Episode, events: list[ev.Event], ref: int | None) -> dict[str, float]:
    """Where episode ``p``'s recovery went, in order, in seconds from its start to the reference
    rank's first step after the restore: the launcher agent's phases and the new process's
    start-up (launcher and pod restarts), then the phases its ``load_done`` reports (after an
    in-process restart NVRx's own ones first: ``nvrx_*``), then the first step. ``other`` is what
    no event accounts for (the failure handling before NVRx's first mark, a process's set-up
    before its first phase). Empty when the episode restored nothing.
    """
    if p.restored_step is None or ref is None:
        return {}
    end = p.end if p.end is not None else math.inf
    mine = [e for e in _within(events, p.start, end) if e.rank == ref]
    load = next((e for e in mine if e.event == "load_done"), None)
    if load is None:
        return {}
    out: dict[str, float] = {}
    reported = {str(k): float(v) for k, v in (load.get("phases") or {}).items() if isinstance(v, (int, float))}
    begin = p.start
    start = next((e for e in mine if e.event == "start" and e.ts <= load.ts), None)
    if start is not None and isinstance(start.get("process_seconds"), (int, float)):
        process_start = start.ts - float(start["process_seconds"])
        agent = {}
        for e in _within(events, p.start, process_start + 1.0):
            if is_agent_diagnostic(e) and p.start < e.ts:
                agent.setdefault(str(e.get("phase")), e.ts)
        mark = p.start
        for name, phase in AGENT_PHASES:
            if phase in agent and agent[phase] >= mark:
                out[name] = agent[phase] - mark
                mark = agent[phase]
        out["new_process"] = max(0.0, process_start - mark)
        out["imports"] = float(start["process_seconds"])
        begin = start.ts
    out["other"] = max(0.0, load.ts - sum(reported.values()) - begin)
    out.update(reported)
    first = next((e for e in mine if e.event == "step" and e.ts > load.ts), None)
    if first is not None:
        # From the restore's end to the first step done: the step, and what the trainer did
        # before it (milliseconds; tens of them on a loaded machine, which the step's own
        # `seconds` left out, so the phases did not add up to the recovery).
        out["first_step"] = first.ts - load.ts
    return {k: round(v, 3) for k, v in out.items()}


def replayed_seconds(p: Episode, runs: list[StepRun]) -> float | None:
    """Step time the rollback of episode ``p`` threw away: the last execution, before the fault,
    of each step after the restored one (those steps were then trained again).
    """
    if p.restored_step is None or p.last_step_before is None:
        return None
    lost: dict[int, float] = {}
    # Back from the restore, the latest execution first, to the trajectory's restored step: the
    # steps after it were all executed since (not the whole run per episode: see _within).
    for i in reversed(range(bisect.bisect_right(runs, p.restored_at or p.start, key=lambda r: r.ts))):
        run = runs[i]
        if run.step <= p.restored_step:
            break
        if run.step <= p.last_step_before:
            lost.setdefault(run.step, run.seconds)
    return sum(lost.values())


def _in_turn(values: Iterable[Any]) -> list[Any]:
    """``values`` without a value repeated next to itself (the world sizes a run trained at, in turn:
    1, 3, 1 for a run resized and resized back).
    """
    return [value for value, _ in itertools.groupby(v for v in values if v is not None)]


def lost_seconds(p: Episode, runs: list[StepRun]) -> float:
    """What fault ``p`` cost the training: its downtime plus the step time trained again after the
    rollback. A writer replaced while training went on cost none (a stranger trial found its
    replacement time counted as lost); its recovery seconds say how long saves waited.
    """
    if p.layer in NON_STOPPING:
        return 0.0
    return (p.seconds or 0.0) + (replayed_seconds(p, runs) or 0.0)


def _episode_dict(p: Episode, t0: float, runs: list[StepRun] | None = None,
                  events: list[ev.Event] | None = None, ref: int | None = None) -> dict[str, Any]:
    replayed = replayed_seconds(p, runs or [])
    return {
        "start": p.start - t0,
        "end": None if p.end is None else p.end - t0,
        "fault": p.fault,
        "cause": p.cause,
        "root_cause": p.root_cause,
        "symptoms": p.symptoms,
        "layer": p.layer,
        "fault_step": p.fault_step,
        "restored_step": p.restored_step,
        "last_step_before": p.last_step_before,
        "rollback_steps": p.rollback,
        "recovery_seconds": p.seconds,
        "replayed_seconds": replayed,
        # what the fault cost: downtime plus the step time trained again after the rollback
        "lost_seconds": None if p.seconds is None else lost_seconds(p, runs or []),
        "recovered": p.recovered,
        # where the recovery went (see recovery_phases): phase -> seconds, in order
        "phases": recovery_phases(p, events or [], ref),
    }
