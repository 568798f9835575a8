"""The manifest's decoding with every check (docs/FORMAT.md section 2): `decode_index` (a
fast column-wise path for shardkit's own encoding, proven by encoding the index it decodes;
else the strict parse), `check_slices`, `parse_version`."""

from __future__ import annotations

import operator
import re
from collections import Counter
from itertools import chain
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from ..errors import (
    CheckpointFormatError,
    CorruptIndexError,
    SliceSpecError,
    UnsupportedVersionError,
)
from ..optional import lazy_import
from ..sharding.structure import check_record, tensor_keys
from ..sharding.tensors import gc_paused
from ..values.dtypes import PACKED, SAFETENSORS_NAMES, packed_problem
from ..values.keys import check_keys
from ..values.slices import SliceSpec, check_tiling, parse_slice_spec

if TYPE_CHECKING:
    import orjson
else:
    orjson = lazy_import("orjson", "a checkpoint's manifest")
from .common import (
    _ITEMSIZE,
    FORMAT_MAJOR,
    FORMAT_NAME,
    GENERATION_KEY,
    GENERATION_MINOR,
    MAX_DEPTH,
    MAX_NDIM,
    STRINGS_MINOR,
    check_shard_file_name,
    shown,
)
from .header import _INT_ONLY, shape_problem
from .index import CheckpointIndex, ShardInfo
from .index_encoding import _index_pieces, huggingface_weight_map
from .strictjson import nesting_within, pairs_to_dict, pairs_to_plain, parse_strict_object
from .string_section import decode_strings_section

_XXH3_RE: Final = re.compile(r"[0-9a-f]{16}")
_GENERATION_RE: Final = re.compile(r"[0-9A-Za-z_.-]{1,64}")


def _check_weight_map(found: dict[str, Any], index: CheckpointIndex, path: str) -> None:
    """The manifest's ``weight_map`` is exactly `huggingface_weight_map` of its shardkit
    section (one dict comparison); else CorruptIndexError naming the first disagreement."""
    want = huggingface_weight_map(index)
    if found == want:
        return
    extra = next((k for k in found if k not in want), None)
    if extra is not None:
        why = ("is not a tensor of shardkit.tensors" if extra not in set(index.keys) else
               "is not stored whole in one entry named by its key (a split tensor)")
        raise CorruptIndexError(
            f"{path}: weight_map lists {shown(extra)}, which {why}; HuggingFace loaders would "
            "read what shardkit does not (the manifest's two sections disagree)")
    missing = next((k for k in want if k not in found), None)
    if missing is not None:
        raise CorruptIndexError(
            f"{path}: weight_map lacks {shown(missing)}, which shardkit.slices stores whole in "
            f"{shown(want[missing])} (the manifest's two sections disagree)")
    key = next(k for k in want if found[k] != want[k])
    raise CorruptIndexError(
        f"{path}: weight_map puts {shown(key)} in {shown(found[key])}, but shardkit.slices "
        f"stores it in {shown(want[key])}; HuggingFace loaders would read other bytes than "
        "shardkit (the manifest's two sections disagree)")


def parse_version(version: Any, path: str) -> tuple[int, int]:
    """(major, minor) of a "MAJOR.MINOR" version; refuses majors newer than this reader's."""
    m = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if m is None:
        raise CorruptIndexError(
            f"{path}: format_version must be a string like \"2.0\", found {shown(version)}"
        )
    major, minor = int(m.group(1)), int(m.group(2))
    if major > FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{path}: checkpoint format version {version} is newer than this shardkit reads "
            f"(up to {FORMAT_MAJOR}.x); upgrade shardkit to read it"
        )
    if major < FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{path}: checkpoint format version {version} is a pre-release layout this shardkit "
            f"no longer reads (it reads {FORMAT_MAJOR}.x); load it with the shardkit that wrote "
            "it and save it again"
        )
    return major, minor


@gc_paused()  # one GC pass at the end instead of many during the decode
def decode_index(data: bytes, path: str) -> CheckpointIndex:
    """Parse and validate a manifest; every error is a CorruptIndexError (or subclass)
    naming `path` and the field, except other majors: UnsupportedVersionError."""
    data = bytes(data)
    doc = _canonical_document(data)
    if doc is not None and _document_within_depth(doc):
        try:
            index = _index_of(doc, path)
        except CheckpointFormatError:
            index = None  # the checked path below words the error
        del doc
        if index is not None and _encodes_to(index, data):
            return index  # its weight_map is byte for byte the one encoded from the index
    # another writer's spelling, or something wrong: parse and check it all
    doc = _index_objects(parse_strict_object(data, path, CorruptIndexError, ""), path)
    index = _index_of(doc, path)
    _check_weight_map(doc["weight_map"], index, path)
    return index


