"""Where does a restored process's first training step go, and what takes it off the critical path?

    python benchmarks/first_step.py [--d-model 2048] [--layers 24] [--repeat 2] [--variants base,fused,...]

A killed 1.3B rank's replacement (a warm spare: CUDA context made, kernels warmed) took 1.1-1.8 s
for its first step after the restore on one H200, against 0.18 s for a steady one (benchmarks
call52-54). This replays that restart without the launcher: a *victim* process trains the model
on the GPU; a *restorer* process warms up as a spare does, then the victim is SIGKILLed and the
restorer builds the model (FSDP2, a world of one), makes the optimizer's state without a step
(``checkpointing.init_optimizer_state``), reads a DCP checkpoint saved beforehand
(``checkpoint_format.dcp_load``), and times its first steps (bf16 autocast, as the trainer).

Variants (each in fresh processes, interleaved over ``--repeat``):

- ``base``: as the product restores today;
- ``fused``: AdamW with ``fused=True`` (one kernel per group, no gradient-sized temporaries);
- ``reserve``: while the checkpoint is read, a thread allocates (and frees, into PyTorch's cache)
  as much device memory as the first step would newly allocate on the default stream;
- ``reserve_serial``: the same allocation before the read, on the critical path (its own cost);
- ``warm``: the checkpoint read on a thread of its own while this thread runs the first optimizer
  step on *shadow* parameters (:func:`warm_step`: DTensors with the real ones' mesh, placements,
  shape and stride over fake local tensors, and a twin of the optimizer), so that the real step
  finds DTensor's sharding decisions cached (they are cached per thread);
- ``warm_serial``: that warm-up before the read (its own cost);
- ``buffers``: the restorer also makes the reading threads' page-locked buffers before the victim
  is killed, as a warm spare does since the twenty-first round (``tensor_read.warm_buffers``).

Each restore also reports the page-locked blocks its read newly asked CUDA for (``host_allocs``)
and the seconds those calls took (``host_alloc_s``, PyTorch's host allocator statistics).

What it showed on one H200 (docs/benchmarks.md, twentieth round): call55 measured ``base``,
``fused`` and the two ``reserve`` variants: the first step newly allocated 26.5 GB in 262
``cudaMalloc`` calls, but reserving 10.4 GB of it took 2 ms and the first step stayed at
1.06-1.22 s; fused AdamW neither (1.17 s). Not memory. call56 split the first step: forward and
backward 0.29 s, the optimizer step 0.83 s (0.03 s once warmed up): DTensor's sharding
propagation for the foreach ops, Python. The warm-up removes it from the step but costs more
than it saves (1.23 s alone; beside the read both slow down, the read being mostly Python too),
so the product does not do it.

Prints one table: seconds (median), and the first step's new device memory (``cudaMalloc`` calls
and GB, from the caching allocator's statistics).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VARIANTS = ("base", "warm", "warm_serial", "fused", "reserve", "reserve_serial", "buffers")


def build(args: argparse.Namespace, device: object, fused: bool = False) -> tuple[object, object, object, object]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from resilient_training.run.config import ModelConfig
    from resilient_training.runtime.trainer import default_shard
    from resilient_training.tasks.gpt import GPTTask

    cfg = ModelConfig(vocab_size=32000, d_model=args.d_model, n_layers=args.layers, n_heads=16, seq_len=args.seq_len)
    task = GPTTask(cfg, batch_size=args.batch_size, lr=3e-4)
    with torch.device("meta"):
        model = task.build_model()
    default_shard(model, init_device_mesh("cuda", (1,)))
    model.to_empty(device=device)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True) if fused
                 else task.build_optimizer(model))
    batch = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), device=device)
    return task, model, optimizer, batch


GRAD_CLIP = 0.0  # the built-in GPT task's (the trainer clips only when a task asks); --grad-clip


def step(task: object, model: object, optimizer: object, batch: object, laps: dict | None = None) -> None:
    import torch

    def mark(name: str) -> None:
        if laps is not None:
            torch.cuda.synchronize()
            laps[name] = time.perf_counter()

    mark("begin")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = task.loss(model, batch)
    loss.backward()
    mark("backward")
    if GRAD_CLIP:
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")


def warm_step(model: Any, optimizer: Any, grad_clip: float = 0.0) -> None:
    """The first ``optimizer.step()`` (and clipping) on shadow parameters: DTensors with the real
    ones' mesh, placements, shape and stride over fake local tensors (no memory, no kernel), a
    gradient each, and a twin optimizer (same class, same groups' settings). DTensor caches its
    sharding decisions per thread: run it on the thread that trains.
    """
    import torch
    from torch._subclasses import fake_tensor
    from torch.distributed.tensor import DTensor

    fake = fake_tensor.FakeTensorMode()

    def shadow(p: Any) -> Any:
        return DTensor.from_local(fake.from_tensor(p._local_tensor), p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    shadows: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in shadows:
                twin = shadows[id(p)] = shadow(p)
                twin.grad = shadow(p)
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [shadows[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    twin_optimizer = type(optimizer)(groups)
    with torch.no_grad():
        if grad_clip:  # in the trainer's order: a foreach op's decision is for its whole list
            torch.nn.utils.clip_grad_norm_([shadows[id(p)] for p in model.parameters() if id(p) in shadows], grad_clip)
        twin_optimizer.step()


def read_while(read: Callable[[], None], work: Callable[[], None], lap: Callable[[str], None]) -> None:
    """``read()`` on a thread of its own (this rank's device current) while ``work()`` runs on this one."""
    import torch

    failed: list[BaseException] = []
    device = torch.cuda.current_device()

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            read()
        except BaseException as exc:  # re-raised on the caller's thread
            failed.append(exc)

    reader = threading.Thread(target=run, name="checkpoint-read", daemon=True)
    reader.start()
    work()
    lap("warm_up")
    reader.join()
    if failed:
        raise failed[0]


def init(args: argparse.Namespace) -> object:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    return torch.device("cuda", 0)


def child_save(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp

    from resilient_training.runtime import checkpointing

    device = init(args)
    task, model, optimizer, batch = build(args, device)
    step(task, model, optimizer, batch)
    dcp.save(checkpointing.state_dict(model, optimizer), checkpoint_id=args.ckpt)
    print(json.dumps({"saved": args.ckpt}))


def child_victim(args: argparse.Namespace) -> None:
    import torch

    device = init(args)
    task, model, optimizer, batch = build(args, device)
    for i in range(1_000_000):
        step(task, model, optimizer, batch)
        if i == 2:
            torch.cuda.synchronize()
            print("ready", flush=True)


def child_restore(variant: str, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from resilient_training.run import checkpoint_format as fmt
    from resilient_training.runtime import checkpointing
    from resilient_training.runtime.spare_pool import warm_kernels

    device = init(args)
    torch.empty(1, device=device)
    warm_kernels(device)
    if variant == "buffers":
        from resilient_training.run.tensor_read import warm_buffers

        print(warm_buffers(device, fmt.READ_THREADS), file=sys.stderr, flush=True)
    print("warm", flush=True)
    sys.stdin.readline()  # the victim is being killed now

    def sync() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    out: dict[str, float] = {}
    start = mark = sync()

    def lap(name: str) -> None:
        nonlocal mark
        now = sync()
        out[name] = now - mark
        mark = now

    task, model, optimizer, batch = build(args, device, fused=variant == "fused")
    lap("build")
    state = checkpointing.state_dict(model, optimizer)
    lap("prepare")
    # What the first step newly allocates on the default stream: gradients (as big as the local
    # shards) and, for a foreach Adam, one temporary of the same size.
    shard_bytes = sum(checkpointing._local(p).numel() * p.element_size() for p in model.parameters())

    def reserve() -> None:
        with torch.cuda.device(device):
            blocks = [torch.empty(int(shard_bytes), dtype=torch.uint8, device=device) for _ in range(2)]
            torch.cuda.current_stream().synchronize()
            del blocks

    thread = None
    host_before = torch.cuda.host_memory_stats()
    if variant == "reserve_serial":
        reserve()
        lap("reserve")
    elif variant == "reserve":
        thread = threading.Thread(target=reserve)
        thread.start()
    if variant == "warm_serial":
        warm_step(model, optimizer, GRAD_CLIP)
        lap("warm_up")
    if variant == "warm":
        def warm_lap(name: str) -> None:
            out["warm_up_wall"] = time.perf_counter() - mark

        read_while(lambda st=state: fmt.dcp_load(st, args.ckpt), lambda: warm_step(model, optimizer, GRAD_CLIP),
                   warm_lap)
    else:
        fmt.dcp_load(state, args.ckpt)
    if thread is not None:
        thread.join()
    lap("load")
    host_after = torch.cuda.host_memory_stats()
    out["host_allocs"] = host_after.get("num_host_alloc", 0) - host_before.get("num_host_alloc", 0)
    out["host_alloc_s"] = (host_after.get("host_alloc_time.total", 0) - host_before.get("host_alloc_time.total", 0)) / 1e6
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    del state
    lap("set_state")
    before = torch.cuda.memory_stats()
    marks: dict[str, float] = {}
    step(task, model, optimizer, batch, marks)
    out["first_forward_backward"] = marks["backward"] - marks["begin"]
    out["first_optimizer"] = marks["optimizer"] - marks["backward"]
    lap("first_step")
    after = torch.cuda.memory_stats()
    out["mallocs"] = after["segment.all.allocated"] - before["segment.all.allocated"]
    out["malloc_gb"] = (after["reserved_bytes.all.allocated"] - before["reserved_bytes.all.allocated"]) / 1e9
    out["retries"] = after["num_alloc_retries"] - before["num_alloc_retries"]
    step(task, model, optimizer, batch)
    lap("second_step")
    for _ in range(3):
        step(task, model, optimizer, batch)
    lap("steady3")
    out["steady"] = out.pop("steady3") / 3
    out["to_first_step"] = sum(out[k] for k in ("build", "prepare", "reserve", "warm_up", "load", "set_state",
                                                 "first_step")
                               if k in out)
    out["total_from_go"] = mark - start
    return out


def readline(proc: subprocess.Popen, expect: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.strip() == expect:
                return
    raise SystemExit(f"no {expect!r} within {timeout:g} s (exit {proc.poll()})")


def trial(variant: str, args: argparse.Namespace) -> dict[str, float]:
    env = os.environ | {"PYTHONWARNINGS": "ignore"}
    base = [sys.executable, __file__, *sys.argv[1:]]
    victim = subprocess.Popen([*base, "--child", "victim", "--port", str(args.port + 1)], stdout=subprocess.PIPE,
                              text=True, env=env)
    restorer = None
    try:
        readline(victim, "ready", 300)
        restorer = subprocess.Popen([*base, "--child", variant, "--port", str(args.port + 2)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env)
        readline(restorer, "warm", 300)
        victim.send_signal(signal.SIGKILL)
        restorer.stdin.write("go\n")
        restorer.stdin.flush()
        out, _ = restorer.communicate(timeout=300)
        if restorer.returncode:
            raise SystemExit(f"{variant}: exit {restorer.returncode}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        victim.kill()
        victim.wait()
        if restorer is not None and restorer.poll() is None:
            restorer.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ckpt", default="/tmp/first-step-ckpt")
    parser.add_argument("--port", type=int, default=29543)
    parser.add_argument("--grad-clip", type=float, default=0.0)
    parser.add_argument("--child", choices=(*VARIANTS, "save", "victim"))
    args = parser.parse_args()
    global GRAD_CLIP
    GRAD_CLIP = args.grad_clip
    if args.child == "save":
        child_save(args)
        return
    if args.child == "victim":
        child_victim(args)
        return
    if args.child:
        print(json.dumps(child_restore(args.child, args)), flush=True)
        return
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        sys.exit(f"error: unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if not Path(args.ckpt, ".metadata").exists():
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", "save"], check=True,
                       env=os.environ | {"PYTHONWARNINGS": "ignore"})
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.repeat):
        for variant in variants:  # interleaved: a drift of the machine hits every variant alike
            results[variant].append(trial(variant, args))
            print(variant, json.dumps(results[variant][-1]), flush=True)
    keys = ("build", "prepare", "reserve", "warm_up", "warm_up_wall", "load", "set_state", "first_step",
            "first_forward_backward", "first_optimizer", "to_first_step", "second_step", "steady", "mallocs",
            "malloc_gb", "retries", "host_allocs", "host_alloc_s")
    print(f"model d_model={args.d_model} layers={args.layers} batch={args.batch_size} repeat={args.repeat}")
    print("| variant | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for variant, runs in results.items():
        cells = [f"{statistics.median(r.get(k, float('nan')) for r in runs):.3f}" for k in keys]
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
