"""The PyTorchJob builder: typed parameters in, a ``kubeflow.org/v1`` PyTorchJob out.

Every worker pod runs ``ft_launcher <flags> -m resilient_training.runtime.worker <trainer flags>``.
The job is elastic (Worker replicas only, no Master), so the Training Operator injects
``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``
(``<job>-worker-0:<port>``), ``PET_RDZV_ID`` and ``PET_MAX_RESTARTS`` and ft_launcher reads them
like torchrun: the same job works for any node count. NVRx decides about restarts inside the
pod; ``restartPolicy: ExitCode`` lets Kubernetes replace a pod only when it was killed
(exit code >= 128: node loss, OOM kill), never after a deterministic failure (exit code 93 or
ft_launcher's own 1 after its restart budget).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from resilient_training.launch import images, k8s_names
from resilient_training.run import checkpoint_format
from resilient_training.run import config as train_config
from resilient_training.run.storage_ref import StorageRef

CONTAINER_NAME = "pytorch"  # the operator finds the training container by this name
PORT_NAME = "pytorchjob-port"  # the operator derives the rendezvous port from this container port
APP_LABEL = "app.kubernetes.io/name"
RUN_ID_LABEL = "resilient-training.io/run-id"
WORKER_MODULE = "resilient_training.runtime.worker"
DEFAULT_NVRX_VERSION = "0.7.0"  # what images/trainer installs
MAX_NODES = 4096
_TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?")


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """What one training job needs; :func:`build_job` turns it into a PyTorchJob."""

    name: str
    """Job name (DNS-1035); pods are ``<name>-worker-<i>``."""
    train: train_config.TrainConfig
    """Trainer configuration; its ``run_dir`` must lie under the storage mount."""
    storage: StorageRef
    """Shared storage (pvc or fsx) mounted into every worker."""
    namespace: str = "default"
    """Namespace of the job (and of the claim)."""
    image: str = images.TRAINER_IMAGE
    """Trainer image (CUDA PyTorch, NVRx, this package)."""
    nodes: int = 1
    """Worker pods (one per node); the maximum when ``min_nodes`` is set."""
    min_nodes: int = 0
    """Fewest nodes to run on (elastic); 0 = exactly ``nodes``."""
    gpus_per_node: int = 8
    """GPUs per worker pod (``nvidia.com/gpu``); 0 for CPU-only pods."""
    procs_per_node: int = 0
    """Training processes per pod; 0 = one per GPU (required when ``gpus_per_node`` is 0)."""
    efa_per_node: int = 0
    """EFA interfaces per pod (``vpc.amazonaws.com/efa``); sets the libfabric env when > 0."""
    cpu: str = ""
    """CPU request and limit per pod (Kubernetes quantity), empty for none."""
    memory: str = ""
    """Memory request and limit per pod (Kubernetes quantity), empty for none."""
    shm_size: str = "64Gi"
    """Size limit of the in-memory ``/dev/shm`` (NCCL, data loaders, async checkpoint staging)."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the worker pods require."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Pod tolerations (``key``, ``operator``, ``value``, ``effect``)."""
    service_account: str = ""
    """Service account of the worker pods (e.g. one with IRSA for S3); empty = namespace default."""
    run_id: str = ""
    """Pipeline run id: the rendezvous id and a label on every object."""
    nvrx_version: str = DEFAULT_NVRX_VERSION
    """NVRx version in the image (selects the ft_launcher flags)."""
    rdzv_port: int = 29400
    """c10d rendezvous port on worker 0."""
    backoff_limit: int = 3
    """Pod replacements (exit code >= 128) before the job fails."""
    active_deadline_seconds: int = 0
    """Whole-job deadline in seconds; 0 = none."""
    ttl_seconds_after_finished: int = 7 * 24 * 3600
    """Delete the finished job (and its pods) after this many seconds; 0 = keep."""
    termination_grace_seconds: int = 120
    """Time a worker gets after SIGTERM (ft_launcher stops workers; async saves finish)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the trainer container (wins over the defaults)."""
    image_pull_policy: str = "IfNotPresent"
    """Image pull policy of the trainer container."""
    priority_class: str = ""
    """Pod priority class, empty for the cluster default."""

    def __post_init__(self) -> None:
        validate(self)

    @property
    def nproc_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node


def validate(spec: JobSpec) -> None:
    """Raise ``ValueError`` naming the field for anything the API server or operator would refuse."""
    k8s_names.check_dns1035_label(spec.name, "job name")
    k8s_names.check_dns1123_label(spec.namespace, "namespace")
    if not isinstance(spec.nodes, int) or not 1 <= spec.nodes <= MAX_NODES:
        raise ValueError(f"nodes must be an integer from 1 to {MAX_NODES}, got {spec.nodes!r}")
    # Pods and their headless services are named <job>-worker-<i>, which must stay a DNS-1035 label.
    longest_pod = f"{spec.name}-worker-{spec.nodes - 1}"
    if len(longest_pod) > 63:
        raise ValueError(
            f"job name {spec.name!r} is too long for {spec.nodes} nodes: pod/service name {longest_pod!r} "
            f"exceeds 63 characters (use at most {63 - len(f'-worker-{spec.nodes - 1}')})"
        )
    if spec.min_nodes < 0 or spec.min_nodes > spec.nodes:
        raise ValueError(f"min_nodes must be 0 (fixed size) or between 1 and nodes ({spec.nodes}), got {spec.min_nodes}")
    if not 0 <= spec.gpus_per_node <= 64:
        raise ValueError(f"gpus_per_node must be between 0 and 64, got {spec.gpus_per_node}")
    if spec.procs_per_node < 0:
        raise ValueError(f"procs_per_node must be >= 0, got {spec.procs_per_node}")
    if spec.nproc_per_node < 1:
        raise ValueError("gpus_per_node is 0 (CPU pods): set procs_per_node to the processes per pod")
    if spec.gpus_per_node and spec.procs_per_node > spec.gpus_per_node:
        raise ValueError(
            f"procs_per_node ({spec.procs_per_node}) exceeds gpus_per_node ({spec.gpus_per_node}): one process per GPU"
        )
    if not 0 <= spec.efa_per_node <= 32:
        raise ValueError(f"efa_per_node must be between 0 and 32, got {spec.efa_per_node}")
    if not spec.image or any(ch.isspace() for ch in spec.image):
        raise ValueError(f"image must be a non-empty image reference without spaces, got {spec.image!r}")
    for what, value in (("cpu", spec.cpu), ("memory", spec.memory), ("shm_size", spec.shm_size)):
        if value and not _QUANTITY.fullmatch(value):
            raise ValueError(f"{what} {value!r} is not a Kubernetes quantity (e.g. 32, 500m, 64Gi)")
    if not spec.storage.shared:
        raise ValueError(
            f"storage backend {spec.storage.backend!r} is not shared between pods: a PyTorchJob needs pvc or fsx"
        )
    if spec.storage.namespace != spec.namespace:
        raise ValueError(
            f"the claim {spec.storage.pvc_name!r} is in namespace {spec.storage.namespace!r}, "
            f"the job in {spec.namespace!r}: pods can only mount claims of their own namespace"
        )
    k8s_names.check_dns1123_subdomain(spec.storage.pvc_name, "claim name")
    mount = k8s_names.check_mount_path(spec.storage.mount_path, "mount path")
    run_dir = k8s_names.check_absolute_path(spec.train.run_dir, "run_dir")
    if not run_dir.startswith(mount + "/"):
        raise ValueError(f"run_dir {spec.train.run_dir!r} must lie under the storage mount {mount!r}")
    for key, value in spec.node_selector.items():
        k8s_names.check_label_key(key, "node selector key")
        k8s_names.check_label_value(value, f"node selector value for {key!r}")
    for tol in spec.tolerations:
        _check_toleration(tol)
    if spec.service_account:
        k8s_names.check_dns1123_subdomain(spec.service_account, "service account")
    if spec.priority_class:
        k8s_names.check_dns1123_subdomain(spec.priority_class, "priority class")
    if spec.run_id:
        k8s_names.check_label_value(_run_label(spec.run_id), "run id")
    if not 1 <= spec.rdzv_port <= 65535:
        raise ValueError(f"rdzv_port must be a TCP port, got {spec.rdzv_port}")
    for what in ("backoff_limit", "active_deadline_seconds", "ttl_seconds_after_finished", "termination_grace_seconds"):
        if getattr(spec, what) < 0:
            raise ValueError(f"{what} must be >= 0, got {getattr(spec, what)}")
    if spec.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        raise ValueError(f"image_pull_policy must be Always, IfNotPresent or Never, got {spec.image_pull_policy!r}")
    _check_faults(spec)
    for key in spec.env:
        if not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", key):
            raise ValueError(f"environment variable name {key!r} is invalid")
        if key.startswith("PET_"):
            raise ValueError(f"{key}: PET_* variables are set by the Training Operator from the job spec")


def _check_faults(spec: JobSpec) -> None:
    """A fault schedule that cannot act as written (rank beyond the world, step after the end) is
    refused here, before a multi-node job is submitted. A YAML schedule is a path inside the pods.
    """
    from resilient_training.run import faults

    text = spec.train.faults.strip()
    if not text or text.endswith((".yaml", ".yml")):
        return
    try:
        schedule = faults.parse(text)
        faults.validate(schedule, world_size=spec.nodes * spec.nproc_per_node, steps=spec.train.steps,
                        async_checkpoint=spec.train.checkpoint.async_save, checkpoint_every=spec.train.checkpoint.every)
    except faults.FaultSpecError as exc:
        raise ValueError(f"faults: {exc}") from None


def _check_toleration(tol: dict[str, Any]) -> None:
    unknown = set(tol) - {"key", "operator", "value", "effect", "tolerationSeconds"}
    if unknown:
        raise ValueError(f"toleration {tol} has unknown fields {sorted(unknown)}")
    operator = tol.get("operator", "Equal")
    if operator not in ("Equal", "Exists"):
        raise ValueError(f"toleration operator must be Equal or Exists, got {operator!r}")
    if operator == "Exists" and tol.get("value"):
        raise ValueError(f"toleration {tol}: operator Exists takes no value")
    if operator == "Equal" and not tol.get("key"):
        raise ValueError(f"toleration {tol}: operator Equal needs a key")
    if tol.get("key"):
        k8s_names.check_label_key(tol["key"], "toleration key")
    if tol.get("value"):
        k8s_names.check_label_value(tol["value"], "toleration value")
    effect = tol.get("effect", "")
    if effect and effect not in _TOLERATION_EFFECTS:
        raise ValueError(f"toleration effect must be one of {', '.join(_TOLERATION_EFFECTS)}, got {effect!r}")


def job_name_for_run(run_id: str) -> str:
    """The job's deterministic name: a retried step attaches to the same job, teardown finds it."""
    return k8s_names.name_for_run("rt", run_id)


