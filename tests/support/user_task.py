"""A user's task outside the package, as ``--task tests/support/user_task.py:make`` names it.

Its own model (an MLP with a registered buffer), SGD with momentum (not AdamW), a
StatefulDataLoader over its own tensors, an lr scheduler, gradient clipping and gradient
accumulation: everything the trainer must handle for any task.
"""

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader


class Regressor(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, width), nn.Linear(width, 1)])
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x))) * self.scale


class Task:
    grad_clip = 1.0
    grad_accumulation = 2

    def __init__(self, width: int, lr: float) -> None:
        self.width, self.lr = width, lr

    def build_model(self) -> nn.Module:
        return Regressor(self.width)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)

    def build_data(self, rank: int, world_size: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(512, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world_size, rank=rank, seed=seed)
        return StatefulDataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def make(width: str = "16", lr: str = "0.05") -> Task:
    return Task(int(width), float(lr))


class TypedTask(Task):
    """A task class named directly as the factory: its __init__'s annotations are the settings' types."""

    def __init__(self, width: int = 16, lr: float = 0.05) -> None:
        super().__init__(width, lr)


def make_typed(width: int = 16, lr: float = 0.05, momentum: bool = True, name: str = "x") -> Task:
    """Annotated settings: the loader converts them (``--task-arg width=4`` arrives as the int 4)."""
    task = Task(width, lr)
    task.settings = (width, lr, momentum, name)
    return task


# Broken tasks: each must be refused before any worker starts, naming the method.
class _Broken(Task):
    def __init__(self) -> None:
        super().__init__(16, 0.05)


class ModelNotAModule(_Broken):
    def build_model(self):
        return {"weight": torch.zeros(1)}


class ModelRaises(_Broken):
    def build_model(self):
        raise RuntimeError("no GPU here")


class OptimizerWrongType(_Broken):
    def build_optimizer(self, model):
        return [p for p in model.parameters()]


class DataWithoutState(_Broken):
    def build_data(self, rank, world_size, seed):
        return iter([torch.zeros(2)])


class LossNotScalar(_Broken):
    def loss(self, model, batch):
        x, _ = batch
        return model(x)


class OptimizerOverOtherTensors(_Broken):
    def build_optimizer(self, model):
        return torch.optim.AdamW(nn.Linear(3, 3).parameters())


class SchedulerItSteps(_Broken):
    """A StepLR made with the optimizer and stepped in loss(): never checkpointed."""

    def build_optimizer(self, model):
        optimizer = torch.optim.AdamW(model.parameters())
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
        return optimizer

    def build_lr_scheduler(self, optimizer):
        return None


class SchedulerWrongType(_Broken):
    def build_lr_scheduler(self, optimizer):
        return "cosine"


class Settings(_Broken):
    def __init__(self, **settings) -> None:
        super().__init__()
        for name, value in settings.items():
            setattr(self, name, value)


class _MissingSample(TensorDataset):
    def __getitem__(self, index):
        if index == 100:
            raise KeyError("sample 100 is missing")
        return super().__getitem__(index)


class BadSample(Task):
    """A bug in the task's data: one sample cannot be read, at the same step of every replay."""

    def build_data(self, rank: int, world_size: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(512, 8, generator=gen)
        dataset = _MissingSample(x, x.sum(dim=1, keepdim=True))
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
        return StatefulDataLoader(dataset, batch_size=16, sampler=sampler)


bad_sample = BadSample(16, 0.05)
model_not_a_module = ModelNotAModule()
optimizer_over_other_tensors = OptimizerOverOtherTensors()
scheduler_it_steps = SchedulerItSteps()
scheduler_wrong_type = SchedulerWrongType()
accumulation_zero = Settings(grad_accumulation=0)
accumulation_string = Settings(grad_accumulation="two")
clip_nan = Settings(grad_clip=float("nan"))
clip_negative = Settings(grad_clip=-1.0)
model_raises = ModelRaises()
optimizer_wrong_type = OptimizerWrongType()
data_without_state = DataWithoutState()
loss_not_scalar = LossNotScalar()
not_a_task = 42


class HalfImportedOnce(Task):
    """The first process's every build fails as after an interrupted import (a module left
    half-initialized: Python's own message); a new process builds normally.
    """

    def build_model(self) -> nn.Module:
        import os

        if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":  # not the launcher's preflight
            raise AttributeError("partially initialized module 'torch._inductor' has no attribute "
                                 "'custom_graph_pass' (most likely due to a circular import)")
        return super().build_model()


half_imported_once = HalfImportedOnce(16, 0.05)


class _EmptyLayer(_Broken):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 0), nn.Linear(0, 1))


empty_layer = _EmptyLayer()
