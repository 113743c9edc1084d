"""The PyTorchJob builder: a :class:`~resilient_training.launch.jobshape.JobSpec` in, a ``kubeflow.org/v1`` PyTorchJob out.

Every worker pod runs ``ft_launcher <flags> -m resilient_training.runtime.worker <trainer flags>``
(``runtime.spare_stub`` with ``--warm-spare``).
The job is elastic (Worker replicas only, no Master), so the Training Operator injects
``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``
(``<job>-worker-0:<port>``), ``PET_RDZV_ID`` and ``PET_MAX_RESTARTS`` and ft_launcher reads them
like torchrun: the same job works for any node count. NVRx decides about restarts inside the
pod; ``restartPolicy: ExitCode`` lets Kubernetes replace a pod only when it was killed
(exit code >= 128: node loss, OOM kill), never after a deterministic failure (exit code 93 or
ft_launcher's own 1 after its restart budget).
"""

from __future__ import annotations

from typing import Any

from resilient_training.launch import jobshape
from resilient_training.launch.jobshape import (  # noqa: F401 - the names callers know from here
    DEFAULT_NVRX_VERSION,
    MAX_NODES,
    JobSpec,
    container_command,
    container_env,
    job_name_for_run,
    parse_toleration,
    validate,
)

CONTAINER_NAME = "pytorch"  # the operator finds the training container by this name
PORT_NAME = "pytorchjob-port"  # the operator derives the rendezvous port from this container port
POD_INDEX_LABEL = "training.kubeflow.org/replica-index"


def build_job(spec: JobSpec) -> Any:
    """The PyTorchJob as kubeflow-training SDK models (``KubeflowOrgV1PyTorchJob``)."""
    from kubeflow.training import models
    from kubernetes import client as k8s

    if spec.kind != "pytorchjob":
        raise ValueError(f"a {spec.kind} spec is built by its own builder, not as a PyTorchJob")
    command, args = container_command(spec)
    labels = jobshape.labels(spec)
    limits = jobshape.resource_limits(spec)
    container = k8s.V1Container(
        name=CONTAINER_NAME,
        image=spec.image,
        image_pull_policy=spec.image_pull_policy,
        command=command,
        args=args,
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in container_env(spec).items()],
        ports=[k8s.V1ContainerPort(name=PORT_NAME, container_port=spec.rdzv_port, protocol="TCP")],
        resources=k8s.V1ResourceRequirements(limits=limits or None, requests=dict(limits) or None),
        security_context=jobshape.security_context(),
        volume_mounts=jobshape.volume_mounts(spec),
    )
    pod_spec = k8s.V1PodSpec(
        containers=[container],
        volumes=jobshape.volumes(spec),
        node_selector=dict(spec.node_selector) or None,
        tolerations=jobshape.tolerations(spec) or None,
        service_account_name=spec.service_account or None,
        priority_class_name=spec.priority_class or None,
        termination_grace_period_seconds=spec.termination_grace_seconds,
    )
    worker = models.KubeflowOrgV1ReplicaSpec(
        replicas=spec.nodes,
        restart_policy="ExitCode",
        template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=dict(labels),
                                                                   annotations=dict(jobshape.POD_ANNOTATIONS)),
                                       spec=pod_spec),
    )
    elastic = models.KubeflowOrgV1ElasticPolicy(
        rdzv_backend="c10d",
        rdzv_port=spec.rdzv_port,
        rdzv_id=jobshape.rendezvous_id(spec),
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


def to_dict(job: Any) -> dict[str, Any]:
    """The job as plain JSON-able data with the API's field names (what ``kubectl apply`` reads)."""
    return jobshape.to_plain(job)


def to_yaml(job: Any) -> str:
    return jobshape.dump_yaml(to_dict(job))
