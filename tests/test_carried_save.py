"""A save in flight at an in-process restart is kept and committed once written (Checkpointer.carry).

Its shard was staged before the fault; dropped, a 1.3B run on one H200 committed nothing between
its in-process restarts, and its launcher restarts rolled back 109 and 201 steps (call72). Kept
only when every rank carries the same save and the restore lands at or past it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from resilient_training.run import checkpoint_format as fmt
from resilient_training.run import config as cfg
from resilient_training.runtime.checkpointing import Checkpointer, StagingBuffers, state_dict
from resilient_training.runtime.nvrx_adapter import CheckpointWriterDied
from tests.support.gates import TINY, train_state


class _HeldWriter:
    """NVRx's writer process, at its edge: writes each shard (real files) once released."""

    ready = True
    death = None
    pid: int | None = 4242  # the writer process

    def __init__(self) -> None:
        self.released = threading.Event()
        self.jobs: list = []

    refuse = False  # the next hand-over fails (the writer went away while it was handed the job)

    def submit(self, fn, job) -> None:
        if self.refuse:
            self.refuse = False
            raise RuntimeError("the writer went away")
        self.jobs.append((fn, job))

    def poll(self) -> bool:
        if not self.released.is_set():
            return False
        while self.jobs:
            fn, job = self.jobs.pop(0)
            fn(*job)
        return True

    def replace(self) -> None:
        pass


def _iteration(run_dir: Path, tag: str, writer, staging, events: list, *, carried=None, peer=None) -> Checkpointer:
    """One in-process iteration's checkpointer; ``peer``: what a second rank answers to "the steps
    held in memory" (None: the same as this rank)."""
    config = cfg.from_argv(["--run-dir", str(run_dir), "--steps", "20", "--checkpoint-every", "5"])

    def gather(value, what):
        if peer is not None and what == "agreeing on the steps held in memory":
            return [value, peer(value)]
        return [value]

    return Checkpointer(config, rank=0, world_size=1, tag=tag, writer=writer, staging=staging,
                        emit=lambda event, step, **kw: events.append((event, step, kw)), gather=gather,
                        carried=carried)


def _failed_during_a_save(run_dir: Path, events: list):
    """Iteration 0 saved step 5 and failed before the write was durable: (writer, staging, carried)."""
    writer, staging = _HeldWriter(), StagingBuffers()
    first = _iteration(run_dir, "r0i0", writer, staging, events)
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    first.save(5, state_dict(model, optimizer), data.state_dict(), {})
    assert writer.jobs and first.local_done() == 0.0  # handed to the writer, not durable yet
    return writer, staging, first.carry()


def test_a_save_in_flight_at_an_in_process_restart_is_committed_once_written(tmp_path: Path) -> None:
    events: list = []
    writer, staging, carried = _failed_during_a_save(tmp_path / "run", events)
    assert carried is not None and carried.step == 5
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried)
    path, manifest = second.find_restorable(in_memory=True)
    assert (path, manifest["memory"], manifest["step"]) == (None, "staged", 5)
    assert [(e, s, kw) for e, s, kw in events if e == "ckpt_carried"] == [("ckpt_carried", 5, {"tier": "persistent",
                                                                                                 "restored": 5})]
    assert second.will_defer(10)  # one save in flight at a time: the carried one
    assert second.local_done() == 0.0
    writer.released.set()
    done = second.local_done()
    assert done == 1.0 and second.will_commit(done)
    second.maybe_commit(done)
    second.committer.settle(30)
    latest = fmt.read_latest(second.root)
    assert latest is not None and fmt.read_manifest(latest)["step"] == 5
    assert fmt.damaged_files(latest, fmt.read_manifest(latest)) == []
    assert not list(second.root.glob(f"{fmt.TMP_PREFIX}*"))


def test_a_save_not_carried_by_every_rank_is_dropped(tmp_path: Path) -> None:
    events: list = []
    writer, staging, carried = _failed_during_a_save(tmp_path / "run", events)
    # The peer's fault struck before its save was handed over: it carries nothing.
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried,
                        peer=lambda mine: [*mine[:2], -1])
    path, manifest = second.find_restorable(in_memory=True)
    assert manifest["memory"] == "staged" and not second.will_defer(10)
    assert "ckpt_carried" not in [e for e, _, _ in events]
    writer.released.set()
    second.maybe_commit(second.local_done())
    second.committer.settle(30)
    assert fmt.read_latest(second.root) is None


