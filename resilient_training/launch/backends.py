"""``launch_training``'s backends behind one call: ``local`` (ft_launcher on this machine),
``pytorchjob`` (a Kubeflow Training Operator PyTorchJob) or ``trainjob`` (a Kubeflow Trainer v2
TrainJob on the NVRx ClusterTrainingRuntime), ft_launcher on every node of either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resilient_training.launch import images, jobshape
from resilient_training.run import config as train_config
from resilient_training.run.storage_ref import StorageRef

LAUNCHERS = ("local", *jobshape.KINDS)


def train_config_for(ref: StorageRef, overrides: dict[str, Any]) -> train_config.TrainConfig:
    """The trainer config: ``overrides`` (flat setting names or groups, ``model`` as a dict) on the defaults."""
    if "run_dir" in overrides:
        raise ValueError("run_dir comes from the storage ref; do not override it")
    return train_config.from_dict({**overrides, "run_dir": ref.run_dir})


def job_spec_for(
    ref: StorageRef,
    *,
    run_id: str,
    launcher: str,
    config: train_config.TrainConfig,
    nodes: int = 1,
    min_nodes: int = 0,
    gpus_per_node: int = 8,
    procs_per_node: int = 0,
    image: str = "",
    efa_per_node: int = 0,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict[str, Any]] | None = None,
    service_account: str = "",
    cpu: str = "",
    memory: str = "",
    shm_size: str = jobshape.DEFAULT_SHM_SIZE,
    nvrx_version: str = jobshape.DEFAULT_NVRX_VERSION,
    backoff_limit: int = 3,
) -> jobshape.JobSpec | None:
    """The cluster job for ``launcher`` (None for ``local``), validated: what :func:`launch_training`
    submits, and what a pipeline's arguments are checked against before a run is created.

    Raises:
        ValueError: an unknown launcher, a cluster launcher on storage the pods cannot share, or a job
            setting the API server or operator would refuse.

    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if launcher == "local":
        return None
    if not ref.shared:
        raise ValueError(f"launcher {launcher!r} needs storage every pod can mount (pvc or fsx), got {ref.backend!r}")
    if not isinstance(node_selector, dict | None):  # a pipeline's JSON parameter
        raise ValueError(f"node_selector must be a mapping of node label to value, got {node_selector!r}")
    if not isinstance(tolerations, list | None):
        raise ValueError(f"tolerations must be a list of tolerations, got {tolerations!r}")
    for what, value in (("cpu", cpu), ("memory", memory), ("shm_size", shm_size)):
        if not isinstance(value, str):  # a pipeline's JSON parameter
            raise ValueError(f"{what} must be a Kubernetes quantity as a string (e.g. '64Gi'), got {value!r}")
    return jobshape.JobSpec(
        kind=launcher, name=jobshape.job_name_for_run(run_id), namespace=ref.namespace, train=config, storage=ref,
        image=image or images.TRAINER_IMAGE, nodes=nodes, min_nodes=min_nodes, gpus_per_node=gpus_per_node,
        procs_per_node=procs_per_node,
        efa_per_node=efa_per_node, node_selector=dict(node_selector or {}), tolerations=list(tolerations or []),
        service_account=service_account, cpu=cpu, memory=memory, shm_size=shm_size, run_id=run_id,
        nvrx_version=nvrx_version, backoff_limit=backoff_limit,
    )


def launch_training(
    *,
    storage_ref: str,
    run_id: str,
    launcher: str = "local",
    train: dict[str, Any] | None = None,
    procs_per_node: int = 0,
    timeout_s: float = 24 * 3600.0,
    poll_s: float = 15.0,
    stream_logs: str = "worker-0",
    training_client: Any = None,
    job_api: Any = None,
    progress: Callable[[str], None] = print,
    **job: Any,
) -> str:
    """Run training to completion; returns the job's name ('' for local). Raises on failure.

    ``job``: the cluster job's settings (:func:`job_spec_for`: nodes, gpus_per_node, image, ...).
    ``training_client`` (pytorchjob) or ``job_api`` (either kind, see ``launch.watch``) reach the
    cluster; by default they are made from the pod's service account or the kubeconfig.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    ref = StorageRef.from_json(storage_ref)
    config = train_config_for(ref, train or {})
    if launcher == "local":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise ValueError("launcher 'local' trains in this process's environment, which has no torch "
                             "(the components image): on a cluster use launcher='pytorchjob' or 'trainjob'")
        from resilient_training.launch.local import run_local

        result = run_local(config, nproc=procs_per_node or 2, progress=progress)
        if not result.ok:
            raise RuntimeError(f"local training failed (exit code {result.exit_code}): {result.reason}")
        return ""
    spec = job_spec_for(ref, run_id=run_id, launcher=launcher, config=config, procs_per_node=procs_per_node, **job)
    assert spec is not None  # launcher is a cluster kind here
    from resilient_training.launch import watch as launch

    if stream_logs not in launch.LOG_MODES:
        raise ValueError(f"stream_logs must be one of {', '.join(launch.LOG_MODES)}, got {stream_logs!r}")
    job_api = job_api or launch.jobs_api(launcher, ref.namespace, training_client=training_client)
    outcome = launch.launch(spec, api=job_api, timeout_s=timeout_s, poll_s=poll_s, stream_logs=stream_logs,
                            progress=progress)
    return outcome.job_name
