"""The TensorBundle adapter: ``<prefix>.index`` + ``<prefix>.data-*`` -> the reader's table.

The ``.index`` table (`table.read_table`; docs/FORMAT.md section 12) holds the header and one
BundleEntryProto per tensor or slice (`protos`), decoded and checked column-wise by `columns`.
The table built here lists the tensors in key order (TensorFlow's), each
slice under shardkit's slice spec text, and keeps where each data file's entries begin
(`TensorBundleIndex.begins`): TensorBundle data files have no header, the index says where
every entry is. Checksums are TensorFlow's (`slice_checksum_kind` "crc32c", see
`checksums`), checked by ``verify``. DT_STRING tensors are kept apart, as
`CheckpointIndex.strings` (`strings.BundleStrings`), shardkit's one mechanism for string
tensors.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import numpy as np

from ...errors import (
    CheckpointNotFoundError,
    CorruptIndexError,
    UnsupportedVersionError,
)
from ...format import (
    MAX_INDEX_BYTES,
    CheckpointIndex,
    EntryLayout,
    ShardInfo,
    check_shard_file_name,
    check_slices,
    shown,
)
from ...sharding.tensors import DEFAULT_DEVICE, gc_paused
from ...shards.files import CheckpointDirectory
from ...values.keys import RESERVED, check_keys
from ...values.slices import WHOLE
from ..base import FormatAdapter, ParsedHeader, PlacedIndex
from .columns import entry_columns, framed_columns
from .datatypes import STRING
from .names import INDEX_SUFFIX, STATE_FILE, data_file
from .source import _align
from .state import parse_state_proto
from .table import read_table, read_table_framed

BUNDLE_VERSION: Final = 1  # kTensorBundleVersion: the producer version written, the consumer read
BUNDLE_MIN_PRODUCER: Final = 0  # kTensorBundleMinProducer
CRC32C: Final = "crc32c"


@dataclass(slots=True, eq=False)
class TensorBundleIndex(PlacedIndex):
    """A TensorBundle's index (`PlacedIndex`), and the number of data files its header names."""

    num_shards: int = 0


class HexColumn(Sequence[str]):
    """Per stored slice, its crc32c as the 8 hex digits of `CheckpointIndex.slice_xxh3`,
    spelled out on first use: a load never looks at them (CHANGELOG.md has the cost)."""

    __slots__ = ("_strings", "_values")

    def __init__(self, values: np.ndarray) -> None:
        self._values = values
        self._strings: list[str] | None = None

    def _list(self) -> list[str]:
        if self._strings is None:
            hexed = self._values.astype(">u4").tobytes().hex()
            self._strings = [hexed[i : i + 8] for i in range(0, len(hexed), 8)]
        return self._strings

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i: Any) -> Any:
        return self._list()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HexColumn):
            other = other._list()
        return self._list() == other

    __hash__ = None  # type: ignore[assignment]


def state_target(directory: CheckpointDirectory) -> str | None:
    """The ``.index`` file that the directory's ``checkpoint`` state file names as the latest
    checkpoint, or None without a state file. CorruptIndexError for a state file that does not
    parse or names a checkpoint outside the directory."""
    data = directory.read_manifest(STATE_FILE, 1 << 20)
    if data is None:
        return None
    path = directory.join(STATE_FILE)
    state = parse_state_proto(data, path)
    target = state.model_checkpoint_path
    if not target:
        raise CorruptIndexError(f"{path}: model_checkpoint_path is empty (no latest checkpoint)")
    if os.path.isabs(target):
        parent, name = os.path.split(target)
        try:
            same = os.path.samefile(parent, directory.path)
        except OSError:
            same = False
        if not same:
            raise CheckpointNotFoundError(
                f"{path}: model_checkpoint_path {shown(target)} is outside this directory; "
                "open that prefix itself")
        target = name
    if "/" in target or target in (".", ".."):
        raise CheckpointNotFoundError(
            f"{path}: model_checkpoint_path {shown(target)} is not in this directory; open "
            "that prefix itself")
    return target + INDEX_SUFFIX


