"""The built-in task: the small GPT of :mod:`resilient_training.runtime.model` on synthetic tokens.

Its settings (``--task-arg``) default to the run's ``--model-*``, ``--batch-size`` and ``--lr``
flags (:func:`resilient_training.runtime.task.task_from_config` passes them). The data is a
global stream: sample ``i`` is a pure function of (seed, i), rank ``r`` of ``W`` reads samples
``[p + r*B, p + (r+1)*B)`` at global position ``p``, and every rank advances ``p`` by ``W*B``. The
position is the same on every rank, so a resume at another world size continues at the same
global sample.
"""

from __future__ import annotations

from typing import Any

import torch

from resilient_training.run.config import ModelConfig
from resilient_training.runtime.model import GPT, batch, loss_fn
from resilient_training.runtime.task import parse_arg


class SyntheticTokens:
    """Stateful iterator over this rank's batches of the global synthetic stream."""

    def __init__(self, cfg: ModelConfig, *, rank: int, world_size: int, seed: int, batch_size: int) -> None:
        self.cfg, self.rank, self.world_size, self.seed, self.batch_size = cfg, rank, world_size, seed, batch_size
        self.position = 0  # global samples consumed by all ranks together

    def __iter__(self) -> SyntheticTokens:
        return self

    def __next__(self) -> torch.Tensor:
        first = self.position + self.rank * self.batch_size
        tokens = batch(self.cfg, seed=self.seed, first=first, batch_size=self.batch_size)
        self.position += self.world_size * self.batch_size
        return tokens

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class GPTTask:
    def __init__(self, cfg: ModelConfig, *, batch_size: int, lr: float) -> None:
        self.cfg, self.batch_size, self.lr = cfg, batch_size, lr

    def build_model(self) -> GPT:
        return GPT(self.cfg)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr)

    def build_data(self, rank: int, world_size: int, seed: int) -> SyntheticTokens:
        return SyntheticTokens(self.cfg, rank=rank, world_size=world_size, seed=seed, batch_size=self.batch_size)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(batch[:, :-1]), batch[:, 1:])


def task(*, vocab_size: str = "256", d_model: str = "64", n_layers: str = "2", n_heads: str = "4",
         seq_len: str = "32", batch_size: str = "8", lr: str = "3e-3") -> GPTTask:
    """The GPT task from ``--task-arg`` strings (ValueError names a bad one)."""
    def number(name: str, value: str, kind: type) -> Any:
        try:
            return parse_arg(value, kind)
        except ValueError:
            raise ValueError(f"task argument {name}={value!r} is not a{'n integer' if kind is int else ' number'}") from None

    cfg = ModelConfig(vocab_size=number("vocab_size", vocab_size, int), d_model=number("d_model", d_model, int),
                      n_layers=number("n_layers", n_layers, int), n_heads=number("n_heads", n_heads, int),
                      seq_len=number("seq_len", seq_len, int))
    size = number("batch_size", batch_size, int)
    if size <= 0:
        raise ValueError(f"task argument batch_size must be positive, got {size}")
    return GPTTask(cfg, batch_size=size, lr=number("lr", lr, float))
