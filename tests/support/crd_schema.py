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