class TensorBundle(FormatAdapter):
    """TensorFlow's TensorBundle checkpoint (tf.train.Checkpoint.write / save, tf.saved_model
    variables): ``<prefix>.index`` and ``<prefix>.data-0000i-of-0000n``."""

    name = "tensorbundle"
    description = "TensorFlow TensorBundle checkpoint"
    checksums = True

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        path = directory.join(name)
        check_shard_file_name(name, path)
        if data is None:
            data = directory.read_manifest(name, MAX_INDEX_BYTES)
            if data is None:
                raise CheckpointNotFoundError(f"no TensorFlow checkpoint at {path}: the file "
                                              "is missing")
        with gc_paused():  # one object per entry: no cyclic GC pass is needed meanwhile
            return decode_bundle(data, path, name[: -len(INDEX_SUFFIX)], directory)

    def open_source(self, index: CheckpointIndex, i: int, path: str, info: ShardInfo, *,
                    mmap: bool, file: Any) -> Any:
        from .source import BundleData

        assert isinstance(index, TensorBundleIndex)
        return BundleData(path, info, index.begins[i], partial(index.layout, i), mmap=mmap,
                          file=file,
                          aligned=bool(index.aligned) and index.aligned[i])

    def checksum(self, kind: str, src: Any, entry: EntryLayout) -> str:
        from .checksums import entry_checksum

        return entry_checksum(kind, src, entry)


def _check_version(header: Any, path: str) -> None:
    v = header.version
    if header.endianness != 0:
        raise UnsupportedVersionError(
            f"{path}: the bundle is big-endian; shardkit reads little-endian bundles only")
    if v.producer < BUNDLE_MIN_PRODUCER:
        raise UnsupportedVersionError(f"{path}: bundle producer version {v.producer} is older "
                                      f"than the oldest supported ({BUNDLE_MIN_PRODUCER})")
    if v.min_consumer > BUNDLE_VERSION:
        raise UnsupportedVersionError(
            f"{path}: the bundle needs a reader of version {v.min_consumer} or newer; shardkit "
            f"reads version {BUNDLE_VERSION} (written by a newer TensorFlow?)")
    if BUNDLE_VERSION in v.bad_consumers:
        raise UnsupportedVersionError(f"{path}: the bundle disallows readers of version "
                                      f"{BUNDLE_VERSION} (bad_consumers)")


