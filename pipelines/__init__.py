"""The project's pipelines, by the name the CLI (`compile`, `upload`, `submit`, `run`, `bench`) uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _registry() -> dict[str, Callable[..., Any]]:
    from .recovery_benchmark import recovery_benchmark
    from .resilient_training import resilient_training

    return {"resilient-training": resilient_training, "recovery-benchmark": recovery_benchmark}


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for the CLI's --help) does not import kfp.
    if name == "PIPELINES":
        return _registry()
    raise AttributeError(name)


__all__ = ["PIPELINES"]
