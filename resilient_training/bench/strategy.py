"""Recovery strategies of the benchmark: the same run under each strategy, other NVRx layers.

A strategy is a small dict: ``{"name": "inprocess+async", "inprocess": true, ...}`` whose other
keys are trainer settings (field names of ``TrainConfig``). Each strategy trains in its own run
directory under the benchmark's storage, with the same model, data, seed and fault schedule.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from resilient_training.run.storage_ref import StorageRef

# The strategies of the reference study, in the order the comparison lists them.
DEFAULT_STRATEGIES: list[dict[str, Any]] = [
    {"name": "inprocess+async", "inprocess": True, "ft_launcher": True, "async_checkpoint": True},
    {"name": "ft_launcher+async", "inprocess": False, "ft_launcher": True, "async_checkpoint": True},
    {"name": "ft_launcher+sync", "inprocess": False, "ft_launcher": True, "async_checkpoint": False},
    {"name": "torchrun+sync", "inprocess": False, "ft_launcher": False, "async_checkpoint": False},
]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,62}")


def parse_strategy(strategy: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, trainer settings) of a strategy dict; the name becomes a directory name."""
    settings = dict(strategy)
    name = str(settings.pop("name", "")).strip()
    if not _NAME.fullmatch(name):
        raise ValueError(f"strategy name {name!r} must be 1-63 letters, digits or _.+- (it names a directory)")
    if "run_dir" in settings:
        raise ValueError(f"strategy {name}: run_dir is chosen by the benchmark")
    return name, settings


def strategy_run_id(run_id: str, name: str) -> str:
    """The run id of strategy ``name``'s training: its job's name and run-id label derive from it."""
    return f"{run_id}-{name}"


def strategy_run_ids(run_id: str, strategies: list[Any]) -> list[str]:
    """The run ids :func:`run_strategies` gives the trainings of ``strategies`` (teardown finds their jobs
    by them). One it refuses (no name, a bad one, not a mapping) is left out: it refuses the whole list
    before training any, so no job was made for it.
    """
    ids = []
    for strategy in strategies:
        try:
            name, _ = parse_strategy(strategy)
        except (ValueError, TypeError, AttributeError):
            continue
        ids.append(strategy_run_id(run_id, name))
    return list(dict.fromkeys(ids))


def run_strategy(
    *,
    storage_ref: str,
    run_id: str,
    strategy: dict[str, Any],
    launcher: str = "local",
    train: dict[str, Any] | None = None,
    procs_per_node: int = 0,
    progress: Callable[[str], None] = print,
    **launch_kwargs: Any,
) -> str:
    """Train one strategy to the end in ``<run dir>/<name>``; returns that run directory.

    A strategy that fails to finish is part of the comparison, not a benchmark failure: its run
    directory is returned all the same and its event log says how far it got.
    """
    from resilient_training.launch.backends import launch_training

    name, settings = parse_strategy(strategy)
    ref = StorageRef.from_json(storage_ref)
    sub = dataclasses.replace(ref, run_dir=f"{ref.run_dir.rstrip('/')}/{name}")
    progress(f"strategy {name}: {json.dumps(settings, sort_keys=True)}")
    try:
        launch_training(storage_ref=sub.to_json(), run_id=strategy_run_id(run_id, name), launcher=launcher,
                        train={**(train or {}), **settings}, procs_per_node=procs_per_node, progress=progress,
                        **launch_kwargs)
    except RuntimeError as exc:  # the run itself failed: record it, compare it
        progress(f"strategy {name} did not finish: {exc}")
    return sub.run_dir


def run_strategies(*, strategies: list[dict[str, Any]], **kwargs: Any) -> list[str]:
    """Train every strategy, one after another (on one machine they would skew each other's
    timings); returns their run directories in order. Names must be unique: they are directories.
    """
    names = [parse_strategy(s)[0] for s in strategies]
    if not names:
        raise ValueError("no strategies to run")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"strategy names must be unique: {', '.join(duplicates)}")
    return [run_strategy(strategy=s, **kwargs) for s in strategies]
