"""PyTorch Distributed Checkpoint (DCP) layouts -> the reader's table, without torch.

A DCP directory, as ``torch.distributed.checkpoint.save`` writes it with the FileSystemWriter:
``.metadata`` (a pickle of DCP's ``Metadata``: per key a ``TensorStorageMetadata`` (dtype,
global size, chunks: offsets and sizes) or a ``BytesStorageMetadata``; ``storage_data``: per
chunk its file, offset and length) and the ``__<rank>_<n>.distcp`` files, in which every chunk
is one torch.save archive of the chunk's tensor (`torchsave.read_archive`). ``.metadata`` is read
by `torchsave.load_pickle`'s restricted unpickler; each chunk's archive is located and its
``data.pkl`` read the same way, so the table places every chunk's raw bytes in its file, as
TensorBundle's does (`tensorbundle.source.BundleData`). Each chunk is a slice of the global
tensor: offsets and sizes become shardkit's slice spec, and the reader assembles, slices and
reshards as for shardkit's own split tensors.

A ``.pt`` / ``.pth`` file of ``dcp_to_torch_save`` (any torch.save of a state dict of tensors)
is one archive: one shard, its tensors stored whole under their flattened keys.

Non-tensor items (DCP's ``BytesStorageMetadata``: pickled Python objects) are never unpickled:
they are left out of the table and listed in the user metadata (``dcp.objects``); asking for
one is a KeyNotFoundError saying why. Checksums: torch.save's records carry zip's CRC-32 of
their bytes, kept as checksum kind ``crc32`` for a tensor that is its record's whole storage.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from ..errors import CheckpointNotFoundError, CorruptIndexError, UnknownCodecError
from ..format import (
    MAX_INDEX_BYTES,
    CheckpointIndex,
    EntryLayout,
    ShardInfo,
    check_shard_file_name,
    check_slices,
    read_safetensors_header,
    shown,
)
from ..optional import lazy_import
from ..sharding.tensors import DEFAULT_DEVICE
from ..shards.files import CheckpointDirectory, CheckpointFile
from ..values.dtypes import itemsize
from ..values.keys import check_keys
from ..values.slices import WHOLE, format_slice_spec
from .base import FormatAdapter, ParsedHeader, PlacedIndex
from .torchsave import (
    METADATA_GLOBALS,
    Record,
    TensorRef,
    TorchDType,
    load_pickle,
    read_archive,
)

if TYPE_CHECKING:
    import orjson
else:
    orjson = lazy_import("orjson", "a DCP safetensors file's sharding info")

METADATA_FILE: Final = ".metadata"
"""DCP's index file (torch.distributed.checkpoint.filesystem._metadata_fn)."""
RANK_METADATA_FILE: Final = "__0.metadata"
"""Rank 0's index file of a DCP checkpoint saved with ``use_collectives=False``."""
SHARDING_INFO: Final = "DCP_SHARDING_INFO"
"""The ``__metadata__`` field of DCP's safetensors files: per key its chunk's offsets."""
CRC32: Final = "crc32"
OBJECTS: Final = "dcp.objects"
_NOT_UNPICKLED: Final = ("a non-tensor item (a pickled Python object) of the PyTorch DCP "
                         "checkpoint; shardkit never unpickles them (load it with "
                         "torch.distributed.checkpoint)")