def _index_of(doc: dict[str, Any], path: str) -> CheckpointIndex:
    """The index of a parsed manifest document, every field checked. The document's columns
    become the index's (shapes and dtypes converted in place, their equal values shared)."""
    if doc.get("format") != FORMAT_NAME:
        raise CorruptIndexError(
            f"{path}: \"format\" must be {shown(FORMAT_NAME)}, found {shown(doc.get('format'))} "
            "(not a shardkit checkpoint index)"
        )
    version = doc.get("format_version")
    _, minor = parse_version(version, path)
    assert isinstance(version, str)  # parse_version checked it
    sk = _field(doc, "shardkit", dict, path, "")
    for name in ("metadata", "weight_map"):
        if name not in doc:
            raise CorruptIndexError(f"{path}: missing field {name}")
        if not isinstance(doc[name], dict):
            raise CorruptIndexError(f"{path}: {shown(name)} must be a JSON object")
    callback = _field(sk, "callback", str, path, "shardkit.")
    generation = sk.get(GENERATION_KEY)
    if generation is not None and not (
            type(generation) is str and _GENERATION_RE.fullmatch(generation)):
        raise CorruptIndexError(
            f"{path}: field shardkit.{GENERATION_KEY} must be a string of 1 to 64 letters, "
            f"digits, '_', '.' or '-', found {shown(generation)}")
    if generation is None and minor >= GENERATION_MINOR:  # the version implies the field:
        raise CorruptIndexError(  # without it no shard would be checked against this save
            f"{path}: format_version {version} records the checkpoint's generation, but "
            f"shardkit.{GENERATION_KEY} is missing (its shards could not be told from another "
            "save's)")
    user_metadata = _field(sk, "user_metadata", dict, path, "shardkit.")
    shards = _decode_shards(_field(sk, "shards", list, path, "shardkit."), path, generation)
    device_names = _str_list(sk, "devices", path, "shardkit.")
    if len(set(device_names)) != len(device_names):
        dup = next(d for d, c in Counter(device_names).items() if c > 1)
        raise CorruptIndexError(f"{path}: device {shown(dup)} is listed twice in shardkit.devices")
    tensors = _field(sk, "tensors", dict, path, "shardkit.")
    where = "shardkit.tensors."
    keys = _str_list(tensors, "key", path, where)
    n = len(keys)
    dtypes = _column(tensors, "dtype", n, path, where)
    shapes = _column(tensors, "shape", n, path, where)
    device_ids = _column(tensors, "device", n, path, where)
    slices = _field(sk, "slices", dict, path, "shardkit.")
    where = "shardkit.slices."
    slice_tensor = _column(slices, "tensor", None, path, where)
    m = len(slice_tensor)
    slice_spec = _column(slices, "spec", m, path, where)
    slice_shard = _column(slices, "shard", m, path, where)
    slice_xxh3 = _column(slices, "xxh3", m, path, where)

    check_keys(keys, error=CorruptIndexError, where=f"{path}: shardkit.tensors.key: ")
    if not _all_in(dtypes, _ITEMSIZE.keys()):
        bad = next(d for d in dtypes if not isinstance(d, str) or d not in _ITEMSIZE)
        raise CorruptIndexError(
            f"{path}: tensor {shown(keys[dtypes.index(bad)])} has unknown dtype {shown(bad)}; "
            f"known: {', '.join(SAFETENSORS_NAMES)}")
    dims = list(chain.from_iterable(shapes)) if set(map(type, shapes)) <= {list} else None
    if dims is None or not (set(map(type, dims)) <= _INT_ONLY and min(dims, default=0) >= 0):
        bad_row = next(i for i, s in enumerate(shapes) if not (
            isinstance(s, list) and _nonneg_ints(s)))
        raise CorruptIndexError(
            f"{path}: tensor {shown(keys[bad_row])} shape must be a list of non-negative "
            f"integers, found {shown(shapes[bad_row])}"
        )
    largest, rank = max(dims, default=0), max(map(len, shapes), default=0)
    # every shape's product is below largest ** rank: when that times an item size (8 at
    # most) could pass 2**63 - 1, each shape is checked exactly (rare: numpy's int64 columns
    # of sizes would wrap where Python's ints do not)
    if largest.bit_length() * rank + 3 > 63 or rank > MAX_NDIM:
        for key, dtype, shape in zip(keys, dtypes, shapes):
            problem = shape_problem(shape, _ITEMSIZE[dtype])
            if problem:
                raise CorruptIndexError(f"{path}: tensor {shown(key)}{problem}")
    packed = bool(PACKED.intersection(dtypes))
    if packed:  # two elements a byte: an even count, whole and sliced
        for key, dtype, shape in zip(keys, dtypes, shapes):
            problem = packed_problem(dtype, shape)
            if problem:
                raise CorruptIndexError(f"{path}: tensor {shown(key)}{problem}")
    _check_ids(device_ids, len(device_names), keys, "device", path, "shardkit.devices")
    _check_ids(slice_tensor, n, None, "tensor", path, "shardkit.tensors.key")
    _check_ids(slice_shard, len(shards), None, "shard", path, "shardkit.shards")
    if any(map(operator.gt, slice_shard, slice_shard[1:])):
        raise CorruptIndexError(f"{path}: shardkit.slices must be listed shard by shard "
                                "(shard numbers never decreasing)")
    if not set(map(type, slice_spec)) <= {str}:
        raise CorruptIndexError(f"{path}: shardkit.slices.spec must hold strings")
    hashes = [x for x in slice_xxh3 if x is not None]
    if hashes and not (set(map(type, hashes)) == {str} and set(map(len, hashes)) == {16}
                       and _HEX_RUN.fullmatch("".join(hashes))):
        j, bad_hash = next((j, x) for j, x in enumerate(slice_xxh3) if x is not None and not (
            isinstance(x, str) and _XXH3_RE.fullmatch(x)))
        raise CorruptIndexError(
            f"{path}: tensor {shown(keys[slice_tensor[j]])} slice {shown(slice_spec[j])}: xxh3 "
            f"must be 16 lowercase hex digits or null, found {shown(bad_hash)}")
    strings = None
    # 2.3 is written exactly when there are string tensors: without this, a manifest that lost
    # its strings section would read as a checkpoint without them (tensors silently missing)
    if minor == STRINGS_MINOR and "strings" not in sk:
        raise CorruptIndexError(f"{path}: format_version 2.3 records string tensors, but the "
                                "shardkit.strings section is missing")
    if minor < STRINGS_MINOR and "strings" in sk:
        raise CorruptIndexError(f"{path}: shardkit.strings (string tensors) needs format_version "
                                f"2.3, found {shown(version)}")
    if "strings" in sk:  # format 2.3: string tensors (shardkit.strings)
        strings = decode_strings_section(sk["strings"], path, generation)
        both = set(strings.keys).intersection(keys)
        if both:
            raise CorruptIndexError(f"{path}: key {shown(min(both))} is both a tensor and a "
                                    "string tensor")
        if strings.file in {s.file for s in shards}:
            raise CorruptIndexError(f"{path}: file {shown(strings.file)} is listed as a shard "
                                    "and as the string file")
    aliases = None
    if "aliases" in sk:  # names of stored tensors: tied weights (any 2.x)
        aliases = _decode_aliases(sk["aliases"], path, keys, strings)
    structure = None
    if "structure" in sk:  # the saved state's containers and Python values (any 2.x)
        structure = check_record(sk["structure"], path)
        stored = set(keys).union(() if strings is None else strings.keys, aliases or ())
        for key in tensor_keys(structure):
            if key not in stored:
                raise CorruptIndexError(
                    f"{path}: shardkit.structure places tensor {shown(key)}, which is not stored")
    shapes[:] = _shared(map(tuple, shapes))  # the lists go as the tuples come
    dtypes[:] = _shared(dtypes)
    devices = list(map(device_names.__getitem__, device_ids))
    device_ids.clear()
    index = CheckpointIndex(
        callback, shards, keys, dtypes, shapes, devices, slice_tensor, slice_spec, slice_shard,
        slice_xxh3, user_metadata, version, generation, strings,
    )
    index.structure, index.aliases = structure, aliases
    index._cache["packed"] = packed  # known here: `has_packed` need not scan the dtypes again
    check_slices(index, path)
    return index


