"""A real S3 API server for tests: ``moto_server`` as its own process on 127.0.0.1.

IAM checks are switched on after the set-up calls (``INITIAL_NO_AUTH_ACTION_COUNT``),
so wrong credentials and a read-only user are refused like on AWS or MinIO.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import free_port
from tests.support.processes import stop_process

BUCKET = "ray-app-test"
_SETUP_CALLS = 7  # create_bucket + 2 x (create_user, put_user_policy, create_access_key)


def _moto_server_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("moto_server")
    return [str(exe)] if exe.exists() else [shutil.which("moto_server") or "moto_server"]


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    admin: tuple[str, str]
    reader: tuple[str, str]
    proc: subprocess.Popen

    def env(self, creds: tuple[str, str] | None = None, endpoint: str | None = None) -> dict:
        """Environment for a ray-app process: the standard AWS variables only."""
        key, secret = creds or self.admin
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_REGION="us-east-1",
                   AWS_ENDPOINT_URL_S3=endpoint or self.endpoint, AWS_EC2_METADATA_DISABLED="true")
        return env

    def client(self, creds: tuple[str, str] | None = None):
        import boto3

        key, secret = creds or self.admin
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                            region_name="us-east-1")

    def snapshot(self, prefix: str = "") -> dict[str, str]:
        """key -> ETag of every object under prefix (to show nothing was deleted or overwritten)."""
        out = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj["ETag"]
        return out

    def stop(self) -> None:
        stop_process(self.proc)


def start_s3_server(log_path: Path) -> S3Server:
    import boto3

    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_SETUP_CALLS))
    log = open(log_path, "wb")
    proc = subprocess.Popen([*_moto_server_cmd(), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError as e:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto_server did not start; see {log_path}") from e
            time.sleep(0.2)

    def c(svc):
        return boto3.client(svc, endpoint_url=endpoint, aws_access_key_id="setup", aws_secret_access_key="setup",
                            region_name="us-east-1")

    def user(name: str, actions) -> tuple[str, str]:
        iam = c("iam")
        iam.create_user(UserName=name)
        doc = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(doc))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    c("s3").create_bucket(Bucket=BUCKET)
    admin = user("trainer", "*")
    # moto 5.2 checks a ListObjectsV2 call against "s3:ListObjectsV2" (AWS: "s3:ListBucket"); both granted
    reader = user("reader", ["s3:GetObject", "s3:ListBucket", "s3:ListObjectsV2", "s3:HeadBucket"])
    return S3Server(endpoint, BUCKET, admin, reader, proc)
