"""KFP component: train every benchmark strategy in turn (a thin wrapper over strategy.py)."""

# No `from __future__ import annotations` here: KFP reads the real annotation objects.

from kfp import dsl

from resilient_training.launch import images


@dsl.component(base_image=images.COMPONENTS_IMAGE, install_kfp_package=False)
def run_strategies(
    storage_ref: str,
    run_id: str,
    strategies: list[dict],
    launcher: str = "local",
    steps: int = 40,
    checkpoint_every: int = 5,
    faults: str = "",
    train_overrides: dict = {},  # noqa: B006 - KFP reads the default
    procs_per_node: int = 0,
    nodes: int = 1,
    gpus_per_node: int = 8,
    image: str = "",
    service_account: str = "",
    task: str = "",
    task_args: dict = {},  # noqa: B006
) -> list[str]:
    """Train each recovery strategy in turn with the same model, data and fault schedule.

    Sequential on purpose: strategies sharing a machine would skew each other's timings (and
    kfp.local substitutes a ParallelFor item for upstream outputs inside the loop, kfp 2.17).

    Args:
        storage_ref: The JSON from ``provision_storage``; the strategy trains in ``<run dir>/<name>``.
        run_id: The pipeline run id (the strategy's job name derives from it).
        strategies: One ``{"name": ..., <trainer setting>: value, ...}`` per strategy, e.g. {"name":
            "torchrun+sync", "inprocess": false, "ft_launcher": false, "async_checkpoint": false}.
        launcher: local (ft_launcher on this machine) or pytorchjob.
        steps: Target step, the same for every strategy.
        checkpoint_every: Steps between persistent checkpoints, the same for every strategy.
        faults: Fault schedule, the same for every strategy.
        train_overrides: Trainer settings shared by every strategy (a strategy's own keys win).
        procs_per_node: Worker processes per node; 0: one per GPU on a cluster, 2 CPU workers for local.
        nodes: Nodes for launcher=pytorchjob.
        gpus_per_node: GPUs per node for launcher=pytorchjob.
        image: Trainer image for launcher=pytorchjob.
        service_account: Service account of the worker pods for launcher=pytorchjob (empty: the namespace's default).
        task: The training task, MODULE:ATTR or path/to/file.py:ATTR (empty: the built-in GPT task).
        task_args: Settings passed to the task ({"KEY": "VALUE"}, as ``--task-arg KEY=VALUE``).

    Returns:
        The strategies' run directories, in order (their event logs are what the comparison reads).

    """
    from resilient_training.bench.strategy import run_strategies as run

    shared = {**train_overrides, "steps": steps, "checkpoint_every": checkpoint_every, "faults": faults}
    if task:
        shared["task"] = task
    if task_args:
        shared["task_args"] = task_args
    return run(storage_ref=storage_ref, run_id=run_id, strategies=strategies, launcher=launcher, train=shared,
               procs_per_node=procs_per_node, nodes=nodes, gpus_per_node=gpus_per_node, image=image,
               service_account=service_account)
