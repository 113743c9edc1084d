"""The memory snapshot (``--memory-snapshot-every``): what an in-process restart resumes from.

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
