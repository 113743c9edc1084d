"""Typed configuration of a training run, grouped by concern, and its round trips.

One source of defaults: the dataclass fields below. The same flags reach a worker whoever starts
it: the local launcher, the PyTorchJob builder (as container args after ``ft_launcher``) and the
simulated multi-node launcher all call :func:`to_argv`, and the worker parses them back with
:func:`from_argv`. Flags stay flat (``--checkpoint-every``) while the config is nested
(``config.checkpoint.every``): each grouped field names its flag in ``metadata["flag"]``.

:func:`from_dict` is the one entry for settings that come as data (``config.json``, the KFP
``train_overrides`` parameter): nested or flat keys, and the coercion KFP needs (dict
parameters travel as protobuf Structs, so ``1024`` arrives as ``1024.0``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from resilient_training.run.paths import has_control

# Past these a worker fails late: timers and timedelta overflow (1e308 s), torch seeds overflow
# (a seed times the data's stride), RLIMIT_AS overflows; found by a stranger trial of render-job.
MAX_SECONDS = 30 * 24 * 3600.0
MAX_SEED = 2**32 - 1
MAX_MEMORY_LIMIT_MB = 2**40
INT64_MAX = 2**63 - 1


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ValueError(f"{name} must be a positive number of seconds up to {MAX_SECONDS:.0f} (30 days), got {value}")


def _f(default: Any, help_text: str, flag: str = "") -> Any:
    return field(default=default, metadata={"help": help_text, "flag": flag})


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Size of the GPT-style model; tiny defaults run on a laptop CPU."""

    vocab_size: int = _f(256, "vocabulary size of the synthetic tokens")
    d_model: int = _f(64, "hidden size")
    n_layers: int = _f(2, "transformer blocks")
    n_heads: int = _f(4, "attention heads (must divide d_model)")
    seq_len: int = _f(32, "tokens per sample")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and where checkpoints are written."""

    every: int = _f(5, "save a checkpoint every N steps", "checkpoint_every")
    keep_last: int = _f(3, "committed checkpoints kept on storage", "keep_last")
    local_every: int = _f(0, "also save to the node-local tier every N steps (0 = off)", "local_checkpoint_every")
    local_dir: str = _f("", "node-local tier directory (default /dev/shm/resilient-training); "
                            "each run keeps its own folder inside", "local_checkpoint_dir")
    async_save: bool = _f(True, "write checkpoints in NVRx's background process", "async_checkpoint")
    write_threads: int = _f(0, "each rank writes its part of a checkpoint as this many DCP files, in parallel "
                               "(0 = one per GB of the rank's part, 4 to 16, on GPUs; 1 on CPU)", "checkpoint_write_threads")
    memory_every: int = _f(0, "also copy the training state within the device's memory every N steps, which an "
                              "in-process restart resumes from (0 = off; it holds one more copy of the weights "
                              "and optimizer state)", "memory_snapshot_every")
    host_snapshot: bool = _f(False, "also keep each memory snapshot in host shared memory, in the node-local tier's "
                                    "directory (two more copies of each rank's state), where a process that the "
                                    "launcher restarts resumes from it", "host_snapshot")
    spare_writer: bool = _f(False, "keep a second async checkpoint writer process started and idle, which takes a "
                                   "dead writer's place at once instead of a new process importing torch (costs one "
                                   "idle torch process per rank)", "spare_writer")

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError(f"checkpoint_every must be a positive number of steps, got {self.every}")
        if self.local_every < 0:
            raise ValueError(f"local_checkpoint_every must be >= 0, got {self.local_every}")
        if not 0 <= self.write_threads <= 64:
            raise ValueError(f"checkpoint_write_threads must be between 0 and 64, got {self.write_threads}")
        if self.memory_every < 0:
            raise ValueError(f"memory_snapshot_every must be >= 0, got {self.memory_every}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {self.keep_last}")
        if self.spare_writer and not self.async_save:
            raise ValueError("spare_writer needs async checkpointing: synchronous saves use no writer process")
        if self.host_snapshot and not (self.memory_every and self.local_every):
            raise ValueError("host_snapshot needs memory_snapshot_every and local_checkpoint_every: it keeps "
                             "the memory snapshot in the node-local tier's directory")


@dataclass(kw_only=True, slots=True)
class RestartConfig:
    """Which recovery layers run, and their budgets."""

    inprocess: bool = _f(True, "NVRx in-process restart (inprocess.Wrapper)", "inprocess")
    ft_launcher: bool = _f(True, "NVRx ft_launcher heartbeats and restarts", "ft_launcher")
    nan_guard: bool = _f(True, "treat a non-finite loss as a failure and roll back", "nan_guard")
    max_inprocess_restarts: int = _f(8, "in-process restarts before giving up", "max_inprocess_restarts")
    max_restarts: int = _f(6, "ft_launcher restarts before giving up", "max_restarts")
    min_world_size: int = _f(0, "in-process: fewest ranks to continue (0 = all)", "min_world_size")
    warm_spare: bool = _f(
        False, "launcher restarts take a pre-imported spare worker process instead of starting Python cold "
        "(costs one idle torch process per node)", "warm_spare")
    spare_cuda_context: bool = _f(
        True, "with warm_spare on a GPU node, each spare makes its local rank's CUDA context and the restore's "
        "read buffers ahead (about 0.5 GB of that GPU's memory and 1 GiB of page-locked host memory while idle; "
        "only with worker_gpu_reclaim, since ft_launcher's own wait for GPU memory would count it)",
        "spare_cuda_context")
    gpu_reclaim_timeout: float = _f(
        10.0, "ft_launcher 0.6+: wait at most this long for a dead worker's GPU memory", "gpu_reclaim_timeout")
    gpu_reclaim_tolerance_mb: int = _f(
        1024, "ft_launcher 0.6+: GPU memory still in use that counts as reclaimed", "gpu_reclaim_tolerance_mb")
    worker_gpu_reclaim: bool = _f(
        True, "a restarted worker waits for its GPU's previous worker itself, just before it allocates its model "
        "(its start-up and NCCL set-up overlap that exit), instead of ft_launcher waiting for every GPU's memory "
        "before the rendezvous; the wait is bounded by gpu_reclaim_timeout", "worker_gpu_reclaim")

    def __post_init__(self) -> None:
        if self.max_inprocess_restarts < 0 or self.max_restarts < 0:
            raise ValueError("restart limits must be >= 0")
        if self.min_world_size < 0:
            raise ValueError(f"min_world_size must be >= 0 (0 = all ranks), got {self.min_world_size}")
        if not (math.isfinite(self.gpu_reclaim_timeout) and 0 <= self.gpu_reclaim_timeout <= MAX_SECONDS):
            raise ValueError(f"gpu_reclaim_timeout must be between 0 (no wait) and {MAX_SECONDS:.0f} seconds, "
                             f"got {self.gpu_reclaim_timeout}")
        if self.gpu_reclaim_tolerance_mb < 0:
            raise ValueError(f"gpu_reclaim_tolerance_mb must be >= 0, got {self.gpu_reclaim_tolerance_mb}")


@dataclass(kw_only=True, slots=True)
class TimeoutConfig:
    """Seconds. On CPU/gloo a blocked collective can only be unblocked by its own timeout, so
    ``pg`` bounds in-process recovery there.
    """

    pg: float = _f(3.0, "process-group collective timeout", "pg_timeout")
    soft: float = _f(6.0, "in-process: no progress this long => restart", "soft_timeout")
    hard: float = _f(12.0, "in-process: hard kill after no progress", "hard_timeout")
    heartbeat: float = _f(10.0, "ft_launcher: rank heartbeat timeout", "heartbeat_timeout")
    initial_heartbeat: float = _f(60.0, "ft_launcher: first heartbeat timeout", "initial_heartbeat_timeout")
    calibrate: bool = _f(True, "raise/lower heartbeat timeouts from measured steps", "calibrate_timeouts")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                _check_seconds(f.metadata["flag"], value)
        if not self.pg < self.soft < self.hard:
            raise ValueError(f"need pg_timeout ({self.pg}) < soft_timeout ({self.soft}) < hard_timeout ({self.hard})")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """What each rank reads per step."""

    batch_size: int = _f(8, "samples per rank per step", "batch_size")

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")


# The built-in task (a synthetic GPT); ``--task MODULE:ATTR`` or ``--task FILE.py:ATTR`` names another.
DEFAULT_TASK = "resilient_training.tasks.gpt:task"
# What `promote` can export a model as (gates/export.py writes them; a run names its own up front).
EXPORT_FORMATS = ("dcp", "torch", "safetensors", "hf")


def absolute_task(spec: str) -> str:
    """A task file named relative to this directory, made absolute (workers and pipeline steps may
    run elsewhere); a module name is returned unchanged.
    """
    import os

    module, sep, attr = spec.rpartition(":")
    if sep and (module.endswith(".py") or "/" in module):
        return f"{os.path.abspath(os.path.expanduser(module))}:{attr}"
    return spec


def absolute_faults(spec: str) -> str:
    """A fault schedule given as a YAML file named relative to this directory, made absolute: the
    workers, the pipeline's steps and the report (which names scheduled faults that never fired,
    from config.json) read it from elsewhere. A compact schedule is returned unchanged.
    """
    import os

    text = spec.strip()
    if text and (text.endswith((".yaml", ".yml")) or os.path.isfile(text)):
        return os.path.abspath(os.path.expanduser(text))
    return spec


def parse_task_arg(item: str) -> tuple[str, str]:
    """``KEY=VALUE`` (one ``--task-arg``) as a pair; the value may contain ``=``."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or key != key.strip():
        raise ValueError(f"task argument {item!r} is not KEY=VALUE")
    return key, value


