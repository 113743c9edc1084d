"""Helpers for tests that run the real trainer under the real launcher and read its event log."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from resilient_training.run import events as ev

# Small and quick, but real: 2 gloo workers under ft_launcher, in-process restart, async saves.
FAST = ["--steps", "16", "--checkpoint-every", "4", "--nproc", "2"]


@dataclass
class Run:
    returncode: int
    output: str
    run_dir: Path

    @property
    def events(self) -> list[ev.Event]:
        return ev.read_events(self.run_dir)


def train(run_dir: Path, *args: str, timeout: float = 240) -> Run:
    command = [sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir), *args]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        # A run that never ends leaves only its console line otherwise: say where it stood.
        raise AssertionError(f"train did not end in {timeout:.0f} s\n{_where_it_stood(run_dir)}") from exc
    return Run(proc.returncode, proc.stdout + proc.stderr, run_dir)


def _where_it_stood(run_dir: Path) -> str:
    lines = []
    try:
        lines += [f"{e.ts:.2f} r{e.rank} a{e.attempt} {e.event} step={e.step} "
                  f"{ {k: v for k, v in e.fields.items() if k in ('cause', 'reason', 'layer', 'fault')} }"
                  for e in ev.read_events(run_dir)[-40:]]
    except Exception as exc:  # the log itself may be what broke
        lines.append(f"(events unreadable: {exc})")
    for log in sorted((run_dir / "logs").glob("*.log")):
        lines += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-30:]]
    return "\n".join(lines)


def rank0_losses(events: list[ev.Event]) -> list[tuple[float, int, float]]:
    """(ts, step, loss) of rank 0's step events, in time order."""
    return [(e.ts, e.step, e["loss"]) for e in events if e.event == "step" and e.rank == 0]


def check_recovered(run: Run, fault: str, *, layer: str, cause: str | None, steps: int = 16) -> dict:
    """Assert one fault was injected, detected, handled by ``layer`` and restored correctly.

    Returns what was found (restored step, first loss after restore) for further checks.
    """
    assert run.returncode == 0, run.output[-3000:]
    events = run.events
    injected = [e for e in events if e.event == "fault_injected" and e["fault"] == fault]
    assert len(injected) == 1, f"{fault} injected {len(injected)} times"
    fault_event = injected[0]
    after = [e for e in events if e.ts >= fault_event.ts]
    if cause is not None:
        assert any(e.event == "failure_detected" and e["cause"] == cause for e in after), (
            f"no failure_detected with cause {cause}: "
            f"{[(e.rank, e['cause']) for e in after if e.event == 'failure_detected']}"
        )
    restarts = [e for e in after if e.event == "restart_done"]
    assert restarts and restarts[0]["layer"] == layer, [(e.rank, e["layer"]) for e in restarts]
    load = next(e for e in after if e.event == "load_done" and e.ts > restarts[0].ts)
    committed = [e.step for e in events if e.event == "ckpt_committed" and e.ts < load.ts and e.step <= fault_event.step]
    if str(load.get("source")) == "memory (snapshot)":
        # An in-process restart from the memory snapshot: a step trained before the fault's restart.
        assert layer == "inprocess", load.fields
        trained = [e.step for e in events if e.event == "step" and e.rank == load.rank and e.ts < fault_event.ts]
        assert load.step in trained, (load.step, trained)
    elif str(load.get("source")).startswith("memory (staged"):
        # An in-process restart may restore a save still in flight that every rank had staged:
        # newer than the last commit, and the last save this rank began before the restart (a
        # peer may log its save a moment after the fault on another rank was logged).
        assert layer == "inprocess", load.fields
        begun = [e.step for e in events if e.event == "ckpt_begin" and e.rank == load.rank and e.ts < restarts[0].ts]
        assert load.step == begun[-1] and load.step > max(committed, default=0), (load.step, begun, committed)
    elif load.step > max(committed, default=0):
        # The one window left: rank 0 killed between `latest` naming the step and its log line
        # (checkpoint_format.commit). Then the step was begun before the fault and never logged.
        begun = [e.step for e in events if e.event == "ckpt_begin" and e.ts < fault_event.ts]
        logged = [e.step for e in events if e.event == "ckpt_committed"]
        assert load.step in begun and load.step not in logged, (load.step, committed, begun)
    else:
        assert load.step == max(committed, default=0), (load.step, committed)
    assert (load["path"] is None) == (load.step == 0)
    if layer == "inprocess":
        # The process survived: a step still held in its staging buffers is restored from memory
        # (the buffers hold the last save begun; a sync save logs ckpt_staged only once written).
        staged = [e.step for e in events if e.event == "ckpt_begin" and e.rank == load.rank and e.ts < load.ts]
        if staged and staged[-1] == load.step:
            assert str(load["source"]).startswith("memory"), load.fields
    # The loss right after the restore equals the loss logged at that step before the fault.
    losses = rank0_losses(events)
    resumed = next((ts, s, loss) for ts, s, loss in losses if ts > load.ts)
    assert resumed[1] == load.step + 1
    before = [loss for ts, s, loss in losses if ts < fault_event.ts and s == resumed[1]]
    if before:
        assert abs(before[-1] - resumed[2]) <= 1e-6 * max(1.0, abs(before[-1])), (before[-1], resumed)
    ends = [e for e in events if e.event == "end" and e.ts > load.ts]
    ranks = {e.rank for e in events if e.event == "start" and e.rank >= 0}  # every worker rank
    assert ranks and {e.rank for e in ends if e["status"] == "completed" and e.step == steps} == ranks
    return {"restored": load.step, "continuity_checked": bool(before), "events": events,
            "recovery_seconds": resumed[0] - fault_event.ts}


# The built-in Llama task at its smallest: real text, a transformers model, seconds per run on a CPU.
LLAMA_TINY = ["--task", "resilient_training.tasks.llama:task", "--task-arg", "preset=tiny", "--task-arg", "seq_len=32",
              "--task-arg", "batch_size=4"]


def gated_llama_run(cache_root: Path) -> Path:
    """A real 2-worker Llama run (checkpoints at steps 4, 8, 12) whose checkpoints all passed
    validate-checkpoint and whose loss passed check-convergence; built once per test session.
    """
    from resilient_training.cli.main import main
    from tests.support.gates import build_once

    def build(path: Path) -> None:
        # Synchronous saves: a checkpoint at every 4th step, none deferred behind a busy writer.
        run = train(path, "--steps", "12", "--checkpoint-every", "4", "--no-async-checkpoint", "--nproc", "2",
                    *LLAMA_TINY)
        assert run.returncode == 0, run.output[-3000:]
        assert main(["validate-checkpoint", str(path), "--all"]) == 0
        assert main(["check-convergence", str(path)]) == 0

    return build_once(cache_root, "gated-llama-run", build)


def two_rank_gpt_run(cache_root: Path) -> Path:
    """8 steps of the built-in GPT task on 2 ranks, synchronous saves at steps 4 and 8: a real,
    short, clean run, built once per test session (pass ``tmp_path_factory.getbasetemp()``) for
    the tests that only need one; read-only (take a copy with ``tests.support.gates.copy_run``).
    """
    from tests.support.gates import build_once

    def build(path: Path) -> None:
        run = train(path, "--nproc", "2", "--steps", "8", "--checkpoint-every", "4", "--no-async-checkpoint")
        assert run.returncode == 0, run.output[-3000:]

    return build_once(cache_root, "two-rank-gpt-run", build)
