"""The memory snapshot (``--memory-snapshot-every``): what an in-process restart resumes from;
and the save that must not be lost, the final step's.

Real models and optimizers on the CPU (the same code copies within GPU memory on a side stream);
the end-to-end runs under ft_launcher are in test_recovery.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resilient_training.run import checkpoint_format as fmt
from resilient_training.run.config import ModelConfig
from resilient_training.runtime.checkpointing import MemorySnapshot
from tests.support.gates import TINY, train_state


def _step(model, optimizer, scheduler, data) -> float:
    from resilient_training.tasks.gpt import task
    from tests.support.gates import task_args

    loss = task(**task_args(TINY)).loss(model, next(data))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def _fresh(cfg: ModelConfig = TINY):
    """A model, optimizer and scheduler as an in-process restart builds them: new objects, other weights."""
    model, optimizer, _ = train_state(cfg, seed=99, steps=0)
    _, _, data = train_state(cfg, seed=1234, steps=0)  # the run's data, at its first position
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), data


def test_a_restore_gives_back_weights_optimizer_scheduler_and_data_exactly():
    """Not only the weights: the next steps after the restore (which depend on Adam's moments,
    its step count, the scheduled learning rate and the data position) equal the original run's.
    """
    model, optimizer, data = train_state(TINY, seed=1234, steps=2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.zero_grad()
    optimizer.step()  # no gradients: changes nothing (the scheduler wants an optimizer step first)
    scheduler.step()
    snapshot = MemorySnapshot()
    snapshot.take(2, model, optimizer, scheduler, data.state_dict(), world=(0, 1))
    assert snapshot.ready() == 2 and snapshot.finite()
    original = [_step(model, optimizer, scheduler, data) for _ in range(3)]

    model2, optimizer2, scheduler2, data2 = _fresh()
    data2.load_state_dict(snapshot.restore(model2, optimizer2, scheduler2))
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"] * 8)
    replayed = [_step(model2, optimizer2, scheduler2, data2) for _ in range(3)]
    assert replayed == original
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # The snapshot is a copy: training on after the restore left it as it was.
    model3, optimizer3, scheduler3, data3 = _fresh()
    data3.load_state_dict(snapshot.restore(model3, optimizer3, scheduler3))
    assert [_step(model3, optimizer3, scheduler3, data3) for _ in range(3)] == original


def test_a_snapshot_that_does_not_fit_the_rebuilt_model_is_refused_and_forgotten():
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    snapshot = MemorySnapshot()
    snapshot.take(1, model, optimizer, None, data.state_dict(), world=(0, 1))
    other, other_optimizer, _ = train_state(dataclasses.replace(TINY, d_model=TINY.d_model * 2), seed=1, steps=0)
    with pytest.raises(fmt.CheckpointError, match="does not fit the rebuilt model"):
        snapshot.restore(other, other_optimizer, None)
    assert snapshot.ready() is None  # not offered again


def test_a_non_finite_value_anywhere_in_the_snapshot_is_found():
    """After a NaN a snapshot is used only if it holds no NaN or Inf (trainer: find_restorable)."""
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    snapshot = MemorySnapshot()
    snapshot.take(1, model, optimizer, None, data.state_dict(), world=(0, 1))
    assert snapshot.finite()
    with torch.no_grad():
        next(iter(optimizer.state.values()))["exp_avg_sq"].view(-1)[-1] = float("inf")
    snapshot.take(1, model, optimizer, None, data.state_dict(), world=(0, 1))
    assert not snapshot.finite()


def test_no_memory_for_a_second_copy_turns_snapshots_off_instead_of_failing(monkeypatch):
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    snapshot = MemorySnapshot()

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(torch, "empty_like", no_memory)
    snapshot.take(1, model, optimizer, None, data.state_dict(), world=(0, 1))
    assert snapshot.ready() is None
    assert snapshot.disabled and "no memory for a second copy" in snapshot.disabled


class _WriterThatDiesEveryWrite:
    """The writer process at its edge: each write dies as a full disk made the real one die on
    the GPU machine (its reason left beside the shard by write_rank_job, exit code 1).
    """

    started = ready = True
    death = None

    def __init__(self) -> None:
        self.pending = False
        self.writes = 0

    def submit(self, fn, args) -> None:
        from pathlib import Path

        tmp_dir, rank = args[0], args[1]
        (Path(tmp_dir) / fmt.error_name(rank)).write_text("OSError: [Errno 28] No space left on device")
        self.pending, self.writes = True, self.writes + 1

    def poll(self) -> bool:
        from resilient_training.runtime.nvrx_adapter import CheckpointWriterDied, WriterDeath

        if self.pending:
            self.pending = False
            self.death = WriterDeath(noticed=0.0, pid=1, exitcode=1)
            raise CheckpointWriterDied(f"{self.death.describe()} with 1 write(s) not known durable")
        return True

    def replace(self) -> None:
        self.death = None


def test_a_final_checkpoint_lost_twice_fails_the_run_and_says_why(tmp_path):
    """Found on the GPU machine: the final save of a 1.3B run died twice on a full disk and the
    run still ended "completed" at its last step, with an older checkpoint as `latest`.
    """
    from resilient_training.run.config import CheckpointConfig, TrainConfig
    from resilient_training.runtime.checkpointing import Checkpointer, StagingBuffers, state_dict

    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    config = TrainConfig(run_dir=str(tmp_path / "run"), steps=4, checkpoint=CheckpointConfig(every=4))
    events = []
    writer = _WriterThatDiesEveryWrite()
    checkpointer = Checkpointer(config, rank=0, world_size=1, tag="a0i0", writer=writer, staging=StagingBuffers(),
                                emit=lambda event, step, **fields: events.append((event, step, fields)))
    checkpointer.save(4, state_dict(model, optimizer), data.state_dict(), {})
    with pytest.raises(fmt.CheckpointError, match=r"final step 4 could not be written \(twice\).*No space left"):
        for _ in range(10):  # what the trainer's finish() does, without the all-reduce of one rank
            checkpointer.maybe_commit(checkpointer.local_done())
    assert writer.writes == 2
    assert [e for e, _, _ in events].count("ckpt_abandoned") == 2
    assert "No space left on device" in next(f["reason"] for e, _, f in events if e == "ckpt_abandoned")
    assert fmt.read_latest(tmp_path / "run" / "checkpoints") is None


def test_a_failed_write_leaves_its_reason_beside_the_shard(tmp_path):
    from resilient_training.runtime.checkpointing import write_rank_job

    with pytest.raises(KeyError):
        write_rank_job(str(tmp_path), 3, {}, False)
    assert (tmp_path / fmt.error_name(3)).read_text().startswith("KeyError")


def test_tensors_replaced_between_snapshots_are_found_again():
    """Snapshots reuse the list of live tensors while they are the same objects on the same
    storage; an optimizer that swaps a state tensor for a new one, or a parameter given new
    storage (``p.data = ...``), must not leave the snapshot copying the old ones.
    """
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    snapshot = MemorySnapshot()
    snapshot.take(1, model, optimizer, None, data.state_dict(), world=(0, 1))
    param = next(iter(optimizer.state))
    optimizer.state[param]["exp_avg"] = torch.full_like(optimizer.state[param]["exp_avg"], 7.0)
    with torch.no_grad():
        model.head.weight.data = torch.full_like(model.head.weight, 3.0)
    snapshot.take(2, model, optimizer, None, data.state_dict(), world=(0, 1))
    model2, optimizer2, _, _ = _fresh()
    snapshot.restore(model2, optimizer2, None)
    index = list(optimizer.state).index(param)
    assert torch.equal(optimizer2.state_dict()["state"][index]["exp_avg"], torch.full_like(param, 7.0))
    assert torch.equal(model2.head.weight, torch.full_like(model2.head.weight, 3.0))
