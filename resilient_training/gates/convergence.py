"""The convergence gate: judge a run from its event log, with stated tolerances.

Checks (each reports its numbers and why it passed or failed):

- ``finite``: the surviving loss curve (each step's last execution) is finite, and within
  :data:`LOSS_LIMIT` (float32's range: no training step logs a larger loss). Non-finite
  losses that were rolled back and replayed finite are reported, not failed: the model that
  ships never trained on them.
- ``completed``: the run ended with status ``completed``, at its target step (the end's step,
  else the ``steps`` of its config.json) and after its last session's steps.
- ``final_loss``: the mean loss of the final window is below ``max_final_loss``.
- ``improvement``: (first-window mean − final-window mean) / first-window mean ≥ ``min_improvement``.
  Both judge the history that leads to the judged checkpoint (the run's latest): the steps up
  to its step, as they stood when it was committed. Steps trained after it are not its model's.
- ``continuity``: after every restore, the first step resumes right after the restored step
  and its loss matches the loss logged for that same step before the fault (relative
  tolerance ``continuity_rtol``: data and state are deterministic, so a correct restore
  replays the step almost exactly). When the step had not been logged before the fault,
  the restored step's own pre-fault loss is the basis, with the looser ``jump_rtol``, or
  1.5 x the largest step-to-step change of the last 5 steps before it where that is larger.
  The next replayed steps too (up to :data:`REPLAY_STEPS` after the restore, each logged
  before the fault), within ``REPLAY_RTOL_FACTOR`` x ``continuity_rtol``: state the checkpoint
  does not hold (a task's own step counter, an LR scheduler it steps itself) leaves the first
  step's loss exact and shows one step later; GPU replays drift within 0.45 % over 12 steps.
  A restore that silently loaded the wrong state fails here. So does a stretch of steps
  whose restore is missing from the log: every process (``start``) and every in-process
  restart iteration of a rank must log ``load_done`` before its first step (a fresh start
  logs step 0), else its restore cannot be checked. Only a rank's very first steps, from step
  1, may go without one: nothing was restored there.
- ``reference`` (optional): at every step both runs logged, the loss is within
  ``reference_rtol`` of the reference run's.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from resilient_training.gates import metrics
from resilient_training.gates.metrics import RunError
from resilient_training.run import layout

__all__ = ["ConvergenceConfig", "RunError", "Verdict", "check_convergence", "check_reachable",
           "write_convergence_record", "check_and_record"]


@dataclasses.dataclass(kw_only=True, slots=True)
class ConvergenceConfig:
    """Thresholds and tolerances of the gate."""

    max_final_loss: float | None = None
    """Final-window mean loss must be below this; None: 0.8 x ln(vocab_size) from the run's manifest."""
    min_improvement: float = 0.1
    """Relative improvement of the final window over the first."""
    window: int = 5
    """Steps in the first and the final window."""
    continuity_rtol: float = 1e-3
    """Relative tolerance of a replayed step's loss after a restore."""
    continuity_atol: float = 1e-5
    """Absolute tolerance added to continuity_rtol (losses near zero)."""
    jump_rtol: float = 0.15
    """Relative tolerance when only the restored step's own pre-fault loss is known."""
    reference_rtol: float = 0.05
    """Relative tolerance against a reference run's curve."""

    def __post_init__(self) -> None:
        # Checked here, not in the CLI: the KFP component and library callers build this too.
        # A lax value would pass anything (min_improvement -1 passes a loss that rose).
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be at least 1 step, got {self.window!r}")
        for name in ("continuity_rtol", "continuity_atol", "jump_rtol", "reference_rtol"):
            value = getattr(self, name)
            if not _is_real(value) or not value >= 0 or not math.isfinite(value):  # NaN fails every comparison
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not _is_real(self.min_improvement) or not 0 <= self.min_improvement < 1:
            raise ValueError(f"min_improvement must be a finite number in [0, 1) (a fraction of the first window's "
                             f"loss), got {self.min_improvement!r}")
        if self.max_final_loss is not None and (not _is_real(self.max_final_loss) or not self.max_final_loss > 0
                                                or not math.isfinite(self.max_final_loss)):
            raise ValueError(f"max_final_loss must be finite and > 0, got {self.max_final_loss!r}")


