"""A real S3 server for the tests: moto's server mode in a subprocess on 127.0.0.1.

`S3Server.start()` picks a free port, runs ``python -m moto.server`` there and waits until it
answers; `bucket()` creates a fresh bucket; `stop()` ends the process (by its pid). The
credentials are dummies; `options` are the storage options s3fs needs for this endpoint, and
`env` the variables that give a subprocess the same (AWS_ENDPOINT_URL and friends).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any

KEY = "testing"
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def options(self) -> dict[str, Any]:
        return {"key": KEY, "secret": KEY, "client_kwargs": {"endpoint_url": self.endpoint,
                                                            "region_name": "us-east-1"}}

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": KEY,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> S3Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env})
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.options)

    def bucket(self) -> str:
        """A new empty bucket's name."""
        import boto3

        name = f"t-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id=KEY, aws_secret_access_key=KEY).create_bucket(Bucket=name)
        return name