@dataclass(slots=True, eq=False)
class DcpIndex(PlacedIndex):
    """A DCP checkpoint's index (`PlacedIndex`), and which keys are non-tensor items
    (`objects`: key -> why it is not in the table)."""

    objects: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Table:
    """The table being built: tensors, then their stored slices (any order until `index`)."""

    keys: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    rows: list[tuple[int, int, int, str, str | None]] = field(default_factory=list)
    objects: dict[str, str] = field(default_factory=dict)

    def index(self, files: list[str], sizes: list[int], callback: str, path: str,
              metadata: dict[str, Any]) -> DcpIndex:
        rows = sorted(self.rows)  # by shard, then begin: data-region order within a shard
        n = len(self.keys)
        if self.objects:
            metadata = {**metadata, OBJECTS: sorted(self.objects)}
        index = DcpIndex(
            callback, [ShardInfo(f, 0, "raw", b) for f, b in zip(files, sizes)], self.keys,
            self.dtypes, self.shapes, [DEFAULT_DEVICE] * n, [r[2] for r in rows],
            [r[3] for r in rows], [r[0] for r in rows], [r[4] for r in rows], metadata, "",
            slice_checksum_kind=[CRC32] * len(rows))
        index.objects = self.objects
        bounds = np.searchsorted([r[0] for r in rows], np.arange(len(files) + 1)).tolist()
        begins = [r[1] for r in rows]
        index.begins = [begins[bounds[i] : bounds[i + 1]] for i in range(len(files))]
        index.aligned = [all(rows[j][1] % itemsize(self.dtypes[rows[j][2]]) == 0
                             for j in range(bounds[i], bounds[i + 1]))
                         for i in range(len(files))]
        check_keys(self.keys, error=CorruptIndexError, where=f"{path}: ")
        if len(rows) != n or any(index.slice_spec):
            check_slices(index, path)
        return index


def _placed(tensor: Any, where: str, key: str, dtype_name: str,
            records: dict[str, tuple[int, int, int]]) -> tuple[int, str | None]:
    """Where the bytes of `tensor` (a `TensorRef` of an archive) begin in the file, and the
    CRC-32 recorded for them (None unless they are their record's whole storage)."""
    if not isinstance(tensor, TensorRef):
        raise CorruptIndexError(f"{where}: the archive holds {shown(type(tensor).__name__)}, "
                                f"not the tensor of key {shown(key)}")
    stored = TorchDType(tensor.dtype).dtype_name
    if stored != dtype_name:
        raise CorruptIndexError(f"{where}: key {shown(key)} is stored as torch.{tensor.dtype}, "
                                f"the index says {dtype_name}")
    expect = 1
    for n, s in zip(reversed(tensor.size), reversed(tensor.stride)):
        if n > 1 and s != expect:
            raise UnknownCodecError(
                f"{where}: key {shown(key)} is stored with strides {list(tensor.stride)} for "
                f"size {list(tensor.size)}, not in C order (a transposed or permuted view "
                "saved as is); shardkit maps C-order bytes only: save it .contiguous()")
        expect *= n
    record = records.get(tensor.storage.key)
    if record is None:
        raise CorruptIndexError(f"{where}: key {shown(key)}'s storage "
                                f"{shown(tensor.storage.key)} has no data record")
    size = itemsize(dtype_name)
    begin = record[0] + tensor.offset * size
    nbytes = math.prod(tensor.size) * size
    if tensor.offset * size + nbytes > record[1]:
        raise CorruptIndexError(f"{where}: key {shown(key)}: {nbytes} bytes at item "
                                f"{tensor.offset} are past the end of its storage record "
                                f"({record[1]} bytes)")
    whole = tensor.offset == 0 and nbytes == record[1] and (record[2] or not nbytes)
    return begin, f"{record[2]:08x}" if whole else None


def _dtype(key: str, props: Any, path: str) -> str:
    state = props.get("state") if isinstance(props, Record) else None
    dtype = (state[0] if isinstance(state, tuple) and state else
             props.get("dtype") if isinstance(props, Record) else None)
    if not isinstance(dtype, TorchDType):
        raise CorruptIndexError(f"{path}: key {shown(key)}: properties hold no torch dtype "
                                f"({shown(state)})")
    if dtype.dtype_name is None:
        raise UnknownCodecError(f"{path}: key {shown(key)} is of dtype torch.{dtype.name}, "
                                "which shardkit has no dtype for")
    return dtype.dtype_name


def _storage_map(md: Record, path: str) -> dict[tuple[str, Any], Record]:
    data = md.get("storage_data")
    if not isinstance(data, dict):
        raise CorruptIndexError(f"{path}: storage_data is {shown(type(data).__name__)}, not the "
                                "FileSystemWriter's map of chunks to files (another "
                                "StorageWriter?)")
    out: dict[tuple[str, Any], Record] = {}
    for k, v in data.items():
        fqn = k.get("fqn") if isinstance(k, Record) else None
        if not isinstance(fqn, str) or not isinstance(v, Record):
            raise CorruptIndexError(f"{path}: storage_data entry {shown(k)} -> {shown(v)} is "
                                    "not a MetadataIndex -> _StorageInfo")
        off = k.get("offset")
        out[(fqn, None if off is None else tuple(off))] = v
    return out


