"""The resilient training pipeline: provision → train under NVRx → validate → gate → promote.

```
check_arguments ─► provision_storage ─► launch_training ─► validate_checkpoint ─► check_convergence ─┐
  ┌─────────────────────────────────────────────────────────────────────────────────────────────────┘
  ├─► [both passed] promote_model
  └─► resilience_report (whatever the gates say)
exit handler: teardown_storage (job, claim, file system this run created)
```
Backends are parameters: ``storage`` local | pvc | fsx and ``launcher`` local | pytorchjob | trainjob.
``local`` runs on a laptop through ``kfp.local``; on a cluster use pvc or fsx storage, which every
step mounts (kfp-kubernetes; the local runner ignores it with a warning).
"""

# No `from __future__ import annotations`: KFP reads the real annotation objects.
from kfp import dsl, kubernetes

from resilient_training.components.check_convergence import check_convergence
from resilient_training.components.launch_training import launch_training
from resilient_training.components.promote_model import promote_model
from resilient_training.components.provision_storage import provision_storage
from resilient_training.components.resilience_report import resilience_report
from resilient_training.components.teardown_storage import teardown_storage
from resilient_training.components.validate_checkpoint import validate_checkpoint
from resilient_training.launch.images import COMPILED_TRAINER_IMAGE
from resilient_training.launch.jobshape import TRAINER_SERVICE_ACCOUNT

from .check_step import check_arguments
from .defaults import (
    CACHING_NOTE,
    EXPORT,
    LAUNCH_RETRY,
    PROVISION_RETRY,
    RUN_CHECKPOINT_EVERY,
    RUN_FAULTS,
    RUN_STEPS,
    TASK,
    TASK_ARGS,
    TEARDOWN_RETRY,
)

# Where every step mounts the run's claim on a cluster (kfp-kubernetes needs it at compile time).
MOUNT_PATH = "/mnt/run"


def mount_run_storage(task: dsl.PipelineTask, pvc_name: str) -> dsl.PipelineTask:
    """Give a step the run's storage on a cluster (ignored by the local runner)."""
    return kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=MOUNT_PATH)


def side_effecting(task: dsl.PipelineTask, retry: tuple[int, str, float, str] | None = None) -> dsl.PipelineTask:
    """Never serve this step from the cache; retry it (with an explicit max duration) when idempotent.

    A KFP server caches by default: a scheduled run with last night's parameters would otherwise
    provision nothing, train nothing and report last night's result again.
    """
    task.set_caching_options(enable_caching=False)
    if retry is not None:
        num_retries, backoff, factor, max_duration = retry
        task.set_retry(num_retries=num_retries, backoff_duration=backoff, backoff_factor=factor,
                       backoff_max_duration=max_duration)
    return task


