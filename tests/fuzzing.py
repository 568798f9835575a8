"""Mutation fuzzing of checkpoint files: the mutators, and a runner that reads each mutant
through every reader entry point in a forked child of a small server process.

The server (`python fuzzing.py serve SEEDS_DIR`) imports shardkit once, then forks one child per
mutant, so a crash, a hang or a runaway allocation costs one child, never the test process, and
each child starts from the same clean state. The child classifies every entry point's outcome:

- ``error``: a ShardkitError subclass was raised (the wanted answer to a corrupt file);
- ``equal``: the data returned equals the original, byte for byte;
- ``silent``: wrong data returned while no checksum was consulted (acceptable, counted);
- anything else is a failure: ``foreign`` (another exception), ``wrong_after_verify`` (wrong
  data after verify passed or from a verifying read), ``verified_refused`` (verify passed, or a
  verifying read returned data, for a mutant the oracle refuses), ``crash`` (killed by a
  signal), ``hang`` (over the time limit), ``memory`` (peak RSS growth over the cap).

"The original" is the seed's data, except for a mutant given an oracle's answer
(`FuzzServer.run(path, expected)`): a resealed TensorBundle may be another valid checkpoint, so
its data is what TensorFlow's own reader makes of the mutated files (`TensorFlowOracle`), or
nothing when TensorFlow refuses them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MEMORY_CAP = 1 << 30  # peak RSS growth a child may show
# seconds a child may take for all entry points of one mutant
TIMEOUT = float(os.environ.get("SHARDKIT_FUZZ_TIMEOUT", "30"))
FAILURES = ("foreign", "wrong_after_verify", "verified_refused", "crash", "hang", "memory")

# --- seeds --------------------------------------------------------------------------------------


def seed_state() -> dict[str, np.ndarray]:
    """A small state with every kind of entry: dtypes of each item size, 0-d, empty, split."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    return {
        "model/dense/kernel": rng.standard_normal((24, 16)).astype(np.float32),
        "model/dense/bias": rng.standard_normal(16).astype(np.float32),
        "model/embed": rng.standard_normal((40, 8)).astype(ml_dtypes.bfloat16),
        "model/ids": rng.integers(-(2**40), 2**40, 9, dtype=np.int64),
        "model/mask": rng.integers(0, 2, (3, 5)).astype(bool),
        "model/q8": rng.integers(-128, 127, 33, dtype=np.int8),
        "step": np.array(1234, np.int64),
        "lr": np.array(0.125, np.float64),
        "empty": np.zeros((0, 3), np.uint16),
        **seed_strings(),
    }


def seed_strings() -> dict[str, np.ndarray]:
    """String tensors of every kind (docs/FORMAT.md section 2.3), in the seeds' string file."""
    vocab = np.empty(4, object)
    vocab[:] = [b"alpha", b"", b"\x00\xff\x00", b"z" * 40]
    word = np.empty((), object)
    word[()] = "h\u00e9llo"
    return {"text/vocab": vocab, "text/word": word,
            "text/names": np.array([["ab", "c"], ["", "d\u00e9f"]]),
            "text/tags": np.array([b"x", b"yz", b""], "S3")}


def make_seeds(root: Path) -> dict[str, Path]:
    """Checkpoints written by shardkit itself: raw (tensors split over several shards by
    MaxShardSizePolicy) and zstd (small chunks, so entries span chunks and chunks hold pieces of
    several entries)."""
    import shardkit

    state = seed_state()
    root.mkdir(parents=True, exist_ok=True)
    np.savez(root / "original.npz", **{k.replace("/", "|"): _storable(v) for k, v in
                                        state.items() if v.dtype.kind not in "OSU"})
    seeds = {"raw": root / "raw", "zstd": root / "zstd"}
    policy = shardkit.MaxShardSizePolicy(max_shard_size=1024)
    # the seeds hold tensors stored as slices on purpose: each save warns that HuggingFace
    # loaders cannot read them (SplitTensorsWarning), which is expected here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", shardkit.SplitTensorsWarning)
        shardkit.save(seeds["raw"], state,
                      options=shardkit.CheckpointOptions(experimental_sharding_callback=policy,
                                                         durable=False))
        shardkit.save(seeds["zstd"], state,
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=shardkit.MaxShardSizePolicy(4096),
                          compression="zstd", chunk_size=256, durable=False))
    assert [w.category for w in caught] == [shardkit.SplitTensorsWarning] * 2
    # a TensorFlow TensorBundle (the same state, split into slices over several data files),
    # with TensorFlow's checkpoint state file, so that the directory opens as the checkpoint
    seeds["tb"] = root / "tb"
    shardkit.save(seeds["tb"] / TB_PREFIX, state,
                  options=shardkit.CheckpointOptions(
                      experimental_sharding_callback=shardkit.MaxShardSizePolicy(max_shard_size=1024),
                      durable=False), format="tensorflow")
    (seeds["tb"] / "checkpoint").write_text(f'model_checkpoint_path: "{TB_PREFIX}"\n')
    return seeds


TB_PREFIX = "ckpt-1"


def is_tensorbundle(path: str | Path) -> bool:
    """Whether a mutant is of the TensorBundle seed (the directory has TensorFlow's state
    file)."""
    return os.path.lexists(os.path.join(path, "checkpoint"))


