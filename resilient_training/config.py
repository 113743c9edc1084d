"""Typed configuration of a training run, and its round trip to command-line flags.

The same flags reach a worker whoever starts it: the local launcher, the PyTorchJob builder
(as container args after ``ft_launcher``) and the simulated multi-node launcher all call
:func:`to_argv`, and the worker parses them back with :func:`from_argv`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Size of the GPT-style model; tiny defaults run on a laptop CPU."""

    vocab_size: int = field(default=256, metadata={"help": "vocabulary size of the synthetic tokens"})
    d_model: int = field(default=64, metadata={"help": "hidden size"})
    n_layers: int = field(default=2, metadata={"help": "transformer blocks"})
    n_heads: int = field(default=4, metadata={"help": "attention heads (must divide d_model)"})
    seq_len: int = field(default=32, metadata={"help": "tokens per sample"})

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything a worker needs; one instance describes one run."""

    run_dir: str = field(metadata={"help": "run directory (checkpoints/, events/ live here)"})
    steps: int = field(default=40, metadata={"help": "target step: the run succeeds once it is reached"})
    checkpoint_every: int = field(default=5, metadata={"help": "save a checkpoint every N steps"})
    keep_last: int = field(default=3, metadata={"help": "committed checkpoints kept on storage"})
    local_checkpoint_every: int = field(
        default=0, metadata={"help": "also save to the node-local tier every N steps (0 = off)"})
    local_checkpoint_dir: str = field(
        default="", metadata={"help": "node-local tier directory (default /dev/shm/resilient-training); "
                                      "each run keeps its own folder inside"})
    async_checkpoint: bool = field(default=True, metadata={"help": "write checkpoints in NVRx's background process"})
    inprocess: bool = field(default=True, metadata={"help": "NVRx in-process restart (inprocess.Wrapper)"})
    ft_launcher: bool = field(default=True, metadata={"help": "NVRx ft_launcher heartbeats and restarts"})
    nan_guard: bool = field(default=True, metadata={"help": "treat a non-finite loss as a failure and roll back"})
    faults: str = field(default="", metadata={"help": "fault schedule TYPE@STEP:RANK,... or a YAML file"})
    seed: int = field(default=1234, metadata={"help": "seed of model init and data"})
    batch_size: int = field(default=8, metadata={"help": "samples per rank per step"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate"})
    step_seconds: float = field(default=0.0, metadata={"help": "minimum seconds per step (pads tiny CPU steps)"})
    # Restart budgets and timeouts (seconds). On CPU/gloo a blocked collective can only be
    # unblocked by its own timeout, so pg_timeout bounds in-process recovery there.
    max_inprocess_restarts: int = field(default=8, metadata={"help": "in-process restarts before giving up"})
    max_restarts: int = field(default=6, metadata={"help": "ft_launcher restarts before giving up"})
    min_world_size: int = field(default=0, metadata={"help": "in-process: fewest ranks to continue (0 = all)"})
    pg_timeout: float = field(default=3.0, metadata={"help": "process-group collective timeout"})
    soft_timeout: float = field(default=6.0, metadata={"help": "in-process: no progress this long => restart"})
    hard_timeout: float = field(default=12.0, metadata={"help": "in-process: hard kill after no progress"})
    heartbeat_timeout: float = field(default=10.0, metadata={"help": "ft_launcher: rank heartbeat timeout"})
    initial_heartbeat_timeout: float = field(default=60.0, metadata={"help": "ft_launcher: first heartbeat timeout"})
    calibrate_timeouts: bool = field(default=True, metadata={"help": "raise/lower heartbeat timeouts from measured steps"})
    gpu_reclaim_timeout: float = field(
        default=10.0, metadata={"help": "ft_launcher 0.6+: wait at most this long for a dead worker's GPU memory"})
    gpu_reclaim_tolerance_mb: int = field(
        default=1024, metadata={"help": "ft_launcher 0.6+: GPU memory still in use that counts as reclaimed"})
    memory_limit_mb: int = field(default=0, metadata={"help": "oom fault: RLIMIT_AS cap in MiB (0 = auto)"})
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.checkpoint_every <= 0:
            raise ValueError(f"checkpoint_every must be a positive number of steps, got {self.checkpoint_every}")
        if self.local_checkpoint_every < 0:
            raise ValueError(f"local_checkpoint_every must be >= 0, got {self.local_checkpoint_every}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {self.keep_last}")
        if not self.pg_timeout < self.soft_timeout < self.hard_timeout:
            raise ValueError(
                f"need pg_timeout ({self.pg_timeout}) < soft_timeout ({self.soft_timeout}) "
                f"< hard_timeout ({self.hard_timeout})"
            )
        if self.inprocess and self.ft_launcher and self.heartbeat_timeout <= self.soft_timeout:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed soft_timeout ({self.soft_timeout}) "
                "so the in-process layer acts before ft_launcher restarts the workers"
            )
        if self.max_inprocess_restarts < 0 or self.max_restarts < 0:
            raise ValueError("restart limits must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _model_dest(name: str) -> str:
    return f"model_{name}"


def add_arguments(parser: argparse.ArgumentParser, *, required_run_dir: bool = True) -> None:
    """Add one flag per config field (``--no-X`` for booleans that default on)."""
    for f in fields(TrainConfig):
        if f.name == "model":
            continue
        default = TrainConfig.__dataclass_fields__[f.name].default
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif f.name == "run_dir":
            parser.add_argument("--run-dir", required=required_run_dir, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=default,
                                help=f"{help_text} (default: {default!r})")
    for f in fields(ModelConfig):
        parser.add_argument(_flag(_model_dest(f.name)), dest=_model_dest(f.name), type=int,
                            default=f.default, help=f"{f.metadata.get('help', '')} (default: {f.default})")


def from_namespace(args: argparse.Namespace) -> TrainConfig:
    model = ModelConfig(**{f.name: getattr(args, _model_dest(f.name)) for f in fields(ModelConfig)})
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name != "model"}
    return TrainConfig(model=model, **values)


def to_argv(config: TrainConfig) -> list[str]:
    """Flags that :func:`from_argv` turns back into an equal config."""
    argv: list[str] = []
    for f in fields(TrainConfig):
        if f.name == "model":
            continue
        value = getattr(config, f.name)
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [_flag(f.name), str(value)]
    for f in fields(ModelConfig):
        argv += [_flag(_model_dest(f.name)), str(getattr(config.model, f.name))]
    return argv


def from_argv(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="resilient_training.worker")
    add_arguments(parser)
    return from_namespace(parser.parse_args(argv))


def from_dict(data: dict[str, Any]) -> TrainConfig:
    data = dict(data)
    model = ModelConfig(**data.pop("model", {}))
    return TrainConfig(model=model, **data)


def dumps(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), indent=1, sort_keys=True)
