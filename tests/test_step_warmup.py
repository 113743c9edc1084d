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
said = step_warmup.warm_first_step(config, world_size=1, device=torch.device("cpu")) if sys.argv[1] == "warm" else ""
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


def _restore(how: str, port: int) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT, how, str(port)], capture_output=True,
                          text=True, timeout=300)
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
    assert said == "first step not warmed (RuntimeError: no such task here)" and not dist.is_initialized()