def _task_arg_value(key: str, value: Any) -> str:
    """Task arguments are strings (the task parses them); data values are coerced like KFP sends them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int | float | str):
        return str(value)
    raise ValueError(f"task argument {key} must be a string or number, got {value!r}")


def task_args_from(data: Any) -> dict[str, str]:
    """``task_args`` from data: a mapping, or a list of ``KEY=VALUE`` strings (the flags' form)."""
    if isinstance(data, dict):
        pairs = list(data.items())
    elif isinstance(data, list | tuple):
        pairs = []
        for item in data:
            if not isinstance(item, str):
                raise ValueError(f"task argument {item!r} is not a KEY=VALUE string")
            pairs.append(parse_task_arg(item))
    else:
        raise ValueError(f"setting task_args must be a mapping or a list of KEY=VALUE, got {data!r}")
    out: dict[str, str] = {}
    for key, value in pairs:
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"task argument name {key!r} must be a non-empty string")
        if key != key.strip() or "=" in key:  # it travels as --task-arg KEY=VALUE: ' lr' or 'a=b' would not come back
            raise ValueError(f"task argument name {key!r} has blanks around it or an '='")
        text = _task_arg_value(key, value)
        if has_control(key + text):  # as every string setting (_coerce)
            raise ValueError(f"task argument {key!r}={text!r} contains a control character (a newline?): remove it")
        if key in out:  # a repeated flag: the last one silently winning hides a typo or a stale script line
            raise ValueError(f"task argument {key} is given twice ({key}={out[key]!r}, {key}={text!r}): give it once")
        out[key] = text
    return out