def _decode_aliases(section: Any, path: str, keys: list[str], strings: Any
                    ) -> dict[str, str] | None:
    """``shardkit.aliases`` (section 2.5): alias key -> the stored tensor it names. Each alias
    follows the key rules, is named once and is no stored tensor; each names a tensor of
    shardkit.tensors (not a string tensor, not another alias)."""
    where = "shardkit.aliases."
    if not isinstance(section, dict):
        raise CorruptIndexError(f"{path}: field shardkit.aliases must be a JSON object, found "
                                f"{type(section).__name__} {shown(section)}")
    names = _str_list(section, "key", path, where)
    of = _str_list(section, "of", path, where)
    if len(of) != len(names):
        raise CorruptIndexError(f"{path}: field {where}of has {len(of)} values, expected "
                                f"{len(names)} (one per alias)")
    check_keys(names, error=CorruptIndexError, where=f"{path}: {where}key: ")
    stored = set(keys)
    both = stored.union(() if strings is None else strings.keys).intersection(names)
    if both:
        raise CorruptIndexError(f"{path}: {shown(min(both))} is both an alias and a stored "
                                "tensor")
    for name, target in zip(names, of):
        if target not in stored:
            raise CorruptIndexError(
                f"{path}: alias {shown(name)} names {shown(target)}, which is not a tensor of "
                "shardkit.tensors")
    return dict(zip(names, of)) or None