def check_reachable(steps: int, config: ConvergenceConfig) -> None:
    """Refuse (ValueError) a run the gate can never pass, before it trains: with one step, the
    first and the final window are the same step, so the improvement is 0.
    """
    if steps < 2 and config.min_improvement > 0:
        raise ValueError(f"steps {steps}: the convergence gate compares the loss of the first steps with that of the "
                         f"last, and in a 1-step run they are the same step (no improvement), so min_improvement "
                         f"{config.min_improvement:g} can never pass: train at least 2 steps, or set min_improvement 0")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """An int or float (not a bool, not a string that looks like one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(slots=True)
class Check:
    name: str
    passed: bool
    reason: str
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    skipped: bool = False


@dataclasses.dataclass(slots=True)
class Verdict:
    run_dir: str
    checks: list[Check]
    recoveries: list[dict[str, Any]]
    thresholds: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The thresholds the gate applied (max_final_loss as used: given or derived), for the record."""
    checkpoint: Path | None = None
    """The checkpoint judged (the run's latest when the gate ran); None when the run has none."""

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)  # a skipped check has passed=True: it fails nothing

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "passed": self.passed, "checks": [dataclasses.asdict(c) for c in self.checks],
                "recoveries": self.recoveries, "thresholds": self.thresholds,
                "checkpoint": None if self.checkpoint is None else str(self.checkpoint)}

    def format(self) -> str:
        lines = [f"{'PASSED' if self.passed else 'FAILED'} convergence gate: {self.run_dir}"]
        for c in self.checks:
            mark = "skip" if c.skipped else ("ok  " if c.passed else "FAIL")
            lines.append(f"  {mark} {c.name}: {c.reason}")
        return "\n".join(lines)


def _default_threshold(checkpoint: Path | None, unusable: str | None) -> tuple[float | None, str, bool]:
    """0.8 x ln(vocab): well below the loss of uniform guessing, from the judged checkpoint's own
    manifest (the one validation pins to the event log): no other step directory's, which anyone
    could plant beside it (a stranger trial's lifted the threshold to 60 and passed a failing
    run); else (None, why there is none, and whether that fails the check: a judged checkpoint
    whose manifest does not read is no model to pass).
    """
    from resilient_training.run import checkpoint_format as cf

    if checkpoint is None:
        why = f"its latest checkpoint cannot be judged ({unusable})" if unusable else "it has no committed checkpoint"
        return None, f"no --max-final-loss, and {why} to derive one from", False
    try:
        manifest = cf.read_manifest(checkpoint)
    except cf.CheckpointError as exc:
        return None, f"the judged checkpoint's manifest does not read: {exc}"[:400], True
    model = manifest.get("model_config")
    vocab = model.get("vocab_size") if isinstance(model, dict) else None
    if _is_int(vocab) and vocab > 1:  # ln(1) = 0 would fail every loss
        return 0.8 * math.log(vocab), f"0.8 x ln(vocab_size {vocab}) from {checkpoint.name}'s manifest", False
    return None, "the run's task records no vocab_size to derive a default threshold from; pass --max-final-loss", False


# The largest loss a training step can log: the trainer all-reduces the loss as a float32 (bf16
# autocast included), so a larger one overflows to inf there. A logged loss beyond it, finite as a
# float64 (1.7e308), was put in the log by hand: it is judged as not finite, never as "improving"
# (a stranger trial's two such first steps crashed the gate, and would have made its first window huge).
LOSS_LIMIT = 3.4028234663852886e38  # float32's largest finite value


def _usable(loss: float) -> bool:
    """A loss the gate can judge: finite and within :data:`LOSS_LIMIT`."""
    return math.isfinite(loss) and abs(loss) <= LOSS_LIMIT


def _close(a: float, b: float, rtol: float, atol: float = 0.0) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b)