def as_tensorbundle_reads(original: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`original` as a TensorBundle gives it back: string tensors as object arrays of bytes
    (str as UTF-8), TensorFlow's form."""
    out = {}
    for k, v in original.items():
        if v.dtype.kind in "OSU":
            items = [x.encode("utf-8") if isinstance(x, str) else bytes(x)
                     for x in v.reshape(-1).tolist()]
            a = np.empty(len(items), object)
            a[:] = items
            v = a.reshape(v.shape)
        out[k] = v
    return out


def tensorflow_reads(prefix: str) -> dict[str, np.ndarray] | None:
    """What TensorFlow's own reader (``tf.train.load_checkpoint``) makes of the bundle at
    `prefix`: every tensor (string tensors as object arrays of bytes), or None when it refuses
    the bundle or any tensor of it. The oracle of resealed mutants: it shares no code with
    shardkit."""
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(prefix)
        out = {}
        for key in sorted(reader.get_variable_to_shape_map()):
            value = reader.get_tensor(key)
            if isinstance(value, bytes):  # a scalar string: not through numpy's "S"
                a = np.empty((), object)
                a[()] = value
                value = a
            out[key] = np.asarray(value)
    except Exception:  # any refusal: TensorFlow's errors, and what its bindings raise
        return None
    return out


ORACLE_READS: list[Callable[[str], dict[str, np.ndarray] | None]] = [tensorflow_reads]
"""The reading an oracle process answers with (`oracle_serve`'s `kind`): TensorFlow's of a
bundle, or torch's of a DCP directory (`dcp_fuzzing.torch_dcp_reads`)."""


def oracle_serve(kind: str = "tensorflow") -> None:
    """Read ``prefix<TAB>answer`` lines from stdin; write `tensorflow_reads(prefix)` (with
    `kind` "torch": `dcp_fuzzing.torch_dcp_reads`) to the pickle `answer` (``{"data": ...}``)
    and print one line when it is there. Each read runs in
    a forked child, so a bundle that aborts or hangs TensorFlow (counted as refused) costs
    that child only, not TensorFlow's import again. A refusal the reader did not answer itself
    says how in ``"how"``: ``"died"`` (TensorFlow aborted the child, e.g. a failed CHECK) or
    ``"hang"`` (over TIMEOUT), so that a run can count the mutants judged by the time limit."""
    if kind == "torch":
        import dcp_fuzzing
        import torch

        torch.set_num_threads(1)  # no intra-op thread pool to inherit half-made in a fork
        ORACLE_READS[0] = dcp_fuzzing.torch_dcp_reads
    else:
        import tensorflow  # noqa: F401  (imported once, before the first mutant)

    print("ready", flush=True)
    child = _fork_ahead(_oracle_read)
    for line in sys.stdin:
        pid, line_w, r = child
        os.write(line_w, line.encode())
        os.close(line_w)
        answer = line.rstrip("\n").partition("\t")[2]
        # the child writes one byte when its answer is there, so the answer is given before
        # the child's exit (unmapping TensorFlow's memory) is over, without polling
        ready, _, _ = select.select([r], [], [], TIMEOUT)
        said = os.read(r, 1) if ready else b""
        os.close(r)
        if not said:  # killed by TensorFlow, or too slow: refused
            how = "died" if ready else "hang"
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(answer + ".part")
            with open(answer, "wb") as f:
                pickle.dump({"data": None, "how": how}, f)
        print("done", flush=True)
        os.waitpid(pid, 0)
        child = _fork_ahead(_oracle_read)  # forked while the fuzz server reads this mutant
    _end_spare(child)


def _oracle_read(line: str, w: int) -> None:
    """The oracle child's work: TensorFlow's reading of the bundle `line` names, to its answer
    pickle, then one byte on `w` to say it is there."""
    prefix, _, answer = line.partition("\t")
    partial = answer + ".part"
    with open(partial, "wb") as f:
        pickle.dump({"data": ORACLE_READS[0](prefix)}, f)
    os.rename(partial, answer)
    os.write(w, b"1")


class TensorFlowOracle:
    """A process running `oracle_serve` (TensorFlow imported once, away from the test process:
    a hostile bundle may abort TensorFlow). Started at once, so that TensorFlow's import runs
    while the test prepares its seeds. `timeout` bounds one answer (`oracle_serve` bounds each
    read by the same TIMEOUT, so this is reached only when the server itself is stuck).
    `kind` "torch": torch's reading of DCP directories instead (`dcp_fuzzing.torch_dcp_reads`,
    torch imported in that process only)."""

    def __init__(self, timeout: float = TIMEOUT, kind: str = "tensorflow") -> None:
        self.timeout = timeout
        self.kind = kind
        self.proc: subprocess.Popen[str] | None = None
        self._start()

    def _start(self) -> None:
        # TF_ENABLE_ONEDNN_OPTS=0: TensorFlow's plain CPU allocator, not oneDNN's BFC
        # allocator, which waits 10 s (AllocatorRetry, for memory another thread might free)
        # before it refuses an allocation it cannot make: a bundle entry with a huge shape
        # then took 10 s to be refused, with the same error (one resealed mutant in six).
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import fuzzing; fuzzing.oracle_serve({self.kind!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            text=True, bufsize=1)
        self._ready = False

    def _line(self, timeout: float) -> str:
        """The process's next line, "" when it ended or took over `timeout` seconds."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    def reads(self, prefix: Path | str, answer: Path) -> Path:
        """Write TensorFlow's reading of the bundle at `prefix` to the pickle `answer`; a
        bundle that kills or hangs TensorFlow counts as refused (and a new process starts)."""
        assert self.proc is not None and self.proc.stdin is not None
        if not self._ready:  # TensorFlow's import: generous, the machine may be loaded
            self._ready = self._line(max(600.0, self.timeout)) == "ready\n"
            if not self._ready:
                raise RuntimeError(f"the {self.kind} oracle did not start")
        self.proc.stdin.write(f"{prefix}\t{answer}\n")
        self.proc.stdin.flush()
        if self._line(2 * self.timeout) != "done\n":
            self.proc.kill()
            self.proc.wait()
            with open(answer, "wb") as f:
                pickle.dump({"data": None, "how": "hang"}, f)
            self._start()
        return answer

    def close(self) -> None:
        if self.proc is None:
            return
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def table_entries(data: bytes) -> list[tuple[bytes, bytes]]:
    from shardkit.adapters.tensorbundle.table import read_table

    return read_table(data, "mutant.index")


def table_bytes(items: list[tuple[bytes, bytes]]) -> bytes:
    """A table of `items` with every block checksum sealed (keys sorted, as a table needs)."""
    from shardkit.adapters.tensorbundle.table import build_table

    return build_table(sorted(dict(items).items()))


def table_blocks(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every block of a table: data blocks, metaindex, index."""
    from shardkit.adapters.tensorbundle import table as t

    footer = data[-t.FOOTER_SIZE:]
    meta_off, pos = t.get_varint(footer, 0, 40)
    meta_size, pos = t.get_varint(footer, pos, 40)
    off, pos = t.get_varint(footer, pos, 40)
    size, _ = t.get_varint(footer, pos, 40)
    blocks = []
    for _, handle in t._entries(memoryview(data)[off : off + size], "x", "index"):
        b_off, p = t.get_varint(handle, 0, len(handle))
        blocks.append((b_off, t.get_varint(handle, p, len(handle))[0]))
    return [*blocks, (meta_off, meta_size), (off, size)]


def reseal_block(data: bytes, offset: int, size: int) -> bytes:
    """Recompute one block's trailer checksum, so a mutation inside reaches the parser."""
    from shardkit.adapters.tensorbundle.crc import crc32c, mask

    crc = struct.pack("<I", mask(crc32c(data[offset : offset + size + 1])))
    return data[: offset + size + 1] + crc + data[offset + size + 5 :]


def edit_proto(value: bytes, header: bool, rnd: random.Random) -> bytes:
    """One field of a BundleEntryProto (or the BundleHeaderProto) changed to a hostile value."""
    from shardkit.adapters.tensorbundle import protos

    if header:
        h = protos.BundleHeaderProto.FromString(value)
        field = rnd.choice(["num_shards", "endianness", "producer", "min_consumer", "bad"])
        if field == "num_shards":
            h.num_shards = rnd.choice([0, -1, h.num_shards + 1, h.num_shards - 1, 2**31 - 1])
        elif field == "endianness":
            h.endianness = 1
        elif field == "producer":
            h.version.producer = rnd.choice([-1, 0, 2, 2**31 - 1])
        elif field == "min_consumer":
            h.version.min_consumer = rnd.choice([1, 2, -1])
        else:
            h.version.bad_consumers.append(rnd.choice([0, 1]))
        return bytes(h.SerializeToString())
    e = protos.BundleEntryProto.FromString(value)
    hostile = [0, 1, -1, 2**31 - 1, 2**40, -(2**62), 7]
    field = rnd.choice(["dtype", "shard_id", "offset", "size", "crc32c", "dim", "rank",
                        "slice", "slices_drop", "unknown_rank"])
    if field == "dtype":
        e.dtype = rnd.choice([0, 1, 2, 3, 7, 8, 14, 19, 20, 21, 23, 29, 101, 999])
    elif field in ("shard_id",):
        e.shard_id = rnd.choice([-1, 1, 2, 2**31 - 1, e.shard_id + 1])
    elif field in ("offset", "size"):
        setattr(e, field, rnd.choice([*hostile, getattr(e, field) + rnd.choice((-1, 1, 4))]))
    elif field == "crc32c":
        e.crc32c ^= 1 << rnd.randrange(32)
    elif field == "dim" and len(e.shape.dim):
        d = rnd.choice(e.shape.dim)
        d.size = rnd.choice([*hostile, d.size + 1, d.size - 1])
    elif field == "rank":
        e.shape.dim.add(size=rnd.choice([0, 1, 2]))
    elif field == "slice" and len(e.slices):
        ext = rnd.choice(rnd.choice(e.slices).extent)
        if rnd.random() < 0.3:
            ext.ClearField("length")
        else:
            setattr(ext, rnd.choice(["start", "length"]), rnd.choice(hostile))
    elif field == "slices_drop" and len(e.slices):
        del e.slices[rnd.randrange(len(e.slices))]
    elif field == "unknown_rank":
        e.shape.unknown_rank = True
    else:
        e.slices.add().extent.add(start=0, length=1)
    return bytes(e.SerializeToString())


# Boundary values for the integer fields of a BundleEntryProto (int64 unless said otherwise):
# where an int32 or a double stops being exact, where int64 ends, and their negatives
BOUNDARY = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53, 2**53 + 1, 2**62, 2**63 - 1, -(2**31),
            -(2**63)]
BOUNDARY_INT32 = [0, 1, -1, 2, 2**31 - 1, -(2**31)]


def _itemsize_of(data_type: int) -> int:
    from shardkit.adapters.tensorbundle.datatypes import DTYPE_OF, STRING
    from shardkit.values.dtypes import itemsize

    name = DTYPE_OF.get(data_type)
    return itemsize(name) if name is not None and name != STRING else 1


def _wrapping_dims(rnd: random.Random, bits: int) -> list[int]:
    """1 to 3 powers of two, each an int64 (at most 2**62), whose product is 2**bits."""
    while True:
        rank = rnd.randint(1, 3)
        cuts = sorted(rnd.randint(0, bits) for _ in range(rank - 1))
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, bits])]
        if max(parts) <= 62:
            return [1 << p for p in parts]