def parse_toleration(text: str) -> dict[str, Any]:
    """``key=value:Effect``, ``key:Effect`` (operator Exists), ``key=value`` or ``key``."""
    body, _, effect = text.partition(":")
    key, has_value, value = body.partition("=")
    tol: dict[str, Any] = {"key": key, "operator": "Equal" if has_value else "Exists"}
    if has_value:
        tol["value"] = value
    if effect:
        tol["effect"] = effect
    _check_toleration(tol)
    return tol


def _run_label(run_id: str) -> str:
    # KFP run ids are UUIDs; anything longer is cut so it still fits a label value.
    return re.sub(r"[^A-Za-z0-9._-]", "-", run_id)[:63].strip("-._")


def container_command(spec: JobSpec) -> tuple[list[str], list[str]]:
    """``(command, args)`` of the trainer container: ft_launcher (or torchrun when it is off)."""
    from resilient_training.runtime import nvrx_adapter

    trainer_argv = train_config.to_argv(spec.train)
    if spec.train.restart.ft_launcher:
        # nnodes, nproc-per-node and rendezvous stay None: ft_launcher reads the operator's PET_* env.
        flags = nvrx_adapter.ft_launcher_flags(
            spec.train, version=spec.nvrx_version, on_gpu=spec.gpus_per_node > 0,
            # NVRx 0.7.0 stops no-progress restart loops only when it can read this file.
            iteration_file=checkpoint_format.iteration_file(spec.train.run_dir),
        )
        return ["ft_launcher"], [*flags, "-m", WORKER_MODULE, *trainer_argv]
    # Plain torchrun reads the same PET_* env.
    command = nvrx_adapter.worker_command(spec.train, trainer_argv, python="python")
    return command[:1], command[1:]


