"""manifests/iam/fsx-provisioner-policy.json, decided request by request like the IAM policy simulator:
what the code sends (tags from storage/fsx.py) is allowed, and the attacks are not (tag a foreign file
system then delete it, link S3 to a foreign file system, create untagged, tag outside creation)."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from resilient_training.storage import fsx

POLICY = json.loads((Path(__file__).resolve().parents[1] / "manifests" / "iam" / "fsx-provisioner-policy.json")
                    .read_text())
ACCOUNT = "111122223333"
OURS = "arn:aws:fsx:us-east-1:111122223333:file-system/fs-0123456789abcdef0"
FOREIGN = "arn:aws:fsx:us-east-1:111122223333:file-system/fs-0fedcba9876543210"
ASSOCIATION = "arn:aws:fsx:us-east-1:111122223333:association/fs-0123456789abcdef0/dra-0123456789abcdef0"
REQUEST = fsx.FsxRequest(run_id="run-1", subnet_id="subnet-0123456789abcdef0",
                         security_group_ids=("sg-0123456789abcdef0",))
RUN_TAGS = {t["Key"]: t["Value"] for t in REQUEST.create_arguments()["Tags"]}  # exactly what the code sends
OTHER_RUN_TAGS = {t["Key"]: t["Value"] for t in fsx.FsxRequest(
    run_id="run-2", subnet_id="subnet-0123456789abcdef0", security_group_ids=("sg-0123456789abcdef0",),
).create_arguments()["Tags"]}


@dataclass
class Request:
    action: str
    resources: dict[str, dict[str, str]]
    """ARN -> that resource's tags (aws:ResourceTag/...)."""
    request_tags: dict[str, str] = field(default_factory=dict)
    context: dict[str, str | list[str]] = field(default_factory=dict)


def _values(request: Request, resource_tags: dict[str, str], key: str) -> list[str] | None:
    if key.startswith("aws:RequestTag/"):
        value = request.request_tags.get(key.split("/", 1)[1])
    elif key.startswith("aws:ResourceTag/"):
        value = resource_tags.get(key.split("/", 1)[1])
    elif key == "aws:TagKeys":
        value = list(request.request_tags) or None
    else:
        value = request.context.get(key)
    if value is None:
        return None
    return value if isinstance(value, list) else [value]


def _condition_holds(condition: dict, request: Request, resource_tags: dict[str, str]) -> bool:
    for operator, tests in condition.items():
        for key, wanted in tests.items():
            wanted = wanted if isinstance(wanted, list) else [wanted]
            values = _values(request, resource_tags, key)
            if operator == "Null":  # "false": the key must be present
                if (values is None) != (wanted == ["true"]):
                    return False
            elif values is None:
                return False  # a missing key never matches StringEquals/StringLike
            elif operator == "StringEquals":
                if not any(v in wanted for v in values):
                    return False
            elif operator == "StringLike":
                if not any(fnmatch.fnmatchcase(v, w) for v in values for w in wanted):
                    return False
            else:  # pragma: no cover - an operator this simulator does not know must not pass silently
                raise AssertionError(f"unsupported condition operator {operator}")
    return True


def decide(request: Request, policy: dict = POLICY) -> bool:
    """Allowed only when every resource of the request is allowed by some statement and none denies it."""
    for arn, tags in request.resources.items():
        allowed = False
        for statement in policy["Statement"]:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            if not any(fnmatch.fnmatchcase(request.action, a) for a in actions):
                continue
            if not any(fnmatch.fnmatchcase(arn, r) for r in resources):
                continue
            if not _condition_holds(statement.get("Condition", {}), request, tags):
                continue
            if statement["Effect"] == "Deny":
                return False
            allowed = True
        if not allowed:
            return False
    return True


