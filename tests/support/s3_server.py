"""A moto S3 server that several real processes share (through ``AWS_ENDPOINT_URL``).

moto's in-process mock (``mock_aws``) patches this interpreter only; racing promoters and a
``run`` whose steps are subprocesses need the server. It honours ``If-None-Match: *`` on
PutObject (412 when the key exists) and stores the CRC32 checksums botocore sends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.request
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def moto_s3_server(*buckets: str) -> Iterator[tuple[dict[str, str], Any]]:
    """(environment for child processes, a boto3 S3 client of this process), buckets created, state fresh."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        # moto's state lives in this process, shared by every server it starts: start from nothing.
        urllib.request.urlopen(urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset", method="POST"))
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield {**os.environ, **env}, client
    finally:
        server.stop()


def keys(client: Any, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))
