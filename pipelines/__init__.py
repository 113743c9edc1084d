"""The project's pipelines, by the name the CLI (`compile`, `upload`, `submit`, `run`, `bench`) uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _registry(*, retries: bool) -> dict[str, Callable[..., Any]]:
    from . import recovery_benchmark, resilient_training

    if retries:
        return {"resilient-training": resilient_training.resilient_training,
                "recovery-benchmark": recovery_benchmark.recovery_benchmark}
    return {"resilient-training": resilient_training.build(retries=False),
            "recovery-benchmark": recovery_benchmark.build(retries=False)}


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for the CLI's --help) does not import kfp.
    # PIPELINES: what is compiled and sent to a KFP server. LOCAL_PIPELINES: the same DAGs without
    # retry policies, for kfp.local (`run`, `bench`), which would honour them.
    if name == "PIPELINES":
        return _registry(retries=True)
    if name == "LOCAL_PIPELINES":
        return _registry(retries=False)
    raise AttributeError(name)


__all__ = ["LOCAL_PIPELINES", "PIPELINES"]
