"""Validate custom objects the way the API server and the Training Operator's webhook would.

- :func:`structural_schema` turns a CRD's ``openAPIV3Schema`` into a JSON Schema with
  structural-schema semantics: a property the schema does not name is an error (the API server
  would silently prune it, which hides mistakes), except under
  ``x-kubernetes-preserve-unknown-fields``; ``x-kubernetes-int-or-string`` accepts both.
- :func:`webhook_errors` states the PyTorchJob admission webhook's rules the schema cannot:
  DNS-1035 name, known replica types, a container named ``pytorch`` with an image in every
  replica, Master replicas = 1, Worker required by an elastic policy, not both
  ``nprocPerNode`` forms.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def load_crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    """``spec.versions[version].schema.openAPIV3Schema`` of the CRD file at ``path``."""
    # libyaml when present: the full Argo CRDs (~3 MB) take ~17 s with the pure-Python loader, ~1.5 s with it.
    crd = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{path} has no version {version}")


def structural_schema(node: dict[str, Any], *, root: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "format"):
            continue
        if key == "properties":
            out["properties"] = {
                name: ({"type": "object"} if root and name == "metadata" else structural_schema(sub, root=False))
                for name, sub in value.items()
            }
        elif key == "items":
            out["items"] = structural_schema(value, root=False)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = structural_schema(value, root=False)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [structural_schema(v, root=False) for v in value]
        elif key == "not":
            out[key] = structural_schema(value, root=False)
        else:
            out[key] = value
    if node.get("type") == "object" and not preserve and "additionalProperties" not in node:
        # Root metadata is ObjectMeta, validated by the API server itself (see metadata_errors).
        out["additionalProperties"] = False
    return out


def schema_errors(obj: dict[str, Any], openapi_schema: dict[str, Any]) -> list[str]:
    """Every violation of the structural schema, as ``path: message`` lines (empty = valid)."""
    import jsonschema

    validator = jsonschema.Draft7Validator(structural_schema(openapi_schema))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors] + metadata_errors(obj)


def metadata_errors(obj: dict[str, Any]) -> list[str]:
    meta = obj.get("metadata") or {}
    allowed = {"name", "namespace", "labels", "annotations", "generateName", "finalizers", "ownerReferences"}
    errors = [f"metadata.{k}: not settable on create" for k in sorted(set(meta) - allowed)]
    for key in ("labels", "annotations"):
        for k, v in (meta.get(key) or {}).items():
            if not isinstance(v, str):
                errors.append(f"metadata.{key}.{k}: value must be a string")
    return errors


def webhook_errors(job: dict[str, Any]) -> list[str]:
    """The Training Operator v1.9 PyTorchJob webhook's create-time rules."""
    errors: list[str] = []
    name = (job.get("metadata") or {}).get("name", "")
    if not name or len(name) > 63 or not _DNS1035.match(name):
        errors.append(f"metadata.name: {name!r} is not a DNS-1035 label")
    spec = job.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        errors.append("spec.pytorchReplicaSpecs: must be set")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            errors.append("spec.pytorchReplicaSpecs[Worker]: must be configured if elastic policy is used")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errors.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    for rtype, rspec in replicas.items():
        path = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in ("Master", "Worker"):
            errors.append(f"{path}: replica type must be Master or Worker")
        count = (rspec or {}).get("replicas")
        if rtype == "Master" and count != 1:
            errors.append(f"{path}.replicas: must be 1")
        elif count is not None and count < 1:
            errors.append(f"{path}.replicas: must be at least 1")
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{path}.template.spec.containers: must be specified")
        if not any(c.get("name") == "pytorch" for c in containers):
            errors.append(f"{path}.template.spec.containers: there must be a container named pytorch")
        for i, c in enumerate(containers):
            if not c.get("image"):
                errors.append(f"{path}.template.spec.containers[{i}].image: must be set")
    return errors