GROUPS: dict[str, type] = {"checkpoint": CheckpointConfig, "restart": RestartConfig, "timeouts": TimeoutConfig,
                           "data": DataConfig}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything a worker needs; one instance describes one run."""

    run_dir: str = field(metadata={"help": "run directory (checkpoints/, events/ live here)"})
    steps: int = _f(40, "target step: the run succeeds once it is reached")
    faults: str = _f("", "fault schedule TYPE@STEP:RANK,... or a YAML file")
    seed: int = _f(1234, "seed of model init and data")
    lr: float = _f(3e-3, "AdamW learning rate")
    step_seconds: float = _f(0.0, "minimum seconds per step (pads tiny CPU steps)")
    memory_limit_mb: int = _f(0, "oom fault: RLIMIT_AS cap in MiB (0 = auto)")
    task: str = _f(DEFAULT_TASK, "the training task: MODULE:ATTR or path/to/file.py:ATTR")
    task_args: dict[str, str] = field(default_factory=dict, metadata={
        "help": "a setting passed to the task, KEY=VALUE (repeatable)", "flag": "task_arg"})
    export_format: str = _f("", "the format the promoted model will be exported in (the pipeline's export): "
                                "hf is refused before any training unless the task builds a transformers model")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if not self.run_dir.strip():
            raise ValueError("run_dir must not be empty")
        if any(ord(ch) < 32 or ch == "\x7f" for ch in self.run_dir):
            raise ValueError(f"run_dir {self.run_dir!r} contains a control character (a newline?)")
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr}")
        if ":" not in self.task or not all(part.strip() for part in self.task.rsplit(":", 1)):
            raise ValueError(f"task {self.task!r} must be MODULE:ATTR or path/to/file.py:ATTR")
        if self.task != self.task.strip() or any(ch.isspace() for ch in self.task.rsplit(":", 1)[1]):
            raise ValueError(f"task {self.task!r} has blanks around it or in its ATTR (no module or attribute is named so)")
        module, _, attr = self.task.rpartition(":")
        if module.endswith(".py") or "/" in module or "\\" in module:
            if not module.endswith(".py"):  # Python imports a file by its suffix: any other never loads
                raise ValueError(f"task {self.task!r}: the file {module!r} does not end in .py (path/to/file.py:ATTR)")
        elif not all(part.isidentifier() for part in module.split(".")):
            raise ValueError(f"task {self.task!r}: {module!r} is no module name (dotted Python names, e.g. "
                             "my_pkg.tasks) and no path/to/file.py, so it could never be imported")
        if not attr.isidentifier():
            raise ValueError(f"task {self.task!r}: {attr!r} is no Python name (the task or the function that "
                             "makes it, e.g. my_pkg.tasks:make_task)")
        self.task_args = task_args_from(self.task_args)
        if self.export_format not in ("", *EXPORT_FORMATS):
            raise ValueError(f"export_format {self.export_format!r}: choose one of {', '.join(EXPORT_FORMATS)} "
                             "(or empty for none)")
        if not (math.isfinite(self.step_seconds) and 0 <= self.step_seconds <= 3600):
            raise ValueError(f"step_seconds must be between 0 and 3600, got {self.step_seconds}")
        if not 0 <= self.memory_limit_mb <= MAX_MEMORY_LIMIT_MB:
            raise ValueError(f"memory_limit_mb must be >= 0 (0 = auto) and at most {MAX_MEMORY_LIMIT_MB}, "
                             f"got {self.memory_limit_mb}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be between 0 and {MAX_SEED}, got {self.seed}")
        for group in (self, self.checkpoint, self.restart, self.data, self.model):
            for f in fields(group):
                value = getattr(group, f.name)
                if type(value) is int and abs(value) > INT64_MAX:  # event log, DCP metadata and C++ take int64
                    raise ValueError(f"{f.metadata.get('flag') or f.name} {value} does not fit 64 bits")
        if self.restart.inprocess and self.restart.ft_launcher and self.timeouts.heartbeat <= self.timeouts.soft:
            raise ValueError(
                f"heartbeat_timeout ({self.timeouts.heartbeat}) must exceed soft_timeout ({self.timeouts.soft}) "
                "so the in-process layer acts before ft_launcher restarts the workers"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TOP_LEVEL = tuple(f.name for f in fields(TrainConfig) if f.name not in (*GROUPS, "model", "task_args"))
# Flat setting name (the flag without dashes) -> (group, field): the names users write.
FLAT: dict[str, tuple[str, str]] = {
    f.metadata["flag"]: (group, f.name) for group, cls in GROUPS.items() for f in fields(cls)
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(f: dataclasses.Field[Any]) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


def _leaves() -> list[tuple[str, str, dataclasses.Field[Any], Any]]:
    """(dest, group or "", field, default) for every flag a worker takes, in a stable order."""
    out: list[tuple[str, str, dataclasses.Field[Any], Any]] = []
    for f in fields(TrainConfig):
        if f.name in TOP_LEVEL:
            out.append((f.name, "", f, TrainConfig.__dataclass_fields__[f.name].default))
    for group, cls in GROUPS.items():
        for f in fields(cls):
            out.append((f.metadata["flag"], group, f, f.default))
    for f in fields(ModelConfig):
        out.append((f"model_{f.name}", "model", f, f.default))
    return out


TASK_ARGS_FIELD = TrainConfig.__dataclass_fields__["task_args"]


def strict_int(text: str) -> int:
    """``int`` for a command-line value, refusing what ``int()`` forgives: surrounding spaces or a
    trailing newline (a value pasted from a file), digits of other scripts ('٤٠') and '1_0' must not
    pass as a number (every command's int flags use it: cli/main.py).
    """
    if text != text.strip() or not text or not text.isascii() or "_" in text:
        raise ValueError(text)
    return int(text)


def strict_float(text: str) -> float:
    """``float`` for a command-line value, with :func:`strict_int`'s refusals."""
    if text != text.strip() or not text or not text.isascii() or "_" in text:
        raise ValueError(text)
    return float(text)


def strict_finite_float(text: str) -> float:
    """:func:`strict_float`, refusing NaN and the infinities too (1e400 overflows to one)."""
    value = strict_float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


# argparse names the type in its message ("invalid int value: '3\n'").
strict_int.__name__, strict_float.__name__ = "int", "float"


def add_arguments(parser: argparse.ArgumentParser, *, required_run_dir: bool = True) -> None:
    """Add one flag per config field (``--no-X`` for booleans that default on)."""
    for dest, _group, f, default in _leaves():
        help_text = f.metadata.get("help", "")
        kind = _kind(f)
        if kind == "bool":
            parser.add_argument(_flag(dest), dest=dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif dest == "run_dir":
            parser.add_argument("--run-dir", required=required_run_dir, help=help_text)
        else:
            parser.add_argument(_flag(dest), dest=dest, type={"int": strict_int, "float": strict_float, "str": str}[kind],
                                default=default, help=f"{help_text} (default: {default!r})")
    parser.add_argument("--task-arg", dest="task_arg", action="append", default=[], metavar="KEY=VALUE",
                        help=TASK_ARGS_FIELD.metadata["help"])


def from_namespace(args: argparse.Namespace) -> TrainConfig:
    nested: dict[str, Any] = {}
    for dest, group, f, _default in _leaves():
        if group:
            nested.setdefault(group, {})[f.name] = getattr(args, dest)
        else:
            nested[dest] = getattr(args, dest)
    nested["task_args"] = list(getattr(args, "task_arg", None) or [])
    return from_dict(nested)


def to_argv(config: TrainConfig) -> list[str]:
    """Flags that :func:`from_argv` turns back into an equal config."""
    argv: list[str] = []
    for dest, group, f, _default in _leaves():
        value = getattr(getattr(config, group) if group else config, f.name)
        if isinstance(value, bool):
            argv.append(_flag(dest) if value else "--no-" + dest.replace("_", "-"))
        else:
            argv += [_flag(dest), str(value)]
    for key, value in config.task_args.items():
        argv += ["--task-arg", f"{key}={value}"]
    return argv


def from_argv(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="resilient_training.runtime.worker")
    add_arguments(parser)
    return from_namespace(parser.parse_args(argv))


def _coerce(f: dataclasses.Field[Any], value: Any, name: str, where: str = "") -> Any:
    """A value to the field's type, refusing what does not fit (a wrong type is a clear error, not a crash later)."""
    kind = _kind(f)
    name = f"{where} setting {name}" if where else f"setting {name}"
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer past a double's range (JSON has no limit)
            raise ValueError(f"{name} must be a finite number, got an integer of {len(str(value))} digits") from None
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    if has_control(value):  # paths and specs: a newline is a mistake, not data
        raise ValueError(f"{name} {value!r} contains a control character (a newline?)")
    return value


def _names(keys: list[Any]) -> str:
    """Keys as a message names them: a plain name as it is, anything else quoted (a key with a
    newline would otherwise start a line of its own in a one-line error).
    """
    return ", ".join(k if isinstance(k, str) and k.isascii() and k.isidentifier() else repr(k) for k in keys)


def _section(data: Any, cls: type, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"setting {where} must be a mapping, got {data!r}")
    known = cls.__dataclass_fields__
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown {where} settings: {_names(unknown)} (known: {', '.join(sorted(known))})")
    return {k: _coerce(known[k], v, f"{k}", where) for k, v in data.items()}


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """A config from data: nested groups (``to_dict``'s shape), flat setting names (``checkpoint_every``,
    the flags' names, as ``train_overrides`` uses), or both; values coerced and checked.
    """
    if not isinstance(data, dict):
        raise ValueError(f"trainer settings must be a mapping, got {data!r}")
    top_fields = TrainConfig.__dataclass_fields__
    nested: dict[str, dict[str, Any]] = {group: {} for group in (*GROUPS, "model")}
    top: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        if key in GROUPS or key == "model":
            nested[key].update(_section(value, GROUPS.get(key, ModelConfig), key))
        elif key in ("task_args", "task_arg"):
            top["task_args"] = task_args_from(value)
        elif key in FLAT:
            group, name = FLAT[key]
            nested[group][name] = _coerce(GROUPS[group].__dataclass_fields__[name], value, key)
        elif key in top_fields:
            top[key] = _coerce(top_fields[key], value, key)
        else:
            unknown.append(key)
    if unknown:
        known = sorted({*TOP_LEVEL, *FLAT, *GROUPS, "model", "run_dir", "task_args"})
        raise ValueError(f"unknown trainer settings: {_names(sorted(unknown))} (known: {', '.join(known)})")
    if "run_dir" not in top:
        raise ValueError("trainer settings need run_dir")
    groups = {g: cls(**nested[g]) for g, cls in GROUPS.items()}
    return TrainConfig(model=ModelConfig(**nested["model"]), **groups, **top)


def dumps(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), indent=1, sort_keys=True)

def builtin_task_flags(config: TrainConfig) -> list[str]:
    """The built-in task's own flags (``--model-*``, ``--batch-size``, ``--lr``) that ``config``
    sets away from their defaults while naming another task, which never reads them.
    """
    if config.task == DEFAULT_TASK:
        return []
    given = [f"--model-{f.name.replace('_', '-')}" for f in fields(ModelConfig)
             if getattr(config.model, f.name) != f.default]
    if config.data.batch_size != DataConfig.__dataclass_fields__["batch_size"].default:
        given.append("--batch-size")
    if config.lr != TrainConfig.__dataclass_fields__["lr"].default:
        given.append("--lr")
    return given
