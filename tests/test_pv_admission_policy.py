"""manifests/rbac/pv-admission-policy.yaml: its CEL, evaluated with cel-python (celpy) the way the API
server applies a ValidatingAdmissionPolicy, against the PV provision_storage creates and against
attacks (hostPath, another driver, no label, reclaim Delete, a foreign claim namespace, DELETE of a
foreign PV through oldObject, another service account, CSI secret refs, a Lustre server other than the
FSx file system volumeHandle names, mount options other than flock)."""

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
# Stranger trial 6 (finding 4): an FSx PV that passed the rules above could still carry a CSI secret
# ref (the kubelet hands another namespace's secret to the node plugin), mount any Lustre server
# (the driver mounts dnsname@tcp:/mountname), or set any mount options.
_KUBE_SYSTEM_SECRET = {"name": "aws-creds", "namespace": "kube-system"}
SECRET_REFS = ["nodePublishSecretRef", "nodeStageSecretRef", "controllerPublishSecretRef",
               "controllerExpandSecretRef", "nodeExpandSecretRef"]
_NO_SECRETS = "must not reference secrets"
_FSX_TARGET = "must mount the FSx file system its volumeHandle names"
_MOUNT_OPTIONS = "mount options other than flock"
_OURS = our_pv()["spec"]["csi"]["volumeAttributes"]
ATTACKS.update({
    **{f"CSI {ref} -> a kube-system secret": (_changed(**{f"spec__csi__{ref}": _KUBE_SYSTEM_SECRET}), _NO_SECRETS)
       for ref in SECRET_REFS},
    "dnsname: any Lustre server":
        (_changed(spec__csi__volumeAttributes={"dnsname": "evil.example.com", "mountname": "x"}), _FSX_TARGET),
    "dnsname: an FSx-like name under another domain": (_changed(spec__csi__volumeAttributes={
        **_OURS, "dnsname": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com.evil.example.com"}), _FSX_TARGET),
    "dnsname: another server before the FSx name (a Lustre NID list)": (_changed(spec__csi__volumeAttributes={
        **_OURS, "dnsname": "10.0.0.1@tcp:fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com"}), _FSX_TARGET),
    "dnsname: another FSx file system than volumeHandle": (_changed(spec__csi__volumeAttributes={
        **_OURS, "dnsname": "fs-0fedcba9876543210.fsx.us-east-1.amazonaws.com"}), _FSX_TARGET),
    "volumeHandle: not an FSx id": (_changed(spec__csi__volumeHandle="evil.example.com"), _FSX_TARGET),
    "no volumeAttributes": (_changed(spec__csi__volumeAttributes=None), _FSX_TARGET),
    "no dnsname": (_changed(spec__csi__volumeAttributes={"mountname": "abcdefgh"}), _FSX_TARGET),
    "no mountname": (_changed(spec__csi__volumeAttributes={"dnsname": _OURS["dnsname"]}), _FSX_TARGET),
    "mountname: a path out of the file system root": (_changed(spec__csi__volumeAttributes={
        **_OURS, "mountname": "abcdefgh/../x"}), _FSX_TARGET),
    "mountname with a mount option smuggled in": (_changed(spec__csi__volumeAttributes={
        **_OURS, "mountname": "abcdefgh,user_xattr"}), _FSX_TARGET),
    "a volume attribute the product does not set": (_changed(spec__csi__volumeAttributes={
        **_OURS, "extra": "x"}), _FSX_TARGET),
    "arbitrary mountOptions": (_changed(spec__mountOptions=["flock", "user_xattr", "noexec=0"]), _MOUNT_OPTIONS),
    "mount options through the beta annotation (the kubelet still honours it)": (_changed(
        metadata__annotations={"volume.beta.kubernetes.io/mount-options": "flock,user_xattr"}), _MOUNT_OPTIONS),
})
# Stranger trial (nineteenth round, left): access modes, csi.readOnly and claimRef.name were not checked.
_SHAPE = "must have the shape provision_storage gives it"
ATTACKS.update({
    "accessModes: ReadWriteOnce": (_changed(spec__accessModes=["ReadWriteOnce"]), _SHAPE),
    "accessModes: ReadWriteMany plus ReadOnlyMany": (_changed(spec__accessModes=["ReadWriteMany", "ReadOnlyMany"]),
                                                     _SHAPE),
    "accessModes left out": (_changed(spec__accessModes=None), _SHAPE),
    "volumeMode Block": (_changed(spec__volumeMode="Block"), _SHAPE),
    "csi.readOnly true": (_changed(spec__csi={**our_pv()["spec"]["csi"], "readOnly": True}), _SHAPE),
    "claimRef with a namespace and no name": (_changed(spec__claimRef={"namespace": "team-a"}), _SHAPE),
    "claimRef.name empty": (_changed(spec__claimRef={"namespace": "team-a", "name": ""}), _SHAPE),
    "claimRef.name with a trailing newline": (_changed(spec__claimRef={"namespace": "team-a", "name": "rt-x-data\n"}),
                                              _SHAPE),
})


def test_the_shape_rule_admits_csi_read_only_false_and_no_volume_mode():
    assert admit(_policy(), "CREATE", LAUNCHER,
                 _changed(spec__volumeMode=None, spec__csi={**our_pv()["spec"]["csi"], "readOnly": False})) is None


def test_the_pv_provision_storage_creates_is_admitted_and_deleted():
    policy = _policy()
    assert admit(policy, "CREATE", LAUNCHER, our_pv()) is None
    assert admit(policy, "DELETE", LAUNCHER, our_pv()) is None


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacking_pvs_are_refused_with_the_rule_they_break(attack):
    pv, message = ATTACKS[attack]
    assert message in (admit(_policy(), "CREATE", LAUNCHER, pv) or "admitted")


@pytest.mark.parametrize("foreign", ["hostPath instead of the CSI driver", "another CSI driver", "no labels at all",
                                     "CSI nodePublishSecretRef -> a kube-system secret", "dnsname: any Lustre server",
                                     "arbitrary mountOptions"])
def test_deleting_a_foreign_pv_is_refused_through_old_object(foreign):
    pv, message = ATTACKS[foreign]
    assert message in (admit(_policy(), "DELETE", LAUNCHER, pv) or "admitted")


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a.startswith(("CSI ", "dnsname", "mountname", "arbitrary mount"))])
def test_the_kubeflow_profile_overlay_refuses_the_same_attacks(attack):
    pv, message = ATTACKS[attack]
    editor = "system:serviceaccount:kubeflow-user-example-com:default-editor"
    assert message in (admit(_policy("overlays/kubeflow-profile"), "CREATE", editor, _in_namespace(
        pv, "kubeflow-user-example-com")) or "admitted")


def _in_namespace(pv: dict, namespace: str) -> dict:
    pv = copy.deepcopy(pv)
    pv["spec"]["claimRef"]["namespace"] = namespace
    return pv


@pytest.mark.parametrize("overlay, username, namespace", [
    ("base", LAUNCHER, "team-a"),
    ("overlays/kubeflow-profile", LAUNCHER, "team-a"),
    ("overlays/kubeflow-profile", "system:serviceaccount:kubeflow-user-example-com:default-editor",
     "kubeflow-user-example-com"),
])
@pytest.mark.parametrize("dns_name", [
    "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
    "fs-0123456789abcdef0.fsx.cn-north-1.amazonaws.com.cn",
    "fs-0123456789abcdef0.fsx.us-gov-west-1.amazonaws.com",
])
def test_what_provision_storage_creates_is_admitted_in_every_partition(overlay, username, namespace, dns_name):
    """our_pv() without relying on CEL errors: admit() reports an error as a denial."""
    policy = _policy(overlay)
    pv = volumes.pv_manifest(name="rt-x-pv", claim="rt-x-data", namespace=namespace, fs_id="fs-0123456789abcdef0",
                             dns_name=dns_name, mount_name="abcdefgh", capacity_gib=1200, labels=volumes.LABELS)
    assert admit(policy, "CREATE", username, pv) is None
    assert admit(policy, "DELETE", username, pv) is None
    scratch_1 = copy.deepcopy(pv)  # SCRATCH_1 file systems report MountName "fsx"
    scratch_1["spec"]["csi"]["volumeAttributes"]["mountname"] = "fsx"
    assert admit(policy, "CREATE", username, scratch_1) is None


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


def _cluster_scoped(path: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in kustomize(path) if "namespace" not in d["metadata"]}


def test_base_and_the_kubeflow_profile_overlay_can_both_be_installed():
    """A stranger trial (finding 17): the overlay's ClusterRoleBinding and policy had base's names, so
    applying it after base replaced them and base's launcher lost its PV rights. No cluster-scoped name
    is shared, not even the (identical) ClusterRole: deleting the overlay would take it from base."""
    base, profile = _cluster_scoped("base"), _cluster_scoped("overlays/kubeflow-profile")
    kinds = {"ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert {kind for kind, _ in profile} == kinds
    assert not set(base) & set(profile), set(base) & set(profile)
    [binding] = [d for (kind, _), d in profile.items() if kind == "ClusterRoleBinding"]
    assert ("ClusterRole", binding["roleRef"]["name"]) in profile
    assert {(s["namespace"], s["name"]) for s in binding["subjects"]} == {
        ("kubeflow-user-example-com", "resilient-training-launcher"), ("kubeflow-user-example-com", "default-editor")}