def _chunks(key: str, meta: Record, shape: tuple[int, ...], path: str
            ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    chunks = meta.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise CorruptIndexError(f"{path}: key {shown(key)} has no chunks")
    kept = []
    for c in chunks:
        offsets, sizes = (tuple(c.get("offsets", ())), tuple(c.get("sizes", ()))
                          ) if isinstance(c, Record) else ((), (-1,))
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > d
                for o, s, d in zip(offsets, sizes, shape)):
            raise CorruptIndexError(f"{path}: key {shown(key)}: chunk {shown(c)} is not a box "
                                    f"of its size {list(shape)}")
        kept.append((offsets, sizes))
    if math.prod(shape):  # an empty chunk of a tensor with items holds nothing: not a slice
        kept = [c for c in kept if math.prod(c[1])] or kept[:1]
    else:
        kept = kept[:1]  # a tensor of no items: one (empty) chunk says it all
    yield from kept


def rank_metadata_files(directory: CheckpointDirectory) -> list[str]:
    """The per-rank metadata files of a DCP checkpoint saved with ``use_collectives=False``
    (``__0.metadata``, ``__1.metadata``, ...: ranks 0 up to the first one missing)."""
    names: list[str] = []
    while directory.has(f"__{len(names)}{METADATA_FILE}"):
        names.append(f"__{len(names)}{METADATA_FILE}")
    return names


def _metadata(name: str, data: bytes, path: str) -> tuple[dict[Any, Any], dict[Any, Record],
                                                           Any]:
    """(state_dict_metadata, `_storage_map`, version) of the ``.metadata`` bytes `data`."""
    md = load_pickle(data, METADATA_GLOBALS, path)
    if type(md).__name__ != "Metadata" or not isinstance(md, Record):
        raise CorruptIndexError(f"{path}: holds {shown(type(md).__name__)}, not DCP's Metadata")
    items = md.get("state_dict_metadata")
    if not isinstance(items, dict):
        raise CorruptIndexError(f"{path}: state_dict_metadata is not a dict")
    return items, _storage_map(md, path), md.get("version")


