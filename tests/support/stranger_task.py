"""A third stranger trial's own task, kept as they wrote it (trimmed): a token MLP with BatchNorm,
a tied embedding and head, a long buffer, optional dropout and shared blocks, SGD with momentum
and a choice of schedulers, and a stateful iterator of its own."""

import torch
import torch.nn.functional as F
from torch import nn

V, T = 48, 12


class Block(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.bn = nn.BatchNorm1d(2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.drop(self.fc2(F.relu(h)))


class TiedMLP(nn.Module):
    def __init__(self, d: int, layers: int, p: float, share: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, d)
        blocks = [Block(d, p) for _ in range(layers)]
        self.blocks = nn.ModuleList([blocks[0]] * layers if share else blocks)  # share: ALBERT-style
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        x = self.embed(tok)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stream:
    """Batch i of rank r depends only on (seed, r, i)."""

    def __init__(self, rank: int, seed: int, bs: int) -> None:
        self.rank, self.seed, self.bs, self.pos = rank, seed, bs, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.pos * 97 + self.rank)
            start = torch.randint(0, V, (self.bs, 1), generator=g)
            stride = torch.randint(1, 4, (self.bs, 1), generator=g)
            self.pos += 1
            yield (start + stride * torch.arange(T + 1)) % V

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


class Task:
    def __init__(self, lr: float, dropout: float, share: bool, sched: str) -> None:
        self.lr, self.dropout, self.share, self.sched = lr, dropout, share, sched

    def build_model(self) -> nn.Module:
        return TiedMLP(32, 2, self.dropout, self.share)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer):
        if self.sched == "plateau":
            return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)

    def build_data(self, rank: int, world_size: int, seed: int) -> Stream:
        return Stream(rank, seed, 16)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, V), batch[:, 1:].reshape(-1))


def task(lr: float = 0.2, dropout: float = 0.0, share: bool = False, sched: str = "step") -> Task:
    return Task(lr, dropout, share, sched)
