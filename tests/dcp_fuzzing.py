"""Mutators and the oracle for fuzzing shardkit's reader of PyTorch DCP directories
(tests/test_fuzz_dcp.py, through tests/fuzzing.py's server).

DCP's only checksums are the CRC-32s of the zip records inside each chunk's torch.save archive
(in the central directory and, after each record, its data descriptor; torch writes no CRC in
the local header). `reseal_distcp` computes them again over a mutated ``.distcp``, so a change
of a tensor's bytes makes another valid checkpoint, which only the structure checks can refuse.
What is right for a mutant is what torch makes of it (`torch_dcp_reads`: ``.metadata`` loaded
with DCP's own classes by an unpickler that admits no other global, each chunk by
``torch.load(weights_only=True)``), in an oracle process of its own (`fuzzing.TensorFlowOracle`
with ``kind="torch"``), so that a hostile archive that crashed torch would cost that process.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

METADATA = ".metadata"
BOUNDARY = (0, 1, -1, 7, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, -(2**63))


# --- the oracle ---------------------------------------------------------------------------------


_ALLOWED = {
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
              "int8", "uint8", "bool", "complex64", "complex128"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` with torch's own classes; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or name in _ALLOWED.get(module,
                                                                                       ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} refused by the oracle")


def _numpy_dtype(dtype: Any) -> np.dtype:
    import ml_dtypes
    import torch

    if dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty(0, dtype=dtype).numpy().dtype


def _raw(t: Any) -> np.ndarray:
    """Tensor `t`'s bytes as a numpy array of its dtype, byte for byte (a bool's stored byte
    as it is, a NaN's payload kept): torch copies neither through its own ops."""
    import torch

    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view(_numpy_dtype(t.dtype)).reshape(tuple(t.shape))