def decode_metadata(directory: CheckpointDirectory, name: str, data: bytes) -> DcpIndex:
    """The table of the DCP checkpoint whose ``.metadata`` bytes are `data`.

    A checkpoint saved without rank coordination (``dcp.save(..., use_collectives=False)``)
    has a metadata file per rank (``__<rank>.metadata``, each naming that rank's chunks) and
    no ``.metadata``: `name` ``__0.metadata`` reads every rank's (`rank_metadata_files`) as
    one table, a chunk that several ranks saved (a replicated tensor) taken from the lowest.

    Args:
        directory: the checkpoint's directory, its ``.distcp`` files opened through it.
        name: the metadata file's name (``.metadata``, or ``__0.metadata``).
        data: its bytes.

    Returns:
        The `DcpIndex`: every tensor chunk a stored slice placed in its file.

    Raises:
        UnsafePickleError: ``.metadata`` or a chunk's ``data.pkl`` names a global outside
            `torchsave.METADATA_GLOBALS` / `torchsave.ARCHIVE_GLOBALS`.
        CorruptIndexError: a malformed index, a chunk past its file's end, a chunk that is
            not a torch.save archive or safetensors entry of the tensor the index describes,
            ranks' metadata files that disagree on a key's size or dtype.
        UnknownCodecError: a chunk stored with a transform (DCP's compressing extensions), a
            dtype or memory layout shardkit cannot map; named by key.
    """
    names = [name]
    if name != METADATA_FILE:
        names = rank_metadata_files(directory) or [name]
    table = _Table()
    placed: list[tuple[str, int, tuple[int, ...], tuple[int, ...], Record]] = []
    # key -> its row, the sizes of its chunks by offsets, the file that named it first
    rows: dict[str, tuple[int, dict[tuple[int, ...], tuple[int, ...]], str]] = {}
    version = None
    for file in names:
        path = directory.join(file)
        if file != name:
            got = directory.read_manifest(file, MAX_INDEX_BYTES)
            if got is None:
                raise CorruptIndexError(f"{path}: rank metadata file vanished while read")
            data = got
        items, storage, version = _metadata(file, data, path)
        for key, meta in items.items():
            if not isinstance(key, str):
                raise CorruptIndexError(f"{path}: key {shown(key)} is not a string")
            kind = type(meta).__name__
            if kind == "BytesStorageMetadata":
                if key in rows:
                    raise CorruptIndexError(f"{path}: key {shown(key)} is an object here and a "
                                            f"tensor in {rows[key][2]}")
                table.objects[key] = _NOT_UNPICKLED
                continue
            if kind != "TensorStorageMetadata" or not isinstance(meta, Record):
                raise CorruptIndexError(f"{path}: key {shown(key)} is described by "
                                        f"{shown(kind)}, not TensorStorageMetadata or "
                                        "BytesStorageMetadata")
            shape = meta.get("size")
            if not isinstance(shape, tuple):
                raise CorruptIndexError(f"{path}: key {shown(key)}: size {shown(shape)} is not "
                                        "a torch.Size")
            dtype = _dtype(key, meta.get("properties"), path)
            if key in table.objects:
                raise CorruptIndexError(f"{path}: key {shown(key)} is a tensor here and an "
                                        "object in an earlier rank's metadata file")
            if key not in rows:
                rows[key] = (len(table.keys), {}, file)
                table.keys.append(key)
                table.dtypes.append(dtype)
                table.shapes.append(shape)
            row, seen, first = rows[key]
            if (table.shapes[row], table.dtypes[row]) != (shape, dtype):
                raise CorruptIndexError(
                    f"{path}: key {shown(key)} is of size {list(shape)} and dtype {dtype} here, "
                    f"of size {list(table.shapes[row])} and dtype {table.dtypes[row]} in "
                    f"{first}")
            for offsets, sizes in _chunks(key, meta, shape, path):
                if offsets in seen:  # listed again, or saved by an earlier rank (replicated)
                    if seen[offsets] != sizes:
                        raise CorruptIndexError(
                            f"{path}: key {shown(key)}: the chunk at {list(offsets)} is of "
                            f"sizes {list(sizes)} and {list(seen[offsets])}")
                    continue
                seen[offsets] = sizes
                info = storage.get((key, offsets))
                if info is None:
                    raise CorruptIndexError(f"{path}: key {shown(key)}: chunk at "
                                            f"{list(offsets)} has no entry in storage_data")
                placed.append((key, row, offsets, sizes, info))
    path = directory.join(name)
    by_file: dict[Any, list[tuple[str, int, tuple[int, ...], tuple[int, ...], Record]]] = {}
    for p in placed:
        by_file.setdefault(p[4].get("relative_path"), []).append(p)
    for file in by_file:
        check_shard_file_name(file, path)
    files = sorted(by_file)
    sizes_of: list[int] = []
    for i, file in enumerate(files):
        with closing(directory.open_shard(file, path)) as f:
            sizes_of.append(f.size)
            headers: dict[int, _Header | None] = {}
            for key, row, offsets, sizes, info in by_file[file]:
                _chunk(table, f, i, key, row, offsets, sizes, info, path, headers)
    metadata = {"dcp.version": version} if isinstance(version, str) else {}
    return table.index(files, sizes_of, "(none: a PyTorch Distributed Checkpoint)", path,
                       metadata)


_Header = tuple[dict[str, EntryLayout], dict[str, str], int]


def _safetensors_at(f: CheckpointFile, start: int, headers: dict[int, _Header | None]
                    ) -> _Header | None:
    """The header of the safetensors file at byte `start` of `f` (its begins made offsets from
    the start of `f`), else None: a torch.save archive (a zip's local header, ``PK``) is there.

    ``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)`` writes a rank's
    non-tensor items first, then one safetensors file of its tensor chunks, and gives every
    chunk the offset where that begins (its length: the chunk's bytes). Cached in `headers`.
    """
    if start in headers:
        return headers[start]
    head = f.read(start, start + 9)
    found = None
    if len(head) == 9 and not head.startswith(b"PK") and head[8:9] == b"{":
        entries, meta, data_start = read_safetensors_header(
            lambda a, b: f.read(start + a, start + b), f.size - start, f.path)
        found = entries, meta, start + data_start
    headers[start] = found
    return found


