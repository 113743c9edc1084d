"""The task interface: the user's model, optimizer, data and loss, which the trainer runs resiliently.

A task is named ``MODULE:ATTR`` (an importable module) or ``path/to/file.py:ATTR`` (a file,
imported under a private module name). ATTR is the task object itself or a callable returning
one; a callable receives the ``--task-arg KEY=VALUE`` settings as keyword arguments, so
``def task(lr: float = 3e-3, **_): ...`` is a complete factory. A parameter annotated ``int``,
``float`` or ``bool`` receives its value converted by the command line's rules (:func:`parse_arg`:
ASCII digits, no ``_``, no blanks, finite; ``true``/``false``), any other a string. An object named
directly takes no settings (any given are an error).

The trainer owns everything around the task: process group, FSDP2 sharding (``fully_shard`` on
the model, unless the task defines ``shard``), device placement of batches, bf16 autocast on
GPUs, the loss all-reduce and NaN guard, checkpoints (DCP), fault injection, restarts. The
task's methods are duck-typed; :class:`Task` is the shape, for editors and type checkers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import posix
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

REQUIRED = ("build_model", "build_optimizer", "build_data", "loss")


@runtime_checkable
class StatefulIterator(Protocol):
    """What ``build_data`` returns: batches, and a position that survives a restart.

    ``torchdata.stateful_dataloader.StatefulDataLoader`` is one. The trainer calls ``iter()`` on
    it after ``load_state_dict`` and again at the end of each epoch.
    """

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Task(Protocol):
    """A user's training. Optional members, read with ``getattr``:

    - ``shard(self, model, mesh) -> None``: wrap ``model`` with FSDP2 yourself (default:
      ``fully_shard`` on every direct child of each ``nn.ModuleList``, then on the model);
    - ``build_lr_scheduler(self, optimizer)``: a ``torch.optim.lr_scheduler`` stepped once per step
      (its state is checkpointed);
    - ``grad_clip: float``: clip the global gradient norm to this (0 or absent: off);
    - ``grad_accumulation: int``: micro-batches per optimizer step (default 1).
    """

    def build_model(self) -> Any:
        """A plain, unsharded ``torch.nn.Module``; the same initial weights on every rank."""

    def build_optimizer(self, model: Any) -> Any:
        """Any ``torch.optim.Optimizer`` over ``model.parameters()`` (called on the sharded model)."""

    def build_data(self, rank: int, world_size: int, seed: int) -> StatefulIterator:
        """The batches of ``rank`` (tensors or nests of them; the trainer moves them to the device)."""

    def loss(self, model: Any, batch: Any) -> Any:
        """The scalar loss of ``batch``."""


class TaskError(ValueError):
    """The task cannot be loaded or breaks the interface: the message names what and which method."""


@contextlib.contextmanager
def cannot_exit(what: str) -> Iterator[None]:
    """Task code run by a gate may not end the process: a task whose import or method called
    ``sys.exit(0)`` or ``os._exit(0)`` made ``validate-checkpoint`` exit 0, a "yes" with no
    verdict. Inside, either raises :class:`TaskError` naming ``what`` instead. (A task ending the
    process below Python, through the C library's ``exit`` or an ``exec``, is caught by the command
    line's process guard, ``cli.gates._with_a_verdict``: no verdict, exit 2.)
    """
    real = os._exit, posix._exit

    def refuse(status: int = 0) -> None:
        raise TaskError(f"{what} tried to end the process (os._exit({status}))")

    os._exit = posix._exit = refuse  # type: ignore[assignment]
    try:
        yield
    except SystemExit as exc:
        raise TaskError(f"{what} tried to end the process (sys.exit({exc.code!r}))") from None
    finally:
        os._exit, posix._exit = real  # type: ignore[assignment]


def _import_target(spec: str) -> Any:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task {spec!r} must be MODULE:ATTR or path/to/file.py:ATTR")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task file {module_name} does not exist")
        # A private module name per file: two task files named task.py never collide.
        name = f"_rt_task_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise TaskError(f"task file {module_name} cannot be imported")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module  # dataclasses and pickling look the module up by name
            # Its folder is importable, as `python path/to/file.py` makes it: a task is rarely one
            # file (a stranger trial's task could not import the module beside it).
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            try:
                loader_spec.loader.exec_module(module)
            except BaseException as exc:
                sys.modules.pop(name, None)
                raise TaskError(f"task file {module_name} failed to import: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(module_name)
        except BaseException as exc:
            raise TaskError(f"task module {module_name} failed to import: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise TaskError(f"task module {module_name} has no attribute {attr!r}") from None


def load_task(spec: str, task_args: dict[str, str] | None = None) -> Any:
    """The task object ``spec`` names, made with ``task_args``; TaskError if it breaks the interface."""
    task_args = dict(task_args or {})
    target = _import_target(spec)
    if _is_task(target):
        if task_args:
            raise TaskError(f"task {spec} is an object, so it takes no --task-arg (got {', '.join(task_args)}); "
                            "name a callable that returns the task to pass settings")
        task = target
    elif callable(target):
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            signature = None
        if signature is not None:
            try:
                signature.bind(**task_args)
            except TypeError as exc:
                raise TaskError(f"task {spec} does not accept these --task-arg settings: {exc}"
                                f"{_accepted(signature)}") from None
            task_args = _typed(spec, target, signature, task_args)
        try:
            task = target(**task_args)
        except TaskError:
            raise
        except Exception as exc:
            raise TaskError(f"task {spec} raised while being created: {type(exc).__name__}: {exc}") from exc
    else:
        raise TaskError(f"task {spec} is a {type(target).__name__}, not a task or a callable returning one")
    missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise TaskError(f"task {spec} lacks {', '.join(missing)} (a task needs {', '.join(REQUIRED)})")
    return task


_KINDS: dict[Any, str] = {int: "an integer", float: "a finite number", bool: "true or false"}


def parse_arg(value: str, kind: type) -> Any:
    """A ``--task-arg`` value as ``kind`` (int, float or bool) by the command line's rules: what
    ``int()``/``float()`` forgive (blanks, a trailing newline, '٤', '1_0', 'nan') is a ValueError.
    For factories that take ``**task_args`` and convert them themselves.
    """
    from resilient_training.run.config import strict_finite_float, strict_int

    if kind is bool:
        if value not in ("true", "false"):
            raise ValueError(value)
        return value == "true"
    return strict_int(value) if kind is int else strict_finite_float(value)


def _typed(spec: str, target: Any, signature: inspect.Signature, task_args: dict[str, Any]) -> dict[str, Any]:
    """``task_args`` with each value whose parameter is annotated int, float or bool converted
    (:func:`parse_arg`); a value that does not convert is a TaskError naming the setting.
    """
    import typing

    try:  # a class's settings are its __init__'s
        hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    except Exception:  # an annotation that does not resolve: read the signature's below
        hints = {}
    typed = {}
    for name, value in task_args.items():
        kind = hints.get(name)
        parameter = signature.parameters.get(name)
        if kind is None and parameter is not None:
            annotation = parameter.annotation
            kind = {"int": int, "float": float, "bool": bool}.get(annotation) if isinstance(annotation, str) else annotation
        kind = next((k for k in _KINDS if kind is k), None)  # Optional[int] and the like: a string
        if kind is not None and isinstance(value, str):
            try:
                value = parse_arg(value, kind)
            except ValueError:
                raise TaskError(f"task {spec}: task argument {name}={value!r} is not {_KINDS[kind]}") from None
        typed[name] = value
    return typed


def _accepted(signature: inspect.Signature) -> str:
    """What the task does take, for the error (a stranger trial had to read the source to find out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in signature.parameters.values() if p.kind in kinds]
    return f" (it takes: {', '.join(names)})" if names else " (it takes no settings)"


def _is_task(obj: Any) -> bool:
    return not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in REQUIRED)


