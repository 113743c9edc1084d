"""The job's shape, shared by both cluster launchers: one typed model in, the pod's parts out.

:class:`JobSpec` holds what a training job needs (nodes, GPUs, image, the checkpoint claim,
``/dev/shm``, EFA, scheduling, service account, the trainer configuration) and refuses what the
API server or an operator would refuse. The pod parts built from it (the trainer container's
command, environment, resources and mounts; the pod's volumes, tolerations, node selector) are
the same for a Training Operator PyTorchJob (:mod:`~resilient_training.launch.pytorchjob`) and a
Kubeflow Trainer TrainJob (:mod:`~resilient_training.launch.trainjob`); each builder only wraps
them in its own object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from resilient_training.launch import images, k8s_names
from resilient_training.run import checkpoint_format
from resilient_training.run import config as train_config
from resilient_training.run.storage_ref import StorageRef

APP_LABEL = "app.kubernetes.io/name"
RUN_ID_LABEL = "resilient-training.io/run-id"
WORKER_MODULE = "resilient_training.runtime.worker"
DEFAULT_NVRX_VERSION = "0.7.0"  # what images/trainer installs
MIN_NVRX_VERSION = (0, 4, 0)  # the oldest NVRx whose ft_launcher flags the adapter knows
# MAJOR.MINOR[.PATCH], then an optional pre-release or local part (0.7.0rc1, 0.7.0+cu13)
_NVRX_VERSION = re.compile(r"\d+\.\d+(\.\d+)?([a-z]+\d*|\.post\d+|\.dev\d+)*(\+[A-Za-z0-9.]+)?")


# The distribution reference grammar (what the kubelet parses): an optional registry host, path
# components in lowercase, an optional tag and an optional digest.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    r"(?:(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:]+\])"
    r"(?::[0-9]+)?/)?"
    rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    # go-digest, which the kubelet uses: these algorithms, lowercase hex of exactly their length
    r"(?:@(?:sha256:[a-f0-9]{64}|sha384:[a-f0-9]{96}|sha512:[a-f0-9]{128}))?"
)


def image_reference_ok(image: str) -> bool:
    """True for a reference the kubelet can pull (the grammar above, name at most 255 characters)."""
    if not _IMAGE.fullmatch(image):
        return False
    first, slash, _ = image.partition("/")
    if slash and not ("." in first or ":" in first or first == "localhost") and not re.fullmatch(_PATH_COMPONENT, first):
        return False  # not a registry host: a path component, which must be lowercase
    return len(images.repository(image)) <= 255


def check_image(image: str, what: str) -> str:
    """``image``, or ``ValueError`` naming ``what`` unless the kubelet can pull it: the one rule for
    ``--image``, a pipeline's ``trainer_image`` and the compile-time ``$RT_*_IMAGE`` variables.
    """
    if not image or any(ch.isspace() for ch in image):
        raise ValueError(f"{what} must be a non-empty image reference without spaces, got {image!r}")
    if not image_reference_ok(image):
        # The kubelet would take the pod and fail it with InvalidImageName, after the job was created.
        raise ValueError(f"{what} {image!r} is not an image reference: [REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], "
                         "NAME in lowercase (e.g. ghcr.io/org/trainer:1.0)")
    return image


def _version(text: str) -> tuple[int, ...]:
    numbers = [int(part) for part in re.match(r"\d+\.\d+(\.\d+)?", text).group(0).split(".")]
    return tuple(numbers + [0] * (3 - len(numbers)))
MAX_NODES = 4096
# The worker pods' service account that manifests/rbac creates, with no API token mounted: the default of
# render-job and of the pipelines' service_account parameter (JobSpec's own default stays the namespace's).
TRAINER_SERVICE_ACCOUNT = "resilient-training-trainer"
DSHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
# The node-local tier's own emptyDir when --local-checkpoint-dir lies outside /dev/shm (see local_tier_mount).
LOCAL_TIER_VOLUME = "local-tier"
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
NAME_MAX, PATH_MAX = 255, 4096  # Linux's, in bytes: ext4, XFS, Lustre (FSx) and tmpfs alike
STORAGE_VOLUME = "run-storage"
KINDS = ("pytorchjob", "trainjob")
_TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# k8s.io/apimachinery's resource.ParseQuantity (a stranger trial found 1e3, +1Gi, .5 and 1n refused): a sign,
# a number ("5", "5.", ".5"), then a binary (Ki..Ei), decimal (n u m k M G T P E) or exponent (e3, E-3) suffix.
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?")


_SUFFIX_FACTORS = {"": 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "k": 10**3,
                   "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _exponent(suffix: str) -> int | None:
    """The exponent of an ``e``/``E`` suffix (``e-3`` is -3), None for a suffix without one (``E`` is exa)."""
    if suffix in _SUFFIX_FACTORS:
        return None
    digits = suffix[1:].lstrip("+-").lstrip("0") or "0"
    if len(digits) > 10:  # past int32 whatever the digits; int() of thousands of digits is refused
        return INT64_MAX
    return -int(digits) if suffix[1] == "-" else int(digits)


def is_quantity(text: str) -> bool:
    """True for what Kubernetes parses as a quantity (``32``, ``500m``, ``64Gi``, ``1e9``, ``.5``, ``+1Gi``)."""
    match = _QUANTITY.fullmatch(text)
    exponent = _exponent(match.group(2) or "") if match else None
    # Go reads an exponent as int64, then keeps it as int32: past that it is refused or wraps around.
    return bool(match) and (exponent is None or -(2**31) <= exponent <= INT32_MAX)


def quantity(text: str) -> Fraction:
    """The value of a quantity :func:`is_quantity` takes (``500m`` is 1/2, ``1Ki`` 1024, ``1e3`` 1000)."""
    number, suffix = _QUANTITY.fullmatch(text).groups()
    exponent = _exponent(suffix or "")
    if exponent is not None:
        # Past this bound the value is beyond 10**30 (or below 10**-30, yet not zero) either way; what it is
        # compared with (0, the floors, int64) cannot tell, and 10**2147483647 would take hours to compute.
        bound = len(number) + 30
        return Fraction(number) * Fraction(10) ** max(-bound, min(bound, exponent))
    return Fraction(number) * _SUFFIX_FACTORS[suffix or ""]


# /dev/shm per pod: NCCL, data loaders, the async checkpoint staging and the node-local tier.
DEFAULT_SHM_SIZE = "64Gi"

@dataclass(kw_only=True, slots=True)
class JobSpec:
    """What one training job needs; ``pytorchjob.build_job`` or ``trainjob.build_job`` wraps it."""

    name: str
    """Job name (DNS-1035); pods are ``<name>-worker-<i>`` (PyTorchJob) or ``<name>-node-0-<i>-<random>`` (TrainJob)."""
    kind: str = "pytorchjob"
    """The object that runs it: ``pytorchjob`` (Training Operator v1) or ``trainjob`` (Kubeflow Trainer v2)."""
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
    """Fewest nodes to run on (elastic, PyTorchJob only: Trainer v2 has no elastic policy); 0 = exactly ``nodes``."""
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
    shm_size: str = DEFAULT_SHM_SIZE
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
    """c10d rendezvous port on worker 0 (PyTorchJob; a TrainJob uses the Trainer's ``PET_MASTER_PORT``)."""
    backoff_limit: int = 3
    """Pod replacements (exit code >= 128) before the job fails; for a TrainJob it is the runtime's
    JobSet ``failurePolicy.maxRestarts`` (a TrainJob cannot change it), so it must match the runtime."""
    active_deadline_seconds: int = 0
    """Whole-job deadline in seconds; 0 = none."""
    ttl_seconds_after_finished: int = 7 * 24 * 3600
    """Delete the finished job (and its pods) after this many seconds; 0 = keep (PyTorchJob only)."""
    termination_grace_seconds: int = 120
    """Time a worker gets after SIGTERM (ft_launcher stops workers; async saves finish)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the trainer container (wins over the defaults)."""
    image_pull_policy: str = "IfNotPresent"
    """Image pull policy of the trainer container."""
    priority_class: str = ""
    """Pod priority class, empty for the cluster default (PyTorchJob only: a TrainJob's runtime patches cannot set it)."""

    def __post_init__(self) -> None:
        validate(self)

    @property
    def nproc_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node


def validate(spec: JobSpec) -> None:
    """Raise ``ValueError`` naming the field for anything the API server or operator would refuse."""
    if spec.kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    k8s_names.check_dns1035_label(spec.name, "job name")
    k8s_names.check_dns1123_label(spec.namespace, "namespace")
    if not isinstance(spec.nodes, int) or not 1 <= spec.nodes <= MAX_NODES:
        raise ValueError(f"nodes must be an integer from 1 to {MAX_NODES}, got {spec.nodes!r}")
    # PyTorchJob pods and services are <job>-worker-<i>; a TrainJob's JobSet names its pods
    # <job>-node-0-<i>-<5 random characters> (its webhook checks that length): either must stay a DNS-1035 label.
    suffix = pod_suffix(spec.kind, spec.nodes - 1)
    if len(spec.name + suffix) > 63:
        raise ValueError(
            f"job name {spec.name!r} is too long for {spec.nodes} nodes: pod/service name {spec.name + suffix!r} "
            f"exceeds 63 characters (use at most {63 - len(suffix)})"
        )
    if spec.kind == "trainjob":
        _check_trainjob_limits(spec)
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
    if not _NVRX_VERSION.fullmatch(spec.nvrx_version) or _version(spec.nvrx_version) < MIN_NVRX_VERSION:
        # The version picks ft_launcher's flags: a typo would silently select another NVRx's flags.
        raise ValueError(f"nvrx_version must be an NVRx release such as {DEFAULT_NVRX_VERSION} "
                         f"(at least {'.'.join(map(str, MIN_NVRX_VERSION))}), got {spec.nvrx_version!r}")
    check_image(spec.image, "image")
    for what, value in (("cpu", spec.cpu), ("memory", spec.memory), ("shm_size", spec.shm_size)):
        if (value or what == "shm_size") and not is_quantity(value):  # an empty sizeLimit fails the CRDs
            raise ValueError(f"{what} {value!r} is not a Kubernetes quantity (e.g. 32, 500m, 64Gi)")
        if value and quantity(value) < 0:  # the API server refuses a negative request or limit
            raise ValueError(f"{what} {value!r} is negative: not a Kubernetes quantity a pod can request "
                             "(e.g. 32, 500m, 64Gi)")
        # Found by a stranger trial: shm_size 0 rendered sizeLimit '0', a /dev/shm without a limit.
        if value and quantity(value) == 0:
            raise ValueError(f"{what} {value!r} is zero: give a positive quantity (e.g. 32, 500m, 64Gi)")
        if value and what != "cpu" and quantity(value) > INT64_MAX:
            raise ValueError(f"{what} {value!r} is past the largest byte count Kubernetes takes (int64)")
    # A stranger trial rendered --memory 1 (one byte): the pod is OOM-killed before python starts.
    for what, value, floor, why in (
            ("memory", spec.memory, "1Gi", "PyTorch and CUDA alone take several GiB"),
            ("shm_size", spec.shm_size, "256Mi", "NCCL and the data loader's workers share tensors through /dev/shm")):
        if value and quantity(value) < quantity(floor):
            raise ValueError(f"{what} {value!r} is below {floor}: {why}")
    if spec.memory and quantity(spec.shm_size) > quantity(spec.memory):
        raise ValueError(f"shm_size {spec.shm_size!r} exceeds memory {spec.memory!r}: /dev/shm is memory-backed and "
                         "counts against the pod's memory limit, so filling it would kill the pod")
    if not spec.storage.shared:
        raise ValueError(
            f"storage backend {spec.storage.backend!r} is not shared between pods: a cluster job needs pvc or fsx"
        )
    if spec.storage.namespace != spec.namespace:
        raise ValueError(
            f"the claim {spec.storage.pvc_name!r} is in namespace {spec.storage.namespace!r}, "
            f"the job in {spec.namespace!r}: pods can only mount claims of their own namespace"
        )
    k8s_names.check_dns1123_subdomain(spec.storage.pvc_name, "claim name")
    mount = k8s_names.check_mount_path(spec.storage.mount_path, "mount path")
    run_dir = _check_pod_path(spec.train.run_dir, "run_dir")
    if not run_dir.startswith(mount + "/"):
        raise ValueError(f"run_dir {spec.train.run_dir!r} must lie under the storage mount {mount!r}")
    if spec.train.checkpoint.local_dir:  # a relative one would be read from the pod's working directory
        _check_pod_path(spec.train.checkpoint.local_dir, "local_checkpoint_dir")
        _check_local_tier_dir(spec.train.checkpoint.local_dir, mount)
    if spec.train.export_format == "hf" and spec.train.task == train_config.DEFAULT_TASK:
        # As the pipelines refuse it (a stranger trial: render-job took it, and every worker then exited 93).
        raise ValueError("export_format hf writes a transformers model, and the built-in GPT task's is not one: "
                         "use safetensors or torch, or a transformers task (--task)")
    for key, value in spec.node_selector.items():
        if not isinstance(key, str) or not isinstance(value, str):  # from a pipeline's JSON parameter
            raise ValueError(f"node selector {{{key!r}: {value!r}}}: labels and values are strings")
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
    # The CRDs' integer widths: past them the operators (Go) cannot decode the object they were
    # given, though the API server stores it (found by a stranger trial: --backoff-limit 2147483648).
    for what, limit in (("backoff_limit", INT32_MAX), ("active_deadline_seconds", INT64_MAX),
                        ("ttl_seconds_after_finished", INT32_MAX), ("termination_grace_seconds", INT64_MAX)):
        if not 0 <= getattr(spec, what) <= limit:
            raise ValueError(f"{what} must be between 0 and {limit}, got {getattr(spec, what)}")
    if spec.train.restart.max_restarts > INT32_MAX:  # elasticPolicy.maxRestarts
        raise ValueError(f"max_restarts must be at most {INT32_MAX}, got {spec.train.restart.max_restarts}")
    if spec.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        raise ValueError(f"image_pull_policy must be Always, IfNotPresent or Never, got {spec.image_pull_policy!r}")
    world = spec.nodes * spec.nproc_per_node
    if spec.train.restart.min_world_size > world:  # (stranger trial: only launcher=local checked it)
        raise ValueError(f"min_world_size {spec.train.restart.min_world_size} exceeds the world size {world} "
                         f"(nodes {spec.nodes} x {spec.nproc_per_node} per node): the in-process layer could never "
                         "go on after a fault")
    _check_faults(spec)
    for key in spec.env:
        if not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", key):
            raise ValueError(f"environment variable name {key!r} is invalid")
        if key.startswith("PET_"):
            raise ValueError(f"{key}: PET_* variables are set by the Training Operator (or the Trainer) from the job spec")


def _check_pod_path(path: str, what: str) -> str:
    """``path`` without a trailing slash, refused unless a normal absolute path that Linux can open in the
    pods (a stranger trial rendered a 300-byte directory name, which every write in the pods then fails).
    """
    path = k8s_names.check_absolute_path(path, what)
    size = len(path.encode("utf-8", "surrogatepass"))
    if size >= PATH_MAX:
        raise ValueError(f"{what} is {size} bytes long, past Linux's limit ({PATH_MAX - 1})")
    for part in path.split("/"):
        if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise ValueError(f"{what}: the name {part[:24]}... is {len(part.encode('utf-8', 'surrogatepass'))} "
                             f"bytes, longer than the file systems in the pods allow ({NAME_MAX})")
    return path


def _canonical(path: str) -> str:
    """A path ``k8s_names.check_absolute_path`` accepted, without its trailing slash: it refuses every
    other spelling (``//``, ``.``, ``..``), so equal strings are equal paths.
    """
    return path.rstrip("/") or "/"


def _within(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies under it (both canonical)."""
    return path == root or root == "/" or path.startswith(root + "/")


def _check_local_tier_dir(local_dir: str, claim_mount: str) -> None:
    """The node-local tier's directory in the pods: under ``/dev/shm`` (the pod's memory volume), or a
    directory that gets an emptyDir of its own (:func:`local_tier_mount`), so never on the checkpoint
    claim (the "node-local" copies would be written to shared storage) nor over a system directory.
    """
    local, claim = _canonical(local_dir), _canonical(claim_mount)
    if _within(local, SHM_PATH):
        return
    if _within(local, claim) or _within(claim, local):
        where = "is" if local == claim else "lies inside" if _within(local, claim) else "contains"
        raise ValueError(f"local_checkpoint_dir {local_dir!r} {where} the checkpoint claim's mount {claim!r}: the "
                         "node-local tier would be written to shared storage; use a directory under /dev/shm (the "
                         "default) or one outside the claim (it gets a node-local emptyDir), e.g. /scratch/rt-local")
    for reserved in k8s_names.RESERVED_MOUNTS:
        if _within(local, reserved) or _within(reserved, local):
            raise ValueError(f"local_checkpoint_dir {local_dir!r} collides with {reserved}: outside /dev/shm the "
                             "directory gets an emptyDir volume of its own mounted there; use a directory under "
                             "/dev/shm (the default) or another one, e.g. /scratch/rt-local")
    if hidden := k8s_names.under_image_dir(local):
        raise ValueError(f"local_checkpoint_dir {local_dir!r} would hide the image's {hidden}: outside /dev/shm the "
                         "directory gets an emptyDir volume of its own mounted there; use a directory inside it "
                         f"({hidden}/rt-local) or another one, e.g. /scratch/rt-local")


def local_tier_mount(spec: JobSpec) -> str | None:
    """Where the pods' node-local directory gets an emptyDir of its own (node disk), or None: no
    ``local_dir`` (the default is under ``/dev/shm``), one under ``/dev/shm``, or one the pods never
    write (no node-local tier, ``local_every`` 0, and no worker pid records, ``worker_gpu_reclaim`` off).
    Without it the directory would be in the container's writable layer (slow overlay, counted as
    ephemeral storage, not creatable by the non-root trainer outside ``/tmp``).
    """
    checkpoint = spec.train.checkpoint
    if not checkpoint.local_dir or not (checkpoint.local_every or spec.train.restart.worker_gpu_reclaim):
        return None
    path = _canonical(checkpoint.local_dir)
    return None if _within(path, SHM_PATH) else path


def pod_suffix(kind: str, index: int) -> str:
    """What follows the job name in pod ``index``'s name (a TrainJob's JobSet adds 5 random characters)."""
    return f"-worker-{index}" if kind == "pytorchjob" else f"-node-0-{index}-xxxxx"


def _check_trainjob_limits(spec: JobSpec) -> None:
    """What a TrainJob cannot express is refused, never dropped silently."""
    from resilient_training.launch import trainjob

    if spec.min_nodes:
        raise ValueError("min_nodes: a TrainJob is not elastic (Trainer v2.2 removed the elastic policy); "
                         "use kind pytorchjob or min_nodes 0")
    if spec.priority_class:
        raise ValueError("priority_class: a TrainJob's runtime patches cannot set it; "
                         "set it in the ClusterTrainingRuntime or use kind pytorchjob")
    if spec.image_pull_policy != "IfNotPresent":
        raise ValueError("image_pull_policy: a TrainJob takes the runtime's (IfNotPresent); use a new tag to pull again")
    if spec.backoff_limit != trainjob.RUNTIME_MAX_RESTARTS:
        raise ValueError(f"backoff_limit: a TrainJob's pod restarts are the runtime's JobSet failurePolicy.maxRestarts "
                         f"({trainjob.RUNTIME_MAX_RESTARTS} in {trainjob.RUNTIME_NAME}); patch the runtime to change it")


def _check_faults(spec: JobSpec) -> None:
    """A fault schedule that cannot act as written (rank beyond the world, step after the end) is
    refused here, before a multi-node job is submitted. A YAML schedule is a path inside the pods.
    """
    from resilient_training.run import faults

    text = spec.train.faults.strip()
    if text and (text.endswith((".yaml", ".yml")) or "/" in text) and not text.startswith("/"):
        # Read by the pods from their own working directory, not this one's (stranger trial: written unread).
        raise ValueError(f"faults: {text!r} is a fault file read inside the pods: give its absolute path there "
                         "(e.g. on the mounted volume)")
    if not text or text.endswith((".yaml", ".yml")) or "/" in text:
        return  # a file inside the pods (the compact form never holds '/'), not one on this machine
    try:
        schedule = faults.parse(text)
        faults.validate(schedule, world_size=spec.nodes * spec.nproc_per_node, steps=spec.train.steps,
                        async_checkpoint=spec.train.checkpoint.async_save, checkpoint_every=spec.train.checkpoint.every,
                        local_checkpoint_every=spec.train.checkpoint.local_every)
    except faults.FaultSpecError as exc:
        raise ValueError(f"faults: {exc}") from None


def _check_toleration(tol: dict[str, Any]) -> None:
    if not isinstance(tol, dict):  # from a pipeline's JSON parameter
        raise ValueError(f"a toleration is a mapping (key, operator, value, effect), got {tol!r}")
    unknown = set(tol) - {"key", "operator", "value", "effect", "tolerationSeconds"}
    if unknown:
        raise ValueError(f"toleration {tol} has unknown fields {sorted(unknown)}")
    operator = tol.get("operator", "Equal")
    for name in ("key", "operator", "value", "effect"):
        if not isinstance(tol.get(name, ""), str):
            raise ValueError(f"toleration {tol}: {name} must be a string")
    seconds = tol.get("tolerationSeconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)):
        raise ValueError(f"toleration {tol}: tolerationSeconds must be an integer")
    if seconds is not None and not -INT64_MAX - 1 <= seconds <= INT64_MAX:
        raise ValueError(f"toleration {tol}: tolerationSeconds is past the API's int64")
    if seconds is not None and tol.get("effect") != "NoExecute":
        # The API server's pod validation refuses it; the job's CRD does not, so pods would never be made.
        raise ValueError(f"toleration {tol}: tolerationSeconds needs effect NoExecute (how long the pod stays "
                         "after such a taint appears); Kubernetes refuses it with any other effect or none")
    if operator not in ("Equal", "Exists"):
        raise ValueError(f"toleration operator must be Equal or Exists, got {operator!r}")
    if operator == "Exists" and tol.get("value"):
        raise ValueError(f"toleration {tol}: operator Exists takes no value")
    if operator == "Equal" and not tol.get("key"):
        raise ValueError(f"toleration {tol}: operator Equal needs a key")
    if operator == "Exists" and not tol.get("key"):
        # As render-job's KEY[=VALUE][:EFFECT] refuses it: every taint, NoExecute too (pods stay on a node
        # being drained); the pipelines' JSON parameter took it (a stranger trial).
        raise ValueError(f"toleration {tol}: operator Exists without a key tolerates every taint, NoExecute "
                         "included; name the taint's key")
    if tol.get("key"):
        k8s_names.check_label_key(tol["key"], "toleration key")
    if tol.get("value"):
        k8s_names.check_label_value(tol["value"], "toleration value")
    effect = tol.get("effect", "")
    if effect and effect not in _TOLERATION_EFFECTS:
        raise ValueError(f"toleration effect must be one of {', '.join(_TOLERATION_EFFECTS)}, got {effect!r}")


# A run id given by hand (render-job's --run-id) is one directory name and, unchanged, the run-id label and the
# rendezvous id: a label value. A stranger trial's 'run id', 'run/id' and 'run-id' shared one label and rdzvId
# in three directories, and a 300-byte id was a name no file system takes. (Pipelines pass KFP's and Argo's
# UUIDs, which fit; their run directory is made by provision_storage.)
_RUN_ID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def check_run_id(run_id: str, what: str) -> str:
    """``run_id``, or ``ValueError`` naming ``what`` unless it is a label value (so a directory name too)."""
    if not _RUN_ID.fullmatch(run_id):
        shown = repr(run_id) if len(run_id) <= 80 else f"{run_id[:24]!r}... ({len(run_id)} characters)"
        raise ValueError(f"{what} {shown} must be at most 63 letters, digits, '.', '_' or '-', beginning and ending "
                         "with a letter or digit: it names one directory (without '.', '..' or '/') and is the "
                         "run's label and rendezvous id as given")
    return run_id


def job_name_for_run(run_id: str) -> str:
    """The job's deterministic name: a retried step attaches to the same job, teardown finds it."""
    return k8s_names.name_for_run("rt", run_id)