def _in_safetensors(header: _Header, f: CheckpointFile, key: str, offsets: tuple[int, ...],
                    sizes: tuple[int, ...], dtype_name: str, length: Any) -> int:
    """Where the chunk of `key` at `offsets` begins in the safetensors file `f`: its entry,
    named by the key, of the chunk's dtype and sizes, at the offsets DCP recorded for it in
    the header's ``DCP_SHARDING_INFO``."""
    entries, meta, data_start = header  # data_start: from the start of `f`
    where = f"{f.path}: key {shown(key)} chunk at {list(offsets)}"
    entry = entries.get(key)
    if entry is None:
        raise CorruptIndexError(f"{where}: the safetensors file has no entry {shown(key)}")
    if entry.dtype_name != dtype_name or entry.shape != sizes:
        raise CorruptIndexError(f"{where}: its safetensors entry is {entry.dtype_name} "
                                f"{list(entry.shape)}, the index says {dtype_name} "
                                f"{list(sizes)}")
    if length != entry.nbytes:
        raise CorruptIndexError(f"{where}: the index says {shown(length)} bytes, its "
                                f"safetensors entry holds {entry.nbytes}")
    info = meta.get(SHARDING_INFO)
    if info is not None:
        try:
            saved = orjson.loads(info)[key]["saved_offsets"]
        except (orjson.JSONDecodeError, TypeError, KeyError):
            saved = None
        if saved != list(offsets):
            raise CorruptIndexError(f"{where}: the file's {SHARDING_INFO} gives "
                                    f"{shown(saved)} as its offsets")
    return data_start + entry.begin


def _chunk(table: _Table, f: CheckpointFile, shard: int, key: str, row: int,
           offsets: tuple[int, ...], sizes: tuple[int, ...], info: Record, path: str,
           headers: dict[int, _Header | None]) -> None:
    """One chunk's archive (or entry of a safetensors file, `_safetensors_at`) located in file
    `f` and its slice added to `table`."""
    where = f"{f.path}: key {shown(key)} chunk at {list(offsets)}"
    transforms = info.get("transform_descriptors")
    if transforms:
        raise UnknownCodecError(
            f"{path}: key {shown(key)}: chunk at {list(offsets)} is stored through transforms "
            f"{shown(list(transforms))} (a DCP extension such as ZStandard compression); "
            "shardkit maps untransformed torch.save bytes only")
    start, length = info.get("offset"), info.get("length")
    if type(start) is not int or type(length) is not int or start < 0 or length < 0:
        raise CorruptIndexError(f"{path}: key {shown(key)}: chunk at {list(offsets)} has "
                                f"offset {shown(start)} and length {shown(length)}")
    shape = table.shapes[row]
    # a tensor of no items keeps one chunk (`_chunks`), which stands for all of it
    whole = (all(o == 0 for o in offsets) and sizes == shape) or not math.prod(shape)
    spec = WHOLE if whole else format_slice_spec(shape, offsets, sizes)
    if start > f.size - length:
        raise CorruptIndexError(
            f"{path}: key {shown(key)}: chunk at {list(offsets)} is bytes [{start}, "
            f"{start + length}) of {f.path}, past its end ({f.size} bytes: truncated?)")
    header = _safetensors_at(f, start, headers)
    if header is not None:  # the safetensors file of its rank's chunks begins at `start`
        begin = _in_safetensors(header, f, key, offsets, sizes, table.dtypes[row], length)
        table.rows.append((shard, begin, row, spec, None))
        return
    archive = read_archive(f.read, start, length, where)
    tensor = archive.value
    if isinstance(tensor, TensorRef) and tensor.size != sizes:
        raise CorruptIndexError(f"{where}: the archive holds a tensor of size "
                                f"{list(tensor.size)}, the index says {list(sizes)}")
    begin, crc = _placed(tensor, where, key, table.dtypes[row], archive.records)
    table.rows.append((shard, begin, row, spec, crc))


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}{k}.", out)
    elif isinstance(value, (list, tuple)) and not isinstance(value, TensorRef):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}{i}.", out)
    else:
        out[prefix[:-1]] = value