def container_env(spec: JobSpec) -> dict[str, str]:
    env = {
        "PYTHONUNBUFFERED": "1",
        "NCCL_DEBUG": "WARN",
        # Workers find the storage ref and run id without parsing flags (events, reports).
        "RT_RUN_ID": spec.run_id,
        "RT_STORAGE_REF": spec.storage.to_json(),
    }
    if spec.efa_per_node:
        # libfabric's EFA provider for NCCL (aws-ofi-nccl); fork-safe because data loaders fork.
        env |= {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
    return env | spec.env


def build_job(spec: JobSpec) -> Any:
    """The PyTorchJob as kubeflow-training SDK models (``KubeflowOrgV1PyTorchJob``)."""
    from kubeflow.training import models
    from kubernetes import client as k8s

    command, args = container_command(spec)
    labels = {APP_LABEL: "resilient-training"}
    if spec.run_id:
        labels[RUN_ID_LABEL] = _run_label(spec.run_id)

    limits: dict[str, str] = {}
    if spec.gpus_per_node:
        limits["nvidia.com/gpu"] = str(spec.gpus_per_node)
    if spec.efa_per_node:
        limits["vpc.amazonaws.com/efa"] = str(spec.efa_per_node)
    if spec.cpu:
        limits["cpu"] = spec.cpu
    if spec.memory:
        limits["memory"] = spec.memory

    container = k8s.V1Container(
        name=CONTAINER_NAME,
        image=spec.image,
        image_pull_policy=spec.image_pull_policy,
        command=command,
        args=args,
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in container_env(spec).items()],
        ports=[k8s.V1ContainerPort(name=PORT_NAME, container_port=spec.rdzv_port, protocol="TCP")],
        # Extended resources need requests == limits; giving both keeps cpu/memory Guaranteed.
        resources=k8s.V1ResourceRequirements(limits=limits or None, requests=dict(limits) or None),
        # IPC_LOCK: NCCL/EFA pin (mlock) communication buffers.
        security_context=k8s.V1SecurityContext(capabilities=k8s.V1Capabilities(add=["IPC_LOCK"])),
        volume_mounts=[
            k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
            k8s.V1VolumeMount(name="run-storage", mount_path=spec.storage.mount_path),
        ],
    )
    pod_spec = k8s.V1PodSpec(
        containers=[container],
        volumes=[
            k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=spec.shm_size)),
            k8s.V1Volume(
                name="run-storage",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=spec.storage.pvc_name),
            ),
        ],
        node_selector=dict(spec.node_selector) or None,
        tolerations=[k8s.V1Toleration(**{_snake(k): v for k, v in t.items()}) for t in spec.tolerations] or None,
        service_account_name=spec.service_account or None,
        priority_class_name=spec.priority_class or None,
        termination_grace_period_seconds=spec.termination_grace_seconds,
    )
    worker = models.KubeflowOrgV1ReplicaSpec(
        replicas=spec.nodes,
        restart_policy="ExitCode",
        template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=dict(labels)), spec=pod_spec),
    )
    elastic = models.KubeflowOrgV1ElasticPolicy(
        rdzv_backend="c10d",
        rdzv_port=spec.rdzv_port,
        rdzv_id=_run_label(spec.run_id) or spec.name,
        min_replicas=spec.min_nodes or spec.nodes,
        max_replicas=spec.nodes,
        max_restarts=spec.train.restart.max_restarts,
    )
    run_policy = models.KubeflowOrgV1RunPolicy(
        backoff_limit=spec.backoff_limit,
        active_deadline_seconds=spec.active_deadline_seconds or None,
        ttl_seconds_after_finished=spec.ttl_seconds_after_finished or None,
        # Free the GPUs of surviving workers as soon as the job is decided; finished pods keep their logs.
        clean_pod_policy="Running",
    )
    return models.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1",
        kind="PyTorchJob",
        metadata=k8s.V1ObjectMeta(name=spec.name, namespace=spec.namespace, labels=labels),
        spec=models.KubeflowOrgV1PyTorchJobSpec(
            # The top-level form only: the operator refuses nprocPerNode in both places.
            nproc_per_node=str(spec.nproc_per_node),
            elastic_policy=elastic,
            pytorch_replica_specs={"Worker": worker},
            run_policy=run_policy,
        ),
    )


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def to_dict(job: Any) -> dict[str, Any]:
    """The job as plain JSON-able data with the API's field names (what ``kubectl apply`` reads)."""
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(job)


def to_yaml(job: Any) -> str:
    import yaml

    return yaml.safe_dump(to_dict(job), sort_keys=False, default_flow_style=False)