def torch_dcp_reads(path: str) -> dict[str, np.ndarray] | None:
    """Every tensor of the DCP directory at `path` as torch reads it, or None where torch
    (``torch.load`` of a chunk) refuses it or DCP's index is not one: a chunk that is not a
    tensor of its recorded size and dtype, chunks that overlap or leave part of a tensor
    unwritten (torch's ``dcp.load`` would leave that part as it was), a file name that leaves
    the directory, a stream transform."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    try:
        with open(os.path.join(path, METADATA), "rb") as f:
            md = _MetadataUnpickler(f).load()
        out = {}
        files: dict[str, bytes] = {}
        for key, meta in md.state_dict_metadata.items():
            if type(meta).__name__ == "BytesStorageMetadata":
                continue
            size, dtype = tuple(meta.size), meta.properties.dtype
            full = np.zeros(size, _numpy_dtype(dtype))
            covered = np.zeros(size, bool)
            seen: dict[tuple[int, ...], tuple[int, ...]] = {}
            for c in meta.chunks:
                offsets, sizes = tuple(c.offsets), tuple(c.sizes)
                if offsets in seen:  # the same chunk listed again: the same storage entry
                    if seen[offsets] != sizes:
                        return None
                    continue
                seen[offsets] = sizes
                info = md.storage_data[MetadataIndex(key, c.offsets)]
                name = info.relative_path
                if (info.transform_descriptors or not isinstance(name, str) or "/" in name
                        or name in ("", ".", "..") or info.offset < 0 or info.length < 0):
                    return None
                if name not in files:
                    with open(os.path.join(path, name), "rb") as f:
                        files[name] = f.read()
                blob = files[name][info.offset : info.offset + info.length]
                if len(blob) != info.length:
                    return None
                t = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
                if (not isinstance(t, torch.Tensor) or tuple(t.shape) != sizes
                        or t.dtype != dtype or len(offsets) != len(size)
                        or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, size))):
                    return None
                at = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                if covered[at].any():
                    return None
                void = f"V{full.itemsize}"  # copied as bytes: numpy's casts keep no payloads
                full.view(void)[at] = _raw(t).view(void)
                covered[at] = True
            if not covered.all():
                return None
            out[key] = full
        return out
    except Exception:  # any refusal: torch's errors, and a broken index's
        return None


# --- resealing ----------------------------------------------------------------------------------


def archives(path: str, distcp: str) -> list[tuple[int, int]]:
    """(offset, length) of every chunk archive of file `distcp` the seed's ``.metadata`` at
    `path` names (read with torch's classes: the seed's is trusted)."""
    with open(os.path.join(path, METADATA), "rb") as f:
        md = _MetadataUnpickler(f).load()
    return sorted({(i.offset, i.length) for i in md.storage_data.values()
                   if i.relative_path == distcp})


def _records(blob: bytes) -> list[tuple[str, int, int, int, int, int, int]]:
    """The records of the zip archive `blob` from its central directory: (name, its central
    entry's position and length, its local header's position, its flags, where its data begin,
    their size); [] for an archive whose structure is broken."""
    eocd = blob.rfind(b"PK\x05\x06")
    if eocd < 0 or eocd + 22 > len(blob):
        return []
    count, _, cd = struct.unpack_from("<HII", blob, eocd + 10)
    if cd == 0xFFFFFFFF:  # zip64: the central directory's offset is in the zip64 record
        loc = blob.rfind(b"PK\x06\x07", 0, eocd)
        if loc < 0:
            return []
        (z64,) = struct.unpack_from("<Q", blob, loc + 8)
        if blob[z64 : z64 + 4] != b"PK\x06\x06" or z64 + 56 > len(blob):
            return []
        count, cd = struct.unpack_from("<QQ", blob, z64 + 32)
    out = []
    p = cd
    for _ in range(min(count, 1000)):
        if blob[p : p + 4] != b"PK\x01\x02" or p + 46 > len(blob):
            return out
        (size,) = struct.unpack_from("<I", blob, p + 20)
        names, extra, comment = struct.unpack_from("<HHH", blob, p + 28)
        (local,) = struct.unpack_from("<I", blob, p + 42)
        if (size == 0xFFFFFFFF or local == 0xFFFFFFFF or local + 30 > len(blob)
                or blob[local : local + 4] != b"PK\x03\x04"):
            return out
        (flags,) = struct.unpack_from("<H", blob, local + 6)
        lname, lextra = struct.unpack_from("<HH", blob, local + 26)
        name = blob[p + 46 : p + 46 + names].decode("utf-8", "replace")
        length = 46 + names + extra + comment
        out.append((name, p, length, local, flags, local + 30 + lname + lextra, size))
        p += length
    return out


def reseal_archive(data: bytearray, start: int, length: int) -> None:
    """Every record's CRC-32 of the zip archive at ``data[start : start + length]`` computed
    again over its bytes (central directory, data descriptor or local header); an archive
    whose structure a mutation broke is left as it is."""
    blob = bytes(data[start : start + length])
    for _, p, _, local, flags, begin, size in _records(blob):
        crc = struct.pack("<I", zlib.crc32(blob[begin : begin + size]))
        data[start + p + 16 : start + p + 20] = crc
        if flags & 8:  # a data descriptor after the data, with or without its signature
            at = begin + size + (4 if blob[begin + size : begin + size + 4] == b"PK\x07\x08"
                                 else 0)
            if at + 4 <= len(blob):
                data[start + at : start + at + 4] = crc
        else:
            data[start + local + 14 : start + local + 18] = crc


def meaning(data: bytes, places: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges of the (seed's) ``.distcp`` `data` that say what its tensors are: each
    archive's ``data.pkl`` and tensor records, their local headers and central entries. The
    rest is zip bookkeeping torch's reader checks more strictly than shardkit's, which does not
    read it: a ``version`` or ``serialization_id`` record, zip64 counts, flags of other
    records."""
    out = []
    for start, length in places:
        for name, p, n, local, _, begin, size in _records(data[start : start + length]):
            if name.endswith("/data.pkl") or "/data/" in name:
                out += [(start + p, start + p + n), (start + local, start + begin + size)]
    return out


def reseal_distcp(data: bytearray, places: list[tuple[int, int]]) -> bytearray:
    for start, length in places:
        if start + length <= len(data):
            reseal_archive(data, start, length)
    return data


