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

The cache is per world size too: an elastic job that lost a node restores into a smaller mesh.
Its spares warm each world size it may take (:func:`world_sizes`: the first worker's, then whole
nodes fewer or more within ``PET_NNODES``'s ``MIN:MAX``, nearest first), and stop between them
when work comes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# World sizes warmed at most: each takes a spare 0.9-1.7 s (1.3B, one H200), idle.
MAX_WORLDS = 4


def world_sizes(environ: Mapping[str, str]) -> list[int]:
    """The world sizes a worker of this run may restore into, nearest first: the first worker's
    ``WORLD_SIZE``, then, when the job is elastic (``PET_NNODES`` is ``MIN:MAX``, as the Training
    Operator and the simulated cluster set it), whole nodes of ``LOCAL_WORLD_SIZE`` fewer or more,
    within ``MIN..MAX`` nodes: a lost node's restart restores at one node fewer. At most
    :data:`MAX_WORLDS`; a value that does not parse warms the first world only.
    """
    def number(name: str, default: int) -> int:
        text = environ.get(name, "")
        return int(text) if re.fullmatch(r"[0-9]{1,6}", text) and int(text) > 0 else default

    world = number("WORLD_SIZE", 1)
    local = number("LOCAL_WORLD_SIZE", world)
    elastic = re.fullmatch(r"([0-9]{1,6}):([0-9]{1,6})", environ.get("PET_NNODES", ""))
    if not elastic or world % local:
        return [world]
    nodes = world // local
    low, high = max(1, int(elastic[1]), nodes - MAX_WORLDS), min(int(elastic[2]), nodes + MAX_WORLDS)
    others = sorted((n for n in range(low, high + 1) if n != nodes), key=lambda n: (abs(n - nodes), n))
    return [world, *(n * local for n in others)][:MAX_WORLDS]


def warm_first_step(config: Any, *, world_size: int | Sequence[int], device: Any,
                    stop: Callable[[], bool] | None = None) -> str:
    """Warm the DTensor dispatch of the run's first optimizer step for this thread, in a process
    that has no process group yet, for each world size given (:func:`world_sizes`). ``stop``:
    asked before each world size after the first (work has come: the spare takes it now). Returns
    what it did, or why not; never raises an ``Exception``.
    """
    import time

    import torch.distributed as dist

    sizes = [world_size] if isinstance(world_size, int) else list(world_size)
    if dist.is_initialized():
        return "first step not warmed (a process group exists)"
    started = time.monotonic()
    warmed: list[int] = []
    for size in sizes:
        if warmed and stop is not None and stop():
            break
        try:
            _warm(config, world_size=size, device=device)
        except Exception as exc:  # a warm-up only: the real step pays as before
            done = f"first step warmed for a world of {', '.join(map(str, warmed))}; " if warmed else ""
            return f"{done}first step not warmed for a world of {size} ({type(exc).__name__}: {exc})"[:300]
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        warmed.append(size)
    return f"first step warmed for a world of {', '.join(map(str, warmed))} ({time.monotonic() - started:.2f} s)"


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
