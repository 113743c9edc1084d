"""Commits run off the training thread, one at a time; a restore waits for them, and their
errors reach the training thread.
"""

import threading
import time

import pytest

from resilient_training.run import checkpoint_format as fmt
from resilient_training.run.config import CheckpointConfig, TrainConfig
from resilient_training.runtime.checkpointing import (
    Checkpointer,
    CommitStuck,
    Committer,
    Remover,
    StagingBuffers,
    state_dict,
)
from tests.support.gates import TINY, train_state


class _InlineWriter:
    """The writer process at its edge: each write done at once, in this process."""

    started = ready = True
    death = None

    def submit(self, fn, args) -> None:
        fn(*args)

    def poll(self) -> bool:
        return True


def _checkpointer(tmp_path, events):
    config = TrainConfig(run_dir=str(tmp_path / "run"), steps=8, checkpoint=CheckpointConfig(every=2))
    return Checkpointer(config, rank=0, world_size=1, tag="a0i0", writer=_InlineWriter(), staging=StagingBuffers(),
                        emit=lambda event, step, **fields: events.append((event, step)))


def test_a_slow_commit_does_not_hold_the_training_thread_and_a_restore_waits_for_it(tmp_path, monkeypatch):
    real_commit, release, entered = fmt.commit, threading.Event(), threading.Event()

    def slow_commit(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(fmt, "commit", slow_commit)
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    events = []
    checkpointer = _checkpointer(tmp_path, events)
    checkpointer.save(2, state_dict(model, optimizer), data.state_dict(), {})
    began = time.monotonic()
    checkpointer.maybe_commit(checkpointer.local_done())  # what the step after the save does
    assert entered.wait(30) and time.monotonic() - began < 1.0  # returned while the commit waits
    root = tmp_path / "run" / "checkpoints"
    assert fmt.read_latest(root) is None and ("ckpt_committed", 2) not in events
    threading.Timer(0.5, release.set).start()
    began = time.monotonic()
    checkpointer.committer.settle(30)  # find_restorable and finish() start with this
    assert time.monotonic() - began >= 0.4
    assert fmt.read_latest(root).name == "step_2" and ("ckpt_committed", 2) in events


def test_a_failed_commit_is_raised_on_the_training_thread(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmt, "commit", full_disk)
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    checkpointer = _checkpointer(tmp_path, [])
    checkpointer.save(2, state_dict(model, optimizer), data.state_dict(), {})
    checkpointer.maybe_commit(checkpointer.local_done())
    with pytest.raises(OSError, match="No space left"):
        checkpointer.committer.settle(30)
    checkpointer.committer.settle(30)  # raised once


def test_commits_run_one_at_a_time_and_a_stuck_one_is_named():
    committer, order, gate = Committer(), [], threading.Event()

    def first() -> None:
        gate.wait(30)
        order.append(1)

    committer.submit(1, first, timeout=30)
    with pytest.raises(CommitStuck, match="commit of step 1 did not finish in 0 s"):
        committer.submit(2, lambda: order.append(2), timeout=0.2)
    gate.set()
    committer.submit(2, lambda: order.append(2), timeout=30)
    committer.settle(30)
    assert order == [1, 2]


def test_a_stuck_commit_is_a_cause_that_hands_the_rank_over_to_the_launcher():
    """In-process retries would wait on the same stuck thread; a new process would not."""
    from types import SimpleNamespace

    from resilient_training.runtime.trainer import HANDED_OVER, Trainer

    trainer = SimpleNamespace(injector=None, guard=SimpleNamespace(expiry=None))
    cause = Trainer.classify(trainer, CommitStuck("the commit of step 8 did not finish in 60 s"))
    assert cause == "commit_stuck" and cause in HANDED_OVER
    assert Trainer.classify(trainer, fmt.CheckpointError("other")) == "checkpoint"


class _Killed(BaseException):
    """The process dying at this point (the launcher stopping rank 0 after a peer died)."""


@pytest.mark.parametrize(("dies_in", "committed"), [
    ("fsync_dir", False),  # the fsync that makes the rename durable: `latest` still names the old step
    ("_atomic_write_text", False),  # writing `latest`
    ("second fsync_dir", True),  # after `latest` moved: the restart loads step 2
    ("prune", True),
])
def test_a_killed_commit_is_logged_exactly_when_a_restart_would_load_it(tmp_path, monkeypatch, dies_in, committed):
    """Rank 0 stopped by the launcher mid-commit (a peer had died). CI once restored step 4 with
    no ckpt_committed of it (logged after the fsyncs and pruning); logged at the rename instead,
    CI then saw step 4 logged and step 0 restored (killed before `latest` moved). The event
    now follows `latest`, the commit point.
    """
    name = dies_in.split()[-1]
    real, state = getattr(fmt, name), {"renamed": False, "calls": 0}
    real_rename = fmt.Path.rename

    def rename(self, target):
        result = real_rename(self, target)
        state["renamed"] |= fmt.parse_step_dirname(fmt.Path(target).name) is not None
        return result

    def dies_after_rename(*args, **kwargs):
        if state["renamed"]:
            state["calls"] += 1
            if state["calls"] == (2 if dies_in.startswith("second") else 1):
                raise _Killed(dies_in)
        return real(*args, **kwargs)

    monkeypatch.setattr(fmt.Path, "rename", rename)
    monkeypatch.setattr(fmt, name, dies_after_rename)
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    events = []
    checkpointer = _checkpointer(tmp_path, events)
    checkpointer.save(2, state_dict(model, optimizer), data.state_dict(), {})
    checkpointer.maybe_commit(checkpointer.local_done())
    with pytest.raises(_Killed):
        checkpointer.committer.settle(30)
    latest = fmt.read_latest(tmp_path / "run" / "checkpoints")  # what a restart restores
    assert (latest is not None and latest.name == "step_2") is committed
    assert (("ckpt_committed", 2) in events) is committed


def test_a_commit_whose_log_line_fails_still_moves_latest_to_it(tmp_path):
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)

    def emit(event, step, **fields):
        if event == "ckpt_committed":
            raise OSError(28, "No space left on device")  # the event log's disk

    config = TrainConfig(run_dir=str(tmp_path / "run"), steps=8, checkpoint=CheckpointConfig(every=2))
    checkpointer = Checkpointer(config, rank=0, world_size=1, tag="a0i0", writer=_InlineWriter(),
                                staging=StagingBuffers(), emit=emit)
    checkpointer.save(2, state_dict(model, optimizer), data.state_dict(), {})
    checkpointer.maybe_commit(checkpointer.local_done())
    with pytest.raises(OSError, match="No space left"):
        checkpointer.committer.settle(30)
    assert fmt.read_latest(tmp_path / "run" / "checkpoints").name == "step_2"


def test_the_remover_deletes_a_killed_commit_s_temporary_latest_file_as_well_as_a_save(tmp_path):
    """CI: `.tmp-latest.<pid>` stayed after a ckpt-kill round (rank 0 stopped between writing it and
    its rename); stale_writes names it, and rmtree alone leaves a file where it is."""
    save = tmp_path / ".tmp-step_4-abcd1234i0"
    save.mkdir()
    (save / "__0_0.distcp").write_bytes(b"x" * 10)
    latest = tmp_path / ".tmp-latest.12047"
    latest.write_text("step_4\n")
    remover = Remover()
    remover(save)
    remover(latest)
    remover.wait(30)
    assert list(tmp_path.iterdir()) == []
