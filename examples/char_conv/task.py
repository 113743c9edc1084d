"""A user's own training task, written outside the package: a character-level causal-convolution
language model, trained with SGD (Nesterov momentum), a warm-up schedule and gradient clipping, on
the text files in ``data/``.

Nothing here imports ``resilient_training``: the product finds the task by name,

    resilient-training train --run-dir runs/char --task examples/char_conv/task.py:task --task-arg lr=0.05

and calls the methods below (build_model, build_optimizer, build_data, loss; optionally
build_lr_scheduler, grad_clip). The trainer adds FSDP2, NVRx restarts, DCP checkpoints, fault
injection, the event log and the gates. Every ``--task-arg KEY=VALUE`` arrives as a keyword
argument of :func:`task`, converted to its annotation (``int``, ``float``, ``bool``; a string
otherwise): ``--task-arg channels=abc`` is refused before training.
"""

from __future__ import annotations

import glob
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

HERE = Path(__file__).resolve().parent
VOCAB = 256  # bytes


class CausalConvBlock(nn.Module):
    """Dilated causal convolution with a gated linear unit, pre-norm and a residual connection."""

    def __init__(self, channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.left_pad = (kernel - 1) * dilation  # pad on the left only: position t never sees t+1
        self.norm = nn.LayerNorm(channels)
        self.conv = nn.Conv1d(channels, 2 * channels, kernel, dilation=dilation)
        self.out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.norm(x).transpose(1, 2), (self.left_pad, 0))
        value, gate = self.conv(h).chunk(2, dim=1)
        return x + self.out((value * torch.sigmoid(gate)).transpose(1, 2))


class CharConvLM(nn.Module):
    def __init__(self, channels: int, layers: int, kernel: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, channels)
        # A ModuleList: the trainer's default FSDP2 wrapping shards each block as its own unit.
        self.blocks = nn.ModuleList(CausalConvBlock(channels, kernel, 2 ** i) for i in range(layers))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TextWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes of the files, read once into memory."""

    def __init__(self, pattern: str, seq_len: int) -> None:
        files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"data={pattern} matches no files")
        data = b"".join(f.read_bytes() + b"\n" for f in files)
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len
        if len(self) < 1:
            raise ValueError(f"data={pattern} holds {len(data)} bytes: fewer than seq_len+1 = {seq_len + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.tokens[start: start + self.seq_len + 1]


class CharConvTask:
    grad_clip = 1.0  # an ordinary option the trainer reads

    def __init__(self, *, data: str, seq_len: int, batch_size: int, lr: float, channels: int, layers: int) -> None:
        self.data, self.seq_len, self.batch_size, self.lr = data, seq_len, batch_size, lr
        self.channels, self.layers = channels, layers

    def build_model(self) -> nn.Module:
        return CharConvLM(self.channels, self.layers)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9, nesterov=True)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=10)

    def build_data(self, rank: int, world_size: int, seed: int) -> StatefulDataLoader:
        dataset = TextWindows(self.data, self.seq_len)
        # torchdata's stateful sampler and loader: their position is part of every checkpoint.
        sampler = StatefulDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                             drop_last=True)
        return StatefulDataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def task(data: str = str(HERE / "data" / "*.txt"), seq_len: int = 32, batch_size: int = 8, lr: float = 0.05,
         channels: int = 64, layers: int = 4) -> CharConvTask:
    """The task from its ``--task-arg`` settings (the trainer converts the annotated numbers)."""
    return CharConvTask(data=data, seq_len=seq_len, batch_size=batch_size, lr=lr, channels=channels, layers=layers)
