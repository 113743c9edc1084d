"""What does a restoring process spend making its optimizer's state before DCP can load into it?

    python benchmarks/optim_init.py [--d-model 2048] [--layers 24] [--device cuda] [--repeat 2]

A killed rank's new process builds the model on the meta device, shards it (FSDP2, a world of
one), allocates its shards and builds AdamW, whose state is empty until a first step. DCP loads
only into tensors that exist, so the restore first makes that state (``load_prepare`` in the
restart profile: 2.1-2.2 s for the 1.3B model on one H200, benchmarks call49/call51). Two ways,
each in a fresh process (imports, CUDA context, the model: not timed), as a launcher restart does:

- ``dcp``: DCP's own ``get_state_dict``: zero gradients, one optimizer step at lr 0, zero_grad;
- ``direct``: ``checkpointing.init_optimizer_state``: the optimizer's own lazy state set-up
  (``_init_group``) without a step, then ``get_state_dict``.

After it, the first and second training steps (forward, backward, optimizer step) are timed: a
cost that only moves into the first step is no saving. Prints one table: seconds, median of
``--repeat`` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("dcp", "direct")


def child(variant: str, args: argparse.Namespace) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from resilient_training.run.config import ModelConfig
    from resilient_training.runtime import checkpointing
    from resilient_training.runtime.trainer import default_shard
    from resilient_training.tasks.gpt import GPTTask

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    cfg = ModelConfig(vocab_size=32000, d_model=args.d_model, n_layers=args.layers, n_heads=16, seq_len=args.seq_len)
    task = GPTTask(cfg, batch_size=args.batch_size, lr=3e-4)
    with torch.device("meta"):
        model = task.build_model()
    default_shard(model, init_device_mesh(device.type, (1,)))
    model.to_empty(device=device)
    optimizer = task.build_optimizer(model)
    batch = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), device=device)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    out: dict[str, float] = {}
    start = sync()
    if variant == "direct":
        assert checkpointing.init_optimizer_state(optimizer)
        out["init"] = sync() - start
    state = checkpointing.state_dict(model, optimizer)
    out["prepare"] = sync() - start
    assert state["optim"]["state"], "no optimizer state made"
    for name in ("first_step", "second_step"):
        begin = sync()
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out[name] = sync() - begin
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--child", choices=VARIANTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeat):
        for variant in VARIANTS:  # interleaved: a drift of the machine hits both alike
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", variant], capture_output=True,
                                  text=True, env=os.environ | {"PYTHONWARNINGS": "ignore"})
            if proc.returncode:
                sys.exit(f"{variant}: exit {proc.returncode}: {proc.stderr[-2000:]}")
            results[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"model d_model={args.d_model} layers={args.layers} device={args.device} repeat={args.repeat}")
    print("| way | make the state (s) | of which the set-up (s) | first step (s) | second step (s) "
          "| prepare + first step (s) |")
    print("|---|---|---|---|---|---|")
    for variant, runs in results.items():
        def med(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r.get(key, float("nan")) for r in runs)
        print(f"| {variant} | {med('prepare'):.3f} | {med('init'):.3f} | {med('first_step'):.3f} | "
              f"{med('second_step'):.3f} | {med('prepare') + med('first_step'):.3f} |")


if __name__ == "__main__":
    main()
