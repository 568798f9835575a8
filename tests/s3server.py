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
START_TIMEOUT = 300.0  # seconds for moto to import and answer: only a hang is slower


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


def kill_state(seed: int) -> dict[str, Any]:
    """The 16 MB state of the kill test's saves; `seed` is its "step"."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4000, 1000)).astype(np.float32),
            "step": np.array(seed, np.int64)}


def kill_rounds_main(url: str, options_json: str) -> None:
    """The kill test's save runner, in a process of its own (no threads of other libraries, so
    forking is safe): per line ``seed delay`` on stdin, fork a child that builds
    `kill_state(seed)`, says so, and saves it at `url` (overwrite); SIGKILL the child `delay`
    seconds after it started saving; print ``finished`` (the save returned first) or
    ``killed``."""
    import json
    import signal

    import s3fs  # noqa: F401  (imported once here, not in every child)

    import shardkit
    import shardkit.storage.save
    from shardkit.storage import fsspec as storage_fsspec

    shardkit.set_storage_options("s3://", **json.loads(options_json))
    storage_fsspec.PART_SIZE = 5 * 2**20  # 16 MB: a multipart upload of 3 parts
    for line in sys.stdin:
        seed, delay = line.split()
        ready_r, ready_w = os.pipe()
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                state = kill_state(int(seed))
                os.write(ready_w, b"r")
                shardkit.save(url, state, overwrite=True,
                              options=shardkit.CheckpointOptions(threads=2))
                os.write(done_w, b"d")
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(done_w)
        os.read(ready_r, 1)
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        finished = os.read(done_r, 1) == b"d"
        os.close(ready_r)
        os.close(done_r)
        print("finished" if finished else "killed", flush=True)
