"""A spare warms the run's first optimizer step on fake tensors before it has work
(``step_warmup.warm_first_step``): the worker's real first step after a restore then makes no
sharding decision of its own (DTensor caches them per thread), and nothing of the warm-up (its
fake process group) is left for the worker to trip on.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A worker's restore in one fresh process (the cache lives as long as the process): the spare's
# warm-up first (or not), then a gloo group, the model built as a restore builds it, a backward
# pass, and the decisions of its optimizer step (calls of the uncached propagation) counted.
SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from resilient_training.run import config as cfg
from resilient_training.runtime import checkpointing, step_warmup
from resilient_training.runtime import task as tk
from resilient_training.runtime.trainer import shard

config = cfg.from_argv(["--run-dir", "unused", "--model-d-model", "48", "--model-n-layers", "3",
                        "--model-n-heads", "2", "--model-vocab-size", "64", "--model-seq-len", "16"])
propagator = DTensor._op_dispatcher.sharding_propagator
own, worked_out = propagator.propagate_op_sharding_non_cached, [0]
def counted(*args, **kwargs):
    worked_out[0] += 1
    return own(*args, **kwargs)
propagator.propagate_op_sharding_non_cached = counted
worlds = [int(w) for w in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1]
said = step_warmup.warm_first_step(config, world_size=worlds, device=torch.device("cpu")) if sys.argv[1] == "warm" else ""
left = dist.is_initialized()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
task = tk.task_from_config(config)
with torch.device("meta"):
    model = tk.build_model(task)
shard(task, model, init_device_mesh("cpu", (1,)))
model.to_empty(device="cpu")
optimizer = tk.build_optimizer(task, model)
checkpointing.init_optimizer_state(optimizer)
task.loss(model, torch.randint(0, 64, (2, 17))).backward()
before = worked_out[0]
optimizer.step()
print(json.dumps({"said": said, "left_a_group": left, "decisions": worked_out[0] - before}))
"""


def _restore(how: str, port: int, worlds: str = "1") -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT, how, str(port), worlds],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_after_a_spares_warm_up_the_first_step_makes_no_sharding_decision_of_its_own() -> None:
    cold = _restore("cold", 29661)
    assert cold["decisions"] > 0  # a fresh process pays for them in its first step
    warmed = _restore("warm", 29662)
    assert warmed["said"].startswith("first step warmed for a world of 1 (") and not warmed["left_a_group"]
    assert warmed["decisions"] == 0


def test_a_warm_up_never_raises_and_leaves_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    from resilient_training.run import config as cfg
    from resilient_training.runtime import step_warmup
    from resilient_training.runtime import task as tk

    def broken(_config: object) -> None:
        raise RuntimeError("no such task here")

    if dist.is_initialized():
        pytest.skip("this process has a group (another test's)")
    monkeypatch.setattr(tk, "task_from_config", broken)
    said = step_warmup.warm_first_step(cfg.from_argv(["--run-dir", "unused"]), world_size=2, device=torch.device("cpu"))
    assert said == "first step not warmed for a world of 2 (RuntimeError: no such task here)"
    assert not dist.is_initialized()


def test_an_elastic_jobs_spare_warms_the_world_a_lost_node_leaves() -> None:
    # The worker restores into a world of 1 (a node of 1 rank lost from 2): warmed for 2 only, its
    # first step still works its sharding out; warmed for 2 and then 1, it makes no decision.
    only_first = _restore("warm", 29663, "2")
    assert only_first["said"].startswith("first step warmed for a world of 2 (") and only_first["decisions"] > 0
    both = _restore("warm", 29664, "2,1")
    assert both["said"].startswith("first step warmed for a world of 2, 1 (") and both["decisions"] == 0
    assert not both["left_a_group"]


@pytest.mark.parametrize(("env", "expected"), [
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, [8]),  # fixed size
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "PET_NNODES": "2"}, [8]),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "PET_NNODES": "1:2"}, [8, 4]),  # a node lost
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "PET_NNODES": "1:3"}, [4, 8, 12]),  # started at the minimum
    ({"WORLD_SIZE": "24", "LOCAL_WORLD_SIZE": "8", "PET_NNODES": "1:8"}, [24, 16, 32, 8]),  # nearest first, 4 at most
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "PET_NNODES": "1:999999"}, [8, 16, 24, 32]),  # no long loop
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "PET_NNODES": "3:1"}, [8]),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "PET_NNODES": "1:2\n"}, [8]),  # what does not parse: the first
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "3", "PET_NNODES": "1:4"}, [8]),  # not whole nodes
    ({"WORLD_SIZE": "８", "LOCAL_WORLD_SIZE": "1"}, [1]),  # ASCII digits only
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "0", "PET_NNODES": "0:2"}, [8, 16]),  # no local size: one node
    ({}, [1]),
])
def test_the_worlds_a_spare_warms_come_from_the_workers_environment(env: dict, expected: list) -> None:
    from resilient_training.runtime.step_warmup import world_sizes

    assert world_sizes(env) == expected


def test_work_that_comes_stops_the_warm_up_after_the_first_world(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from resilient_training.run import config as cfg
    from resilient_training.runtime import step_warmup

    warmed: list[int] = []
    monkeypatch.setattr(step_warmup, "_warm", lambda config, *, world_size, device: warmed.append(world_size))
    config = cfg.from_argv(["--run-dir", "unused"])
    said = step_warmup.warm_first_step(config, world_size=[8, 4], device=torch.device("cpu"), stop=lambda: True)
    assert warmed == [8] and said.startswith("first step warmed for a world of 8 (")
    warmed.clear()
    step_warmup.warm_first_step(config, world_size=[8, 4], device=torch.device("cpu"), stop=lambda: False)
    assert warmed == [8, 4]