def parse_toleration(text: str) -> dict[str, Any]:
    """``key=value:Effect``, ``key:Effect`` (operator Exists), ``key=value`` or ``key``."""
    body, colon, effect = text.partition(":")
    key, has_value, value = body.partition("=")
    if not key.strip():
        # Kubernetes reads an empty key with Exists as "tolerate every taint": never from an unset variable.
        raise ValueError(f"toleration {text!r} names no KEY (KEY[=VALUE][:EFFECT])")
    if colon and not effect:
        # No effect tolerates every effect, NoExecute included: never from a typo or an unset variable.
        raise ValueError(f"toleration {text!r} has no EFFECT after ':' ({', '.join(_TOLERATION_EFFECTS)}); "
                         "leave the ':' out to tolerate every effect")
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
    """``(command, args)`` of the trainer container: ft_launcher through our wrapper (or torchrun
    when it is off).
    """
    from resilient_training.runtime import nvrx_adapter

    trainer_argv = train_config.to_argv(spec.train)
    if spec.train.restart.ft_launcher:
        # nnodes, nproc-per-node and rendezvous stay None: ft_launcher reads the operator's PET_* env.
        flags = nvrx_adapter.ft_launcher_flags(
            spec.train, version=spec.nvrx_version, on_gpu=spec.gpus_per_node > 0,
            # NVRx 0.7.0 stops no-progress restart loops only when it can read this file.
            iteration_file=checkpoint_format.iteration_file(spec.train.run_dir),
        )
        return [nvrx_adapter.FT_LAUNCHER_SCRIPT], [*flags, "-m", nvrx_adapter.worker_module(spec.train), *trainer_argv]
    # Plain torchrun reads the same PET_* env.
    command = nvrx_adapter.worker_command(spec.train, trainer_argv, python="python")
    return command[:1], command[1:]