def decode_bundle(data: bytes, path: str, prefix: str,
                  directory: CheckpointDirectory) -> TensorBundleIndex:
    """The table of the bundle whose ``.index`` bytes are `data` (file `path`); the data files
    (`prefix` + ``.data-*``) are opened through `directory` for their sizes."""
    from .protos import MARKS, BundleHeaderProto, DecodeError

    raw_keys, framed, lengths = read_table_framed(data, path, MARKS)
    if not raw_keys or raw_keys[0] != b"":
        raise CorruptIndexError(f"{path}: the table has no header entry (key \"\"); not a "
                                "TensorBundle index")
    start = len(MARKS) + lengths[0]
    header = BundleHeaderProto()
    try:
        header.ParseFromString(bytes(framed[len(MARKS) : start]))
    except DecodeError as e:
        raise CorruptIndexError(f"{path}: the header entry is not a parseable "
                                f"BundleHeaderProto ({e})") from None
    _check_version(header, path)
    n = header.num_shards
    if n < 0 or n > 99999:
        raise CorruptIndexError(f"{path}: num_shards {n} is out of range [0, 99999]")
    cols = framed_columns(raw_keys[1:], framed, start, lengths[1:], n, path)
    if cols is None:  # sliced tensors, or entries that are not as TensorFlow encodes them
        cols = entry_columns(read_table(data, path)[1:], n, path)
    keys, dtypes, shapes, rows, texts = cols
    text_keys = [t[4] for t in texts]
    text_shapes = [t[5] for t in texts]
    if not RESERVED.isdisjoint(text_keys) or any(_has_key(keys, k) for k in RESERVED):
        # the table's strict key order after the header's "" already made the keys unique
        # and non-empty, and strict UTF-8 decoding made them valid: only this rule is left
        check_keys(keys + text_keys, error=CorruptIndexError, where=f"{path}: ")
    files = [data_file(prefix, i, n) for i in range(n)]
    shards = []
    for file in files:
        check_shard_file_name(file, path)
        with closing(directory.open_shard(file, path)) as f:
            shards.append(ShardInfo(file, 0, "raw", f.size))
    shard, offset, row, size, crc, order = rows.columns
    steps = shard[1:] - shard[:-1]
    if ((steps > 0) | ((steps == 0) & (offset[1:] >= offset[:-1]))).all() and (
            order[1:] > order[:-1]).all():
        place = order  # in that order already (TensorFlow writes in key order): no sort
        specs = rows.specs or [WHOLE] * len(place)
    else:
        place = np.lexsort((order, offset, shard))  # by shard, then offset, then index order
        shard, offset, row, size, crc = (shard[place], offset[place], row[place], size[place],
                                         crc[place])
        specs = [rows.specs[i] for i in place.tolist()] if rows.specs else [WHOLE] * len(place)
    limits = np.array([s.bytes for s in shards], np.int64)
    # offset + size <= the file's size, as a difference: neither is negative (checked), so
    # it cannot wrap where the sum of an offset near 2**63 would
    past = np.flatnonzero(offset > limits[shard] - size) if len(place) else place
    for t in texts:
        if t[1] + t[3] > shards[t[0]].bytes:
            raise CorruptIndexError(
                f"{path}: tensor {shown(t[4])}: bytes [{t[1]}, {t[1] + t[3]}) are past the "
                f"end of {files[t[0]]} ({shards[t[0]].bytes} bytes)")
    if len(past):
        j = int(past[0])
        a, s_ = int(offset[j]), int(shard[j])
        b = a + int(size[j])
        raise CorruptIndexError(
            f"{path}: tensor {shown(keys[int(row[j])])}: bytes [{a}, {b}) are past the end of "
            f"{files[s_]} ({shards[s_].bytes} bytes)")
    slice_tensor = row.tolist()
    index = TensorBundleIndex(
        callback="(none: a TensorFlow TensorBundle checkpoint)", shards=shards, keys=keys,
        dtypes=dtypes, shapes=shapes, devices=[DEFAULT_DEVICE] * len(keys),
        slice_tensor=slice_tensor, slice_spec=specs, slice_shard=shard.tolist(),
        slice_xxh3=HexColumn(crc),
        user_metadata={}, version="", generation=None,
        slice_checksum_kind=[CRC32C] * len(slice_tensor), num_shards=n)
    bounds = np.searchsorted(shard, np.arange(n + 1)).tolist()
    begins = offset.tolist()
    index.begins = [begins[bounds[i] : bounds[i + 1]] for i in range(n)]
    alignment = {d: _align(d) for d in set(dtypes)}
    if len(alignment) == 1:
        step = next(iter(alignment.values()))
    else:
        step = np.array(list(map(alignment.__getitem__, dtypes)), np.int64)[row]
    unaligned = set(shard[np.flatnonzero(offset % step)].tolist())
    index.aligned = [i not in unaligned for i in range(n)]
    if texts:
        from .strings import BundleStrings

        index.strings = BundleStrings(
            text_keys, ["bytes"] * len(texts), text_shapes, [DEFAULT_DEVICE] * len(texts),
            files=[files[t[0]] for t in texts], offsets=[t[1] for t in texts],
            sizes=[t[3] for t in texts], crcs=[t[2] for t in texts])
    if rows.specs or len(row) != len(keys) or not (
            np.bincount(row, minlength=len(keys)) == 1).all():
        check_slices(index, path)  # else every tensor is one whole entry, named by its key
    return index


def _has_key(keys: list[str], key: str) -> bool:
    """`key` is in `keys`, which are sorted (a table's order: its UTF-8 bytes' order is its
    code points' order, which is how str compares)."""
    at = bisect.bisect_left(keys, key)
    return at < len(keys) and keys[at] == key


TENSORBUNDLE: Final = TensorBundle()
__all__ = ["STRING", "TENSORBUNDLE", "TensorBundle", "TensorBundleIndex", "decode_bundle",
           "state_target"]
