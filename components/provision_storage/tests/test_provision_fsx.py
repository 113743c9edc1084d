"""FSx for Lustre: state and idempotency with moto, lifecycle sequences with botocore's Stubber."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from resilient_training.storage import fsx

SUBNET = "subnet-0123456789abcdef0"
SG = "sg-0123456789abcdef0"


def request(**overrides):
    values = dict(run_id="run-1", subnet_id=SUBNET, security_group_ids=(SG,), region="us-east-1",
                  tags={"team": "ml"})
    values.update(overrides)
    return fsx.FsxRequest(**values)


@pytest.fixture
def aws(monkeypatch):
    # moto never reaches AWS; these keep botocore from looking for real credentials.
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield boto3.client("fsx", region_name="us-east-1")


def test_create_is_idempotent_per_run_and_tagged(aws):
    messages = []
    first = fsx.create(aws, request(), messages.append)
    second = fsx.create(aws, request(), messages.append)  # a retried step: found by its token tag
    assert first["FileSystemId"] == second["FileSystemId"]
    systems = aws.describe_file_systems()["FileSystems"]
    assert len(systems) == 1
    tags = {t["Key"]: t["Value"] for t in systems[0]["Tags"]}
    assert tags[fsx.TOKEN_TAG] == fsx.request_token("run-1")
    assert tags[fsx.RUN_TAG] == "run-1" and tags["team"] == "ml"
    assert systems[0]["StorageCapacity"] == 1200
    assert any("reusing" in m for m in messages)
    fsx.create(aws, request(run_id="run-2"), messages.append)  # another run gets its own
    assert len(aws.describe_file_systems()["FileSystems"]) == 2


def test_delete_is_idempotent_and_never_touches_another_runs_file_system(aws):
    mine = fsx.create(aws, request(), print)["FileSystemId"]
    theirs = fsx.create(aws, request(run_id="someone-else"), print)["FileSystemId"]
    token = fsx.request_token("run-1")
    with pytest.raises(fsx.FsxError, match="not created by this run"):
        fsx.delete(aws, theirs, token=token)
    assert fsx.delete(aws, mine, token=token) == "deleted"
    assert fsx.delete(aws, mine, token=token) == "gone"
    assert [fs["FileSystemId"] for fs in aws.describe_file_systems()["FileSystems"]] == [theirs]


def test_token_is_stable_and_fits_the_api():
    token = fsx.request_token("0f8e2f6c-3a44-4bfb-9d1c-5f0f0e4c2a11")
    assert token == fsx.request_token("0f8e2f6c-3a44-4bfb-9d1c-5f0f0e4c2a11")
    assert len(token) <= 63 and token != fsx.request_token("other")


def test_create_arguments_per_deployment_type():
    scratch = request(import_path="s3://my-data/train", export_path="s3://my-data/out").create_arguments()
    assert scratch["LustreConfiguration"] == {"DeploymentType": "SCRATCH_2", "DataCompressionType": "NONE",
                                              "ImportPath": "s3://my-data/train", "ExportPath": "s3://my-data/out",
                                              "AutoImportPolicy": "NEW_CHANGED_DELETED"}
    persistent = request(deployment_type="PERSISTENT_2", per_unit_throughput=250, capacity_gib=4800).create_arguments()
    assert persistent["LustreConfiguration"]["PerUnitStorageThroughput"] == 250
    assert persistent["StorageCapacity"] == 4800 and persistent["SubnetIds"] == [SUBNET]


def _fs(state, **extra):
    fs = {"FileSystemId": "fs-0123456789abcdef0", "FileSystemType": "LUSTRE", "Lifecycle": state,
          "StorageCapacity": 1200, "DNSName": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
          "LustreConfiguration": {"MountName": "abcdefgh", "DeploymentType": "SCRATCH_2"},
          "Tags": [{"Key": fsx.TOKEN_TAG, "Value": fsx.request_token("run-1")}]}
    fs.update(extra)
    return {"FileSystems": [fs]}


@pytest.fixture
def stubbed():
    client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def test_wait_reports_progress_until_available(stubbed):
    client, stubber = stubbed
    for state in ("CREATING", "CREATING", "AVAILABLE"):
        stubber.add_response("describe_file_systems", _fs(state), {"FileSystemIds": ["fs-0123456789abcdef0"]})
    messages = []
    fs = fsx.wait_available(client, "fs-0123456789abcdef0", timeout_s=5, poll_s=0.01, progress=messages.append)
    assert fsx.mount_info(fs) == ("fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", "abcdefgh")
    assert [m.split(" after")[0] for m in messages] == ["fsx: fs-0123456789abcdef0 is CREATING",
                                                         "fsx: fs-0123456789abcdef0 is AVAILABLE"]


@pytest.mark.parametrize("state", ["FAILED", "MISCONFIGURED", "MISCONFIGURED_UNAVAILABLE"])
def test_wait_fails_clearly_on_a_dead_end_state(stubbed, state):
    client, stubber = stubbed
    stubber.add_response("describe_file_systems", _fs("CREATING"))
    stubber.add_response("describe_file_systems",
                         _fs(state, FailureDetails={"Message": "subnet has no free IP addresses"}))
    with pytest.raises(fsx.FsxError, match=f"is {state}: subnet has no free IP addresses"):
        fsx.wait_available(client, "fs-0123456789abcdef0", timeout_s=5, poll_s=0.01, progress=print)


def test_wait_times_out(stubbed):
    client, stubber = stubbed
    for _ in range(2):  # polled at 0 s and 0.3 s; a third poll would pass the 0.5 s timeout
        stubber.add_response("describe_file_systems", _fs("CREATING"))
    with pytest.raises(TimeoutError, match="still CREATING"):
        fsx.wait_available(client, "fs-0123456789abcdef0", timeout_s=0.5, poll_s=0.3, progress=print)


def test_delete_of_a_file_system_already_deleting_is_a_no_op(stubbed):
    client, stubber = stubbed
    stubber.add_response("describe_file_systems", _fs("DELETING"))
    assert fsx.delete(client, "fs-0123456789abcdef0", token=fsx.request_token("run-1")) == "deleting"


def test_delete_when_aws_says_not_found(stubbed):
    client, stubber = stubbed
    stubber.add_client_error("describe_file_systems", "FileSystemNotFound", "File system does not exist.")
    assert fsx.delete(client, "fs-0123456789abcdef0", token=fsx.request_token("run-1")) == "gone"


def test_delete_retries_while_the_file_system_is_still_being_created(stubbed):
    """A run cancelled while provisioning: teardown finds the file system CREATING; if AWS refuses
    the delete then, it retries until the file system settles."""
    client, stubber = stubbed
    fs_ids = {"FileSystemIds": ["fs-0123456789abcdef0"]}
    for state in ("CREATING", "CREATING"):
        stubber.add_response("describe_file_systems", _fs(state), fs_ids)
        stubber.add_client_error("delete_file_system", "BadRequest", "File system is not in a deletable state.")
    stubber.add_response("describe_file_systems", _fs("AVAILABLE"), fs_ids)
    stubber.add_response("delete_file_system", {"FileSystemId": "fs-0123456789abcdef0", "Lifecycle": "DELETING"},
                         {"FileSystemId": "fs-0123456789abcdef0"})
    messages = []
    assert fsx.delete(client, "fs-0123456789abcdef0", token=fsx.request_token("run-1"), poll_s=0.01,
                      progress=messages.append) == "deleted"
    assert sum("cannot be deleted yet" in m for m in messages) == 2


def test_delete_gives_up_on_a_file_system_that_never_settles(stubbed):
    client, stubber = stubbed
    for _ in range(2):  # tried at 0 s and 0.3 s; a third try would pass the 0.5 s limit
        stubber.add_response("describe_file_systems", _fs("CREATING"))
        stubber.add_client_error("delete_file_system", "BadRequest", "File system is not in a deletable state.")
    with pytest.raises(TimeoutError, match="still CREATING"):
        fsx.delete(client, "fs-0123456789abcdef0", token=fsx.request_token("run-1"), settle_timeout_s=0.5, poll_s=0.3)


def test_delete_does_not_retry_other_errors(stubbed):
    client, stubber = stubbed
    stubber.add_response("describe_file_systems", _fs("AVAILABLE"))
    stubber.add_client_error("delete_file_system", "AccessDenied", "not authorized", http_status_code=403)
    with pytest.raises(client.exceptions.ClientError, match="AccessDenied"):
        fsx.delete(client, "fs-0123456789abcdef0", token=fsx.request_token("run-1"), poll_s=0.01)
