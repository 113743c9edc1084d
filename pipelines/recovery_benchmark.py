"""The recovery benchmark pipeline: every strategy on the same model, data and fault schedule.

The reference study's first step for a team: run sync vs async checkpointing and in-process vs
ft_launcher vs plain relaunch side by side, then compare goodput and recovery time.

```
check_benchmark_arguments ─► provision_storage ─► run_strategies (one after another) ─► compare_strategies
exit handler: teardown_storage (each strategy's job, the claim, the file system this run created)
```
"""

# No `from __future__ import annotations`: KFP reads the real annotation objects.

from kfp import dsl

from resilient_training.bench.strategy import DEFAULT_STRATEGIES
from resilient_training.components.compare_strategies import compare_strategies
from resilient_training.components.provision_storage import provision_storage
from resilient_training.components.run_strategies import run_strategies
from resilient_training.components.teardown_storage import teardown_storage
from resilient_training.launch.images import COMPILED_TRAINER_IMAGE
from resilient_training.launch.jobshape import TRAINER_SERVICE_ACCOUNT

from .check_step import check_benchmark_arguments
from .defaults import (
    BENCH_CHECKPOINT_EVERY,
    BENCH_FAULTS,
    BENCH_STEPS,
    CACHING_NOTE,
    PROVISION_RETRY,
    TASK,
    TASK_ARGS,
    TEARDOWN_RETRY,
)
from .resilient_training import MOUNT_PATH, mount_run_storage, side_effecting


def build(*, retries: bool = True) -> "dsl.graph_component.GraphComponent":
    """The recovery-benchmark pipeline; ``retries=False`` for ``kfp.local`` runs (``run``/``bench``).

    kfp.local honours retry policies, and nothing on one machine fails transiently: a retried local
    launch would train again after minutes of backoff. Caching is off either way.
    """

    @dsl.pipeline(
        name="recovery-benchmark",
        description="The same training run under each recovery strategy (NVRx layers on or off), "
        "compared on goodput and recovery time. " + CACHING_NOTE,
    )
    def recovery_benchmark(
        strategies: list[dict] = DEFAULT_STRATEGIES,  # noqa: B006 - KFP reads the default
        steps: int = BENCH_STEPS,
        checkpoint_every: int = BENCH_CHECKPOINT_EVERY,
        faults: str = BENCH_FAULTS,
        train_overrides: dict = {},  # noqa: B006
        task: str = TASK,
        task_args: dict = TASK_ARGS,  # noqa: B006
        storage: str = "local",
        launcher: str = "local",
        procs_per_node: int = 0,
        nodes: int = 1,
        gpus_per_node: int = 8,
        trainer_image: str = COMPILED_TRAINER_IMAGE,
        service_account: str = TRAINER_SERVICE_ACCOUNT,
        namespace: str = "",
        local_root: str = "runs",
        pvc_name: str = "",
        fsx_file_system_id: str = "",
        fsx_subnet_id: str = "",
        fsx_security_group_ids: str = "",
        region: str = "",
    ):
        """Run each strategy with the same schedule and compare them.

        Args:
            strategies: One dict per strategy: a "name" plus trainer settings, e.g. {"name":
                "torchrun+sync", "inprocess": false, "ft_launcher": false, "async_checkpoint": false}.
            steps: Target step of every strategy.
            checkpoint_every: Steps between persistent checkpoints, for every strategy.
            faults: Fault schedule injected into every strategy (TYPE@STEP:RANK,...).
            train_overrides: Trainer settings shared by all strategies (model size, local tier, ...).
            task: The training task, MODULE:ATTR or path/to/file.py:ATTR (default: the built-in GPT).
            task_args: Settings passed to the task ({"KEY": "VALUE"}).
            storage: local, pvc or fsx (see the resilient-training pipeline).
            launcher: local, pytorchjob or trainjob.
            procs_per_node: Worker processes per node; 0: one per GPU on a cluster, 2 CPU workers for local.
            nodes: Nodes for launcher=pytorchjob.
            gpus_per_node: GPUs per node for launcher=pytorchjob.
            trainer_image: Trainer image for launcher=pytorchjob (default: $RT_TRAINER_IMAGE at compile time, else
                the release's trainer image).
            service_account: Service account of the worker pods for launcher=pytorchjob (empty: the namespace's
                default).
            namespace: Kubernetes namespace (pvc, fsx, pytorchjob).
            local_root: Parent directory of run directories for storage=local.
            pvc_name: Existing claim for storage=pvc.
            fsx_file_system_id: Reuse this FSx file system instead of creating one.
            fsx_subnet_id: Subnet for a new FSx file system.
            fsx_security_group_ids: Security groups for a new FSx file system, comma-separated.
            region: AWS region (default: the client's).

        """
        # First: every parameter by name (locals() also holds the closure's `retries`).
        parameters = {k: v for k, v in locals().items() if k in check_benchmark_arguments.component_spec.inputs}
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        # The strategies too: each trained in a job of its own, which teardown must find if run_strategies
        # died without deleting it (OOM kill, node loss); an exit task can take pipeline inputs only.
        cleanup = teardown_storage(
            run_id=run_id, storage=storage, namespace=namespace, pvc_name=pvc_name,
            fsx_file_system_id=fsx_file_system_id, region=region, strategies=strategies,
        ).set_display_name("teardown")
        side_effecting(cleanup, TEARDOWN_RETRY if retries else None)
        with dsl.ExitHandler(cleanup, name="benchmark-and-clean-up"):
            checked = side_effecting(check_benchmark_arguments(**parameters).set_display_name("check arguments"))
            provisioned = provision_storage(
                run_id=run_id, storage=storage, namespace=namespace, mount_path=MOUNT_PATH, local_root=local_root,
                pvc_name=pvc_name, fsx_file_system_id=fsx_file_system_id, fsx_subnet_id=fsx_subnet_id,
                fsx_security_group_ids=fsx_security_group_ids, region=region,
            ).set_display_name("provision storage").after(checked)
            side_effecting(provisioned, PROVISION_RETRY if retries else None)
            claim = provisioned.outputs["pvc_name"]
            trained = run_strategies(
                storage_ref=provisioned.outputs["storage_ref"], run_id=run_id, strategies=strategies,
                launcher=launcher, steps=steps, checkpoint_every=checkpoint_every, faults=faults,
                train_overrides=train_overrides, task=task, task_args=task_args,
                procs_per_node=procs_per_node, nodes=nodes,
                gpus_per_node=gpus_per_node, image=trainer_image, service_account=service_account,
            ).set_display_name("train each strategy")
            # No retry: a strategy's timing is the measurement, and a retried run would mix two attempts.
            side_effecting(trained)
            mount_run_storage(trained, claim)
            compared = side_effecting(compare_strategies(run_dirs=trained.output).set_display_name("compare"))
            mount_run_storage(compared, claim)

    return recovery_benchmark


recovery_benchmark = build()