class _SnapshotOfStep3:
    """The memory snapshot (device memory), at its edge: holds step 3, every value finite."""

    world = (0, 1)

    def ready(self) -> int:
        return 3

    def finite(self) -> bool:
        return True


def test_a_save_is_not_carried_past_a_restore_that_lands_before_it(tmp_path: Path) -> None:
    events: list = []
    writer, staging, carried = _failed_during_a_save(tmp_path / "run", events)
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried)
    second._snapshot = _SnapshotOfStep3()
    # After a NaN the staged step is not restored (it may hold the cause): the snapshot of step 3
    # is, training goes on from there, and step 5 is saved again when it comes.
    path, manifest = second.find_restorable(in_memory=True, after_nan=True)
    assert (path, manifest["memory"], manifest["step"]) == (None, "snapshot", 3)
    assert "ckpt_carried" not in [e for e, _, _ in events] and not second.will_defer(5)


def test_a_save_whose_writer_died_is_not_carried(tmp_path: Path) -> None:
    events: list = []
    writer, staging, carried = _failed_during_a_save(tmp_path / "run", events)
    writer.death = "killed by SIGKILL"  # found dead after the failure, before the restore
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried)
    second.find_restorable(in_memory=True)
    assert "ckpt_carried" not in [e for e, _, _ in events]


def test_a_save_handed_to_a_writer_since_replaced_is_not_carried(tmp_path: Path) -> None:
    """The trainer gives a dead writer up between iterations (AsyncWriter.abandon: no writer, no
    death) and starts another: neither holds the job, and either says "durable" when polled."""
    events: list = []
    writer, staging, carried = _failed_during_a_save(tmp_path / "run", events)
    writer.jobs.clear()  # the job died with its process
    writer.pid = 4343  # a new writer process (or None: none yet)
    writer.released.set()
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried)
    second.find_restorable(in_memory=True)
    assert "ckpt_carried" not in [e for e, _, _ in events]
    second.maybe_commit(second.local_done())
    second.committer.settle(30)
    assert fmt.read_latest(second.root) is None  # nothing committed that was never written


def test_a_carried_save_not_yet_decided_is_passed_on_to_the_next_iteration(tmp_path: Path) -> None:
    events: list = []
    writer, staging, carried = _failed_during_a_save(tmp_path / "run", events)
    # The next iteration failed before its restore decided (e.g. while waiting for rank 0's commit).
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried)
    assert second.carry() is carried
    third = _iteration(tmp_path / "run", "r0i2", writer, staging, events, carried=second.carry())
    third.find_restorable(in_memory=True)
    assert [s for e, s, _ in events if e == "ckpt_carried"] == [5]


def test_a_save_whose_hand_over_failed_is_handed_over_again_not_committed_unwritten(tmp_path: Path) -> None:
    events: list = []
    writer, staging = _HeldWriter(), StagingBuffers()
    first = _iteration(tmp_path / "run", "r0i0", writer, staging, events)
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    writer.refuse = True
    with pytest.raises(RuntimeError, match="went away"):
        first.save(5, state_dict(model, optimizer), data.state_dict(), {})
    carried = first.carry()
    assert carried is not None and carried.job is not None  # staged, never handed over
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried)
    second.find_restorable(in_memory=True)
    writer.released.set()
    for _ in range(3):
        second.maybe_commit(second.local_done())
    second.committer.settle(30)
    latest = fmt.read_latest(second.root)
    assert latest is not None and fmt.read_manifest(latest)["step"] == 5
    assert fmt.damaged_files(latest, fmt.read_manifest(latest)) == []


def _carried_then_failed(run_dir: Path, events: list):
    """Iteration 1 adopted iteration 0's save of step 5 (logged as carried) and failed before it was
    written: (writer, staging, what iteration 1 passes on)."""
    writer, staging, carried = _failed_during_a_save(run_dir, events)
    second = _iteration(run_dir, "r0i1", writer, staging, events, carried=carried)
    second.find_restorable(in_memory=True)
    assert [s for e, s, _ in events if e == "ckpt_carried"] == [5]
    return writer, staging, second.carry()


def _abandoned(events: list) -> list:
    return [(s, kw["reason"]) for e, s, kw in events if e == "ckpt_abandoned"]


