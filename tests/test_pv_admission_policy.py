"""manifests/rbac/pv-admission-policy.yaml: its CEL, evaluated with cel-python (celpy) the way the API
server applies a ValidatingAdmissionPolicy, against the PV provision_storage creates and against
attacks (hostPath, another driver, no label, reclaim Delete, a foreign claim namespace, DELETE of a
foreign PV through oldObject, another service account)."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest

from resilient_training.storage import volumes
from tests.test_manifests import kustomize

LAUNCHER = "system:serviceaccount:team-a:resilient-training-launcher"
# Kubernetes CEL reaches a field named like a CEL reserved word as __word__ (claimRef.namespace ->
# claimRef.__namespace__); map values (labels, volumeAttributes) keep their keys.
_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
             "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}
_MAPS = {"labels", "annotations", "volumeAttributes", "capacity"}


def _escape(value: Any, in_map: bool = False) -> Any:
    if isinstance(value, dict):
        return {(k if in_map or k not in _RESERVED else f"__{k}__"): _escape(v, k in _MAPS) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def _policy(path: str = "base") -> dict:
    [policy] = [d for d in kustomize(path) if d["kind"] == "ValidatingAdmissionPolicy"]
    [binding] = [d for d in kustomize(path) if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    return policy


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(activation)


def admit(policy: dict, operation: str, username: str, pv: dict) -> str | None:
    """None when admitted, else the policy's message (a CEL error counts as denial: failurePolicy Fail)."""
    spec = policy["spec"]
    if not any(operation in rule["operations"] and "persistentvolumes" in rule["resources"]
               for rule in spec["matchConstraints"]["resourceRules"]):
        return None
    request = {"operation": operation, "userInfo": {"username": username}, "namespace": ""}
    obj, old = (None, pv) if operation == "DELETE" else (pv, None)
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel(request), "object": celpy.json_to_cel(_escape(obj)),
        "oldObject": celpy.json_to_cel(_escape(old)),
    }
    if not all(_eval(c["expression"], activation) for c in spec.get("matchConditions", [])):
        return None  # not one of the components' service accounts: this policy does not apply
    variables = {}
    for variable in spec.get("variables", []):
        variables[variable["name"]] = _eval(variable["expression"], {**activation,
                                                                     "variables": celpy.celtypes.MapType(variables)})
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    for validation in spec["validations"]:
        try:
            ok = _eval(validation["expression"], activation)
        except celpy.CELEvalError as exc:  # pragma: no cover - the expressions guard with has()
            return f"CEL error: {exc}"
        if ok is not True and ok != celpy.celtypes.BoolType(True):
            return validation["message"]
    return None


def our_pv(namespace: str = "team-a") -> dict:
    """Exactly what provision_storage creates (volumes.pv_manifest with volumes.LABELS)."""
    return volumes.pv_manifest(name="rt-x-pv", claim="rt-x-data", namespace=namespace, fs_id="fs-0123456789abcdef0",
                               dns_name="fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", mount_name="abcdefgh",
                               capacity_gib=1200, labels=volumes.LABELS)


def _changed(**changes: Any) -> dict:
    pv = copy.deepcopy(our_pv())
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = pv
        for key in parents:
            node = node[key]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return pv


HOST_PATH = {"path": "/", "type": "Directory"}
ATTACKS = {
    "hostPath instead of the CSI driver": (_changed(spec__csi=None, spec__hostPath=HOST_PATH), "FSx CSI driver"),
    "another CSI driver": (_changed(spec__csi={"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"}), "FSx CSI"),
    "no labels at all": (_changed(metadata__labels=None), "labelled app.kubernetes.io/managed-by"),
    "label with another value": (_changed(metadata__labels={"app.kubernetes.io/managed-by": "someone"}), "labelled"),
    "reclaim Delete (the driver would delete the file system)":
        (_changed(spec__persistentVolumeReclaimPolicy="Delete"), "Retain"),
    "reclaim policy left to the default": (_changed(spec__persistentVolumeReclaimPolicy=None), "Retain"),
    "claim in another namespace": (our_pv(namespace="kube-system"), "pre-bound (claimRef)"),
    "no claimRef (any claim could bind it)": (_changed(spec__claimRef=None), "pre-bound (claimRef)"),
    "a namespace that only starts like ours": (our_pv(namespace="team"), "pre-bound (claimRef)"),
}


