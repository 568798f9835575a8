"""Checkpoints on object storage against a local S3 server (moto's server mode), in one run.

    python bench/bench_s3.py [--mb 256] [--rounds 5] [--check]

Starts ``python -m moto.server`` on 127.0.0.1 (a free port), then per round, alternating:

- shardkit ``save`` to ``s3://bench/sk`` (overwrite: upload, manifest last, old generation
  deleted) against the floor: the same shard files (a local shardkit save, outside the timer)
  uploaded with one s3fs ``put`` per file (all files in one ``put`` call: concurrent); and
  against safetensors: the same tensors written with ``safetensors.numpy.save_file`` into as
  many local files, then uploaded the same way (timed together);
- shardkit ``load`` of the URL against a parallel download (one s3fs ``cat`` of all shard
  objects: concurrent GETs) of the same objects;
- ``get_slice`` of one row of the largest tensor: the bytes fetched (counted at s3fs) and the
  time, against downloading that tensor's shard;
- ``verify`` of the URL (every entry fetched and hashed), against the parallel download.

Prints medians and the ratios; ``--check`` exits 1 unless save >= 0.9x the floor, load >= 0.9x
the parallel download and the one-row get_slice fetched < 1% of the tensor's bytes. The server
and the client share the machine's cores, so only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

KEY = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the moto server did not start") from None
            time.sleep(0.1)


def _state(mb: int) -> dict[str, np.ndarray]:
    """An LLM-like state of about `mb` MB: 8 large float32 matrices and 64 small vectors."""
    rng = np.random.default_rng(0)
    big = mb * 1_000_000 // 8 // 4
    cols = 1024
    state = {f"layer{i}/w": rng.standard_normal((big // cols, cols), np.float32)
             for i in range(8)}
    state.update({f"layer{i}/b{j}": rng.standard_normal(cols, np.float32)
                  for i in range(8) for j in range(8)})
    return state


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MB (default 256)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)

    import s3fs
    from safetensors.numpy import save_file

    import shardkit

    proc, endpoint = _start_server()
    try:
        opts = {"key": KEY, "secret": KEY, "client_kwargs": {"endpoint_url": endpoint}}
        shardkit.set_storage_options("s3://", **opts)
        fs = s3fs.S3FileSystem(**opts)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id=KEY, aws_secret_access_key=KEY
                     ).create_bucket(Bucket="bench")
        state = _state(args.mb)
        total = sum(a.nbytes for a in state.values())
        url = "s3://bench/sk"
        tmp = Path(tempfile.mkdtemp(prefix="shardkit-bench-s3-"))
        local = shardkit.save(tmp / "local", state)
        shard_files = [str(tmp / "local" / f) for f in local.files[:-1]]
        shardkit.save(url, state)  # warm-up; every timed save below overwrites
        objects = [f"bench/sk/{f}" for f in shardkit.save(url, state, overwrite=True).files[:-1]]
        groups = [list(shardkit.open(tmp / "local").index.keys[i::len(shard_files)])
                  for i in range(len(shard_files))]
        times: dict[str, list[float]] = {k: [] for k in (
            "shardkit save", "floor: s3fs put of the shard files", "safetensors files + put",
            "shardkit load", "parallel download (s3fs cat)")}
        for r in range(args.rounds):
            order = [0, 1, 2] if r % 2 == 0 else [2, 1, 0]
            for which in order:
                if which == 0:
                    times["shardkit save"].append(
                        _timed(lambda: shardkit.save(url, state, overwrite=True)))
                    with shardkit.open(url) as reader:
                        objects = [f"bench/sk/shards-{reader.generation}/{s.file}"
                                   for s in reader.index.shards]
                elif which == 1:
                    dest = [f"bench/floor/{r}/{os.path.basename(p)}" for p in shard_files]
                    times["floor: s3fs put of the shard files"].append(
                        _timed(lambda dest=dest: fs.put(shard_files, dest)))
                    fs.rm(f"bench/floor/{r}", recursive=True)
                else:
                    out = tmp / f"st{r}"
                    out.mkdir()

                    def st_save(out: Path = out, r: int = r) -> None:
                        files = []
                        for i, keys in enumerate(groups):
                            p = str(out / f"part{i}.safetensors")
                            save_file({k: state[k] for k in keys}, p)
                            files.append(p)
                        fs.put(files, [f"bench/st/{r}/{os.path.basename(p)}" for p in files])

                    times["safetensors files + put"].append(_timed(st_save))
                    fs.rm(f"bench/st/{r}", recursive=True)
                    for p in out.iterdir():
                        p.unlink()
                    out.rmdir()
            for which in ([0, 1] if r % 2 == 0 else [1, 0]):
                if which == 0:
                    times["shardkit load"].append(_timed(lambda: shardkit.load(url)))
                else:
                    times["parallel download (s3fs cat)"].append(
                        _timed(lambda objects=objects: fs.cat(objects)))

        # verify: every entry fetched (coalesced batches, several in flight) and hashed
        def verify() -> None:
            with shardkit.open(url) as reader:
                reader.verify()

        t_verify = statistics.median(_timed(verify) for _ in range(min(3, args.rounds)))

        # get_slice of one row of the largest tensor; GetObject requests counted by a botocore
        # event hook on s3fs's client (what reaches the server)
        key = max(state, key=lambda k: state[k].nbytes)
        fetched: list[int] = []
        store_fs = shardkit.storage.open_storage(url).fs
        store_fs.connect()

        def count(parsed=None, **kwargs):
            fetched.append(int(parsed["ContentLength"]))

        with shardkit.open(url) as reader:
            store_fs.s3.meta.events.register("after-call.s3.GetObject", count)
            try:
                t_slice = _timed(lambda: reader.get_slice(key, (slice(7, 8),)))
            finally:
                store_fs.s3.meta.events.unregister("after-call.s3.GetObject", count)
            shard = reader.index.shards[reader.index.slice_shard[reader.index.rows()[key]]]
            shard_object = f"bench/sk/shards-{reader.generation}/{shard.file}"
        t_shard = _timed(lambda: fs.cat_file(shard_object))
        fraction = sum(fetched) / state[key].nbytes
    finally:
        proc.terminate()
        proc.wait(10)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"state: {len(state)} tensors, {total / 1e6:.0f} MB, {len(shard_files)} shards; "
          f"median of {args.rounds} rounds, alternating")
    for k, v in med.items():
        print(f"  {k:<40} {v:7.3f} s  {total / v / 1e9:6.2f} GB/s")
    save_ratio = med["floor: s3fs put of the shard files"] / med["shardkit save"]
    st_ratio = med["safetensors files + put"] / med["shardkit save"]
    load_ratio = med["parallel download (s3fs cat)"] / med["shardkit load"]
    print(f"  save vs floor: {save_ratio:.2f}x (target >= 0.9); vs safetensors + put: "
          f"{st_ratio:.2f}x")
    print(f"  load vs parallel download: {load_ratio:.2f}x (target >= 0.9)")
    print(f"  verify: {t_verify:.3f} s, {total / t_verify / 1e9:.2f} GB/s = "
          f"{med['parallel download (s3fs cat)'] / t_verify:.2f}x the parallel download "
          "(fetch and hash every entry; info)")
    print(f"  get_slice one row of {key!r} ({state[key].nbytes / 1e6:.0f} MB): {len(fetched)} "
          f"GETs, {sum(fetched)} bytes = {fraction:.5%} of the tensor (target < 1%), "
          f"{t_slice * 1e3:.1f} ms vs {t_shard * 1e3:.0f} ms to download its shard")
    ok = save_ratio >= 0.9 and load_ratio >= 0.9 and fraction < 0.01
    if args.check and not ok:
        print("target missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
