"""Saving and restoring FSDP2 training state under the checkpoint contract.

Each rank stages its own dim-0 slices (a copy to host memory: the only time training
blocks) and writes them either in NVRx's persistent background writer (async) or inline
(sync). A save is committed only when every rank's shard is durable. Ranks learn that
together from a flag that rides on the loss all-reduce of every step, so all ranks reach the
same decision at the same step without an extra collective; rank 0 then commits. One save is
in flight at a time; when the writer is still busy at the next interval the save is deferred,
never waited for.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resilient_training import checkpoint_format as fmt
from resilient_training.config import TrainConfig


def chunk_bounds(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s slice along dim 0: ``torch.chunk`` semantics, as FSDP2."""
    chunk = math.ceil(dim0 / world_size) if dim0 else 0
    offset = min(rank * chunk, dim0)
    return offset, max(0, min(chunk, dim0 - offset))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def write_shard_job(tmp_dir: str, rank: int, shard: dict[str, Any], torn_write: bool) -> None:
    """Runs in the background writer process (module-level so it pickles)."""
    fmt.write_shard(tmp_dir, rank, shard, torn_write=torn_write)


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """(flat name, tensor, the parameter it belongs to) for every model and optimizer tensor."""
    for name, param in model.named_parameters():
        yield f"model/{name}", param, param
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizer.state.get(param, {})
            if key in state:
                yield f"optim/{name}/{key}", state[key], param


@dataclass(slots=True)
class _InFlight:
    step: int
    tmp_dir: Path
    begin_ts: float
    manifest_fields: dict[str, Any]