ASSOCIATION_TAGS = {k: v for k, v in REQUEST.ownership_tags.items()}
CASES = {
    # --- what the code does
    "create the run's file system with its tags": (True, Request(
        "fsx:CreateFileSystem", {OURS: {}}, RUN_TAGS)),
    "tag it in the same call": (True, Request(
        "fsx:TagResource", {OURS: {}}, RUN_TAGS, {"fsx:CreateAction": "CreateFileSystem"})),
    "describe": (True, Request("fsx:DescribeFileSystems", {"*": {}})),
    "delete the run's own file system": (True, Request("fsx:DeleteFileSystem", {OURS: RUN_TAGS})),
    "delete a file system another run of this role made (the code checks the run's token)":
        (True, Request("fsx:DeleteFileSystem", {OURS: OTHER_RUN_TAGS})),
    "link S3 to the run's file system, association tagged": (True, Request(
        "fsx:CreateDataRepositoryAssociation", {OURS: RUN_TAGS, ASSOCIATION: {}}, ASSOCIATION_TAGS)),
    "tag the association in the same call": (True, Request(
        "fsx:TagResource", {ASSOCIATION: {}}, ASSOCIATION_TAGS,
        {"fsx:CreateAction": "CreateDataRepositoryAssociation"})),
    "service-linked role for FSx": (True, Request(
        "iam:CreateServiceLinkedRole", {"*": {}}, context={"iam:AWSServiceName": "fsx.amazonaws.com"})),
    # --- attacks and mistakes
    "tag a foreign file system after the fact (then delete it)": (False, Request(
        "fsx:TagResource", {FOREIGN: {"team": "db"}}, RUN_TAGS)),
    "tag a foreign file system claiming a create action": (False, Request(
        "fsx:TagResource", {FOREIGN: {"team": "db"}}, RUN_TAGS, {"fsx:CreateAction": "CreateBackup"})),
    "delete a foreign file system": (False, Request("fsx:DeleteFileSystem", {FOREIGN: {"team": "db"}})),
    "delete one someone labelled managed-by by hand, without a run token": (False, Request(
        "fsx:DeleteFileSystem", {FOREIGN: {fsx.MANAGED_TAG: fsx.MANAGED_VALUE}})),
    "delete one whose run token is empty": (False, Request(
        "fsx:DeleteFileSystem", {FOREIGN: {fsx.MANAGED_TAG: fsx.MANAGED_VALUE, fsx.TOKEN_TAG: "rt-"}})),
    "create without tags": (False, Request("fsx:CreateFileSystem", {OURS: {}})),
    "create with the shared tag but no run token": (False, Request(
        "fsx:CreateFileSystem", {OURS: {}}, {fsx.MANAGED_TAG: fsx.MANAGED_VALUE})),
    "link S3 to a foreign file system": (False, Request(
        "fsx:CreateDataRepositoryAssociation", {FOREIGN: {"team": "db"}, ASSOCIATION: {}}, ASSOCIATION_TAGS)),
    "link S3 with an untagged association": (False, Request(
        "fsx:CreateDataRepositoryAssociation", {OURS: RUN_TAGS, ASSOCIATION: {}})),
    "untag anything": (False, Request("fsx:UntagResource", {OURS: RUN_TAGS}, RUN_TAGS)),
    "update a file system": (False, Request("fsx:UpdateFileSystem", {OURS: RUN_TAGS})),
    "create in another account": (False, Request(
        "fsx:CreateFileSystem", {OURS.replace(ACCOUNT, "444455556666"): {}}, RUN_TAGS)),
    "service-linked role for another service": (False, Request(
        "iam:CreateServiceLinkedRole", {"*": {}}, context={"iam:AWSServiceName": "ec2.amazonaws.com"})),
}


@pytest.mark.parametrize("case", CASES)
def test_policy_decisions(case):
    expected, request = CASES[case]
    assert decide(request) is expected


def test_the_simulator_can_say_no_and_yes():
    # A policy that allows everything allows the attack; one that allows nothing refuses the code.
    everything = {"Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    assert decide(CASES["tag a foreign file system after the fact (then delete it)"][1], everything)
    assert not decide(CASES["create the run's file system with its tags"][1], {"Statement": []})
    deny = {"Statement": [*everything["Statement"], {"Effect": "Deny", "Action": "fsx:Delete*", "Resource": "*"}]}
    assert not decide(CASES["delete the run's own file system"][1], deny)


def test_each_run_tags_its_resources_with_its_own_value():
    assert RUN_TAGS[fsx.TOKEN_TAG] != OTHER_RUN_TAGS[fsx.TOKEN_TAG]
    assert RUN_TAGS[fsx.TOKEN_TAG] == fsx.request_token("run-1") and RUN_TAGS[fsx.TOKEN_TAG].startswith(fsx.TOKEN_PREFIX)
    # The policy names exactly the keys the code sets.
    text = json.dumps(POLICY)
    for key in (fsx.MANAGED_TAG, fsx.TOKEN_TAG):
        assert f"aws:RequestTag/{key}" in text and f"aws:ResourceTag/{key}" in text
    assert f'"{fsx.TOKEN_PREFIX}?*"' in text
