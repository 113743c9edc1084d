"""When a rank counts as hung: the one place that owns the progress deadline.

Progress is a finished training step (or a bounded wait inside a save). The *allowance* is how
long the training thread may go without progress. It starts at ``soft_timeout`` and is calibrated
from what was measured: ``margin`` × the slowest gap between steps seen so far (never below
``floor``, never above ``soft_timeout``; the first steps after each start get ``soft_timeout``),
and for each known long phase (start-up, a restore up to the ranks' agreement, a save through
the next step, a commit, the end of the run) ``margin`` × its slowest measured duration (never
below ``soft_timeout``). The measurements only grow, are kept across in-process
restarts and are persisted (``state_dict``) so a restarted process starts calibrated.

Within the allowance a keeper thread reports progress to both monitors on the training thread's
behalf (NVRx's in-process progress watchdog and ft_launcher's heartbeats), so a phase may be longer
than NVRx's fixed ``soft_timeout``. Past it, the keeper stops reporting and calls ``on_expire``
once: the trainer reports a soft timeout to NVRx's in-process layer at once, whose monitor thread
on every rank aborts the NCCL communicators (releasing ranks blocked in a collective with the hung
one) and restarts the training function. Without the in-process layer, ft_launcher's heartbeat
timeout (fed only within the allowance) catches the hang.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# A gap is only evidence once training runs steadily: the first steps after (re)starting include
# lazy initialisation (NCCL communicators, kernels, allocator growth).
WARM_UP_STEPS = 3

# A rank waiting in a collective is most likely waiting for the hung one: its allowance runs this
# much longer, so that a rank stalled outside collectives reports first and is the one named. Both
# ran out together before (same calibration, same last progress): on 2 H200s the waiting rank
# reported first in 2 of 5 such hangs, by 5-88 ms (benchmarks/results/h200x2-*).
COLLECTIVE_GRACE = 0.5


class ProgressGuard:
    """The allowance, its calibration and the keeper thread (one per worker process)."""

    def __init__(self, *, initial: float, phase_default: float, floor: float, margin: float,
                 beat: Callable[[], None] = lambda: None, tick: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.initial = initial  # allowance between steps before any calibration
        self.phase_default = phase_default  # a phase never measured yet
        self.floor = floor
        self.margin = margin
        self._beat = beat
        self._tick = tick
        self._clock = clock
        self._lock = threading.Lock()
        self.slowest_gap: float | None = None  # seconds, steady training
        self.slowest_phase: dict[str, float] = {}
        self._ping: Callable[[], None] | None = None
        self._on_expire: Callable[[str], None] | None = None
        self._armed = False
        self._expired = False
        self.expiry: str | None = None  # why the allowance ran out in the current attempt
        self._last = clock()
        self._phase: tuple[str, float, float] | None = None  # name, budget, started
        self._steps_since_start = 0
        # Set by the training thread around the part of a step that holds collectives (forward,
        # backward, the loss all-reduce): a rank that stalls there is most likely waiting for a
        # hung peer, not hung itself (the report says which).
        self.in_collective = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="progress-keeper", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the allowance

    @property
    def step_allowance(self) -> float:
        """``margin`` × the slowest steady step, at least ``floor`` and at most ``initial``
        (soft_timeout): calibration only ever shortens the wait for a hang between steps. On 2
        H200s an allowance that had grown past NVRx's own soft and hard timeouts (16 s, from one
        slow step) ended in a launcher restart instead of an in-process one, twice.
        """
        if self.slowest_gap is None:
            return self.initial
        return min(self.initial, max(self.floor, self.margin * self.slowest_gap))

    def _warming_up(self) -> bool:
        """The next step is one of the first after a (re)start: the steady calibration is not
        for it. A restarted 1.3B rank's second step took over 3 s beside its new staging buffers
        and writer start, against a persisted 3.0 s (5 × 0.28 s), and was reported hung (call43).
        """
        return self._steps_since_start < WARM_UP_STEPS

    def _allowance(self) -> float:
        if self._phase is not None:
            return self._phase[1]
        return self.initial if self._warming_up() else self.step_allowance

    def phase_allowance(self, name: str, default: float | None = None) -> float:
        """A phase never gets less than ``initial`` (soft_timeout): steps calibrate below it, phases
        (a restart's set-up, a load) vary more with what else the machine is doing. ``default``:
        the allowance before the phase was ever measured (else ``phase_default``).
        """
        measured = self.slowest_phase.get(name)
        if measured is None:
            return self.phase_default if default is None else max(self.floor, default)
        return max(self.floor, self.initial, self.margin * measured)

    def describe(self) -> str:
        with self._lock:
            return self._describe()

    def where(self) -> str:
        """What the training thread was doing: a phase name, ``collective`` or ``step``."""
        if self._phase is not None:
            return self._phase[0]
        return "collective" if self.in_collective else "step"

    def _describe(self) -> str:
        if self._phase is not None:
            name, budget, _ = self._phase
            how = "default" if name not in self.slowest_phase else (
                f"{self.margin:g} × slowest {name} {self.slowest_phase[name]:.2f} s")
            return f"phase {name}: allowance {budget:.1f} s ({how})"
        if self.slowest_gap is None:
            return f"allowance {self.initial:.1f} s (soft_timeout; not calibrated yet)"
        if self._warming_up():
            return f"allowance {self.initial:.1f} s (soft_timeout; the first steps after a start)"
        if self.margin * self.slowest_gap > self.initial:
            return (f"allowance {self.step_allowance:.1f} s (soft_timeout; {self.margin:g} × slowest step "
                    f"{self.slowest_gap:.3f} s would be longer)")
        return f"allowance {self.step_allowance:.1f} s ({self.margin:g} × slowest step {self.slowest_gap:.3f} s)"

    # ------------------------------------------------------------------ the training thread's side

    def arm(self, *, ping: Callable[[], None] | None, on_expire: Callable[[str], None]) -> None:
        """Start watching a new attempt of the training function (a restart iteration)."""
        with self._lock:
            self._ping, self._on_expire = ping, on_expire
            self._last = self._clock()
            self._expired = False
            self.expiry = None
            self._steps_since_start = 0
            self._phase = None
            self._armed = True

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            self._ping = self._on_expire = None
            self._phase = None
            self.in_collective = False

    def progress(self) -> None:
        """A step finished (or a wait inside a save made headway)."""
        now = self._clock()
        with self._lock:
            if self._phase is None:
                self._steps_since_start += 1
                if self._steps_since_start > WARM_UP_STEPS:
                    gap = now - self._last
                    if self.slowest_gap is None or gap > self.slowest_gap:
                        self.slowest_gap = gap
            self._last = now
        self._report()

    def begin_phase(self, name: str, *, default: float | None = None) -> tuple[str, float, float] | None:
        """Enter a known long stretch without steps; returns what :meth:`end_phase` takes."""
        started = self._clock()
        with self._lock:
            outer = self._phase
            self._phase = (name, self.phase_allowance(name, default), started)
            self._last = started
        return outer

    def end_phase(self, outer: tuple[str, float, float] | None, *, measure: bool = True,
                  warm_up: bool = False) -> None:
        """Leave the phase entered last; its duration counts for calibration only if ``measure``
        (a phase that failed, or did not do its real work, says nothing about the next one).
        ``warm_up``: training (re)starts here, so the next few steps are not steady yet.
        """
        ended = self._clock()
        with self._lock:
            if self._phase is None:
                return  # disarmed meanwhile
            name, _, started = self._phase
            if measure:
                self.slowest_phase[name] = max(self.slowest_phase.get(name, 0.0), ended - started)
            self._phase = outer
            self._last = ended
            if warm_up:
                self._steps_since_start = 0
        self._report()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """:meth:`begin_phase`/:meth:`end_phase` around a block; measured if it completes."""
        outer = self.begin_phase(name)
        yield
        self.end_phase(outer)

    def observe(self, name: str, seconds: float) -> None:
        """A duration measured elsewhere that bounds phase ``name`` (e.g. a save's write time
        for the first load, which nothing has measured yet).
        """
        if seconds > 0:
            with self._lock:
                self.slowest_phase[name] = max(self.slowest_phase.get(name, 0.0), seconds)

    def calibrated(self) -> dict[str, Any]:
        """What the allowance is now (logged with the ``calibrated`` event)."""
        with self._lock:
            return {"step": round(self.step_allowance, 3),
                    **{name: round(self.phase_allowance(name), 3) for name in sorted(self.slowest_phase)}}

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"slowest_gap": self.slowest_gap, "slowest_phase": dict(self.slowest_phase)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Merge a persisted calibration (only ever raises the allowance)."""
        if not isinstance(state, dict):
            return
        with self._lock:
            gap = state.get("slowest_gap")
            if _seconds(gap):
                self.slowest_gap = max(self.slowest_gap or 0.0, float(gap))
            for name, seconds in (state.get("slowest_phase") or {}).items():
                if _seconds(seconds):
                    self.slowest_phase[name] = max(self.slowest_phase.get(name, 0.0), float(seconds))

    # ------------------------------------------------------------------ the keeper

    def _report(self) -> None:
        ping = self._ping
        if ping is not None:
            with contextlib.suppress(Exception):
                ping()
        with contextlib.suppress(Exception):
            self._beat()

    def _keep(self) -> None:
        while not self._closed.wait(self._tick):
            with self._lock:
                if not self._armed or self._expired:
                    continue
                allowance = self._allowance()
                grace = COLLECTIVE_GRACE if self._phase is None and self.in_collective else 0.0
                allowance += grace
                silent = self._clock() - self._last
                if silent > allowance:
                    self._expired = True
                    on_expire = self._on_expire
                    reason = self.expiry = (f"no progress for {silent:.1f} s in {self.where()}; {self._describe()}"
                                            + (f" + {grace:g} s waiting in a collective" if grace else ""))
                else:
                    on_expire = None
            if on_expire is not None:
                with contextlib.suppress(Exception):
                    on_expire(reason)
            elif silent <= allowance:
                self._report()

    def close(self) -> None:
        self.disarm()
        self._closed.set()


def _seconds(value: Any) -> bool:
    """A usable duration from a manifest: positive and finite (JSON also reads ``Infinity``, which
    would make an allowance that never runs out), never a bool.
    """
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
