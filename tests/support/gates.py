"""Real artefacts for testing and benchmarking the gates: checkpoints, event logs, trainer runs.

Checkpoints without a distributed run:

:func:`write_checkpoint` trains the built-in GPT task (:mod:`resilient_training.tasks.gpt`) for a
few steps on its real data, splits every tensor along dim 0 the way FSDP2 ``Shard(0)`` does
(``torch.chunk``) into one DCP write plan per rank, and writes them through
:func:`~resilient_training.run.checkpoint_format.write_rank` and
:func:`~resilient_training.run.checkpoint_format.commit`: the same files the trainer writes. It
also logs the commit (``ckpt_committed`` with the world size) as the trainer does.
:func:`rewrite_chunk` alters one stored chunk and (optionally) re-records its checksums in the
manifest, which is how a corruption that slipped past the writer looks; :func:`rewrite_metadata`
edits DCP's ``.metadata`` (the tool of an attacker who keeps everything consistent).

Event logs with exact timestamps: :class:`ScriptedLog` writes ``RUN/events/*.jsonl`` in the
real format (:class:`~resilient_training.run.events.Event`) on a virtual clock, so metrics can be
checked against numbers worked out by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from resilient_training.run import checkpoint_format as cf
from resilient_training.run import layout
from resilient_training.run.config import ModelConfig

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, seq_len=16)


def task_args(cfg: ModelConfig, *, lr: float = 3e-3, batch_size: int = 4) -> dict[str, str]:
    """The built-in GPT task's settings for ``cfg`` (as the trainer records them)."""
    return {**{k: str(getattr(cfg, k)) for k in cfg.__slots__}, "batch_size": str(batch_size), "lr": repr(lr)}


def train_state(cfg: ModelConfig, *, seed: int, steps: int, lr: float = 3e-3) -> tuple[Any, Any, Any]:
    """(model, optimizer, data) of the GPT task after ``steps`` real AdamW steps on its data."""
    import torch

    from resilient_training.tasks.gpt import task

    gpt = task(**task_args(cfg, lr=lr))
    torch.manual_seed(seed)
    model = gpt.build_model()
    optimizer = gpt.build_optimizer(model)
    data = gpt.build_data(0, 1, seed)
    for _ in range(steps):
        loss = gpt.loss(model, next(data))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer, data