class Checkpointer:
    """Stages, writes and commits checkpoints; restores the latest committed one."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        rank: int,
        world_size: int,
        tag: str,
        writer: Any,
        emit: Callable[..., Any],
        atomic: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.root = fmt.checkpoints_dir(config.run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self._tag = tag  # unique per attempt/iteration: temporary directories never collide
        self._writer = writer  # nvrx_adapter.AsyncWriter (kept across in-process restarts)
        self._emit = emit
        self._atomic = atomic
        self._in_flight: _InFlight | None = None

    # ------------------------------------------------------------------ restore

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
        """Restore the latest committed checkpoint into sharded ``model``/``optimizer``.

        Returns (step restored, manifest); (0, {}) when there is none. Reshards when the
        checkpoint was written by a different world size.
        """
        latest = fmt.read_latest(self.root)
        if latest is None:
            return 0, {}
        manifest = fmt.read_manifest(latest)
        check_compatible(manifest, self.config)
        if manifest["world_size"] == self.world_size:
            tensors = fmt.load_shard(latest / fmt.shard_name(self.rank))["tensors"]
            meta_step = manifest["step"]
        else:
            full = fmt.assemble_full(list(fmt.iter_shards(latest, manifest)))
            tensors = {}
            for name, tensor in full.items():
                offset, length = chunk_bounds(tensor.shape[0], self.world_size, self.rank)
                tensors[name] = tensor[offset : offset + length]
            meta_step = manifest["step"]
        step_tensor = torch.tensor(float(manifest["optimizer_step"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                _local(param).copy_(tensors[f"model/{name}"])
                state = {"step": step_tensor.clone()}
                for key in ("exp_avg", "exp_avg_sq"):
                    local = tensors[f"optim/{name}/{key}"].to(_local(param).device)
                    if hasattr(param, "placements"):
                        from torch.distributed.tensor import DTensor

                        state[key] = DTensor.from_local(local, param.device_mesh, param.placements,
                                                        shape=param.shape, stride=param.stride())
                    else:
                        state[key] = local
                optimizer.state[param] = state
        return meta_step, manifest

    # ------------------------------------------------------------------ save

    def stage(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Copy this rank's slices to host memory: what the writer will persist."""
        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, dict[str, Any]] = {}
        for flat, tensor, param in named_state(model, optimizer):
            local = _local(tensor).detach()
            tensors[flat] = local.to("cpu", copy=True)
            offset, _ = chunk_bounds(param.shape[0], self.world_size, self.rank)
            layout[flat] = {"global_shape": list(param.shape), "offset": offset}
        opt_steps = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
        if len(opt_steps) > 1:
            raise RuntimeError(f"optimizer parameters disagree on their step count: {sorted(opt_steps)}")
        meta = {
            "format_version": fmt.FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "optimizer_step": opt_steps.pop() if opt_steps else 0,
            "data_position": step,
            "layout": layout,
        }
        return {"meta": meta, "tensors": tensors}

    def should_save(self, step: int) -> bool:
        return step % self.config.checkpoint_every == 0 or step == self.config.steps

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             manifest_fields: dict[str, Any], *, torn_write: bool = False,
             kill_after_submit: Callable[[], None] | None = None) -> None:
        """Start a save of ``step`` (async) or do it whole (sync). Call on every rank.

        Async: returns once staged; the commit happens at a later step through
        :meth:`maybe_commit`. If the previous save is still being written, this one is skipped
        (``ckpt_deferred``), except for the final step, which waits.
        """
        if self._in_flight is not None:
            if step != self.config.steps:
                self._emit("ckpt_deferred", step, reason=f"step {self._in_flight.step} still writing")
                return
            self.finish()  # the final step is always saved: wait for the previous write
        begin = time.time()
        self._emit("ckpt_begin", step, mode="async" if self.config.async_checkpoint else "sync")
        tmp_dir = self.root / f"{fmt.TMP_PREFIX}{fmt.step_dirname(step)}-{self._tag}"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        shard = self.stage(step, model, optimizer)
        self._in_flight = _InFlight(step, tmp_dir, begin, manifest_fields)
        if self.config.async_checkpoint:
            self._writer.submit(write_shard_job, (str(tmp_dir), self.rank, shard, torn_write))
            self._emit("ckpt_staged", step, seconds=time.time() - begin)
            if kill_after_submit is not None:
                kill_after_submit()
        else:
            fmt.write_shard(tmp_dir, self.rank, shard, torn_write=torn_write)
            self._commit_when_all_done(local_done=True)
            self._emit("ckpt_staged", step, seconds=time.time() - begin)

    def local_done(self) -> float:
        """1.0 when this rank has no write in flight (or it finished); raises if the writer died."""
        if self._in_flight is None:
            return 1.0
        return 1.0 if self._writer.poll() else 0.0

    def maybe_commit(self, done_count: float) -> None:
        """Commit the save in flight once every rank reported it durable (same step everywhere)."""
        if self._in_flight is not None and round(done_count) == self.world_size:
            self._commit()

    def _commit_when_all_done(self, local_done: bool) -> None:
        flag = torch.tensor([1.0 if local_done else 0.0], device=_flag_device())
        torch.distributed.all_reduce(flag)
        self.maybe_commit(flag.item())

    def _commit(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        if self.rank != 0:
            return
        with self._atomic():  # an in-process restart must not interrupt a commit halfway
            path = fmt.commit(in_flight.tmp_dir, step=in_flight.step, world_size=self.world_size,
                              manifest_fields=in_flight.manifest_fields, keep_last=self.config.keep_last)
            size = sum(f.stat().st_size for f in path.iterdir())
            _write_iteration_file(self.config.run_dir, in_flight.step)
        self._emit("ckpt_committed", in_flight.step, bytes=size, seconds=time.time() - in_flight.begin_ts,
                   path=str(path))

    def finish(self) -> None:
        """Before a clean exit: wait for the write in flight and commit it on every rank."""
        if self._in_flight is None:
            return
        self._writer.wait(timeout=600)
        self._commit_when_all_done(local_done=True)

    def forget_in_flight(self, wait_seconds: float) -> None:
        """After a failure: let a write still running finish (bounded) and never commit it."""
        self._in_flight = None
        if self._writer.in_flight:
            try:
                self._writer.wait(timeout=wait_seconds)
            except Exception:
                self._writer.abandon()


def _flag_device() -> torch.device:
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _write_iteration_file(run_dir: str, step: int) -> None:
    """ft_launcher 0.6+ reads this to stop restart loops that make no progress."""
    path = Path(run_dir) / "ft_iteration"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, path)


def iteration_file(run_dir: str) -> str:
    return str(Path(run_dir) / "ft_iteration")


def check_compatible(manifest: dict[str, Any], config: TrainConfig) -> None:
    """Refuse to resume from a checkpoint of another model shape."""
    saved = manifest.get("model_config")
    wanted = {k: getattr(config.model, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")}
    if saved is not None and {k: saved.get(k) for k in wanted} != wanted:
        raise fmt.CheckpointError(
            f"{config.run_dir} holds checkpoints of a different model ({saved}); this run wants {wanted}. "
            "Use a new --run-dir."
        )