def test_the_pv_provision_storage_creates_is_admitted_and_deleted():
    policy = _policy()
    assert admit(policy, "CREATE", LAUNCHER, our_pv()) is None
    assert admit(policy, "DELETE", LAUNCHER, our_pv()) is None


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacking_pvs_are_refused_with_the_rule_they_break(attack):
    pv, message = ATTACKS[attack]
    assert message in (admit(_policy(), "CREATE", LAUNCHER, pv) or "admitted")


@pytest.mark.parametrize("foreign", ["hostPath instead of the CSI driver", "another CSI driver", "no labels at all"])
def test_deleting_a_foreign_pv_is_refused_through_old_object(foreign):
    pv, message = ATTACKS[foreign]
    assert message in (admit(_policy(), "DELETE", LAUNCHER, pv) or "admitted")


@pytest.mark.parametrize("overlay, username", [
    ("base", LAUNCHER),
    ("overlays/kubeflow-profile", "system:serviceaccount:kubeflow-user-example-com:default-editor"),
])
def test_deleting_another_namespace_s_pv_is_refused(overlay, username):
    """A stranger trial: DELETE skipped the claim's namespace check, so any namespace's launcher
    account could delete another team's resilient-training PV (a well-formed one: FSx, labelled,
    Retain)."""
    policy = _policy(overlay)
    own = username.split(":")[2]
    assert "pre-bound (claimRef)" in (admit(policy, "DELETE", username, our_pv(namespace="team-b")) or "admitted")
    assert "pre-bound (claimRef)" in (admit(policy, "DELETE", username, our_pv(namespace=own[:-1])) or "admitted")
    assert "pre-bound (claimRef)" in (admit(policy, "DELETE", username, _changed(spec__claimRef=None)) or "admitted")
    assert admit(policy, "DELETE", username, our_pv(namespace=own)) is None


@pytest.mark.parametrize("username", [
    "system:serviceaccount:other-team:resilient-training-launcher",  # our name in any namespace: bounded too
    "system:serviceaccount:team-a:resilient-training-launcher",
])
def test_the_launcher_account_is_bounded_in_every_namespace(username):
    assert admit(_policy(), "CREATE", username, ATTACKS["hostPath instead of the CSI driver"][0]) is not None


@pytest.mark.parametrize("username", [
    "system:serviceaccount:kube-system:ebs-csi-controller-sa",  # the cluster's own provisioners are not ours to bound
    "system:serviceaccount:team-a:resilient-training-launcher-2",
    "system:serviceaccount:team-a:default-editor",
    "alice@example.com",
])
def test_other_accounts_are_not_this_policys_business(username):
    assert admit(_policy(), "CREATE", username, ATTACKS["hostPath instead of the CSI driver"][0]) is None


def test_the_kubeflow_profile_overlay_bounds_its_default_editor_too():
    policy = _policy("overlays/kubeflow-profile")
    editor = "system:serviceaccount:kubeflow-user-example-com:default-editor"
    hostpath = ATTACKS["hostPath instead of the CSI driver"][0]
    assert "FSx CSI" in admit(policy, "CREATE", editor, hostpath)
    assert "FSx CSI" in admit(policy, "CREATE", LAUNCHER, hostpath)
    assert admit(policy, "CREATE", "system:serviceaccount:other:default-editor", hostpath) is None
    assert admit(policy, "CREATE", editor, our_pv(namespace="kubeflow-user-example-com")) is None


def test_updates_are_not_matched_because_rbac_grants_none():
    # The ClusterRole grants create/get/delete only: update/patch of a PV is refused before admission.
    [role] = [d for d in kustomize("base") if d["kind"] == "ClusterRole"]
    assert {verb for rule in role["rules"] for verb in rule["verbs"]} == {"create", "get", "delete"}