def rank_jobs(state: Mapping[str, Any], *, world_size: int, step: int, data_state: Any) -> list[dict[str, Any]]:
    """One DCP write job per rank, as FSDP2 ``Shard(0)`` over ``world_size`` ranks would stage them."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    from resilient_training.runtime.checkpointing import flat_state

    flat, paths = flat_state(dict(state))
    jobs = [{"items": [], "tensors": {}, "blobs": {}, "paths": paths, "data_state": data_state,
             "meta": {"step": step, "optimizer_step": step, "data_position": step}} for _ in range(world_size)]
    for name, value in flat.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            chunk = -(-value.shape[0] // world_size)
            for rank, job in enumerate(jobs):
                offset = min(rank * chunk, value.shape[0])
                length = max(0, min(chunk, value.shape[0] - offset))
                offsets = torch.Size([offset] + [0] * (value.dim() - 1))
                sizes = torch.Size([length, *value.shape[1:]])
                job["items"].append(WriteItem(
                    index=MetadataIndex(name, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                properties=TensorProperties.create_from_tensor(value),
                                                size=value.size())))
                job["tensors"][name] = value.detach().narrow(0, offset, length).clone()
        elif isinstance(value, torch.Tensor):
            jobs[0]["items"] += _create_write_items(name, value)
            jobs[0]["tensors"][name] = value.detach().clone()
        else:
            blob = io.BytesIO()
            torch.save(value, blob)
            jobs[0]["items"] += _create_write_items(name, value)
            jobs[0]["blobs"][name] = blob.getvalue()
    return jobs


def log_commit(run_dir: str | os.PathLike[str], step: int, world_size: int) -> None:
    """Rank 0's ``ckpt_committed`` for ``step``, as the trainer logs it (validation reads its world
    size and the digest of the manifest now in ``checkpoints/step_N``).
    """
    from resilient_training.run import gate_records
    from resilient_training.run.events import EventLog

    log = EventLog(run_dir, rank=0, attempt=0)
    log.emit("ckpt_committed", step, bytes=0, seconds=0.0, path=f"checkpoints/step_{step}", tier="persistent",
             world_size=world_size,
             manifest_checksum=gate_records.manifest_digest(Path(run_dir) / "checkpoints" / f"step_{step}"))
    log.close()


def write_checkpoint(
    run_dir: str | os.PathLike[str],
    *,
    step: int,
    world_size: int = 2,
    cfg: ModelConfig = TINY,
    seed: int = 1234,
    train_steps: int | None = None,
    keep_last: int = 100,
    run_id: str = "test-run",
    state: Mapping[str, Any] | None = None,
    threads: int = 1,
) -> Path:
    """Commit ``RUN/checkpoints/step_<step>`` holding real trained state (each rank's part as
    ``threads`` DCP files); returns its path.
    """
    import torch

    from resilient_training.run.config import DEFAULT_TASK
    from resilient_training.runtime.checkpointing import state_dict

    data_state: Any = {"position": 0}
    if state is None:
        model, optimizer, data = train_state(cfg, seed=seed, steps=step if train_steps is None else train_steps)
        state, data_state = state_dict(model, optimizer), data.state_dict()
    root = layout.checkpoints_dir(run_dir)
    tmp = root / f"{cf.TMP_PREFIX}{cf.step_dirname(step)}-a0i0"
    tmp.mkdir(parents=True, exist_ok=True)
    for rank, job in enumerate(rank_jobs(state, world_size=world_size, step=step, data_state=data_state)):
        cf.write_rank(tmp, rank, {**job, "threads": threads})
    path = cf.commit(
        tmp,
        step=step,
        world_size=world_size,
        keep_last=keep_last,
        manifest_fields={
            "model_config": dataclasses.asdict(cfg),
            "task": DEFAULT_TASK,
            "task_args": task_args(cfg),
            "versions": {"torch": torch.__version__},
            "seed": seed,
            "run_id": run_id,
            "run_uid": cf.run_uid(run_dir),  # as the trainer records it
        },
    )
    log_commit(run_dir, step, world_size)
    return path


def forge_commit_record(ckpt_dir: str | os.PathLike[str]) -> None:
    """Rewrite the run's event log as well, as an attacker who keeps everything consistent would:
    rank 0's commit of the checkpoint's step is logged again, with the digest of the manifest now
    in the directory (and the world size last logged for that step). Each deeper check of
    validation must hold on its own against such an attacker. Nothing is logged while the
    manifest does not parse.
    """
    from resilient_training.run.gate_records import recorded_commit

    ckpt_dir = Path(ckpt_dir)
    run_dir = ckpt_dir.parent.parent
    try:
        step = cf.read_manifest(ckpt_dir)["step"]
    except (cf.CheckpointError, OSError, KeyError, TypeError):
        return
    _, world_size, _ = recorded_commit(run_dir, step)
    log_commit(run_dir, step, world_size or 0)


def rewrite_manifest(ckpt_dir: str | os.PathLike[str], edit: Callable[[dict[str, Any]], None]) -> None:
    path = Path(ckpt_dir) / cf.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def record_file(ckpt_dir: str | os.PathLike[str], name: str) -> None:
    """Re-record one file's size and checksum in the manifest (what a careless repair would do)."""
    size, digest = cf.checksum_file(Path(ckpt_dir) / name)

    def edit(manifest: dict[str, Any]) -> None:
        manifest["files"][name].update(bytes=size, checksum=digest)

    rewrite_manifest(ckpt_dir, edit)


def read_metadata(ckpt_dir: str | os.PathLike[str]) -> Any:
    import pickle

    with open(Path(ckpt_dir) / cf.METADATA_NAME, "rb") as handle:
        return pickle.load(handle)


def rewrite_metadata(ckpt_dir: str | os.PathLike[str], edit: Callable[[Any], None]) -> None:
    """Edit DCP's ``.metadata`` in place and re-record its checksum (a consistent forgery)."""
    import pickle

    metadata = read_metadata(ckpt_dir)
    edit(metadata)
    path = Path(ckpt_dir) / cf.METADATA_NAME
    tmp = path.with_name(path.name + ".rewrite")
    tmp.write_bytes(pickle.dumps(metadata))
    os.replace(tmp, path)
    record_file(ckpt_dir, cf.METADATA_NAME)