def tensor_bytes_at(data: bytes, places: list[tuple[int, int]], rnd: random.Random
                    ) -> tuple[int, int] | None:
    """A tensor record's data range of one of the archives: where a mutation changes values."""
    import zipfile

    start, length = rnd.choice(places)
    with zipfile.ZipFile(io.BytesIO(data[start : start + length])) as z:
        records = [i for i in z.infolist() if "/data/" in i.filename and i.file_size]
        if not records:
            return None
        info = rnd.choice(records)
        local = start + info.header_offset
        lname, lextra = struct.unpack_from("<HH", data, local + 26)
        begin = local + 30 + lname + lextra
        return begin, begin + info.file_size


# --- .metadata edits ----------------------------------------------------------------------------


def edit_metadata(data: bytes, rnd: random.Random, files: list[str]) -> bytes:
    """The seed's ``.metadata`` (torch's classes) with one structured edit, pickled again: a
    chunk's storage offset or length at a boundary or moved, a chunk's offsets or sizes
    changed, a tensor's size or dtype changed, two chunks' storage swapped, a chunk dropped or
    listed twice, a storage entry dropped, another file named, a transform recorded."""
    import dataclasses

    import torch

    md = _MetadataUnpickler(io.BytesIO(data)).load()
    storage = list(md.storage_data.items())
    tensors = [(k, v) for k, v in md.state_dict_metadata.items()
               if type(v).__name__ == "TensorStorageMetadata"]
    how = rnd.choice(["offset", "offset", "length", "length", "chunk", "size", "dtype", "swap",
                      "drop_chunk", "twice", "drop_storage", "file", "transform"])
    index, info = rnd.choice(storage)
    meta = rnd.choice(tensors)[1]
    if how in ("offset", "length"):
        old = getattr(info, how)
        value = rnd.choice([*BOUNDARY, old + 1, old - 1, old + 8, old - 8, old + 64])
        md.storage_data[index] = dataclasses.replace(info, **{how: value})
    elif how == "chunk" and meta.chunks:
        c = rnd.choice(meta.chunks)
        field = rnd.choice(["offsets", "sizes"])
        dims = list(getattr(c, field))
        if dims:
            dims[rnd.randrange(len(dims))] = rnd.choice([0, 1, -1, 2, 2**31, 2**63 - 1])
            setattr(c, field, torch.Size(dims))
    elif how == "size":
        dims = list(meta.size) or [1]
        dims[rnd.randrange(len(dims))] = rnd.choice([0, 1, 2, 3, 2**32, 2**62])
        meta.size = torch.Size(dims)
    elif how == "dtype":
        meta.properties.dtype = rnd.choice([torch.float32, torch.int32, torch.float64,
                                            torch.bfloat16, torch.uint8, torch.bool])
    elif how == "swap":
        other, other_info = rnd.choice(storage)
        md.storage_data[index], md.storage_data[other] = other_info, info
    elif how == "drop_chunk" and meta.chunks:
        meta.chunks.pop(rnd.randrange(len(meta.chunks)))
    elif how == "twice" and meta.chunks:
        meta.chunks.append(rnd.choice(meta.chunks))
    elif how == "drop_storage":
        del md.storage_data[index]
    elif how == "file":
        name = rnd.choice([*files, "__9_0.distcp", "../escape.distcp", ".metadata", ""])
        md.storage_data[index] = dataclasses.replace(info, relative_path=name)
    elif how == "transform":
        md.storage_data[index] = dataclasses.replace(info, transform_descriptors=["x"])
    return pickle.dumps(md)


def bookkeeping_only(seed: str, mutant: str) -> bool:
    """Whether the DCP directory `mutant` differs from `seed` only in zip bookkeeping of its
    ``.distcp`` files (outside every range `meaning` gives; same lengths, same ``.metadata``):
    its tensors are the seed's, whatever torch's stricter zip reader makes of it."""
    def same(name: str) -> bool:
        return Path(seed, name).read_bytes() == Path(mutant, name).read_bytes()

    if not same(METADATA):
        return False
    for name in sorted(os.listdir(seed)):
        if name == METADATA or same(name):
            continue
        a = np.fromfile(os.path.join(seed, name), np.uint8)
        b = np.fromfile(os.path.join(mutant, name), np.uint8)
        if a.size != b.size:
            return False
        changed = np.flatnonzero(a != b)
        for lo, hi in meaning(a.tobytes(), archives(seed, name)):
            if ((changed >= lo) & (changed < hi)).any():
                return False
    return True