# --- Kubeflow Trainer v2.3 (TrainJob, ClusterTrainingRuntime) ----------------------------------
# Rules from the Trainer's webhooks (pkg/webhooks, the Torch and JobSet plugins' Validate), the
# CRDs' CEL rules (x-kubernetes-validations: the JSON schema check above does not run them) and
# the Job/JobSet validation the runtime's template meets when the JobSet is created (JobSet
# v0.12's webhook: failure policy rules, default-off feature gates, generated pod name lengths).

_TORCH_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
_DOMAIN_PREFIXED_PATH = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/\S+$")
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
_JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                        "PodFailurePolicy")
_ANCESTOR_CONTAINER = {"trainer": "node", "model-initializer": "model-initializer",
                       "dataset-initializer": "dataset-initializer"}


def _containers(rjob: dict[str, Any]) -> list[dict[str, Any]]:
    pod = ((((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {})
    return list(pod.get("initContainers") or []) + list(pod.get("containers") or [])


def runtime_admission_errors(runtime: dict[str, Any]) -> list[str]:
    """ClusterTrainingRuntime: the Trainer's webhook, the CRD's CEL rules, Job and JobSet validation."""
    errors: list[str] = []
    spec = runtime.get("spec") or {}
    policies = [k for k in ("torch", "mpi", "jax", "xgboost", "flux") if k in (spec.get("mlPolicy") or {})]
    if len(policies) > 1:
        errors.append("spec.mlPolicy: Only one of the policy can be configured")
    jobset = (spec.get("template") or {}).get("spec") or {}
    rjobs = jobset.get("replicatedJobs") or []
    names = [r.get("name") for r in rjobs]
    for i, rjob in enumerate(rjobs):
        path = f"spec.template.spec.replicatedJobs[{i}]"
        ancestor = (((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}).get(_ANCESTOR)
        if ancestor in _ANCESTOR_CONTAINER:
            if rjob.get("replicas", 1) != 1:
                errors.append(f"{path}.replicas: always must be 1")
            if not any(c.get("name") == _ANCESTOR_CONTAINER[ancestor] for c in _containers(rjob)):
                errors.append(f"{path}: must contain the required container for the ancestor: {ancestor}")
        job = (rjob.get("template") or {}).get("spec") or {}
        pod = (job.get("template") or {}).get("spec") or {}
        container_names = {c.get("name") for c in pod.get("containers") or []}
        pfp = job.get("podFailurePolicy")
        if pfp is not None:
            if pod.get("restartPolicy") != "Never":
                errors.append(f"{path}: podFailurePolicy requires template.spec.restartPolicy Never")
            for j, rule in enumerate(pfp.get("rules") or []):
                codes = rule.get("onExitCodes")
                if codes is None:
                    continue
                values = codes.get("values") or []
                if codes.get("containerName") and codes["containerName"] not in container_names:
                    errors.append(f"{path}.podFailurePolicy.rules[{j}].onExitCodes.containerName: not a container")
                if codes.get("operator") == "In" and 0 in values:
                    errors.append(f"{path}.podFailurePolicy.rules[{j}].onExitCodes.values: 0 is not allowed with In")
                if values != sorted(set(values)) or not 1 <= len(values) <= 255:
                    errors.append(f"{path}.podFailurePolicy.rules[{j}].onExitCodes.values: 1-255 sorted unique codes")
    rules = (jobset.get("failurePolicy") or {}).get("rules") or []
    if len({r.get("name") for r in rules}) != len(rules):
        errors.append("spec.template.spec.failurePolicy.rules: rule names are not unique")
    if (jobset.get("failurePolicy") or {}).get("restartStrategy") == "InPlaceRestart":
        errors.append("spec.template.spec.failurePolicy.restartStrategy: InPlaceRestart needs an alpha feature gate")
    for i, rule in enumerate(rules):
        if rule.get("action") in ("RestartJob", "RestartJobAndIgnoreMaxRestarts"):
            errors.append(f"spec.template.spec.failurePolicy.rules[{i}].action: needs the RestartJob alpha feature gate")
        if not _RULE_NAME.match(rule.get("name") or "") or len(rule.get("name") or "") > 128:
            errors.append(f"spec.template.spec.failurePolicy.rules[{i}].name: invalid rule name")
        for reason in rule.get("onJobFailureReasons") or []:
            if reason not in _JOB_FAILURE_REASONS:
                errors.append(f"spec.template.spec.failurePolicy.rules[{i}].onJobFailureReasons: {reason!r} unknown")
        for target in rule.get("targetReplicatedJobs") or []:
            if target not in names:
                errors.append(f"spec.template.spec.failurePolicy.rules[{i}].targetReplicatedJobs: {target!r} unknown")
    return errors


def trainjob_admission_errors(job: dict[str, Any], runtimes: dict[str, dict[str, Any]]) -> list[str]:
    """TrainJob create: the CRD's CEL rules and the Trainer's webhook against the runtimes that exist."""
    errors: list[str] = []
    name = (job.get("metadata") or {}).get("name", "")
    if not name or len(name) > 63 or not _DNS1035.match(name):
        errors.append(f"metadata.name: {name!r} is not a DNS-1035 label")
    spec = job.get("spec") or {}
    if spec.get("managedBy") not in (None, "trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"):
        errors.append("spec.managedBy: ManagedBy must be trainer.kubeflow.org/trainjob-controller")
    ref = spec.get("runtimeRef") or {}
    runtime = runtimes.get(ref.get("name", "")) if ref.get("kind", "ClusterTrainingRuntime") == "ClusterTrainingRuntime" \
        else None
    if runtime is None:
        return errors + ["spec.runtimeRef: specified clusterTrainingRuntime must be created before the TrainJob is created"]
    trainer = spec.get("trainer") or {}
    reserved = sorted({e.get("name") for e in trainer.get("env") or []} & _TORCH_RESERVED_ENV)
    if reserved and "torch" in ((runtime.get("spec") or {}).get("mlPolicy") or {}):
        errors.append(f"spec.trainer.env: must not have reserved envs, invalid envs configured: {reserved}")
    rjobs = {r.get("name"): {c.get("name") for c in _containers(r)}
             for r in (((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []}
    for i, patch in enumerate(spec.get("runtimePatches") or []):
        path = f"spec.runtimePatches[{i}]"
        if not _DOMAIN_PREFIXED_PATH.match(patch.get("manager") or ""):
            errors.append(f"{path}.manager: must be a domain-prefixed path")
        patch_jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get(
            "replicatedJobs") or []
        for rjob in patch_jobs:
            if rjob.get("name") not in rjobs:
                errors.append(f"{path}: must not have replicated job that doesn't exist in the runtime job template")
                continue
            pod = ((((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {})
            for c in list(pod.get("initContainers") or []) + list(pod.get("containers") or []):
                if c.get("name") not in rjobs[rjob["name"]]:
                    errors.append(f"{path}: must not have container that doesn't exist in the runtime job {rjob['name']}")
                elif c.get("env") and c.get("name") in ("node", "model-initializer", "dataset-initializer"):
                    errors.append(f"{path}: must not have envs for the initializer or node containers")
    # JobSet (v0.12, which Trainer v2.3 builds on) checks the pods of the JobSet the Trainer makes
    # (named as the TrainJob, an Indexed Job of numNodes pods per replicated job):
    # <jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<5 random> must be a DNS-1035 label.
    nodes = trainer.get("numNodes") or ((runtime.get("spec") or {}).get("mlPolicy") or {}).get("numNodes", 1)
    for rjob_name in rjobs if isinstance(nodes, int) else ():  # a non-integer is the schema's error
        longest = f"{name}-{rjob_name}-0-{nodes - 1}-abcde"
        if len(longest) > 63:
            errors.append(f"JobSet {name}: pod names generated for this JobSet will exceed 63 characters ({longest!r})")
    return errors
