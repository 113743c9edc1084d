"""The TrainJob builder: a :class:`~resilient_training.launch.jobshape.JobSpec` in, a Kubeflow
Trainer v2 ``trainer.kubeflow.org/v1alpha1`` TrainJob out, plus the NVRx ClusterTrainingRuntime it names.

The runtime (:func:`build_runtime`, shipped as ``manifests/runtimes/``) holds what every job
shares: the ``node`` container runs ``ft_launcher`` meeting its peers through c10d at
``$(PET_MASTER_ADDR):$(PET_MASTER_PORT)`` (node 0's headless hostname and port 29500, which the
Trainer's Torch policy injects with ``PET_NNODES``, ``PET_NPROC_PER_NODE`` and
``PET_NODE_RANK``; ft_launcher reads those three like torchrun), and the restart policy:

- Process and rank faults stay inside the pods: NVRx restarts in-process, ft_launcher restarts
  the workers of every pod (a new rendezvous round); no pod is replaced for them.
- A pod that exits 1-127 (the trainer's deterministic 93, or ft_launcher's 1 after its restart
  budget) fails the Job through its ``podFailurePolicy`` (reason ``PodFailurePolicy``), and the
  JobSet ``failurePolicy`` rule fails the whole JobSet: restarting would repeat it.
- A pod that NVRx cannot save (killed: exit >= 128, OOM kill, node loss; or disrupted:
  eviction, preemption, drain, whatever its exit code) fails the Job (``backoffLimit: 0``), and
  the JobSet recreates all pods (``BlockingRecreate``: the old generation is gone before the new
  one meets) up to ``maxRestarts`` times; training resumes from the last checkpoint.

The TrainJob carries the per-job parts: image, the ft_launcher and trainer flags, env, node and
process counts, resources, and a runtime patch with the claim and ``/dev/shm`` volumes, node
selector, tolerations, service account and grace period. Both objects are the Trainer's own
API models (the ``kubeflow-trainer-api`` package the ``kubeflow`` SDK is built on).
"""

from __future__ import annotations

from typing import Any

from resilient_training.launch import images, jobshape, k8s_names
from resilient_training.launch.jobshape import JobSpec
from resilient_training.runtime import nvrx_adapter

API_VERSION = "trainer.kubeflow.org/v1alpha1"
GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
RUNTIME_NAME = "nvrx-ft-launcher"
RUNTIME_MAX_RESTARTS = 3  # JobSet restarts (all pods recreated) for what NVRx cannot recover
CONTAINER_NAME = "node"  # the Trainer finds the trainer container by this name (its webhook requires it)
REPLICATED_JOB = "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
MASTER_PORT = 29500  # the Trainer's PET_MASTER_PORT (constants.ContainerTrainerPort)
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # on every pod; the JobSet is named after the TrainJob
POD_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # the pod's node rank (PET_NODE_RANK)
PATCH_MANAGER = "resilient-training.io/launcher"
# Exit codes that mean "a deterministic failure: do not restart" (as the PyTorchJob's ExitCode policy).
DETERMINISTIC_EXIT_CODES = list(range(1, 128))
# ft_launcher (or torchrun) finds its peers at node 0; nnodes, nproc-per-node, node-rank come from PET_*.
RENDEZVOUS_FLAGS = ["--rdzv-backend=c10d", "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"]
TORCHRUN = ["python", "-m", "torch.distributed.run"]


def build_runtime(*, name: str = RUNTIME_NAME, image: str = images.TRAINER_IMAGE,
                  max_restarts: int = RUNTIME_MAX_RESTARTS) -> Any:
    """The NVRx ``ClusterTrainingRuntime`` (``TrainerV1alpha1ClusterTrainingRuntime``)."""
    from kubeflow_trainer_api import models

    container = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [nvrx_adapter.FT_LAUNCHER_SCRIPT, *RENDEZVOUS_FLAGS],
        "securityContext": jobshape.to_plain(jobshape.security_context()),
    }
    job_spec = {
        # Any pod failure fails the Job; the JobSet failure policy below decides what happens next.
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": [
            # Evicted, preempted, drained: the node's fault, whatever the exit code (SIGTERM makes ft_launcher exit 1).
            {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In",
                                                  "values": DETERMINISTIC_EXIT_CODES}},
        ]},
        # podFailurePolicy needs Never; the kubelet must not restart ft_launcher in place either.
        "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
    }
    runtime = {
        "apiVersion": API_VERSION,
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch",
                                              jobshape.APP_LABEL: "resilient-training"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {
                "failurePolicy": {
                    "maxRestarts": max_restarts,
                    "restartStrategy": "BlockingRecreate",
                    "rules": [{"name": "deterministicFailure", "action": "FailJobSet",
                               "onJobFailureReasons": ["PodFailurePolicy"], "targetReplicatedJobs": [REPLICATED_JOB]}],
                },
                "replicatedJobs": [{
                    "name": REPLICATED_JOB,
                    "replicas": 1,  # the Trainer's webhook: the trainer's replicated job is one Job of numNodes pods
                    "template": {"metadata": {"labels": {ANCESTOR_LABEL: "trainer"}}, "spec": job_spec},
                }],
            }},
        },
    }
    return typed(models.TrainerV1alpha1ClusterTrainingRuntime, runtime)


