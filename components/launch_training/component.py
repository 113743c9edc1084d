"""KFP component: run training, locally under ft_launcher or as a Kubeflow PyTorchJob or TrainJob."""

from typing import NamedTuple, Optional

from kfp import dsl

from resilient_training.launch import images


@dsl.component(base_image=images.COMPONENTS_IMAGE, install_kfp_package=False)
def launch_training(
    storage_ref: str,
    run_id: str,
    launcher: str = "local",
    steps: int = 40,
    checkpoint_every: int = 5,
    faults: str = "",
    async_checkpoint: bool = True,
    inprocess: bool = True,
    ft_launcher: bool = True,
    train_overrides: Optional[dict] = None,  # noqa: UP045 - KFP reads the annotation
    task: str = "",
    task_args: Optional[dict] = None,  # noqa: UP045
    export: str = "",
    nodes: int = 1,
    min_nodes: int = 0,
    gpus_per_node: int = 8,
    procs_per_node: int = 0,
    image: str = "",
    efa_per_node: int = 0,
    node_selector: Optional[dict] = None,  # noqa: UP045
    tolerations: Optional[list] = None,  # noqa: UP045
    service_account: str = "",
    cpu: str = "",
    memory: str = "",
    shm_size: str = "64Gi",
    nvrx_version: str = "0.7.0",
    backoff_limit: int = 3,
    timeout_seconds: int = 86400,
    poll_seconds: float = 15.0,
    stream_logs: str = "worker-0",
) -> NamedTuple("Outputs", [("job_name", str), ("run_dir", str)]):
    """Train to the target step with all NVRx layers, and wait for the result.

    Args:
        storage_ref: The JSON from ``provision_storage`` (the run directory lives there).
        run_id: Pipeline run id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``); the job name derives from it,
            so a retried step attaches to its running job instead of starting a second one.
        launcher: ``local`` (ft_launcher with gloo workers in this pod/machine), ``pytorchjob``
            (Training Operator v1) or ``trainjob`` (Kubeflow Trainer v2 on the ``nvrx-ft-launcher``
            runtime, ``kubectl apply -k manifests/runtimes``). ``cluster:`` parameters apply to both.
        steps: Target step; the run succeeds once it is reached.
        checkpoint_every: Save a checkpoint every N steps.
        faults: Fault schedule ``TYPE@STEP:RANK,...`` (exception, sigkill, hang, oom, nan).
        async_checkpoint: NVRx asynchronous checkpointing.
        inprocess: NVRx in-process restart.
        ft_launcher: NVRx ft_launcher (heartbeats, restarts); off = plain torchrun.
        train_overrides: Any other trainer settings by TrainConfig field name (``model`` as a dict).
        task: The training task, ``MODULE:ATTR`` or ``path/to/file.py:ATTR`` (importable where the
            workers run: this machine for local, the trainer image for pytorchjob); empty: the
            built-in GPT task.
        task_args: Settings passed to the task, ``{"KEY": "VALUE"}`` (``--task-arg KEY=VALUE``).
        export: The format ``promote_model`` will export the model in (its ``export``): the workers
            refuse ``hf`` before any training unless the task builds a transformers model (on a
            cluster the task is the trainer image's, which nothing before the job can build).
        nodes: cluster: worker pods, one per node (the maximum when ``min_nodes`` is set).
        min_nodes: pytorchjob only (Trainer v2 is not elastic): elastic lower bound; training goes
            on with this many nodes when others are lost. 0 = exactly ``nodes``.
        gpus_per_node: cluster: GPUs per pod (0 for CPU pods with ``procs_per_node``).
        procs_per_node: Processes per pod (local: per machine, default 2); 0 = one per GPU.
        image: cluster: trainer image; empty = the release's trainer image.
        efa_per_node: cluster: EFA interfaces per pod (``vpc.amazonaws.com/efa``).
        node_selector: cluster: node labels the workers need (e.g. instance type).
        tolerations: cluster: pod tolerations, e.g. ``[{"key": "nvidia.com/gpu", "operator":
            "Exists", "effect": "NoSchedule"}]``.
        service_account: cluster: service account of the worker pods.
        cpu: cluster: CPU request and limit per pod (a Kubernetes quantity); empty: none.
        memory: cluster: memory request and limit per pod (at least 1Gi); empty: none.
        shm_size: cluster: size of each pod's in-memory ``/dev/shm`` (at least 256Mi, at most ``memory``).
        nvrx_version: cluster: NVRx version in the trainer image (selects ft_launcher flags).
        backoff_limit: cluster: pod replacements (exit code >= 128) before the job fails; for
            ``trainjob`` it must equal the runtime's JobSet ``maxRestarts`` (3), which sets it.
        timeout_seconds: Overall limit for the job; on expiry it is deleted and the step fails.
        poll_seconds: cluster: seconds between status checks.
        stream_logs: cluster: ``worker-0`` (node 0), ``all`` or ``none``.

    Returns:
        job_name: The PyTorchJob's or TrainJob's name (for ``teardown_storage``); empty for local.
        run_dir: The run directory (checkpoints/, events/) for the following steps.

    """
    from collections import namedtuple

    from resilient_training.launch.backends import launch_training as launch
    from resilient_training.run.storage_ref import StorageRef

    train = dict(train_overrides or {})
    train.update(steps=steps, checkpoint_every=checkpoint_every, faults=faults, async_checkpoint=async_checkpoint,
                 inprocess=inprocess, ft_launcher=ft_launcher)
    if task:
        train["task"] = task
    if task_args:
        train["task_args"] = task_args
    if export.strip():
        train["export_format"] = export.strip()
    job_name = launch(
        storage_ref=storage_ref, run_id=run_id, launcher=launcher, train=train, nodes=nodes, min_nodes=min_nodes,
        gpus_per_node=gpus_per_node, procs_per_node=procs_per_node, image=image, efa_per_node=efa_per_node,
        node_selector=node_selector, tolerations=tolerations, service_account=service_account, cpu=cpu,
        memory=memory, shm_size=shm_size, nvrx_version=nvrx_version, backoff_limit=backoff_limit,
        timeout_s=timeout_seconds, poll_s=poll_seconds, stream_logs=stream_logs,
    )
    outputs = namedtuple("Outputs", ["job_name", "run_dir"])
    return outputs(job_name, StorageRef.from_json(storage_ref).run_dir)
