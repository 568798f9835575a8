"""The manifest's encoding: `encode_index` (orjson, in pieces a writer writes as they are)
and `huggingface_weight_map`, the one spelling of its ``weight_map`` (docs/FORMAT.md
section 2)."""

from __future__ import annotations

import json
import operator
from collections.abc import Iterator
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from ..optional import lazy_import

if TYPE_CHECKING:
    import orjson
else:
    orjson = lazy_import("orjson", "a checkpoint's manifest")
from .common import FORMAT_NAME
from .index import CheckpointIndex


def encode_index(index: CheckpointIndex) -> bytes:
    """The manifest's bytes: compact UTF-8 JSON (as ``json.dumps(doc, separators=(",", ":"),
    ensure_ascii=False)``) and a newline. Column-wise, encoded by orjson (byte-identical to
    that json.dumps for these values, and faster)."""
    return b"".join(index_chunks(index))


def index_chunks(
    index: CheckpointIndex, parts: tuple[list[bytes], list[bytes]] | None = None
) -> list[bytes]:
    """`encode_index` as the pieces that, joined, are its bytes (a writer writes them as they
    are). `parts`: what `encode_index_parts` gave for this index, if it was called already."""
    head, tail = parts or encode_index_parts(index)
    return [*head, orjson.dumps(index.slice_xxh3, default=list), *tail]  # list: any Sequence


def encode_index_parts(index: CheckpointIndex) -> tuple[list[bytes], list[bytes]]:
    """`index_chunks` without the checksum column: the pieces before it and after it, so that
    a writer can encode the rest while the checksums are still being computed."""
    head: list[bytes] = []
    tail: list[bytes] = []
    for piece in _index_pieces(index):
        if piece is None:
            head, tail = tail, head
        else:
            tail.append(piece)
    return head, tail


def _index_pieces(index: CheckpointIndex) -> Iterator[bytes | None]:
    """The manifest's pieces in order, None where the checksum column goes; each is encoded
    only when it is asked for, so that a reader comparing them one by one (`_encodes_to`)
    never holds them all."""
    try:
        user_metadata = _dumps(index.user_metadata).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata is not JSON-serialisable: {e}") from None
    n_tensors = len(index.keys)
    devices = list(dict.fromkeys(index.devices))
    dumps = orjson.dumps
    yield from (b'{"format":', dumps(FORMAT_NAME), b',"format_version":', dumps(index.version),
                b',"metadata":{"total_size":', str(index.total_size()).encode(),
                b'},"weight_map":')
    yield dumps(huggingface_weight_map(index))
    yield from (b',"shardkit":{"callback":', dumps(index.callback))
    if index.generation is not None:
        yield from (b',"generation":', dumps(index.generation))
    yield from (b',"devices":', dumps(devices), b',"shards":', dumps(
        [{"file": s.file, "task": s.task, "codec": s.codec, "bytes": s.bytes}
         for s in index.shards]))
    yield from (b',"tensors":{"key":', dumps(index.keys), b',"dtype":', dumps(index.dtypes),
                b',"shape":')
    try:
        yield dumps(index.shapes)
    except TypeError:  # numpy integers in a shape
        yield dumps([list(map(int, s)) for s in index.shapes])
    yield b',"device":'
    yield dumps([0] * n_tensors if len(devices) == 1 else
                list(map({d: i for i, d in enumerate(devices)}.__getitem__, index.devices)))
    yield from (b'},"slices":{"tensor":', dumps(index.slice_tensor), b',"spec":',
                dumps(index.slice_spec), b',"shard":', dumps(index.slice_shard), b',"xxh3":',
                None, b'}')
    if index.strings is not None:
        yield from (b',"strings":', dumps(index.strings.section()))
    if index.aliases:
        yield from (b',"aliases":{"key":', dumps(list(index.aliases)), b',"of":',
                    dumps(list(index.aliases.values())), b'}')
    if index.structure is not None:
        yield from (b',"structure":', dumps(index.structure))
    yield from (b',"user_metadata":', user_metadata, b"}}\n")


def huggingface_weight_map(index: CheckpointIndex) -> dict[str, str]:
    """HuggingFace's ``weight_map`` of `index` (docs/FORMAT.md section 2): checkpoint key ->
    shard file, for the tensors stored whole in an entry named like their key (one slice, spec
    ``""``), in save order. String tensors are not in it. The writer writes it; the reader
    requires the manifest's to be exactly this, so that HuggingFace's loaders read what
    shardkit reads."""
    files = [s.file for s in index.shards]
    n_tensors = len(index.keys)
    tensor = np.asarray(index.slice_tensor, np.int64)
    if (len(tensor) == n_tensors and not any(index.slice_spec)
            and np.array_equal(tensor, np.arange(n_tensors))):
        # every tensor whole, listed in save order: the shard files, shard by shard
        return dict(zip(index.keys, chain.from_iterable(
            repeat(f, len(index.shard_range(i))) for i, f in enumerate(files))))
    # else the slices of one row that are whole and alone, in save order, column by column
    whole = np.fromiter(map(operator.not_, index.slice_spec), bool, len(index.slice_spec))
    if len(tensor):
        whole &= index.slice_counts()[tensor] == 1
    picked = np.flatnonzero(whole)
    picked = picked[np.argsort(tensor[picked], kind="stable")]  # save order
    rows = tensor[picked].tolist()
    shards = np.asarray(index.slice_shard, np.int64)[picked].tolist()
    return dict(zip(map(index.keys.__getitem__, rows), map(files.__getitem__, shards)))


def _dumps(value: Any) -> str:
    # compact: with indent, json falls back to its pure-Python encoder, which is much slower
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
