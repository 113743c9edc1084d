"""A restore makes the optimizer's empty state without DCP's zero-gradient step
(``checkpointing.init_optimizer_state``): the same tensors DCP's way makes, nothing else changed,
and a checkpoint loads into it exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import _init_optim_state

from resilient_training.run import checkpoint_format as fmt
from resilient_training.runtime import checkpointing
from resilient_training.runtime.trainer import default_shard
from tests.support.gates import TINY, train_state, write_checkpoint


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A gloo group of one and its mesh: FSDP2's parameters are DTensors, as in the trainer."""
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _model(mesh: Any, seed: int = 0) -> torch.nn.Module:
    from resilient_training.tasks.gpt import GPTTask

    torch.manual_seed(seed)
    model = GPTTask(TINY, batch_size=2, lr=1e-3).build_model()
    default_shard(model, mesh)
    return model


def _layout(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter's state: every key's kind, shape, dtype, device and (DTensors) placements."""
    return [{k: (type(v).__name__, tuple(v.shape), v.dtype, v.device, getattr(v, "placements", None))
             for k, v in state.items()} for state in optimizer.state.values()]


SETTINGS = [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"foreach": False}),
    (torch.optim.Adam, {"fused": True}),
]


@pytest.mark.parametrize(("kind", "settings"), SETTINGS, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_the_state_made_without_a_step_is_the_one_dcps_zero_step_makes(world_of_one, kind, settings) -> None:
    ours_model = _model(world_of_one)
    dcps_model = _model(world_of_one)
    before = {k: v.full_tensor().clone() for k, v in ours_model.state_dict().items()}
    ours = kind(ours_model.parameters(), lr=1e-3, **settings)
    dcps = kind(dcps_model.parameters(), lr=1e-3, **settings)

    assert checkpointing.init_optimizer_state(ours)
    _init_optim_state(dcps)

    assert _layout(ours) and _layout(ours) == _layout(dcps)
    assert all(float(s["step"]) == 0 for s in ours.state.values())  # no step taken (DCP's counts one)
    assert all(p.grad is None for p in ours_model.parameters())
    after = ours_model.state_dict()
    assert all(torch.equal(before[k], after[k].full_tensor()) for k in before)
    # and the optimizer's own next step finds its state as if it had made it
    ours_model(torch.zeros(2, TINY.seq_len, dtype=torch.long)).sum().backward()
    ours.step()
    assert all(float(s["step"]) == 1 for s in ours.state.values())


def test_other_optimizers_and_made_state_are_left_to_dcp(world_of_one) -> None:
    model = _model(world_of_one)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert not checkpointing.init_optimizer_state(sgd)
    assert not sgd.state

    class MyAdam(torch.optim.AdamW):  # a subclass may keep more state than AdamW: DCP's step makes it
        pass

    assert not checkpointing.init_optimizer_state(MyAdam(model.parameters(), lr=1e-3))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert checkpointing.init_optimizer_state(adam)
    made = {id(v) for s in adam.state.values() for v in s.values()}
    assert not checkpointing.init_optimizer_state(adam)  # made once; a second call replaces nothing
    assert made == {id(v) for s in adam.state.values() for v in s.values()}


def test_a_checkpoint_loads_exactly_into_the_state_made_without_a_step(world_of_one, tmp_path: Path) -> None:
    """The restore's own path (``state_dict`` then ``dcp_load``) into a fresh model and optimizer."""
    model, optimizer, _ = train_state(TINY, seed=7, steps=3)
    path = write_checkpoint(tmp_path / "run", step=3, world_size=1, seed=7, state=copy.deepcopy(
        checkpointing.state_dict(model, optimizer)))
    saved = checkpointing.flat_state(checkpointing.state_dict(model, optimizer))[0]

    fresh_model = _model(world_of_one, seed=99)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=3e-3)
    state = checkpointing.state_dict(fresh_model, fresh)
    fmt.dcp_load(state, path)
    loaded = checkpointing.flat_state(state)[0]

    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        got = loaded[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name
    assert any(name.endswith(".step") and float(v) == 3 for name, v in loaded.items())


def test_an_init_group_of_another_shape_is_left_to_dcp(world_of_one, monkeypatch) -> None:
    """A private method: a torch whose AdamW._init_group takes other arguments (an older one took a
    bool ``amsgrad`` among the lists) gets DCP's step, not a state made by guesswork."""
    model = _model(world_of_one)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)

    def older(self, group, params_with_grad, grads, amsgrad, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        raise AssertionError("called")

    monkeypatch.setattr(torch.optim.AdamW, "_init_group", older)
    assert not checkpointing.init_optimizer_state(adam)
    assert not adam.state