def check_convergence(
    run_dir: str | os.PathLike[str],
    config: ConvergenceConfig | None = None,
    *,
    reference_dir: str | os.PathLike[str] | None = None,
) -> Verdict:
    """Run every check on the run's event log; RunError when it is not a run, EventLogError
    (a ValueError) when a line of its event log is not an event.
    """
    config = config or ConvergenceConfig()
    run_dir = Path(run_dir)
    events = metrics.load_events(run_dir)
    ref = metrics.reference_rank(events)
    runs = metrics.step_runs(events, ref)
    if not runs:
        raise RunError(f"{run_dir} logged no training step: nothing to judge")
    survivors = metrics.surviving(runs)
    curve = [(step, run.loss) for step, run in survivors.items()]
    checkpoint, judged_step, history, unusable = _judged_history(run_dir, events, runs)
    checks = [_finite(runs, curve, events), _completed(run_dir, events, runs[-1].step)]
    if unusable:  # committed steps, but `latest` names none of them: which model would pass is unknown
        checks.append(Check("latest_checkpoint", False, f"the run's latest checkpoint cannot be judged: {unusable}"))
    learning, threshold_from = _learning(checkpoint, unusable, history, config, judged_step)
    checks += learning
    continuity, recoveries = _continuity(events, config)
    checks.append(continuity)
    if reference_dir is not None:
        checks.append(_reference(events, Path(reference_dir), config))
    thresholds = {**dataclasses.asdict(config), "max_final_loss": learning[0].values["threshold"],
                  "max_final_loss_from": threshold_from}
    return Verdict(run_dir=str(run_dir), checks=checks, recoveries=recoveries, thresholds=thresholds,
                   checkpoint=checkpoint)


def _judged_history(run_dir: Path, events: list[Any], runs: list[metrics.StepRun],
                    ) -> tuple[Path | None, int | None, list[tuple[int, float]], str | None]:
    """The checkpoint the gate judges (the run's latest), its step, the loss curve that leads to
    it, and why ``latest`` is unusable when the run has committed steps but it names none.

    That curve is each step's last execution up to the checkpoint's step, among those logged
    before it was (last) committed: steps trained after it, or replayed on another branch after
    a rollback past it, are not its model's. Without a checkpoint: the whole surviving curve.
    """
    from resilient_training.run import checkpoint_format as cf

    root = layout.checkpoints_dir(run_dir)
    unusable = None
    try:
        checkpoint = cf.read_latest(root)
    except cf.CheckpointError as exc:
        checkpoint, unusable = None, str(exc)  # the record then names no checkpoint, and promotion refuses
    if checkpoint is None and unusable is None and cf.committed_steps(root):
        unusable = f"{root / cf.LATEST_NAME} is missing or not a file, and steps are committed"
    step = cf.parse_step_dirname(checkpoint.name) if checkpoint is not None else None
    if step is None:
        return checkpoint, None, [(s, r.loss) for s, r in metrics.surviving(runs).items()], unusable
    commits = [e.ts for e in events if e.event == "ckpt_committed" and e.step == step and e.get("tier") != "local"]
    until = max(commits, default=math.inf)
    history = metrics.surviving(r for r in runs if r.ts <= until)
    return checkpoint, step, [(s, r.loss) for s, r in history.items() if s <= step], None


def _finite(runs: list[metrics.StepRun], curve: list[tuple[int, float]], events: list[Any]) -> Check:
    bad = [(s, v) for s, v in curve if not _usable(v)]
    logged = sum(1 for r in runs if not _usable(r.loss))
    # The NaN guard stops a step whose loss is not finite before it is logged: its failure says so
    # (every rank's, at one step of one attempt and iteration). "All finite" said nothing of five.
    seen = {(e.attempt, e.iteration, e.step) for e in events
            if e.event == "step" and not _usable(e.get("loss", math.nan))}
    # Rolled back and replayed: training went on after it (a NaN that ended the run was counted too).
    last = max((e.ts for e in events if e.event == "step"), default=-math.inf)
    caught = len({(e.attempt, e.iteration, e.step) for e in events
                  if e.event == "failure_detected" and e.get("cause") == "nan" and e.ts < last} - seen)
    values = {"steps": len(curve), "non_finite_in_curve": len(bad), "non_finite_logged": logged,
              "non_finite_caught": caught, "first_bad_step": bad[0][0] if bad else None}
    huge = sum(1 for _, v in bad if math.isfinite(v))
    values["beyond_float32"] = huge
    if bad:
        what = (f"non-finite or out of range ({huge} finite but beyond {LOSS_LIMIT:.4g}, the largest loss a float32 "
                "training step can log: put in the log by hand?)" if huge else "non-finite")
        return Check("finite", False, f"{len(bad)} of {len(curve)} steps end {what}, first at step {bad[0][0]} "
                     f"(loss {bad[0][1]})", values)
    if logged or caught:
        said = ([f"{logged} logged"] if logged else []) + ([f"{caught} stopped by the NaN guard before logging"]
                                                            if caught else [])
        return Check("finite", True, f"all {len(curve)} steps finite; {logged + caught} non-finite loss(es) "
                     f"({', '.join(said)}) were rolled back and replayed finite", values)
    return Check("finite", True, f"all {len(curve)} logged losses are finite", values)