def test_a_carried_save_whose_writer_then_died_is_logged_as_abandoned(tmp_path: Path) -> None:
    """call74: the 1.3B matrix carried the save of step 400 into the next iteration, whose writer
    was then killed: the log said "committed once written" and nothing more."""
    events: list = []
    writer, staging, carried = _carried_then_failed(tmp_path / "run", events)
    assert carried is not None and carried.step == 5
    # What the trainer does when it gives the dead writer up between iterations.
    carried.abandoned, carried.reason = True, "the async checkpoint writer process (pid 4242) died: killed by SIGKILL"
    writer.jobs.clear()
    third = _iteration(tmp_path / "run", "r0i2", writer, staging, events, carried=carried)
    third.find_restorable(in_memory=True)
    assert _abandoned(events) == [(5, "carried save dropped: the async checkpoint writer process (pid 4242) died: "
                                      "killed by SIGKILL")]
    assert [s for e, s, _ in events if e == "ckpt_carried"] == [5]  # not carried again
    writer.released.set()
    third.maybe_commit(third.local_done())
    third.committer.settle(30)
    assert fmt.read_latest(third.root) is None


def test_a_carried_save_a_peer_no_longer_carries_is_logged_as_abandoned_by_this_rank_too(tmp_path: Path) -> None:
    events: list = []
    writer, staging, carried = _carried_then_failed(tmp_path / "run", events)
    third = _iteration(tmp_path / "run", "r0i2", writer, staging, events, carried=carried,
                       peer=lambda mine: [*mine[:2], -1])  # the peer's writer died: it carries nothing
    third.find_restorable(in_memory=True)
    assert _abandoned(events) == [(5, "carried save dropped: a rank no longer carries it")]
    assert not third.will_defer(10)  # nothing in flight: step 5's save was dropped, the next is made


def test_a_carried_save_a_later_restore_lands_before_is_logged_as_abandoned(tmp_path: Path) -> None:
    events: list = []
    writer, staging, carried = _carried_then_failed(tmp_path / "run", events)
    third = _iteration(tmp_path / "run", "r0i2", writer, staging, events, carried=carried)
    third._snapshot = _SnapshotOfStep3()
    third.find_restorable(in_memory=True, after_nan=True)
    assert _abandoned(events) == [(5, "carried save dropped: this restore landed at step 3, before it")]


def test_a_save_dropped_without_having_been_carried_is_logged_as_abandoned(tmp_path: Path) -> None:
    """Every begun save ends in the log committed or abandoned. Dropped unsaid, rank 0's last word
    on it stayed its ckpt_begin: what the restore check takes for a commit rank 0 did not live to
    log (gate_records.logged_save_open), so a step planted there with this run's run_uid passed
    that check (stranger trial: a writer-kill and an exception in one restart, step 30 begun and
    then neither)."""
    events: list = []
    writer, staging, carried = _failed_during_a_save(tmp_path / "run", events)
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events, carried=carried,
                        peer=lambda mine: [*mine[:2], -1])
    second.find_restorable(in_memory=True)
    assert _abandoned(events) == [(5, "save dropped at the in-process restart: a rank no longer carries it")]
    assert "ckpt_carried" not in [e for e, _, _ in events]


class _DyingWriter(_HeldWriter):
    """A writer whose process was killed with the save: its poll says so."""

    def poll(self) -> bool:
        raise CheckpointWriterDied("the async checkpoint writer process (pid 4242) died: killed by SIGKILL")


def test_a_save_whose_writer_died_on_this_rank_before_the_restart_is_logged_as_abandoned(tmp_path: Path) -> None:
    """The rank whose writer was killed saw the death at its next step; the peer's exception came
    before the ranks agreed to abandon the save: it was dropped at the restart, unlogged."""
    events: list = []
    writer, staging = _DyingWriter(), StagingBuffers()
    first = _iteration(tmp_path / "run", "r0i0", writer, staging, events)
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    first.save(5, state_dict(model, optimizer), data.state_dict(), {})
    assert first.local_done() < 0  # this rank's part: lost (the peers have not agreed yet)
    assert _abandoned(events) == []
    assert first.carry() is None
    assert _abandoned(events) == [(5, "save dropped at the in-process restart: writer died on this rank (the async "
                                      "checkpoint writer process (pid 4242) died: killed by SIGKILL)")]
    second = _iteration(tmp_path / "run", "r0i1", _HeldWriter(), staging, events)
    second.find_restorable(in_memory=True)
    assert len(_abandoned(events)) == 1  # once