def _document_within_depth(doc: dict[str, Any]) -> bool:
    """The index document nests at most MAX_DEPTH levels, the known columns of
    ``shardkit.tensors`` / ``shardkit.slices`` aside (their type checks allow only flat values,
    and are not walked: 50,000 shapes)."""
    sk = doc.get("shardkit")
    if type(sk) is not dict:
        return nesting_within(doc, MAX_DEPTH)
    for k, v in doc.items():
        if k != "shardkit" and not nesting_within(v, MAX_DEPTH - 1):
            return False
    for name, value in sk.items():
        if name in _COLUMNS and type(value) is dict:
            for column, cells in value.items():
                if column not in _COLUMNS[name] and not nesting_within(cells, MAX_DEPTH - 3):
                    return False
        elif not nesting_within(value, MAX_DEPTH - 2):
            return False
    return True


_SHARDKIT_SECTION: Final = b'},"shardkit":{"callback":'
_HEAD_RE: Final = re.compile(rb'\{"format":"shardkit","format_version":("[0-9.]{1,16}"),'
                             rb'"metadata":\{"total_size":(?:0|[1-9][0-9]{0,19})\},"weight_map":\{')
# the columns as shardkit writes them, in order: (section, column, what follows the column)
_COLUMN_MARKS: Final = (("tensors", "key", b',"dtype":'), ("tensors", "dtype", b',"shape":'),
                        ("tensors", "shape", b',"device":'),
                        ("tensors", "device", b'},"slices":{"tensor":'),
                        ("slices", "tensor", b',"spec":'), ("slices", "spec", b',"shard":'),
                        ("slices", "shard", b',"xxh3":'), ("slices", "xxh3", b']}'))