def call(task: Any, method: str, *args: Any) -> Any:
    """``task.method(*args)``; an exception becomes a TaskError naming the method."""
    try:
        return getattr(task, method)(*args)
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task {method}() raised {type(exc).__name__}: {exc}") from exc


def build_model(task: Any) -> Any:
    from torch import nn

    model = call(task, "build_model")
    if not isinstance(model, nn.Module):
        raise TaskError(f"task build_model() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_optimizer(task: Any, model: Any) -> Any:
    import torch

    optimizer = call(task, "build_optimizer", model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TaskError(f"task build_optimizer() returned a {type(optimizer).__name__}, not a torch.optim.Optimizer")
    # Its state is checkpointed under the model's parameter names: one over other tensors failed
    # every step with "KeyError: 0", retried 8 times (stranger trial).
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise TaskError(f"task build_optimizer() returned an optimizer over {foreign} tensor(s) that are not the "
                        "model's parameters: build it from the model it is given (model.parameters())")
    return optimizer


def build_data(task: Any, rank: int, world_size: int, seed: int) -> Any:
    data = call(task, "build_data", rank, world_size, seed)
    lacking = [m for m in ("__iter__", "state_dict", "load_state_dict") if not callable(getattr(data, m, None))]
    if lacking:
        raise TaskError(f"task build_data() returned a {type(data).__name__} without {', '.join(lacking)} "
                        "(it must be iterable and have state_dict()/load_state_dict(), like StatefulDataLoader)")
    return data


def check_loss(value: Any) -> Any:
    import torch

    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        what = (f"a tensor of shape {list(value.shape)} and dtype {str(value.dtype).removeprefix('torch.')}"
                if isinstance(value, torch.Tensor) else type(value).__name__)
        raise TaskError(f"task loss() returned {what}, not a scalar floating-point tensor")
    return value.reshape(())


def lr_scheduler(task: Any, optimizer: Any) -> Any:
    """The task's scheduler, or None; it must have step()/state_dict()/load_state_dict()."""
    if not callable(getattr(task, "build_lr_scheduler", None)):
        return None
    scheduler = call(task, "build_lr_scheduler", optimizer)
    if scheduler is None:
        _no_hidden_scheduler(optimizer)
        return None
    lacking = [m for m in ("step", "state_dict", "load_state_dict") if not callable(getattr(scheduler, m, None))]
    if lacking:
        raise TaskError(f"task build_lr_scheduler() returned a {type(scheduler).__name__} without {', '.join(lacking)}")
    return scheduler


def _no_hidden_scheduler(optimizer: Any) -> None:
    """The LR schedulers of torch mark the optimizer they drive (``initial_lr`` in each param group):
    one the task made and steps itself, not returned from ``build_lr_scheduler``, is not
    checkpointed, and each restore would start its schedule over (a stranger trial's StepLR
    changed every loss after a restore, and the gates passed the run).
    """
    if any("initial_lr" in group for group in optimizer.param_groups):
        raise TaskError("task build_optimizer() attached an LR scheduler to the optimizer (its param groups have "
                        "initial_lr), but build_lr_scheduler() returns none: the trainer would not checkpoint its "
                        "position; return it from build_lr_scheduler(optimizer), which the trainer steps once a step")


def option(task: Any, name: str, kind: type, default: Any) -> Any:
    """An ordinary option the task may set (``grad_clip``, ``grad_accumulation``), checked."""
    value = getattr(task, name, default)
    if value is None:
        return default
    number = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if kind is int and not (number and int(value) == value and value >= 1):
        raise TaskError(f"task {name} must be a positive integer, got {value!r}")
    if not number or value < 0:  # a NaN clip turned every loss NaN, retried 8 times (stranger trial)
        raise TaskError(f"task {name} must be a finite number >= 0, got {value!r}")
    return kind(value)


def preflight(config: Any, *, world_size: int) -> None:
    """Load the task and check every ``build_*`` before any worker starts (TaskError on failure).

    The model is built on the meta device (no memory, no weights: a 1B model checks in well
    under a second); the optimizer is built over it; rank 0's data yields its first batch.
    ``loss`` needs real weights, so the workers check it at their first step.
    """
    # What the task's code warns about while it is checked is held back until it passes: a stranger
    # trial's one-line refusal came after a screen of a library's import warnings.
    with warnings.catch_warnings(record=True) as caught:
        _preflight(config, world_size=world_size)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _preflight(config: Any, *, world_size: int) -> None:
    import torch

    task = task_from_config(config)
    seed = config.seed
    with torch.device("meta"):
        model = build_model(task)
    # FSDP2 fails on an empty parameter at the first step ("_chunk_cat expects non-empty tensor"),
    # again after every in-process restart: a stranger trial's zero-width layer retried 8 times.
    empty = [f"{name} {list(p.shape)}" for name, p in model.named_parameters() if p.numel() == 0]
    if empty:
        raise TaskError(f"task build_model() has parameters with no elements ({', '.join(empty[:3])}"
                        f"{', ...' if len(empty) > 3 else ''}): FSDP cannot shard an empty parameter")
    if problem := export_refusal(config.task, model, config.export_format):
        raise TaskError(f"export_format {config.export_format}: {problem}: export it with safetensors or torch")
    optimizer = build_optimizer(task, model)
    # The task's settings and scheduler, checked here as the workers would (a stranger trial's
    # grad_accumulation 0 started the workers and wrote the run directory first).
    option(task, "grad_clip", float, 0.0)
    option(task, "grad_accumulation", int, 1)
    lr_scheduler(task, optimizer)
    data = build_data(task, 0, world_size, seed)
    try:
        next(iter(data))
    except StopIteration:
        raise TaskError("task build_data() yields no batch for rank 0") from None
    except Exception as exc:
        raise TaskError(f"task build_data()'s iterator raised {type(exc).__name__}: {exc}") from exc


def export_refusal(spec: str, model: Any, export_format: str) -> str | None:
    """Why ``promote`` could not export the model this task builds in ``export_format``, or None:
    ``hf`` writes a transformers model (a third stranger trial's `run --export hf` trained and
    promoted first, then failed). Also where transformers is not installed: no model there is one.
    """
    if export_format != "hf":
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return f"the run's task ({spec}) builds a {type(model).__name__}, not a transformers model (no transformers here)"
    if isinstance(model, PreTrainedModel):
        return None
    return f"the run's task ({spec}) builds a {type(model).__name__}, not a transformers model"


def check_export(config: Any, task: Any) -> None:
    """A worker's refusal (TaskError) of a run whose promotion will export its model in a format
    that cannot hold it, before any training: on a cluster the task lives in the trainer image,
    and no check before the job could build it. The model is built on the meta device.
    """
    if not config.export_format:
        return
    import torch

    with torch.device("meta"):
        model = build_model(task)
    if problem := export_refusal(config.task, model, config.export_format):
        raise TaskError(f"export_format {config.export_format}: {problem}: export it with safetensors or torch")


def effective_args(config: Any) -> dict[str, str]:
    """The settings the run's task is made with: for the built-in GPT task, the run's ``--model-*``,
    ``--batch-size`` and ``--lr`` flags under any ``--task-arg``; for any other task, ``--task-arg`` alone.
    """
    from resilient_training.run.config import DEFAULT_TASK

    if config.task != DEFAULT_TASK:
        return dict(config.task_args)
    base = {name: str(getattr(config.model, name)) for name in config.model.__slots__}
    base.update(batch_size=str(config.data.batch_size), lr=repr(config.lr))
    return {**base, **config.task_args}


def comparable_args(spec: str, task_args: dict[str, Any]) -> dict[str, Any]:
    """``task_args`` as the task's factory receives them, for comparing two runs' settings: a
    parameter annotated int, float or bool gets the converted value (``lr=0.10`` and ``lr=0.1``
    are one learning rate; a resume with the other spelling was refused). Anything else, or a
    task that cannot be imported here, stays as given (a string parameter's spelling may matter).
    """
    try:
        target = _import_target(spec)
        signature = inspect.signature(target)
    except Exception:  # noqa: BLE001 - named where the task is loaded; here the strings are compared
        return dict(task_args)
    if _is_task(target):
        return dict(task_args)
    out: dict[str, Any] = {}
    for name, value in task_args.items():
        try:
            out.update(_typed(spec, target, signature, {name: value}))
        except TaskError:  # not a value of its kind: compared as given
            out[name] = value
    return out


def task_from_config(config: Any) -> Any:
    return load_task(config.task, effective_args(config))