def test_a_save_abandoned_before_the_restart_is_not_logged_twice(tmp_path: Path) -> None:
    events: list = []
    writer, staging = _DyingWriter(), StagingBuffers()
    first = _iteration(tmp_path / "run", "r0i0", writer, staging, events)
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    first.save(5, state_dict(model, optimizer), data.state_dict(), {})
    first.maybe_commit(first.local_done())  # every rank agreed: abandoned, logged
    assert [s for s, _ in _abandoned(events)] == [5]
    assert first.carry() is None
    assert [s for s, _ in _abandoned(events)] == [5]


def test_the_trainer_marks_the_carried_save_of_a_writer_it_gives_up(tmp_path: Path) -> None:
    """Between iterations the trainer gives a dead writer up; the save it carries is marked
    abandoned with the death's description (what the next find_restorable logs), not forgotten."""
    from types import SimpleNamespace

    from resilient_training.runtime import nvrx_adapter
    from resilient_training.runtime.trainer import Trainer

    events: list = []
    _, _, carried = _carried_then_failed(tmp_path / "run", events)

    class _DeadWriter:
        death = nvrx_adapter.WriterDeath(noticed=0.0, pid=4242, exitcode=-9)
        abandoned = False

        def poll(self) -> bool:
            raise nvrx_adapter.CheckpointWriterDied(self.death.describe())

        def abandon(self) -> None:
            self.abandoned = True

    trainer = SimpleNamespace(writer=_DeadWriter(), _carried=carried)
    Trainer._drop_stale_write(trainer)
    assert trainer.writer.abandoned and trainer._carried is carried
    assert carried.abandoned and carried.reason == "the async checkpoint writer process (pid 4242) died: killed by SIGKILL"


def test_an_abandoned_save_s_files_are_removed_off_the_training_thread(tmp_path: Path) -> None:
    """A save lost with a dead writer: its temporary directory goes to the remover (its own
    thread), not rmtree on the training thread (a 1.3B rank's torn 16 GB held it 3.3 s, call73)."""
    events: list = []
    handed: list[Path] = []
    writer, staging = _HeldWriter(), StagingBuffers()
    config = cfg.from_argv(["--run-dir", str(tmp_path / "run"), "--steps", "20", "--checkpoint-every", "5"])
    ckpt = Checkpointer(config, rank=0, world_size=1, tag="r0i0", writer=writer, staging=staging,
                        emit=lambda event, step, **kw: events.append((event, step, kw)), remover=handed.append)
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    ckpt.save(5, state_dict(model, optimizer), data.state_dict(), {})
    (tmp_dir,) = ckpt.root.glob(f"{fmt.TMP_PREFIX}*")
    ckpt.maybe_commit(-1.0)  # every rank agreed: a writer died with it
    assert [e for e, _, _ in events if e == "ckpt_abandoned"] == ["ckpt_abandoned"]
    ckpt.maybe_commit(1.0)  # every writer idle again: dropped
    assert handed == [tmp_dir] and tmp_dir.is_dir()  # handed over, not deleted here
    assert not ckpt.will_defer(10)


class _SnapshotOfTheFinalStep(_SnapshotOfStep3):
    def ready(self) -> int:
        return 20  # the run's --steps


def test_the_final_step_is_restored_from_its_snapshot_only_while_its_checkpoint_is_not_committed(
        tmp_path: Path) -> None:
    """A hang in the final save: its snapshot is restored and the checkpoint written again. Once
    the final checkpoint is committed (a failure after it, in the wind-down), storage is restored:
    restoring the snapshot would write the final step a second time."""
    events: list = []
    writer, staging = _HeldWriter(), StagingBuffers()
    first = _iteration(tmp_path / "run", "r0i0", writer, staging, events)
    first._snapshot = _SnapshotOfTheFinalStep()
    path, manifest = first.find_restorable(in_memory=True)
    assert (path, manifest["memory"], manifest["step"]) == (None, "snapshot", 20)
    first._snapshot = None  # (the save reads the live state here, not the fake snapshot)
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    first.save(20, state_dict(model, optimizer), data.state_dict(), {})
    writer.released.set()
    first.maybe_commit(first.local_done())
    first.committer.settle(30)
    assert fmt.read_manifest(fmt.read_latest(first.root))["step"] == 20
    second = _iteration(tmp_path / "run", "r0i1", writer, staging, events)
    second._snapshot = _SnapshotOfTheFinalStep()
    path, manifest = second.find_restorable(in_memory=True)
    assert path is not None and manifest["step"] == 20 and "memory" not in manifest