def container_env(spec: JobSpec) -> dict[str, str]:
    """The trainer container's environment (``spec.env`` wins over the defaults)."""
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


def labels(spec: JobSpec) -> dict[str, str]:
    """Labels of the job and its pods (the run id label finds a run's objects)."""
    out = {APP_LABEL: "resilient-training"}
    if spec.run_id:
        out[RUN_ID_LABEL] = _run_label(spec.run_id)
    return out


# Istio's sidecar, injected into the pods of a Kubeflow profile's namespace, keeps a pod running after
# its trainer exits (the job never completes) and sits in the c10d/NCCL path: the Training Operator's own
# docs ask for this annotation on PyTorchJobs in user namespaces (a stranger trial found none).
POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}


def rendezvous_id(spec: JobSpec) -> str:
    return _run_label(spec.run_id) or spec.name


def resource_limits(spec: JobSpec) -> dict[str, str]:
    """Per-pod limits; requests are set equal (extended resources need it; cpu/memory stay Guaranteed)."""
    limits: dict[str, str] = {}
    if spec.gpus_per_node:
        limits["nvidia.com/gpu"] = str(spec.gpus_per_node)
    if spec.efa_per_node:
        limits["vpc.amazonaws.com/efa"] = str(spec.efa_per_node)
    if spec.cpu:
        limits["cpu"] = spec.cpu
    if spec.memory:
        limits["memory"] = spec.memory
    return limits


