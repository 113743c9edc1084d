"""A spare's warm-up of the first optimizer step, made before it has work, on fake tensors.

A process's first ``optimizer.step()`` (and gradient clipping) over FSDP2's DTensor parameters
works out how each of its foreach ops shards (DTensor's sharding propagation: Python, for every
tensor of the list) and caches the answer for that process's thread. Every launcher restart's
first step paid it again: after a 1.3B restore on one H200 the optimizer step took 0.83 s, the
steady one 0.03 s (benchmarks/first_step.py, call56). Made while the checkpoint is read it only
slowed the read (both Python: benchmarks/first_step.py ``warm``), so a warm spare makes it
instead, idle, on the thread that will train (:mod:`.spare_pool`).

:func:`warm_first_step` builds the run's model as a restore does (meta device, the task's
sharding over a mesh of the run's world size, ``to_empty``), but over a *fake* process group and
fake tensors (no communication, no memory, no kernel), makes the optimizer's state
(``checkpointing.init_optimizer_state``), gives every parameter a gradient and takes one step.
DTensor's cache is keyed by the mesh's ranks, device type and thread, the global shapes, strides
and placements: the real step's decisions are then found cached. Nothing of it outlives the call
but that cache; the fake process group is destroyed before the worker makes its own.
"""

from __future__ import annotations

from typing import Any


def warm_first_step(config: Any, *, world_size: int, device: Any) -> str:
    """Warm the DTensor dispatch of the run's first optimizer step for this thread, in a process
    that has no process group yet. Returns what it did, or why not; never raises an ``Exception``.
    """
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        return "first step not warmed (a process group exists)"
    started = time.monotonic()
    try:
        _warm(config, world_size=world_size, device=device)
    except Exception as exc:  # a warm-up only: the real step pays as before
        return f"first step not warmed ({type(exc).__name__}: {exc})"[:300]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return f"first step warmed for a world of {world_size} ({time.monotonic() - started:.2f} s)"


def _warm(config: Any, *, world_size: int, device: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from resilient_training.runtime import checkpointing
    from resilient_training.runtime import task as tk
    from resilient_training.runtime.trainer import shard

    task = tk.task_from_config(config)
    current = torch.cuda.current_device() if device.type == "cuda" else None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh(device.type, (world_size,))
        with torch.device("meta"):
            model = tk.build_model(task)
        shard(task, model, mesh)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=device)
        optimizer = tk.build_optimizer(task, model)
        checkpointing.init_optimizer_state(optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            clip = tk.option(task, "grad_clip", float, 0.0)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
    finally:
        if current is not None:  # the mesh may have made another device current
            torch.cuda.set_device(current)