def _canonical_document(data: bytes) -> dict[str, Any] | None:
    """The index document, if `data` may be the compact encoding shardkit writes (else None),
    with its ``weight_map`` left unparsed (empty). The ``shardkit`` section is parsed with
    orjson (faster than json) in place, column by column, each column's repeated
    values shared as soon as it is parsed. The pieces are found by the markers shardkit writes
    between them (a ``"`` inside a JSON string is escaped, so the first marker after a piece
    ends it); orjson keeps the last of repeated keys and the weight map is not read, so the
    caller proves the document is shardkit's encoding by encoding the index it decodes and
    comparing (`_encodes_to`): whatever was cut wrongly fails that.

    Memory: the weight map, HuggingFace's view of what the section already says, is about
    half of a manifest and would be one dict entry and two str objects per tensor; parsing
    column by column holds one column's parse tree at a time, not the whole document's."""
    head = _HEAD_RE.match(data)
    cut = data.find(_SHARDKIT_SECTION) if head else -1
    columns = data.find(b',"tensors":{"key":', cut)
    if cut < 0 or columns < 0 or not data.endswith(b"}}\n"):
        return None
    view = memoryview(data)
    try:
        section = orjson.loads(bytes(view[cut + 13 : columns]) + b"}")
        if type(section) is not dict:
            return None
        at = columns + len(b',"tensors":{"key":')
        parsed: dict[str, dict[str, Any]] = {"tensors": {}, "slices": {}}
        for part, name, follows in _COLUMN_MARKS:
            end = data.find(follows, at)
            if end < 0:
                return None
            if name == "xxh3":
                end += 1  # the closing bracket is the column's
            cells = orjson.loads(view[at:end])
            if type(cells) is list and name in ("dtype", "shape"):
                cells = _shared(cells) if name == "dtype" else _shared_lists(cells)
            parsed[part][name] = cells
            at = end + len(follows) - (1 if name == "xxh3" else 0)
        rest = orjson.loads(b"{" + bytes(view[at + 1 : len(data) - 3]) + b"}")
    except (orjson.JSONDecodeError, RecursionError):
        return None
    if type(rest) is not dict or not rest.keys().isdisjoint(section) or (
            not rest.keys().isdisjoint(parsed)):
        return None
    section.update(parsed)
    section.update(rest)
    assert head is not None
    return {"format": FORMAT_NAME, "format_version": orjson.loads(head[1]), "metadata": {},
            "weight_map": {}, "shardkit": section}


def _shared_lists(values: list[Any]) -> list[Any]:
    """`values` (lists) with equal lists made one object: a manifest's shapes repeat."""
    seen: dict[Any, Any] = {}
    try:
        return [seen.setdefault(tuple(v), v) if type(v) is list else v for v in values]
    except TypeError:  # an unhashable cell: left as it is, for the checks to word
        return values


def _encodes_to(index: CheckpointIndex, data: bytes) -> bool:
    """Whether `encode_index(index)` is `data`, compared piece by piece as each is encoded
    (never all held, never joined)."""
    at = 0
    for piece in _index_pieces(index):
        if piece is None:
            piece = orjson.dumps(index.slice_xxh3, default=list)
        if not data.startswith(piece, at):
            return False
        at += len(piece)
    return at == len(data)


def _shared(values: Any) -> list[Any]:
    """`values` as a list in which equal values are one object (a manifest's dtypes and shapes
    repeat: one str or tuple each instead of one per tensor)."""
    seen: dict[Any, Any] = {}
    return [seen.setdefault(v, v) for v in values]


_COLUMNS: Final = {"tensors": ("key", "dtype", "shape", "device"),
                   "slices": ("tensor", "spec", "shard", "xxh3")}


def _index_objects(raw: tuple[tuple[str, Any], ...], path: str) -> dict[str, Any]:
    """The index document from `_loads_pairs` as dicts, duplicates checked everywhere; the
    columns of ``shardkit.tensors`` and ``shardkit.slices`` stay as parsed (their checks reject
    anything but the documented value types, JSON objects included)."""
    what, err = "manifest", CorruptIndexError
    doc = pairs_to_dict(raw, what, path, err)
    for k, v in doc.items():
        if k == "shardkit" and type(v) is tuple:
            sk = doc[k] = pairs_to_dict(v, what, path, err)
            for name, value in sk.items():
                if name in _COLUMNS and type(value) is tuple:
                    section = sk[name] = pairs_to_dict(value, what, path, err)
                    for column, cells in section.items():
                        if column not in _COLUMNS[name]:  # a later minor's: checked as JSON
                            section[column] = pairs_to_plain(cells, what, path, err, 4)
                else:
                    sk[name] = pairs_to_plain(value, what, path, err, 3)
        else:
            doc[k] = pairs_to_plain(v, what, path, err, 2)
    return doc


def _decode_shards(raw_shards: list[Any], path: str, generation: str | None
                   ) -> list[ShardInfo]:
    shards: list[ShardInfo] = []
    seen_files: set[str] = set()
    for i, s in enumerate(raw_shards):
        where = f"shardkit.shards[{i}]."
        if not isinstance(s, dict):
            raise CorruptIndexError(f"{path}: shardkit.shards[{i}] must be a JSON object")
        file = check_shard_file_name(_field(s, "file", str, path, where), path)
        if file in seen_files:
            raise CorruptIndexError(f"{path}: shard file {shown(file)} is listed twice")
        seen_files.add(file)
        task = _nonneg_int(s, "task", path, where)
        codec = _field(s, "codec", str, path, where)
        nbytes = _nonneg_int(s, "bytes", path, where)
        shards.append(ShardInfo(file, task, codec, nbytes, generation))
    return shards