def chunk_entry(ckpt_dir: str | os.PathLike[str], fqn: str, rank: int) -> dict[str, Any]:
    """The manifest's record of the chunk of ``fqn`` that ``rank`` wrote."""
    manifest = cf.read_manifest(ckpt_dir)
    return next(c for c in manifest["tensors"][fqn]["chunks"] if c["rank"] == rank)


def rewrite_chunk(
    ckpt_dir: str | os.PathLike[str],
    fqn: str,
    rank: int,
    edit: Callable[[Any], None],
    *,
    rerecord: str | None = "all",
) -> None:
    """Load the chunk of ``fqn`` that ``rank`` stored, let ``edit`` change it in place, store it back.

    ``rerecord``: ``"all"`` re-records the chunk's checksum and its file in the manifest (as if
    the writer had saved the edited state), ``"file"`` only the file's size and checksum (a
    careless repair), None nothing (damage after the commit).
    """
    import io

    import torch

    entry = chunk_entry(ckpt_dir, fqn, rank)
    path = Path(ckpt_dir) / entry["file"]
    data = path.read_bytes()
    start, length = entry["offset"], entry["length"]
    tensor = torch.load(io.BytesIO(data[start:start + length]), weights_only=True)
    edit(tensor)
    blob = io.BytesIO()
    torch.save(tensor, blob)
    assert len(blob.getvalue()) == length, "the edit changed the stored length"
    save_bytes(data[:start] + blob.getvalue() + data[start + length:], path)
    if rerecord == "all":
        def edit_manifest(manifest: dict[str, Any]) -> None:
            for chunk in manifest["tensors"][fqn]["chunks"]:
                if chunk["rank"] == rank:
                    chunk["checksum"] = cf.tensor_checksum(tensor)

        rewrite_manifest(ckpt_dir, edit_manifest)
    if rerecord in ("all", "file"):
        record_file(ckpt_dir, entry["file"])


def save_bytes(data: bytes, path: Path) -> None:
    """Write a new file renamed over ``path`` (readers that mapped the old one keep it whole)."""
    tmp = path.with_name(path.name + ".rewrite")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_replacing(obj: Any, path: Path) -> None:
    """torch.save to a new file renamed over ``path``: a reader may memory-map the old one, and
    truncating a mapped file in place would SIGBUS whoever still reads it.
    """
    import torch

    tmp = path.with_name(path.name + ".rewrite")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def build_once(cache_root: str | os.PathLike[str], name: str, build: Callable[[Path], None]) -> Path:
    """``cache_root/name`` built by ``build(path)`` the first time it is asked for, then reused.

    Lets test folders that cannot share a fixture (each has its own conftest) share the
    expensive artefacts of one test session: pass ``tmp_path_factory.getbasetemp()``.
    With pytest-xdist workers, one worker builds it for all (the others wait on a lock): each
    worker built its own before, two trainer-run builds at once on two cores, ~100 s each.
    """
    import fcntl

    root = Path(cache_root)
    if "PYTEST_XDIST_WORKER" in os.environ and root.name.startswith("popen-gw"):
        root = root.parent  # the session's temporary root, shared by its workers
    final = root / "shared-artefacts" / name
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or by the kernel if this worker dies
        if not final.exists():
            staging = final.with_name(f"{cf.TMP_PREFIX}{name}-{os.getpid()}")
            staging.mkdir(parents=True)
            build(staging)
            staging.rename(final)
    return final