def security_context() -> Any:
    from kubernetes import client as k8s

    # IPC_LOCK: NCCL/EFA pin (mlock) communication buffers. The trainer image runs as UID 1000;
    # the kubelet refuses to start an image that would run as root.
    return k8s.V1SecurityContext(capabilities=k8s.V1Capabilities(add=["IPC_LOCK"]),
                                 run_as_non_root=True, allow_privilege_escalation=False)


def volume_mounts(spec: JobSpec) -> list[Any]:
    from kubernetes import client as k8s

    mounts = [k8s.V1VolumeMount(name=DSHM_VOLUME, mount_path=SHM_PATH),
              k8s.V1VolumeMount(name=STORAGE_VOLUME, mount_path=spec.storage.mount_path)]
    local = local_tier_mount(spec)
    if local:
        mounts.append(k8s.V1VolumeMount(name=LOCAL_TIER_VOLUME, mount_path=local))
    return mounts


def volumes(spec: JobSpec) -> list[Any]:
    """An in-memory ``/dev/shm`` of ``shm_size``, the run's checkpoint claim and, for a node-local
    directory outside ``/dev/shm`` (:func:`local_tier_mount`), an emptyDir on the node's disk.
    """
    from kubernetes import client as k8s

    out = [
        k8s.V1Volume(name=DSHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=spec.shm_size)),
        k8s.V1Volume(name=STORAGE_VOLUME,
                     persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=spec.storage.pvc_name)),
    ]
    if local_tier_mount(spec):
        # No size limit (no job field sizes it): the node's free disk bounds it (the kubelet evicts on disk pressure).
        out.append(k8s.V1Volume(name=LOCAL_TIER_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource()))
    return out