def check_slices(index: CheckpointIndex, path: str) -> None:
    """Every tensor is stored: once whole, or as slices that tile it; entry names are unique
    within a shard."""
    keys, counts = index.keys, index.slice_counts()
    if len(keys) and counts.min() == 0:
        key = keys[int(np.argmin(counts))]
        raise CorruptIndexError(f"{path}: tensor {shown(key)} has no slices")
    if any(index.slice_spec) or len(index.slice_tensor) != len(keys):
        by_tensor = index.slices_of()
        for row in np.flatnonzero(counts > 1).tolist() + [
            r for r, sl in enumerate(by_tensor) if len(sl) == 1 and index.slice_spec[sl[0]]
        ]:
            key, shape = keys[row], index.shapes[row]
            specs: list[SliceSpec] = []
            for j in by_tensor[row]:
                try:
                    specs.append(parse_slice_spec(index.slice_spec[j], shape))
                except SliceSpecError as e:
                    raise CorruptIndexError(f"{path}: tensor {shown(key)}: {e}") from None
            try:
                check_tiling(shape, specs)
            except SliceSpecError as e:
                raise CorruptIndexError(f"{path}: the slices of tensor {shown(key)} do not tile "
                                        f"its shape {list(shape)}: {e}") from None
    names = index.entry_names()
    if len(set(names)) != len(names):
        owner: dict[tuple[int, str], str] = {}
        for j, (shard, name) in enumerate(zip(index.slice_shard, names)):
            key = keys[index.slice_tensor[j]]
            other = owner.setdefault((shard, name), key)
            if other is not key:
                raise CorruptIndexError(
                    f"{path}: entry {shown(name)} of shard {shown(index.shards[shard].file)} is "
                    f"claimed by more than one slice (tensors {shown(other)} and {shown(key)})")


def _field(d: dict[str, Any], name: str, kind: type, path: str, where: str) -> Any:
    if name not in d:
        raise CorruptIndexError(f"{path}: missing field {where}{name}")
    v = d[name]
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise CorruptIndexError(
            f"{path}: field {where}{name} must be {kind.__name__}, found {type(v).__name__} "
            f"{shown(v)}"
        )
    return v


def _nonneg_int(d: dict[str, Any], name: str, path: str, where: str) -> int:
    v = _field(d, name, int, path, where)
    if v < 0:
        raise CorruptIndexError(f"{path}: field {where}{name} must be >= 0, found {shown(v)}")
    return int(v)


def _column(d: dict[str, Any], name: str, n: int | None, path: str, where: str) -> list[Any]:
    col: list[Any] = _field(d, name, list, path, where)
    if n is not None and len(col) != n:
        raise CorruptIndexError(
            f"{path}: field {where}{name} has {len(col)} values, expected {n} (one per row)"
        )
    return col


def _str_list(d: dict[str, Any], name: str, path: str, where: str) -> list[str]:
    col = _column(d, name, None, path, where)
    if not set(map(type, col)) <= {str}:
        raise CorruptIndexError(f"{path}: field {where}{name} must be a list of strings")
    return col


def _all_in(values: list[Any], allowed: Any) -> bool:
    try:
        return set(values) <= allowed
    except TypeError:  # an unhashable value
        return False


def _nonneg_ints(values: Any) -> bool:
    values = list(values)
    return set(map(type, values)) <= _INT_ONLY and min(values, default=0) >= 0


def _check_ids(ids: list[Any], n: int, keys: list[str] | None, name: str, path: str,
               target: str) -> None:
    if _nonneg_ints(ids) and max(ids, default=-1) < n:
        return
    bad_at, bad = next((i, x) for i, x in enumerate(ids) if not (type(x) is int and 0 <= x < n))
    what = f"tensor {shown(keys[bad_at])}" if keys is not None else f"slice {bad_at}"
    raise CorruptIndexError(
        f"{path}: {what}: {name} {shown(bad)} is not an index into {target} ({n} entries)"
    )


_HEX_RUN: Final = re.compile(r"[0-9a-f]*")