def decode_torch_save(directory: CheckpointDirectory, name: str) -> DcpIndex:
    """The table of the torch.save file `name` (a ``dcp_to_torch_save`` output).

    Args:
        directory: the directory holding it.
        name: the file's name (``.pt`` / ``.pth``).

    Returns:
        The `DcpIndex`: its tensors whole, under their keys flattened with ``.``; other values
        listed in `DcpIndex.objects` (and the ``dcp.objects`` metadata).

    Raises:
        UnsafePickleError, CorruptIndexError, UnknownCodecError: as `decode_metadata`.
    """
    path = directory.join(name)
    check_shard_file_name(name, path)
    table = _Table()
    with closing(directory.open_shard(name, name)) as f:
        archive = read_archive(f.read, 0, f.size, path)
        size = f.size
    flat: dict[str, Any] = {}
    _flatten(archive.value, "", flat)
    for key, value in flat.items():
        if not isinstance(value, TensorRef):
            table.objects[key] = (f"a non-tensor value ({type(value).__name__}) of the torch.save "
                                  "file; shardkit reads its tensors only")
            continue
        dtype = TorchDType(value.dtype).dtype_name
        if dtype is None:
            raise UnknownCodecError(f"{path}: key {shown(key)} is of dtype torch.{value.dtype}, "
                                    "which shardkit has no dtype for")
        row = len(table.keys)
        table.keys.append(key)
        table.dtypes.append(dtype)
        table.shapes.append(value.size)
        begin, crc = _placed(value, path, key, dtype, archive.records)
        table.rows.append((0, begin, row, WHOLE, crc))
    return table.index([name], [size], "(none: a torch.save file)", path, {})


class _Placed(FormatAdapter):
    """A layout whose index places every entry in its file (no shard header)."""

    checksums = True
    separator = "."  # DCP's fully qualified names: model.layers.0.weight

    def open_source(self, index: CheckpointIndex, i: int, path: str, info: ShardInfo, *,
                    mmap: bool, file: Any) -> Any:
        from .tensorbundle.source import BundleData

        assert isinstance(index, DcpIndex)
        return BundleData(path, info, index.begins[i], partial(index.layout, i), mmap=mmap,
                          file=file, aligned=index.aligned[i])

    def checksum(self, kind: str, src: Any, entry: EntryLayout) -> str:
        if kind != CRC32:
            return super().checksum(kind, src, entry)
        n = entry.nbytes
        view = src.view(entry, 0, n) if n else None
        if view is not None or n == 0:
            return f"{zlib.crc32(view if view is not None else b''):08x}"
        crc, pos = 0, 0
        buf = np.empty(min(n, 8 << 20), np.uint8)
        while pos < n:
            k = min(len(buf), n - pos)
            src.read_into(entry, pos, pos + k, buf.data[:k])
            crc = zlib.crc32(buf.data[:k], crc)
            pos += k
        return f"{crc:08x}"

    def missing(self, index: CheckpointIndex, key: str) -> str | None:
        return index.objects.get(key) if isinstance(index, DcpIndex) else None


class DistributedCheckpoint(_Placed):
    """PyTorch's Distributed Checkpoint directory (``.metadata`` + ``*.distcp``)."""

    name = "dcp"
    description = "PyTorch Distributed Checkpoint (DCP)"

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        if data is None:
            data = directory.read_manifest(name, MAX_INDEX_BYTES)
            if data is None:
                raise CheckpointNotFoundError(f"no DCP checkpoint at {directory.path}: "
                                              f"{name} is missing")
        return decode_metadata(directory, name, data)


class TorchSaveFile(_Placed):
    """One torch.save file of a state dict of tensors (``dcp_to_torch_save``'s ``.pt``)."""

    name = "torch-save"
    description = "torch.save file (PyTorch state dict)"

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        return decode_torch_save(directory, name)


DCP: Final = DistributedCheckpoint()
TORCH_SAVE: Final = TorchSaveFile()
__all__ = ["DCP", "METADATA_FILE", "RANK_METADATA_FILE", "TORCH_SAVE", "DcpIndex",
           "DistributedCheckpoint", "TorchSaveFile", "decode_metadata", "decode_torch_save",
           "rank_metadata_files"]