def tolerations(spec: JobSpec) -> list[Any]:
    from kubernetes import client as k8s

    # An empty key, value or effect means what leaving it out means (any key, any effect), and the
    # TrainJob's CRD allows only the named effects: left out.
    return [k8s.V1Toleration(**{_snake(k): v for k, v in t.items() if v != ""}) for t in spec.tolerations]


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


# go-yaml v2's float syntax, with which kubectl reads YAML. PyYAML (YAML 1.1) takes 1e3, 2e-3 or 5.e8 for text
# and writes it bare: kubectl would read --cpu 2e-3 (taken since a stranger trial) or the argument 1e-05 as a
# number, which the CRDs refuse.
_GO_YAML_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")


# go-yaml v2's booleans (resolve.go), and its integers as Go's strconv.ParseInt(s, 0, 64) reads them: PyYAML
# writes y, N, on, 0o17, 0X1F or 0B1 bare, and kubectl read a label value, a claim name or an env value as a
# bool or a number, which the API refuses (a stranger trial).
_GO_YAML_BOOL = re.compile(r"^(y|Y|yes|Yes|YES|n|N|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$")
_GO_YAML_INT = re.compile(r"^[-+]?(0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+|[0-9][0-9_]*)$")


def kubectl_dumper() -> Any:
    """A PyYAML dumper that quotes every string kubectl (go-yaml v2) would read as a number or a boolean."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _GO_YAML_FLOAT, list("-+.0123456789"))
    Dumper.add_implicit_resolver("tag:yaml.org,2002:bool", _GO_YAML_BOOL, list("yYnNtTfFoO"))
    Dumper.add_implicit_resolver("tag:yaml.org,2002:int", _GO_YAML_INT, list("-+0123456789"))
    return Dumper


def dump_yaml(data: Any) -> str:
    """``data`` as block YAML that kubectl reads back as written (see :func:`kubectl_dumper`)."""
    import yaml

    return yaml.dump(data, Dumper=kubectl_dumper(), sort_keys=False, default_flow_style=False)


def to_plain(obj: Any) -> Any:
    """Kubernetes client models (or lists of them) as JSON-able data with the API's field names."""
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(obj)