def copy_run(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """A private copy of a shared run, safe to corrupt."""
    import shutil

    return Path(shutil.copytree(source, dest, symlinks=True))


def scripted_loss(step: int) -> float:
    """A learning curve: what the same step gives again after a correct restore."""
    import math

    return 1.0 + 4.5 * math.exp(-step / 8)


class ScriptedLog:
    """Writes an event log in the real format on a virtual clock (``t`` seconds after ``t0``)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, world_size: int = 2, t0: float = 1_700_000_000.0):

        self.dir = layout.events_dir(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.world_size = world_size
        self.t0 = t0
        self.t = 0.0
        self.attempt = 0
        self.iteration = 0
        self.lines: dict[str, list[str]] = {}

    def emit(self, event: str, step: int | None = None, *, rank: int | None = None, **fields: Any) -> None:
        """One event from ``rank`` (all ranks when None; -1 is the launcher) at the current time."""
        from resilient_training.run.events import EVENT_TYPES, Event

        assert event in EVENT_TYPES, event
        for r in range(self.world_size) if rank is None else [rank]:
            record = Event(ts=self.t0 + self.t, rank=r, attempt=self.attempt, iteration=self.iteration, event=event,
                           step=step, fields=dict(fields))
            self.lines.setdefault("launcher" if r < 0 else f"rank{r}", []).append(record.to_json())

    def wait(self, seconds: float) -> None:
        self.t += seconds

    def steps(self, first: int, last: int, *, seconds: float = 0.1, loss: Callable[[int], float] = scripted_loss,
              checkpoint_every: int = 0, stall: float = 0.02, save_seconds: float = 0.2) -> None:
        """Steps first..last, each taking ``seconds``, saving every ``checkpoint_every`` steps."""
        for step in range(first, last + 1):
            self.wait(seconds)
            self.emit("step", step, loss=loss(step), seconds=seconds)
            if checkpoint_every and step % checkpoint_every == 0:
                self.emit("ckpt_begin", step, mode="async")
                self.wait(stall)
                self.emit("ckpt_staged", step, seconds=stall)
                self.emit("ckpt_committed", step, rank=0, bytes=1000, seconds=save_seconds,
                          path=f"checkpoints/step_{step}")

    def start(self) -> None:
        self.emit("start", world_size=self.world_size, pid=1, host="test", layers=[], nvrx_version="0",
                  torch_version="0")

    def end(self, status: str = "completed", reason: str = "") -> None:
        self.emit("end", status=status, reason=reason)

    def close(self) -> None:
        for name, lines in self.lines.items():
            with open(self.dir / f"{name}.jsonl", "a", encoding="utf-8") as handle:
                handle.write("".join(line + "\n" for line in lines))
        self.lines.clear()


# --------------------------------------------------------------------------- trainer runs

# Real `resilient-training train` runs the gate tests share: name -> flags after --run-dir.
# Sync saves commit at once, so a fault at step 12 restores step 10 on this 2-core machine
# (the async writer's first write can outlast a short run's first interval).
# Collective and store timeouts above the defaults: three runs share two cores, and a rank
# still importing torch must not time its peer out (DistStoreError after 3 s was seen).
RELAXED = ["--pg-timeout", "8", "--soft-timeout", "16", "--hard-timeout", "32", "--heartbeat-timeout", "40"]
TRAINER_RUNS: dict[str, list[str]] = {
    # exception on rank 1 at step 12: in-process restart restores step 10 and replays.
    "faulted": ["--steps", "30", "--checkpoint-every", "5", "--no-async-checkpoint", "--faults", "exception@12:1"],
    # NaN loss at step 6 with the NaN guard off: the weights turn NaN and training goes on.
    "nan": ["--steps", "12", "--checkpoint-every", "5", "--no-async-checkpoint", "--no-nan-guard",
            "--faults", "nan@6:0"],
    # rank 1 killed while writing step 10's shard: ft_launcher restarts; .tmp-step_10-*/__1_0.distcp.partial stays.
    "killed-mid-save": ["--steps", "30", "--checkpoint-every", "5", "--no-async-checkpoint",
                        "--faults", "ckpt-kill@10:1"],
    # learning rate 0: runs fine, learns nothing.
    "no-learning": ["--steps", "12", "--checkpoint-every", "5", "--no-async-checkpoint", "--lr", "0"],
}
# A copy of "faulted" whose step_30 gets the initial weights (checksums re-recorded, so it
# validates), then resumed to step 34: the restore loads the wrong state.
RESUME_TAMPERED = ["--steps", "34", "--checkpoint-every", "5", "--no-async-checkpoint"]


def train_command(run_dir: str | os.PathLike[str], flags: list[str], nproc: int = 2) -> list[str]:
    import sys

    return [sys.executable, "-m", "resilient_training.cli", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
            *flags]


def run_trainers(runs: Mapping[str, tuple[Path, list[str]]], *, parallel: int = 2,
                 timeout: float = 240) -> dict[str, int]:
    """Run trainers, ``parallel`` at a time (more starve the 3 s collective timeouts on 2 cores); name -> exit code."""
    import subprocess
    import time

    pending = list(runs.items())
    running: dict[str, tuple[subprocess.Popen[bytes], Any, float]] = {}
    codes: dict[str, int] = {}
    while pending or running:
        while pending and len(running) < parallel:
            name, (run_dir, flags) = pending.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir.parent / f"{run_dir.name}.train.log", "ab")  # noqa: SIM115 - closed below
            running[name] = (subprocess.Popen(train_command(run_dir, flags), stdout=log, stderr=subprocess.STDOUT),
                             log, time.monotonic())
        for name, (proc, log, started) in list(running.items()):
            if proc.poll() is None and time.monotonic() - started < timeout:
                continue
            if proc.returncode is None:
                proc.kill()
                proc.wait()
            log.close()
            codes[name] = proc.returncode
            del running[name]
        time.sleep(0.1)
    return codes


def tamper_with_initial_weights(ckpt_dir: str | os.PathLike[str], *, forge_log: bool = True) -> None:
    """Replace a checkpoint's model weights by the initial ones, re-recording every checksum,
    and (``forge_log``) the run's record of its commit.

    With the log forged too the result is consistent (validation passes): only the loss after a
    restore from it shows that it is not the state the run saved. Without, validation finds the
    manifest is not the one the run committed.
    """
    import torch

    from resilient_training.runtime import task as tk

    manifest = cf.read_manifest(ckpt_dir)
    torch.manual_seed(int(manifest.get("seed", 0)))  # the trainer builds under the run's seed
    fresh = tk.build_model(tk.load_task(manifest["task"], manifest["task_args"])).state_dict()
    for fqn, tensor in fresh.items():
        for chunk in manifest["tensors"][f"model.{fqn}"]["chunks"]:
            def edit(stored: Any, chunk: dict[str, Any] = chunk, tensor: Any = tensor) -> None:
                region = tensor
                for dim, (offset, size) in enumerate(zip(chunk["offsets"], chunk["sizes"], strict=True)):
                    region = region.narrow(dim, offset, size)
                stored.copy_(region)

            rewrite_chunk(ckpt_dir, f"model.{fqn}", chunk["rank"], edit)
    if forge_log:
        forge_commit_record(ckpt_dir)


def build_trainer_runs(root: Path) -> None:
    """The runs of :data:`TRAINER_RUNS` and "tampered-restore" under ``root/<name>`` (1.5 min on 2 cores)."""
    import shutil

    codes = run_trainers({name: (root / name, flags + RELAXED) for name, flags in TRAINER_RUNS.items()}, parallel=3)
    tampered = root / "tampered-restore"
    shutil.copytree(root / "faulted", tampered)
    tamper_with_initial_weights(tampered / "checkpoints" / "step_30")
    codes |= run_trainers({"tampered-restore": (tampered, RESUME_TAMPERED + RELAXED)})
    if any(codes.values()):
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in root.glob("*.train.log")}
        raise RuntimeError(f"trainer runs ended {codes}, expected all 0; logs: {logs}")


def flip_tensor_byte(ckpt_dir: str | os.PathLike[str], rank: int = 0) -> str:
    """Flip one byte inside the stored values of ``rank``'s largest chunk, nothing re-recorded
    (bit rot after the commit): the file still loads, with one value changed. Returns the file's name.
    """
    import io

    import torch

    manifest = cf.read_manifest(ckpt_dir)
    entry = max((c for t in manifest["tensors"].values() for c in t["chunks"] if c["rank"] == rank),
                key=lambda c: c["length"])
    path = Path(ckpt_dir) / entry["file"]
    data = bytearray(path.read_bytes())
    blob = bytes(data[entry["offset"]:entry["offset"] + entry["length"]])
    values = torch.load(io.BytesIO(blob), weights_only=True).contiguous().view(torch.uint8).numpy().tobytes()
    at = blob.find(values)
    assert at >= 0 and len(values) > 1, "the chunk's values are not stored as one byte range"
    data[entry["offset"] + at + len(values) // 2] ^= 0x40
    save_bytes(bytes(data), path)
    return entry["file"]