def build(*, retries: bool = True) -> "dsl.graph_component.GraphComponent":
    """The resilient-training pipeline; ``retries=False`` for ``kfp.local`` runs (``run``/``bench``).

    kfp.local honours retry policies, and nothing on one machine fails transiently: a retried local
    launch would train again after minutes of backoff. Caching is off either way.
    """

    @dsl.pipeline(
        name="resilient-training",
        description="NVRx-wrapped FSDP training with injected faults; checkpoints validated and the model "
        "promoted only when integrity and convergence gates pass; a resilience report always. " + CACHING_NOTE,
    )
    def resilient_training(
        storage: str = "local",
        launcher: str = "local",
        steps: int = RUN_STEPS,
        checkpoint_every: int = RUN_CHECKPOINT_EVERY,
        faults: str = RUN_FAULTS,
        async_checkpoint: bool = True,
        inprocess: bool = True,
        ft_launcher: bool = True,
        train_overrides: dict = {},  # noqa: B006 - KFP reads the default as the parameter's default
        task: str = TASK,
        task_args: dict = TASK_ARGS,  # noqa: B006
        nodes: int = 1,
        gpus_per_node: int = 8,
        procs_per_node: int = 0,
        trainer_image: str = COMPILED_TRAINER_IMAGE,
        service_account: str = TRAINER_SERVICE_ACCOUNT,
        efa_per_node: int = 0,
        node_selector: dict = {},  # noqa: B006
        tolerations: list = [],  # noqa: B006
        cpu: str = "",
        memory: str = "",
        shm_size: str = "64Gi",
        namespace: str = "",
        local_root: str = "runs",
        pvc_name: str = "",
        fsx_file_system_id: str = "",
        fsx_subnet_id: str = "",
        fsx_security_group_ids: str = "",
        fsx_capacity_gib: int = 1200,
        fsx_deployment_type: str = "SCRATCH_2",
        fsx_per_unit_throughput: int = 0,
        region: str = "",
        promote_to: str = "promoted",
        export: str = EXPORT,
        max_final_loss: float = -1.0,
        min_improvement: float = 0.1,
        delete_file_system: bool = True,
    ):
        """Train with injected faults, prove the recovery was clean, and promote only then.

        Args:
            storage: Where checkpoints and the event log live: local (a directory; laptop only),
                pvc (an existing PersistentVolumeClaim) or fsx (Amazon FSx for Lustre, created or reused).
            launcher: How workers start: local (ft_launcher on this machine, gloo on CPU), pytorchjob
                (a Kubeflow Training Operator PyTorchJob, ft_launcher on every node) or trainjob (a
                Kubeflow Trainer v2 TrainJob on the nvrx-ft-launcher ClusterTrainingRuntime).
            steps: Target training step; the run succeeds once it is reached.
            checkpoint_every: Steps between persistent checkpoints.
            faults: Injected fault schedule, TYPE@STEP:RANK comma-separated (exception, sigkill, hang,
                oom, nan, ckpt-kill, writer-kill); empty for none.
            async_checkpoint: Write checkpoints in NVRx's background process (false: synchronous saves).
            inprocess: Enable NVRx in-process restart.
            ft_launcher: Run workers under NVRx ft_launcher (false: plain torchrun).
            train_overrides: Further trainer settings by name (e.g. {"model": {"d_model": 1024},
                "local_checkpoint_every": 25, "lr": 0.0003}).
            task: The training task, MODULE:ATTR or path/to/file.py:ATTR (importable where the workers
                run: the trainer image on a cluster); default the built-in GPT on synthetic tokens.
            task_args: Settings passed to the task ({"KEY": "VALUE"}, as ``--task-arg KEY=VALUE``).
            nodes: Nodes (worker pods) for launcher=pytorchjob or trainjob.
            gpus_per_node: GPUs per node for launcher=pytorchjob or trainjob.
            procs_per_node: Worker processes per node; 0 (default): one per GPU for launcher=pytorchjob or
                trainjob, 2 CPU workers for launcher=local (a default of 2 left 6 of 8 GPUs idle on a cluster).
            trainer_image: Trainer image for launcher=pytorchjob or trainjob (default: $RT_TRAINER_IMAGE at compile
                time, else the release's trainer image).
            service_account: Service account of the worker pods for launcher=pytorchjob or trainjob (manifests/rbac
                makes it, with no API token mounted); empty: the namespace's default.
            efa_per_node: EFA interfaces per worker pod (vpc.amazonaws.com/efa) for launcher=pytorchjob or trainjob;
                0: none.
            node_selector: Node labels the worker pods need, e.g. {"node.kubernetes.io/instance-type":
                "p5.48xlarge"}.
            tolerations: Worker pod tolerations, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"}].
            cpu: CPU request and limit per worker pod for launcher=pytorchjob or trainjob, a Kubernetes
                quantity such as 180; empty: none.
            memory: Memory request and limit per worker pod, such as 1800Gi (at least 1Gi); empty: none.
            shm_size: Size of each worker pod's in-memory /dev/shm (NCCL, data loaders, checkpoint staging),
                at least 256Mi and at most memory.
            namespace: Kubernetes namespace of the claim and the job (pvc, fsx, pytorchjob, trainjob).
            local_root: Parent directory of run directories for storage=local.
            pvc_name: Existing claim for storage=pvc.
            fsx_file_system_id: Reuse this FSx file system instead of creating one (never deleted).
            fsx_subnet_id: Subnet for a new FSx file system.
            fsx_security_group_ids: Security groups for a new FSx file system, comma-separated.
            fsx_capacity_gib: Capacity of a new FSx file system (1200, 2400 or a multiple of 2400).
            fsx_deployment_type: SCRATCH_2 or PERSISTENT_2.
            fsx_per_unit_throughput: PERSISTENT_2 only (and then required): 125, 250, 500 or 1000 MB/s per TiB.
            region: AWS region (default: the client's).
            promote_to: Where a model that passed both gates is copied: a directory or s3://bucket/prefix;
                {run_id} in it becomes the run's id (a schedule needs it: each run promotes to its own place).
            export: Also write the promoted model inside promote_to in a format other tools load:
                safetensors (model.safetensors), torch (model.pt) or hf (hf/, for transformers models);
                empty for the DCP checkpoint only.
            max_final_loss: Convergence gate: the final loss must be below this (negative: 0.8 x ln(vocab_size)
                from the run's manifest; skipped for a task that records none).
            min_improvement: Convergence gate: relative loss improvement over the first window.
            delete_file_system: Delete an FSx file system this run created when the run ends.

        """
        # First: every parameter by name (locals() also holds the closure's `retries`); the check
        # step takes each one (a test says the two lists are the same).
        parameters = {k: v for k, v in locals().items() if k in check_arguments.component_spec.inputs}
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        cleanup = teardown_storage(
            run_id=run_id, storage=storage, namespace=namespace, pvc_name=pvc_name,
            fsx_file_system_id=fsx_file_system_id, region=region, delete_file_system=delete_file_system,
        ).set_display_name("teardown")
        side_effecting(cleanup, TEARDOWN_RETRY if retries else None)
        with dsl.ExitHandler(cleanup, name="run-and-clean-up"):
            # A run made in the UI, the API or `argo submit -p` was checked by nothing of ours.
            checked = side_effecting(check_arguments(**parameters).set_display_name("check arguments"))
            provisioned = provision_storage(
                run_id=run_id, storage=storage, namespace=namespace, mount_path=MOUNT_PATH, local_root=local_root,
                pvc_name=pvc_name, fsx_file_system_id=fsx_file_system_id, fsx_subnet_id=fsx_subnet_id,
                fsx_security_group_ids=fsx_security_group_ids, fsx_capacity_gib=fsx_capacity_gib,
                fsx_deployment_type=fsx_deployment_type, fsx_per_unit_throughput=fsx_per_unit_throughput,
                region=region,
            ).set_display_name("provision storage").after(checked)
            side_effecting(provisioned, PROVISION_RETRY if retries else None)
            claim = provisioned.outputs["pvc_name"]
            trained = launch_training(
                storage_ref=provisioned.outputs["storage_ref"], run_id=run_id, launcher=launcher, steps=steps,
                checkpoint_every=checkpoint_every, faults=faults, async_checkpoint=async_checkpoint,
                inprocess=inprocess, ft_launcher=ft_launcher, train_overrides=train_overrides, task=task,
                task_args=task_args, export=export, nodes=nodes,
                gpus_per_node=gpus_per_node, procs_per_node=procs_per_node, image=trainer_image,
                service_account=service_account, efa_per_node=efa_per_node, node_selector=node_selector,
                tolerations=tolerations, cpu=cpu, memory=memory, shm_size=shm_size,
            ).set_display_name("train (NVRx)")
            side_effecting(trained, LAUNCH_RETRY if retries else None)
            run_dir = trained.outputs["run_dir"]
            valid = validate_checkpoint(run_dir=run_dir).set_display_name("validate checkpoint")
            converged = check_convergence(
                run_dir=run_dir, max_final_loss=max_final_loss, min_improvement=min_improvement,
            ).set_display_name("check convergence").after(valid)
            with dsl.If(valid.outputs["Output"] == True, name="checkpoint-valid"):  # noqa: E712 - a KFP condition
                with dsl.If(converged.outputs["Output"] == True, name="converged"):  # noqa: E712
                    promoted = promote_model(checkpoint=run_dir, dest=promote_to, export=export).set_display_name(
                        "promote model")
            report = resilience_report(run_dir=run_dir).set_display_name("resilience report").after(converged)
            for task in (valid, converged, promoted, report):
                side_effecting(task)  # deterministic: a retry would give the same answer
            for task in (trained, valid, converged, promoted, report):
                mount_run_storage(task, claim)

    return resilient_training


resilient_training = build()