def _completed(run_dir: Path, events: list[Any], last_step: int) -> Check:
    ends = [e for e in events if e.event == "end"]
    final = next((e for e in reversed(ends) if e.rank <= 0), ends[-1] if ends else None)
    if final is None:
        return Check("completed", False, "the run logged no end event (still running, or killed)", {"status": None})
    # The end of an earlier session does not end a later one (a resume killed, or still training):
    # rank 0 logs its end after its last step, in every session.
    later = [e for e in events if e.rank == 0 and e.event in ("start", "step") and e.ts > final.ts]
    if later:
        step = max((e.step for e in later if e.event == "step"), default=None)
        return Check("completed", False, "the run's last session logged no end event (still running, or killed)"
                     + (f" after step {step}" if step is not None else "")
                     + f"; an earlier session ended {final.get('status')}", {"status": None})
    status, reason = final.get("status"), final.get("reason")
    target = metrics.target_step(run_dir, final) if status == "completed" else None
    if target is not None and target != last_step:
        # The trainer ends "completed" at its target step, the last it trained: a log cut after an
        # earlier step and its end kept said completed (a second stranger trial); with the end's
        # step nulled out, the target is the run's config.json's (a third).
        said = "" if isinstance(final.step, int) else " (the target step of the run's config.json: its end names none)"
        return Check("completed", False, f"the run's end says completed at step {target}{said}, but its last "
                     f"logged step is {last_step} (the event log was cut or edited)", {"status": None})
    # (``last_step``: the last step logged, in time: a resume to fewer steps than an earlier session
    # reached ends at its own target, a stranger trial's "cut or edited" for a correct run.)
    return Check("completed", status == "completed", f"run ended {status}" + (f" ({reason})" if reason else ""),
                 {"status": status, "reason": reason})