def boundary_entry(value: bytes, rnd: random.Random) -> bytes:
    """A BundleEntryProto re-encoded with one field (or a shape and its size) set to a
    boundary value: 0, -1, 2**31, 2**32, 2**53, 2**63 - 1, 2**64 / itemsize, a shape whose
    element count times the item size is 2**63 or 2**64 (wrapping int64 to -2**63 or 0) with
    the size the wrapped product gives, an offset that wraps when the size is added."""
    from shardkit.adapters.tensorbundle import protos

    e = protos.BundleEntryProto.FromString(value)
    item = _itemsize_of(e.dtype)
    per_item = [v for v in (2**64 // item, 2**63 // item, 2**32 // item) if v < 2**63]
    how = rnd.choice(["offset", "size", "wrap_offset", "dim", "wrap_shape", "wrap_shape",
                      "shard_id", "extent", "dtype"])
    if how in ("offset", "size"):
        setattr(e, how, rnd.choice([*BOUNDARY, *per_item]))
    elif how == "wrap_offset":  # offset + size just past 2**63 (or the offset past it alone)
        e.offset = 2**63 - rnd.choice([1, max(1, e.size // 2), max(1, e.size), 8])
    elif how == "dim" and len(e.shape.dim):
        rnd.choice(e.shape.dim).size = rnd.choice([*BOUNDARY, *per_item])
    elif how == "wrap_shape" or how == "dim":
        bits = rnd.choice([63, 64]) - (item.bit_length() - 1)
        del e.shape.dim[:]
        for d in _wrapping_dims(rnd, bits):
            e.shape.dim.add(size=d)
        if not e.slices:  # the size the wrapped product gives, or another boundary
            e.size = rnd.choice([0, -(2**63), 2**63 - 1, e.size])
    elif how == "shard_id":
        e.shard_id = rnd.choice(BOUNDARY_INT32)
    elif how == "extent" and len(e.slices):
        ext = rnd.choice(rnd.choice(e.slices).extent)
        setattr(ext, rnd.choice(["start", "length"]), rnd.choice([*BOUNDARY, *per_item]))
    else:  # another dtype of the same or another item size: perhaps another valid bundle
        e.dtype = rnd.choice([1, 2, 3, 4, 5, 6, 9, 10, 14, 17, 19, 22, 23])
    return bytes(e.SerializeToString())


def reseal_entries(d: Path, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`items` (a TensorBundle table of the checkpoint in `d`) with the crc32c of every numeric
    entry set to that of the bytes its offset and size name in its data file (clipped to the
    file), so that only the structure checks can refuse a mutant."""
    from shardkit.adapters.tensorbundle import protos
    from shardkit.adapters.tensorbundle.crc import crc32c, mask

    header = protos.BundleHeaderProto.FromString(items[0][1])
    files: dict[int, bytes] = {}
    out = [items[0]]
    for key, value in items[1:]:
        e = protos.BundleEntryProto.FromString(value)
        if not e.slices and e.dtype != 7:  # DT_STRING: its own checksum, not the bytes'
            name = d / f"{TB_PREFIX}.data-{e.shard_id:05d}-of-{header.num_shards:05d}"
            if e.shard_id not in files:
                files[e.shard_id] = name.read_bytes() if 0 <= e.shard_id < max(
                    header.num_shards, 0) and name.exists() else b""
            data = files[e.shard_id]
            lo = min(max(e.offset, 0), len(data))
            e.crc32c = mask(crc32c(data[lo : lo + max(0, min(e.size, len(data)))]))
            value = bytes(e.SerializeToString())
        out.append((key, value))
    return out


def _storable(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def load_original(root: Path) -> dict[str, np.ndarray]:
    import ml_dtypes

    with np.load(root / "original.npz") as z:
        out = {k.replace("|", "/"): z[k] for k in z.files}
    out["model/embed"] = out["model/embed"].view(ml_dtypes.bfloat16)
    out.update(seed_strings())  # not in the npz (object arrays need pickle): rebuilt
    return out


# --- mutators (pure: bytes in, bytes out) -------------------------------------------------------

HOSTILE_JSON = [
    "1" + "0" * 5000,  # past Python's int-string limit
    "-1",
    "18446744073709551616",  # 2**64
    "9223372036854775808",  # 2**63
    "-9223372036854775809",
    "1.5",
    "1e400",
    "true",
    "null",
    '"x"',
    '""',
    "[]",
    "{}",
    '"' + "a" * 200_000 + '"',
    "[" * 20_000 + "]" * 20_000,  # deep nesting
    '{"a":' * 5_000 + "1" + "}" * 5_000,
    '"\\ud800"',  # a lone surrogate
    '"../../etc/passwd"',
    '"/dev/zero"',
    "[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]",
    "[4294967296,4294967296,4294967296]",
]


def bit_flips(data: bytes, rnd: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    hi = len(data) if hi is None else hi
    if hi <= lo:
        return data
    out = bytearray(data)
    for _ in range(rnd.choice((1, 1, 2, 8))):
        i = rnd.randrange(lo, hi)
        out[i] ^= 1 << rnd.randrange(8)
    return bytes(out)


def overwrite(data: bytes, rnd: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    hi = len(data) if hi is None else hi
    if hi <= lo:
        return data
    at = rnd.randrange(lo, hi)
    n = min(hi - at, rnd.choice((1, 4, 8, 16)))
    fill = rnd.choice((b"\x00", b"\xff", None))
    new = fill * n if fill is not None else rnd.randbytes(n)
    return data[:at] + new + data[at + n :]


def truncate(data: bytes, rnd: random.Random) -> bytes:
    return data[: rnd.randrange(0, max(1, len(data)))]


def extend(data: bytes, rnd: random.Random) -> bytes:
    return data + rnd.choice((b"\x00", b" ", rnd.randbytes(1))) * rnd.choice((1, 7, 8, 4096))


def json_paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every path to a value in a parsed JSON document."""
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(json_paths(v, (*path, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node[:64]):
            out.extend(json_paths(v, (*path, i)))
    return out


def json_edit(text: bytes, rnd: random.Random) -> bytes:
    """Parse, change one value (a hostile literal, a deletion, a duplicate key, a type swap)
    and print again; the hostile literal is spliced in as text, since some cannot be built."""
    doc = json.loads(text)
    path = rnd.choice(json_paths(doc))
    marker = "\x00HOSTILE\x00"
    how = rnd.randrange(6)
    parent = _at(doc, path[:-1]) if path else None
    literal = rnd.choice(HOSTILE_JSON)
    if how == 0 or not path:
        if not path:
            return literal.encode()
        parent[path[-1]] = marker
    elif how == 1:  # delete
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
        literal = None
    elif how == 2 and isinstance(parent, dict):  # duplicate key: the same name again, later
        parent[path[-1] + marker] = marker
        literal = None
    elif how == 3:  # a value of another container type wrapping the old one
        parent[path[-1]] = [parent[path[-1]]] if rnd.random() < 0.5 else {"v": parent[path[-1]]}
        literal = None
    elif how == 4:  # a number nudged by one, or a string changed by one character
        v = parent[path[-1]]
        if isinstance(v, bool) or v is None:
            parent[path[-1]] = not v
        elif isinstance(v, int):
            parent[path[-1]] = v + rnd.choice((-1, 1, 8, -8, 2**32))
        elif isinstance(v, str):
            parent[path[-1]] = v[:-1] + rnd.choice("0aZ/:, ") if v else "x"
        else:
            parent[path[-1]] = marker
    else:
        parent[path[-1]] = marker
    out = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    if how == 2:
        out = out.replace(marker + '":"' + marker + '"', '":0')
    if literal is not None:
        out = out.replace('"' + marker + '"', literal)
    return out.encode("utf-8", "surrogatepass")


def _at(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


# --- file structure helpers ---------------------------------------------------------------------


def safetensors_parts(data: bytes) -> tuple[int, bytes, bytes]:
    """(header length, header text, rest) of a raw shard."""
    (n,) = struct.unpack_from("<Q", data)
    return n, data[8 : 8 + n], data[8 + n :]


def with_header(text: bytes, rest: bytes) -> bytes:
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text + rest


SKZ_PREAMBLE = 40


def skz_parts(data: bytes) -> dict[str, int]:
    """Byte offsets of the parts of a .skz shard (docs/FORMAT.md section 6)."""
    (frames,) = struct.unpack_from("<Q", data, 24)
    (n,) = struct.unpack_from("<Q", data, SKZ_PREAMBLE)
    table = SKZ_PREAMBLE + 8 + n
    check = table + 32 * frames
    return {"header": SKZ_PREAMBLE + 8, "header_end": table, "table": table, "check": check,
            "frames": check + 8}


def reseal_skz(data: bytes) -> bytes:
    """Recompute the header checksum, so a mutation reaches the checks behind it."""
    import xxhash

    try:
        p = skz_parts(data)
    except struct.error:
        return data
    if p["check"] + 8 > len(data) or p["check"] < 0:
        return data
    digest = xxhash.xxh3_64_intdigest(data[: p["check"]])
    return data[: p["check"]] + struct.pack("<Q", digest) + data[p["check"] + 8 :]


def manifest_path(ckpt: Path) -> Path:
    """The manifest of the checkpoint `ckpt`, found as the reader finds it: its
    ``model.safetensors.index.json`` (or the ``index.json`` of format 2.0 / 2.1)."""
    from shardkit.format import MANIFEST_FILE, find_manifest

    return ckpt / (find_manifest(ckpt) or MANIFEST_FILE)


def set_recorded_size(index: bytes, name: str, size: int) -> bytes:
    """The manifest `index` with shard `name`'s recorded byte count set to `size`."""
    doc = json.loads(index)
    for s in doc["shardkit"]["shards"]:
        if s["file"] == name:
            s["bytes"] = size
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def set_string_file_size(index: bytes, size: int) -> bytes:
    """The manifest `index` with the string file's recorded byte count set to `size`."""
    doc = json.loads(index)
    doc["shardkit"]["strings"]["bytes"] = size
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def copy_checkpoint(seed: Path, dest: Path) -> None:
    shutil.copytree(seed, dest)


# --- the child: every reader entry point on one mutant ------------------------------------------


def _index_forms(shape: tuple[int, ...]) -> list[Any]:
    if not shape:
        return [(), Ellipsis]
    forms: list[Any] = [Ellipsis, (slice(1, None, 2),), (0,) if shape[0] else (slice(0, 0),)]
    if len(shape) > 1:
        forms.append((slice(None), slice(None, None, -3)))
    return forms


def _content(a: np.ndarray) -> Any:
    """What makes two arrays equal: their bytes, or their elements for object arrays."""
    return a.tolist() if a.dtype.kind == "O" else a.tobytes()


def _same(got: dict[str, np.ndarray], original: dict[str, np.ndarray]) -> bool:
    if list(got) != list(original) and set(got) != set(original):
        return False
    for k, a in original.items():
        b = np.asarray(got[k])
        if b.dtype != a.dtype or b.shape != a.shape or _content(b) != _content(a):
            return False
    return True


def run_entry_points(path: str, original: dict[str, np.ndarray], *,
                     refused: bool = False) -> dict[str, str]:
    """Outcome of each reader entry point on the checkpoint at `path` (see module docstring).
    `refused`: the oracle refuses the mutant (no data is right; `original` then only shapes
    the restore's targets): any data is ``silent`` unless verified, ``verified_refused`` then,
    and so is a verify that passes."""
    import shardkit
    from shardkit.errors import ShardkitError
    from shardkit.tools import cli

    outcomes: dict[str, str] = {}
    verified = False

    def attempt(name: str, fn: Any, checks: bool = False) -> None:
        nonlocal verified
        try:
            got = fn()
        except ShardkitError:
            outcomes[name] = "error"
            return
        except BaseException as e:
            outcomes[name] = f"foreign: {type(e).__name__}: {str(e)[:300]}"
            return
        if got is None:
            if refused and name in ("verify", "cli_verify"):
                outcomes[name] = "verified_refused"
            else:
                outcomes[name] = "silent" if refused else "equal"
            if name == "verify":
                verified = True
            return
        if refused:
            outcomes[name] = "verified_refused" if checks or verified else "silent"
        elif _same(got, original):
            outcomes[name] = "equal"
        elif checks or verified:
            outcomes[name] = "wrong_after_verify"
        else:
            outcomes[name] = "silent"

    def verify() -> None:
        with shardkit.open(path) as r:
            r.verify()

    def reader_reads(mmap: bool) -> dict[str, np.ndarray]:
        with shardkit.open(path, mmap=mmap) as r:
            got = {k: np.array(r[k]) for k in r.keys()}
            for k in r.keys():
                info = r.info(k)
                for form in _index_forms(info.shape):
                    part = np.array(r.get_slice(k, form))
                    if k in original and info.shape != original[k].shape:
                        got[k] = part  # another shape (a resealed index edit): wrong data
                    elif k in original:  # an array, never a scalar: numpy's bool scalars
                        # make any nonzero byte 1, where a stored BOOL may hold other bytes
                        at = form if form is Ellipsis else (*form, Ellipsis)
                        want = np.array(original[k][at], dtype=original[k].dtype)
                        if part.shape != want.shape or _content(part) != _content(want):
                            got[k] = part  # a wrong slice: report it as wrong data
        return got

    def restore() -> dict[str, np.ndarray]:
        targets = {k: np.zeros_like(a) for k, a in original.items()}
        shardkit.restore_into(path, targets)
        return targets

    def cli_run(*args: str) -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main([*args, path])
        if code not in (0, 1):
            raise RuntimeError(f"shardkit {args[0]} exited {code}")
        if code == 1:
            raise ShardkitError("reported by the command")

    attempt("verify", verify)
    attempt("load", lambda: shardkit.load(path))
    attempt("load_pread", lambda: shardkit.load(path, mmap=False))
    attempt("load_verify", lambda: shardkit.load(path, verify=True), checks=True)
    attempt("load_verify_pread", lambda: shardkit.load(path, verify=True, mmap=False),
            checks=True)
    attempt("reader", lambda: reader_reads(True))
    attempt("reader_pread", lambda: reader_reads(False))
    attempt("restore_into", restore)
    attempt("cli_inspect", lambda: cli_run("inspect"))
    attempt("cli_verify", lambda: cli_run("verify"))
    return outcomes


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(path: str, original: dict[str, np.ndarray], out_fd: int, *,
           refused: bool = False) -> None:
    # A hostile file must not take the machine's memory: cap the address space well above
    # what a legitimate read of these small checkpoints needs.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + 4 * MEMORY_CAP, resource.RLIM_INFINITY))
    start = _rss()
    outcomes = run_entry_points(path, original, refused=refused)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    outcomes["_rss_growth"] = str(max(0, peak - start))
    os.write(out_fd, json.dumps(outcomes).encode() + b"\n")


def serve(seeds: Path) -> None:
    """Read mutant paths from stdin, one per line; print one JSON result per line. A line
    ``path<TAB>answer`` gives the oracle's answer for that mutant (a pickle written by
    `TensorFlowOracle.reads`): its data replaces the seed's as what is right."""
    import shardkit  # noqa: F401  (imported once, before any fork)

    original = load_original(seeds)
    tb_original = as_tensorbundle_reads(original)
    for seed in ("raw", "zstd", "tb"):  # warm up: every lazy import and first-use cost, once
        run_entry_points(str(seeds / seed), tb_original if seed == "tb" else original)
    def mutant(line: str) -> tuple[str, dict[str, np.ndarray], bool]:
        path, _, answer = line.partition("\t")
        want = tb_original if is_tensorbundle(path) else original
        if not answer:
            return path, want, False
        with open(answer, "rb") as f:
            told = pickle.load(f)["data"]
        return (path, want, True) if told is None else (path, told, False)

    _serve_each(mutant)


def _serve_each(mutant: Callable[[str], tuple[str, dict[str, np.ndarray], bool]]) -> None:
    """For each line of stdin, fork a child that reads the mutant `mutant(line)` names (its
    path, the data that is right, whether every read must fail) and print the child's result
    as one JSON line. The paths ``!segv`` and ``!sleep`` check the harness itself.

    Each child is forked ahead, as soon as the previous result is out, and waits for its line
    on a pipe: the fork (copying the server's page tables) runs while the test makes the next
    mutant, not while it waits for this one's result. The child is still a fresh fork of the
    server, which never reads a mutant itself."""
    def run(line: str, w: int) -> None:
        path, want, refused = mutant(line)
        if path == "!segv":  # the harness's own check: a crash is seen as one
            os.kill(os.getpid(), signal.SIGSEGV)
        if path == "!sleep":
            time.sleep(TIMEOUT + 5)
        _child(path, want, w, refused=refused)

    child = _fork_ahead(run)
    for line in sys.stdin:
        pid, line_w, r = child
        os.write(line_w, line.encode())
        os.close(line_w)
        result = _wait(pid, r)
        os.close(r)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        child = _fork_ahead(run)
    _end_spare(child)  # no more mutants: the spare child ends without reading one


def _fork_ahead(run: Callable[[str, int], None]) -> tuple[int, int, int]:
    """A forked child waiting for its line on a pipe, which then calls ``run(line, w)`` (`w`:
    the pipe back to the parent) and exits, with code 3 if `run` raised, without the parent's
    exit handlers. Returns (pid, the line's pipe, the pipe back); closing the line's pipe with
    nothing written ends the child without calling `run`."""
    line_r, line_w = os.pipe()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(line_w)
            os.close(r)
            line = _read_line(line_r).rstrip("\n")
            if line:
                run(line, w)
        except BaseException:
            code = 3
        os._exit(code)
    os.close(line_r)
    os.close(w)
    return pid, line_w, r


def _end_spare(child: tuple[int, int, int]) -> None:
    """End a `_fork_ahead` child that was given no line."""
    pid, line_w, r = child
    os.close(line_w)
    os.close(r)
    os.waitpid(pid, 0)


def _read_line(fd: int) -> str:
    """Everything written to the pipe `fd` until its writer closes it."""
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    os.close(fd)
    return data.decode()


def _wait(pid: int, r: int) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"_status": "hang"}
        ready, _, _ = select.select([r], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(r, 1 << 16)
            if chunk:
                data += chunk
                continue
            break  # EOF: the child is done or dead
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"_status": f"crash: signal {os.WTERMSIG(status)}"}
    if not data:
        return {"_status": f"crash: exit {os.WEXITSTATUS(status)} without a result"}
    result = json.loads(data)
    result["_status"] = "done"
    return result


class FuzzServer:
    """The parent's handle on a `serve` process."""

    def __init__(self, seeds: Path, timeout: float = TIMEOUT) -> None:
        env = dict(os.environ, SHARDKIT_FUZZ_TIMEOUT=str(timeout))
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", str(seeds)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )

    def run(self, path: Path | str, expected: Path | str | None = None) -> dict[str, Any]:
        """The outcomes for the mutant at `path`; `expected`: the oracle's answer for it (a
        pickle from `TensorFlowOracle.reads`), else the seed's data is what is right."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{path}\t{expected}\n" if expected is not None else f"{path}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fuzz server died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def failures(result: dict[str, Any]) -> list[str]:
    """The failures in one mutant's result (empty when it passed)."""
    status = result.get("_status", "")
    if status != "done":
        return [status]
    out = [f"{name}: {o}" for name, o in result.items()
           if not name.startswith("_") and o not in ("error", "equal", "silent")]
    growth = int(result.get("_rss_growth", 0))
    if growth > MEMORY_CAP:
        out.append(f"memory: peak RSS grew by {growth >> 20} MiB")
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(Path(sys.argv[2]))


# --- foreign layouts: the truth computed per mutant (tests/test_fuzz_huggingface.py) -----------


def serve_foreign(seeds: Path) -> None:
    """`serve` for mutants of HuggingFace directories, single safetensors files and shardkit
    weight_map edits: each child compares shardkit's reads against what the mutant itself says,
    read without shardkit (`foreign_reader.expected`); a mutant the layout's rules refuse is
    compared against its seed's state, and the caller requires an error everywhere."""
    import foreign_reader

    import shardkit  # noqa: F401  (imported once, before any fork)

    def truth(path: Path) -> dict[str, np.ndarray]:
        got = foreign_reader.expected(path, seeds)
        return got if got is not None else foreign_reader.seed_truth(path, seeds)

    for seed in FOREIGN_SEEDS:  # warm up, as `serve` does
        run_entry_points(str(seeds / seed), truth(seeds / seed))
    _serve_each(lambda line: (line.strip(), truth(Path(line.strip())), False))


FOREIGN_SEEDS = ("hf", "st", "sk")


class ForeignFuzzServer(FuzzServer):
    """A `serve_foreign` process (the same protocol as `FuzzServer`)."""

    def __init__(self, seeds: Path, timeout: float = TIMEOUT) -> None:
        env = dict(os.environ, SHARDKIT_FUZZ_TIMEOUT=str(timeout))
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve-foreign", str(seeds)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )


if __name__ == "__main__" and sys.argv[1:2] == ["serve-foreign"]:
    serve_foreign(Path(sys.argv[2]))


BOUNDARY_NUMBERS = (0, -1, 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64)
_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
         "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_SAME_SIZE = {4: ["F32", "I32", "U32"], 2: ["F16", "BF16", "I16", "U16"], 8: ["F64", "I64", "U64"],
              1: ["I8", "U8"]}


def header_number_edit(data: bytes, rnd: random.Random) -> bytes:
    """A safetensors file with one number of its header at a boundary (offsets, lengths, shape
    entries: 0, -1, 2**31, 2**32, 2**53, 2**63 - 1, 2**64 / itemsize, ...), a shape whose
    product wraps at 2**64, the length prefix changed, or an edit that keeps the header
    self-consistent (a reshape, a dtype of the same item size, two entries' places swapped):
    then the file is another valid file, whose data a reader must return."""
    import math

    n, text, rest = safetensors_parts(data)
    try:
        header = json.loads(text)
    except ValueError:  # an earlier edit moved the length prefix: edit that again
        header = {}
    names = [k for k in header if k != "__metadata__"]
    how = rnd.choice(["begin", "end", "dim", "dim", "add_dim", "wrap", "length", "reshape",
                      "dtype", "swap", "shift"])
    if how == "length" or not names:
        value = rnd.choice([*BOUNDARY_NUMBERS, n + 8, n - 8, len(data) - 8])
        return struct.pack("<Q", value % 2**64) + data[8:]
    e = header[rnd.choice(names)]
    item = _ITEM.get(e.get("dtype"), 1)
    begin, end = e["data_offsets"]
    hostile = [*BOUNDARY_NUMBERS, 2**64 // item, 2**64 // item + 1, 2**63 // item]
    if how in ("begin", "end"):
        value = rnd.choice([*hostile, begin + item, end - item, end + item])
        e["data_offsets"][0 if how == "begin" else 1] = value
        if rnd.random() < 0.5:  # the other end follows: the entry's size stays its own
            other = value + (end - begin) if how == "begin" else value - (end - begin)
            e["data_offsets"][1 if how == "begin" else 0] = other
    elif how == "dim" and e["shape"]:
        i = rnd.randrange(len(e["shape"]))
        e["shape"][i] = rnd.choice([*hostile, e["shape"][i] + 1, e["shape"][i] - 1])
        if rnd.random() < 0.5:  # the offsets follow the new size
            e["data_offsets"][1] = begin + math.prod(e["shape"]) * item
    elif how == "add_dim":
        e["shape"].insert(rnd.randrange(len(e["shape"]) + 1), rnd.choice([0, 1, 2, 2**32]))
    elif how == "wrap":  # prod(shape) * itemsize == the entry's size modulo 2**64
        size = end - begin
        e["shape"] = rnd.choice([[2**64 // item + size // item], [2**32, 2**32 // item],
                                 [2**32, 2**32 // item, 1] if size == 0 else [2**33, 2**31 // item],
                                 [2**16] * 4])
    elif how == "reshape":  # valid: the same bytes under another shape
        count = math.prod(e["shape"])
        e["shape"] = rnd.choice([[count], [1, count], list(reversed(e["shape"])), [count, 1]])
    elif how == "dtype":  # valid: the same bytes as another dtype of the same item size
        e["dtype"] = rnd.choice(_SAME_SIZE[item])
    elif how == "swap":  # valid when both have the same size: each reads the other's bytes
        other = header[rnd.choice(names)]
        e["data_offsets"], other["data_offsets"] = other["data_offsets"], e["data_offsets"]
    else:  # every entry moved by some bytes: a hole at the start, the end past the region
        k = rnd.choice([1, 8, -8, 2**32])
        for name in names:
            header[name]["data_offsets"] = [o + k for o in header[name]["data_offsets"]]
    return with_header(json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode(),
                       rest)