def command_and_args(spec: JobSpec, *, runtime: str = RUNTIME_NAME) -> tuple[list[str] | None, list[str]]:
    """``(command, args)`` of the TrainJob's trainer: command None keeps our runtime's ft_launcher.

    Another runtime's command is not ours to rely on: the Trainer's stock ``torch-distributed``
    has none, so the image's entrypoint would have run the ft_launcher flags as a program. There
    the command is given in full.
    """
    command, args = jobshape.container_command(spec)
    rdzv_id = f"--rdzv-id={jobshape.rendezvous_id(spec)}"
    if spec.train.restart.ft_launcher:
        if runtime != RUNTIME_NAME:
            return [nvrx_adapter.FT_LAUNCHER_SCRIPT, *RENDEZVOUS_FLAGS], [rdzv_id, *args]
        return None, [rdzv_id, *args]
    # torchrun reads the same PET_* variables; only the rendezvous flags must be given.
    head = command + args
    if head[:len(TORCHRUN)] != TORCHRUN:
        raise ValueError(f"expected a torchrun command, got {head[:3]}")
    return [*TORCHRUN, *RENDEZVOUS_FLAGS, rdzv_id], head[len(TORCHRUN):]


def build_job(spec: JobSpec, *, runtime: str = RUNTIME_NAME) -> Any:
    """The TrainJob (``TrainerV1alpha1TrainJob``) that runs ``spec`` on the runtime ``runtime``."""
    from kubeflow_trainer_api import models

    if spec.kind != "trainjob":
        raise ValueError(f"a {spec.kind} spec is built by its own builder, not as a TrainJob")
    k8s_names.check_dns1123_subdomain(runtime, "runtime")
    command, args = command_and_args(spec, runtime=runtime)
    limits = jobshape.resource_limits(spec)
    trainer: dict[str, Any] = {
        "image": spec.image,
        "args": args,
        "env": [{"name": k, "value": v} for k, v in jobshape.container_env(spec).items()],
        "numNodes": spec.nodes,
        "numProcPerNode": spec.nproc_per_node,
    }
    if command is not None:
        trainer["command"] = command
    if limits:
        trainer["resourcesPerNode"] = {"limits": limits, "requests": dict(limits)}
    pod_spec: dict[str, Any] = {
        # The runtime's node container gains the mounts; its env comes only through spec.trainer.env
        # (the Trainer's webhook refuses env in a patch of the node container).
        "containers": [{"name": CONTAINER_NAME, "volumeMounts": jobshape.to_plain(jobshape.volume_mounts(spec))}],
        "volumes": jobshape.to_plain(jobshape.volumes(spec)),
        "terminationGracePeriodSeconds": spec.termination_grace_seconds,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = jobshape.to_plain(jobshape.tolerations(spec))
    if spec.service_account:
        pod_spec["serviceAccountName"] = spec.service_account
    patch = {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
        "name": REPLICATED_JOB,
        "template": {"spec": {"template": {"metadata": {"labels": jobshape.labels(spec),
                                                         "annotations": dict(jobshape.POD_ANNOTATIONS)},
                                            "spec": pod_spec}}},
    }]}}}}
    job: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": jobshape.labels(spec)},
        "spec": {
            "runtimeRef": {"name": runtime, "apiGroup": GROUP, "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "runtimePatches": [patch],
        },
    }
    if spec.active_deadline_seconds:
        job["spec"]["activeDeadlineSeconds"] = spec.active_deadline_seconds
    return typed(models.TrainerV1alpha1TrainJob, job)


def typed(model: Any, data: dict[str, Any]) -> Any:
    """``data`` as the Trainer API ``model``; a field the model does not know is an error.

    The generated models drop unknown fields silently, so a misspelt field would vanish from
    the object; the round trip must give back exactly what went in.
    """
    obj = model.from_dict(data)
    if to_dict(obj) != data:
        raise ValueError(f"{model.__name__}: fields the Trainer API does not know (or wrong types) in {data}")
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """A TrainJob or runtime as plain data with the API's field names (what ``kubectl apply`` reads)."""
    import json

    # The models' own JSON: quantities and int-or-string fields come out as the API writes them.
    return json.loads(obj.to_json())


def to_yaml(obj: Any) -> str:
    return jobshape.dump_yaml(to_dict(obj))


def runtime_yaml() -> str:
    """``manifests/runtimes/nvrx-ft-launcher.yaml`` (tests keep the shipped file equal to this)."""
    import yaml

    header = ("# Generated by resilient_training.launch.trainjob.runtime_yaml(); "
              "tests/test_trainjob.py keeps it equal.\n")
    # Flow style for lists of scalars keeps the 127 exit codes on one line.
    return header + yaml.safe_dump(to_dict(build_runtime()), sort_keys=False, default_flow_style=None, width=120)