def _learning(checkpoint: Path | None, unusable: str | None, curve: list[tuple[int, float]],
              config: ConvergenceConfig, judged_step: int | None) -> tuple[list[Check], str | None]:
    """final_loss and improvement over ``curve`` (ending at the judged checkpoint), and where the threshold came from."""
    window = min(config.window, max(1, len(curve) // 2))
    first = [v for _, v in curve[:window]]
    final = [v for _, v in curve[-window:]]
    # (metrics.mean: statistics.fmean raised OverflowError on two losses of 1.7e308, a stranger
    # trial's traceback, which left the gate's earlier PASS in place.)
    first_mean = metrics.mean(first) if first else math.nan
    final_mean = metrics.mean(final) if final else math.nan
    beyond = [v for v in first + final if math.isfinite(v) and not _usable(v)]
    unjudgeable = False
    if config.max_final_loss is not None:
        threshold, threshold_from = config.max_final_loss, "given"
    else:
        threshold, threshold_from, unjudgeable = _default_threshold(checkpoint, unusable)
    values = {"window": window, "first_mean": first_mean, "final_mean": final_mean, "threshold": threshold,
              "first_steps": [curve[0][0], curve[window - 1][0]] if curve else None,
              "final_steps": [curve[-window][0], curve[-1][0]] if curve else None, "judged_step": judged_step}
    if unjudgeable:
        final_check = Check("final_loss", False, threshold_from or "", values)
        threshold_from = None
    elif threshold is None:
        final_check = Check("final_loss", True, f"skipped: {threshold_from}", values, skipped=True)
        threshold_from = None
    elif not math.isfinite(final_mean):
        final_check = Check("final_loss", False, f"final-window mean is {final_mean}", values)
    elif not all(_usable(v) for v in final):
        final_check = Check("final_loss", False, f"the final window (steps {values['final_steps'][0]}-"
                            f"{values['final_steps'][1]}) holds a loss beyond {LOSS_LIMIT:.4g}, the largest a "
                            "float32 training step can log: no loss to judge", values)
    else:
        ok = final_mean < threshold
        final_check = Check("final_loss", ok, f"final-window mean {final_mean:.4f} (steps {values['final_steps'][0]}"
                            f"-{values['final_steps'][1]}) {'<' if ok else '>='} threshold {threshold:.4f}", values)
    improvement = (first_mean - final_mean) / abs(first_mean) if first_mean and math.isfinite(first_mean) \
        and math.isfinite(final_mean) else math.nan
    ivalues = {**values, "improvement": improvement, "min_improvement": config.min_improvement}
    if len(curve) < 2:
        upto = f" up to the judged checkpoint (step {judged_step})" if judged_step is not None else ""
        imp = Check("improvement", False, f"only {len(curve)} step logged{upto}: cannot show learning", ivalues)
    elif beyond:
        imp = Check("improvement", False, f"a window holds a loss beyond {LOSS_LIMIT:.4g} ({beyond[0]:.4g}), the "
                    "largest a float32 training step can log: no improvement can be judged from it", ivalues)
    elif not math.isfinite(improvement):
        imp = Check("improvement", False, f"improvement is {improvement} (non-finite losses)", ivalues)
    else:
        ok = improvement >= config.min_improvement
        imp = Check("improvement", ok, f"loss fell {improvement:.1%} from first window {first_mean:.4f} to final "
                    f"{final_mean:.4f} ({'>=' if ok else '<'} {config.min_improvement:.1%} required)", ivalues)
    return [final_check, imp], threshold_from


def _unlogged_restores(events: list[Any]) -> list[tuple[float, dict[str, Any]]]:
    """(time, entry) for every stretch of a rank's steps that no ``load_done`` precedes in its segment.

    A segment is one process (from its ``start``; a process ends at its ``end``) and one
    in-process restart iteration (a new attempt or iteration). The trainer logs ``load_done``
    before its first step in every segment (step 0 on a fresh start), so a segment without one
    had its restore removed from the log. Only a rank's very first steps, from step 1, need
    none: nothing was restored there (logs written by tests and older trainers omit it).
    """
    out: list[tuple[float, dict[str, Any]]] = []
    segments: dict[int, dict[str, Any]] = {}  # rank -> its current segment
    trained: set[int] = set()
    for e in events:
        if e.rank < 0:
            continue
        seg = segments.get(e.rank)
        if seg is None or e.event == "start" or seg["ended"] or (e.attempt, e.iteration) != seg["key"]:
            seg = segments[e.rank] = {"key": (e.attempt, e.iteration), "loaded": False, "stepped": False,
                                      "ended": False}
        if e.event == "load_done":
            seg["loaded"] = True
        elif e.event == "end":
            seg["ended"] = True
        elif e.event == "step" and not seg["stepped"]:
            seg["stepped"] = True
            fresh = e.rank not in trained and e.step == 1
            if not seg["loaded"] and not fresh:
                out.append((e.ts, {
                    "rank": e.rank, "attempt": e.attempt, "iteration": e.iteration, "restored_step": None,
                    "first_step": e.step, "loss": e.get("loss"), "basis": "missing", "expected": None,
                    "deviation": None, "passed": False,
                    "reason": f"rank {e.rank} attempt {e.attempt} iteration {e.iteration}: the steps from step "
                              f"{e.step} on follow no load_done: its restore is not in the event log: it cannot be "
                              "checked"}))
        if e.event == "step":
            trained.add(e.rank)
    return out


PACE_STEPS = 5  # the steps before a restore whose step-to-step changes set its jump allowance
# After a restore, the steps compared with their pre-fault losses, and their tolerance (x the
# first step's). The first step is exact on CPU and GPU; later GPU steps drift (atomics in
# kernels): in the 518 restores of the committed H200 runs at most 0.018 % at the 2nd step and
# 0.45 % within 12 (benchmarks/replay_drift.py). A task's own step counter, unsaved, put 4.2 %
# on the 2nd step (stranger trial), which the first-step check passed with "deviation 0".
REPLAY_STEPS = 10
REPLAY_RTOL_FACTOR = 10.0
JUMP_PACE_MARGIN = 1.5


def _recent_pace(before: list[Any], restored: int) -> float:
    """The largest relative change between consecutive steps among the last :data:`PACE_STEPS`
    logged up to ``restored`` (each step's last loss; 0 when fewer than two are known).
    """
    last = {e.step: e.get("loss") for e in before if e.step is not None and restored - PACE_STEPS <= e.step <= restored}
    changes = [abs(last[s] - last[s - 1]) / abs(last[s - 1]) for s in sorted(last)
               if s - 1 in last and math.isfinite(last[s]) and math.isfinite(last[s - 1]) and last[s - 1]]
    return max(changes, default=0.0)  # (a step event's loss is a JSON number: the event log says so)


# Ranks log the same step within this of each other (a step is collective): a rank's execution of
# the restored step this much before the last one of any rank is from another history.
HISTORY_SKEW_S = 5.0


def _world_sizes(events: list[Any]) -> dict[int, list[tuple[float, Any]]]:
    """Each rank's ``start`` events as (time, world size), in order."""
    out: dict[int, list[tuple[float, Any]]] = {}
    for e in events:
        if e.event == "start" and e.rank >= 0:
            out.setdefault(e.rank, []).append((e.ts, e.get("world_size")))
    return out


def _world_at(starts: list[tuple[float, Any]], ts: float) -> Any:
    """The world size of the process that logged at ``ts`` (its last ``start`` before), or None."""
    return next((size for at, size in reversed(starts) if at <= ts), None)


def _continuity(events: list[Any], config: ConvergenceConfig) -> tuple[Check, list[dict[str, Any]]]:
    timed: list[tuple[float, dict[str, Any]]] = _unlogged_restores(events)
    worlds = _world_sizes(events)
    for load in metrics.restores(events):
        rank = load.rank
        before = [e for e in events if e.event == "step" and e.rank == rank and e.ts < load.ts]
        after = next((e for e in events if e.event == "step" and e.rank == rank and e.ts > load.ts), None)
        entry: dict[str, Any] = {"rank": rank, "attempt": load.attempt, "iteration": load.iteration,
                                 "restored_step": load.step, "first_step": None, "loss": None, "basis": None,
                                 "expected": None, "deviation": None, "passed": True, "reason": ""}
        timed.append((load.ts, entry))
        if after is None:
            entry["reason"] = "no step after this restore (the run ended or failed again first)"
            entry["basis"] = "none"
            continue
        restored = int(load.step or 0)
        loss = float(after.get("loss", math.nan))
        entry.update(first_step=after.step, loss=loss)
        if after.step != restored + 1:
            entry.update(passed=False, reason=f"resumed at step {after.step}, expected {restored + 1} after restoring "
                         f"step {restored}")
            continue
        # The restored state's history: from the last execution of the restored step by any rank (a
        # stranger trial resized 3 -> 1 -> 3 ranks: the 1-rank session's step 35 was restored, and
        # rank 1's step 36 of the first session, another history, was taken for its replay).
        origin = next((e for e in reversed(events) if e.event == "step" and e.step == restored and e.ts < load.ts),
                      None)
        since = origin.ts if origin is not None else -math.inf
        same = [e for e in before if e.step == after.step and e.ts > since]
        prior = [e for e in before if e.step == restored]
        if origin is not None and (not prior or prior[-1].ts < since - HISTORY_SKEW_S):
            prior = [origin]  # this rank did not run in that history (it is new): another rank's loss
        now = _world_at(worlds.get(rank, []), load.ts)
        basis = (same or prior or [load])[-1]
        then = _world_at(worlds.get(basis.rank, []), basis.ts)
        if now is not None and then is not None and now != then:
            # At another world size a rank's batches and the reduction differ: its losses are not the
            # same numbers (a stranger trial's resume at 1 rank of a 2-rank run: 0.5 % off at once,
            # an elastic run's 3 % by the 7th step; a task sharding its data by rank: 12 %). The
            # restored step's own loss, within the jump tolerance, is the basis; no replay.
            entry["world_sizes"] = [then, now]
            same = []
        if same:
            expected = float(same[-1].get("loss", math.nan))
            entry.update(basis="replayed step", expected=expected)
            ok = _close(loss, expected, config.continuity_rtol, config.continuity_atol)
            tol = f"rtol {config.continuity_rtol:g}"
        elif prior:
            expected = float(prior[-1].get("loss", math.nan))
            entry.update(basis="restored step", expected=expected)
            # One step's change as large as the curve's own recent ones passes: early in training
            # a correct restore's next step fell 19 % where 15 % was allowed (stranger trial).
            pace = _recent_pace(before, restored)
            jump = max(config.jump_rtol, JUMP_PACE_MARGIN * pace)
            ok = _close(loss, expected, jump)
            tol = (f"jump rtol {jump:.3g} ({JUMP_PACE_MARGIN:g} x the largest of the last {PACE_STEPS} steps' "
                   f"changes, {pace:.3g})" if jump > config.jump_rtol else f"jump rtol {config.jump_rtol:g}")
        else:
            entry.update(basis="none", reason=f"no loss logged before the fault at step {after.step} or {restored}: "
                         "unchecked")
            continue
        if not math.isfinite(expected):
            entry.update(basis="none", reason=f"the pre-fault loss at step {same[-1].step if same else restored} was "
                         "not finite (the fault itself): unchecked")
            continue
        entry["deviation"] = abs(loss - expected) / abs(expected) if expected else abs(loss - expected)
        entry["passed"] = ok
        entry["reason"] = (f"rank {rank} step {after.step}: loss {loss:.6g} vs {expected:.6g} before the fault "
                           f"({entry['basis']}), relative deviation {entry['deviation']:.3g} "
                           f"{'within' if ok else 'exceeds'} {tol}")
        if "world_sizes" in entry:
            entry["reason"] += f" (world size {entry['world_sizes'][0]} before the fault, {entry['world_sizes'][1]} after)"
        if ok and same:
            _check_replay(entry, load, before, events, config)
    recoveries = [entry for _, entry in sorted(timed, key=lambda t: t[0])]
    failed = [r for r in recoveries if not r["passed"]]
    checked = [r for r in recoveries if r["basis"] not in (None, "none", "missing")]
    unlogged = sum(1 for r in recoveries if r["basis"] == "missing")
    values = {"restores": len(recoveries), "checked": len(checked), "failed": len(failed),
              "max_deviation": max((r["deviation"] for r in checked if r["deviation"] is not None), default=None),
              "max_replay_deviation": max((r["replay_deviation"] for r in checked if "replay_deviation" in r),
                                          default=None),
              "replayed_steps": sum(r.get("replayed", 0) for r in checked), "not_logged": unlogged}
    if failed:
        what = "failed the check" if unlogged else "broke the loss curve"
        return Check("continuity", False, f"{len(failed)} of {len(recoveries)} restores {what}; first: "
                     f"{failed[0]['reason']}", values), recoveries
    if not recoveries:
        return Check("continuity", True, "no restore in this run: nothing to compare", values, skipped=True), recoveries
    replay = (f", {values['replayed_steps']} replayed steps within {values['max_replay_deviation']:.3g}"
              if values["max_replay_deviation"] is not None else "")
    return Check("continuity", True, f"all {len(checked)} checked restores continue the loss curve (max relative "
                 f"deviation {values['max_deviation'] or 0:.3g} at the first step{replay}); "
                 f"{len(recoveries) - len(checked)} unchecked", values), recoveries


def _check_replay(entry: dict[str, Any], load: Any, before: list[Any], events: list[Any],
                  config: ConvergenceConfig) -> None:
    """The steps after the first one of a restore, as long as each was logged before the fault
    (the last time, by this rank), up to :data:`REPLAY_STEPS`: same loss within the replay
    tolerance. Sets ``replayed`` and ``replay_deviation``; fails ``entry`` at the first that is not.
    """
    logged = {e.step: e.get("loss") for e in before}
    rtol = REPLAY_RTOL_FACTOR * config.continuity_rtol
    worst, compared = 0.0, 1
    for e in events:
        if compared >= REPLAY_STEPS:
            break
        if e.ts <= load.ts or e.rank != load.rank or e.event not in ("step", "load_done", "start"):
            continue
        if e.event != "step" or (e.attempt, e.iteration) != (load.attempt, load.iteration):
            break  # the next restore, or process: its own entry
        if e.step == entry["first_step"]:
            continue
        expected, loss = logged.get(e.step), e.get("loss")
        if expected is None or not math.isfinite(expected) or not math.isfinite(loss):
            break  # past the fault (never logged), or the fault itself (a NaN): not replayed
        compared += 1
        deviation = abs(loss - expected) / abs(expected) if expected else abs(loss - expected)
        worst = max(worst, deviation)
        if not _close(loss, expected, rtol, config.continuity_atol):
            entry.update(passed=False, replayed=compared, replay_deviation=deviation, reason=(
                f"rank {load.rank} step {e.step} ({compared} steps after restoring step {load.step}): loss {loss:.6g} "
                f"vs {expected:.6g} before the fault, relative deviation {deviation:.3g} exceeds replay rtol "
                f"{rtol:g} ({REPLAY_RTOL_FACTOR:g} x continuity rtol; its first step matched): the replay left "
                "the history the fault cut short: state the checkpoint does not hold (a task's own step counter, "
                "an LR scheduler it steps itself and does not return from build_lr_scheduler?)"))
            return
    entry.update(replayed=compared, replay_deviation=worst)


def _trained_at(events: list[Any]) -> dict[int, tuple[float, Any]]:
    """Each surviving step of the reference rank: (loss, the world size it was trained at)."""
    ref = metrics.reference_rank(events)
    worlds = _world_sizes(events).get(ref, []) if ref is not None else []
    return {s: (r.loss, _world_at(worlds, r.ts)) for s, r in metrics.surviving(metrics.step_runs(events, ref)).items()}


def _reference(events: list[Any], reference_dir: Path, config: ConvergenceConfig) -> Check:
    mine, theirs = _trained_at(events), _trained_at(metrics.load_events(reference_dir))
    # At another world size a rank's losses are other numbers (its share of the batch): a stranger
    # trial's 1-rank run against a 3-rank reference failed "deviation 0.345" without saying why.
    def alike(a: Any, b: Any) -> bool:
        return a == b or a is None or b is None  # (a log without start events says nothing of it)

    common = [(s, v, theirs[s][0]) for s, (v, world) in mine.items() if s in theirs and alike(theirs[s][1], world)]
    apart = [(world, theirs[s][1]) for s, (_, world) in mine.items() if s in theirs and not alike(theirs[s][1], world)]
    other = sorted(set(apart), key=str)
    if not common:
        why = (f": this run trained at world size {other[0][0]}, the reference at {other[0][1]} (a rank's losses "
               "are other numbers at another world size; compare with a reference run at the same one)"
               if other else "")
        return Check("reference", False, f"no step in common with the reference run {reference_dir}{why}",
                     {"common_steps": 0})
    deviations = [(abs(v - r) / abs(r) if r else abs(v - r), s) for s, v, r in common]
    worst, at = max(deviations, key=lambda d: (not math.isfinite(d[0]), d[0]))
    ok = all(_close(v, r, config.reference_rtol) for _, v, r in common)
    skipped = f"; {len(apart)} steps trained at another world size than the reference's not compared" if apart else ""
    return Check("reference", ok, f"{len(common)} common steps, worst relative deviation {worst:.3g} at step {at} "
                 f"({'within' if ok else 'exceeds'} rtol {config.reference_rtol:g}){skipped}",
                 {"common_steps": len(common), "max_deviation": worst, "at_step": at,
                  "reference": str(reference_dir)})


def check_and_record(run_dir: str | os.PathLike[str], config: ConvergenceConfig | None = None, *,
                     reference_dir: str | os.PathLike[str] | None = None) -> Verdict:
    """:func:`check_convergence`, then its record (:func:`write_convergence_record`). A run the gate
    cannot judge has its earlier record withdrawn before the error is raised, whatever the error:
    promotion must not go on from a verdict on what the run was before (a stranger trial's
    OverflowError skipped the withdrawal, and promotion went on from the earlier PASS). An error
    that is no ValueError (RunError, EventLogError, RecordError are) is raised as a RunError
    saying so, which the CLI turns into one line and exit 2.
    """
    from resilient_training.run import gate_records

    gate_records.check_recordable(run_dir, gate_records.CONVERGENCE)  # before the gate's time is spent
    try:
        verdict = check_convergence(run_dir, config, reference_dir=reference_dir)
        write_convergence_record(run_dir, verdict)
    except BaseException as exc:  # Ctrl-C too: the record must not outlive a gate that did not finish
        gate_records.withdraw(run_dir, gate_records.CONVERGENCE)
        if isinstance(exc, ValueError) or not isinstance(exc, Exception):
            raise
        what = " ".join(str(exc).split())[:300]
        raise RunError(f"the convergence gate could not judge {run_dir} (internal error {type(exc).__name__}"
                       f"{': ' + what if what else ''}); its earlier record is withdrawn") from exc
    return verdict


def write_convergence_record(run_dir: str | os.PathLike[str], verdict: Verdict) -> Path:
    """Record the verdict in ``RUN/gates/convergence.json``: the checks (a skipped one says so:
    ``"skipped": true``; it fails nothing), the thresholds applied, and the checkpoint judged.
    """
    from resilient_training.run import checkpoint_format as cf
    from resilient_training.run import gate_records

    record: dict[str, Any] = {
        "passed": verdict.passed,
        "checks": {c.name: {"passed": c.passed, "skipped": c.skipped, "reason": c.reason} for c in verdict.checks},
        "thresholds": verdict.thresholds,
    }
    # The checkpoint the verdict judged, not whatever `latest` names now: its window ended there.
    if verdict.checkpoint is not None:
        try:
            record.update(gate_records.checkpoint_identity(run_dir, verdict.checkpoint))
        except cf.CheckpointError:
            pass  # deleted since: the record names none, and promotion refuses
    return gate_records.write_record(run_dir, gate_records.CONVERGENCE, record)
