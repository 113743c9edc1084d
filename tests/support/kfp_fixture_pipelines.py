"""Tiny real pipelines for the CLI tests, registered like resilient_training.pipelines.PIPELINES.

They have what the project's pipelines have that the server commands care about: typed
parameters with defaults and descriptions (one required), an exit handler, a condition, and a
Kubernetes platform spec (kfp-kubernetes), which makes the compiled YAML two documents.
"""

# No "from __future__ import annotations": kfp reads the annotations as types.
from kfp import dsl, kubernetes

IMAGE = "python:3.11-slim"


@dsl.component(base_image=IMAGE)
def train(nodes: int, backend: str) -> float:
    """Pretend to train.

    Args:
        nodes: number of nodes.
        backend: storage backend.
    """
    return 1.0 / nodes


@dsl.component(base_image=IMAGE)
def promote(loss: float):
    """Pretend to promote a model."""
    print(loss)


@dsl.component(base_image=IMAGE)
def teardown(run_id: str):
    """Pretend to clean up."""
    print(run_id)


def _tiny_train(default_nodes: int):
    @dsl.pipeline(name="tiny-train", description="Tiny training pipeline for the CLI tests.")
    def tiny_train(
        run_id: str,
        nodes: int = default_nodes,
        backend: str = "local",
        tolerance: float = 0.05,
        inject_faults: bool = True,
        fault_steps: list = [5, 9],  # noqa: B006 (KFP reads the default; it is never mutated)
        extra: dict = {},  # noqa: B006
    ):
        """Train, then promote when the loss is low.

        Args:
            run_id: name of this run's storage folder.
            nodes: number of training nodes.
            backend: storage backend, local | pvc | fsx.
            tolerance: allowed loss difference.
            inject_faults: inject the fault schedule.
            fault_steps: steps at which faults are injected.
            extra: free-form settings.
        """
        cleanup = teardown(run_id=run_id)
        with dsl.ExitHandler(cleanup):
            trained = train(nodes=nodes, backend=backend)
            kubernetes.set_image_pull_secrets(trained, ["regcred"])
            with dsl.If(trained.output < tolerance, name="converged"):
                promote(loss=trained.output)

    return tiny_train


@dsl.pipeline(name="tiny-bench", description="Tiny benchmark pipeline for the CLI tests.")
def tiny_bench(repeats: int = 3):
    """Benchmark.

    Args:
        repeats: how many times.
    """
    train(nodes=repeats, backend="local")


PIPELINES = {"tiny-train": _tiny_train(2), "tiny-bench": tiny_bench}
# The same pipeline name with another default: other content, so a new version on upload.
PIPELINES_CHANGED = {"tiny-train": _tiny_train(4)}
