"""PyTorch's pickles and torch.save archives, read without torch and without running them.

`load_pickle` unpickles with a `pickle.Unpickler` whose ``find_class`` admits only the globals
of an allow-list, each mapped to a small local stand-in (`Record` and friends here): PyTorch
DCP's metadata classes, torch's dtypes and ``torch.Size``, the tensor rebuild functions and
storage classes of a torch.save ``data.pkl``, ``collections.OrderedDict``. Any other global (a
reduce of ``os.system``, ``builtins.eval``, ``subprocess.Popen``...) is an `UnsafePickleError`
naming it; nothing from the pickle is ever called but these stand-ins.

`read_archive` reads one torch.save archive (a zip of stored records: ``<name>/data.pkl``,
``<name>/byteorder``, ``<name>/data/<key>`` per storage), at some offset of a file: its
``data.pkl`` through `load_pickle`, and where each storage's bytes begin in the file, so the
reader maps them as it maps a safetensors entry. docs/FORMAT.md section 11 has the layout.
"""

from __future__ import annotations

import io
import pickle
import re
import reprlib
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from ..errors import CorruptIndexError, UnsafePickleError
from ..format import shown
from ..values.dtypes import SAFETENSORS_NAMES, STORABLE_NAMES

# torch's dtype attribute names -> shardkit's (safetensors) dtype names: the one dtype table's
# (torch names its dtypes as numpy and ml_dtypes do), and torch's other spellings of them; other
# torch dtypes are admitted as names (`TorchDType`) so that their tensors can be refused by key
TORCH_DTYPES: Final[dict[str, str]] = {
    **dict(zip(STORABLE_NAMES, SAFETENSORS_NAMES)),
    "double": "F64", "float": "F32", "half": "F16", "long": "I64", "int": "I32", "short": "I16",
    "cfloat": "C64", "cdouble": "C128",
}
_OTHER_DTYPES: Final = frozenset({
    "complex32", "chalf", "qint8", "qint32", "quint8", "quint4x2",
    "quint2x4", "float4_e2m1fn_x2", "bits8", "bits16", "int1", "int2",
    "int3", "int4", "int5", "int6", "int7", "uint1", "uint2", "uint3", "uint4", "uint5",
    "uint6", "uint7"})
# the legacy typed storages torch.save names (torch.storage._dtype_to_storage_type_map)
STORAGES: Final[dict[str, str]] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "QInt8Storage": "qint8", "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}
MAX_PICKLE_BYTES: Final = 1 << 30  # a data.pkl larger than this is refused, not read
_SHORT: Final = reprlib.Repr()  # Python 3.11's takes no arguments
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 40, 60


@dataclass(frozen=True, slots=True)
class TorchDType:
    """A ``torch.<dtype>`` global: its torch name, and shardkit's name (None: not storable)."""

    name: str

    @property
    def dtype_name(self) -> str | None:
        return TORCH_DTYPES.get(self.name)


class Record:
    """The stand-in of an admitted class: NEWOBJ makes it, BUILD fills its attributes (a dict
    state) or its `state` (any other: DCP's TensorProperties pickles a tuple)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) of a slotted dataclass
        if isinstance(state, dict):
            for k, v in state.items():
                if not isinstance(k, str):
                    raise CorruptIndexError(f"attribute name {shown(k)} is not a string")
                self.__dict__[k] = v
        else:
            self.__dict__["state"] = state

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    @reprlib.recursive_repr()
    def __repr__(self) -> str:  # short: it goes into error messages (`format.shown`)
        fields = ", ".join(f"{k}={_SHORT.repr(v)}" for k, v in list(self.__dict__.items())[:6])
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A torch.save persistent id: storage `key` (its record ``data/<key>``), `dtype` (a torch
    name), `numel` (items of that dtype)."""

    key: str
    dtype: str
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A ``_rebuild_tensor_v2 / v3`` call: the tensor's storage, offset (items), size, stride."""

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch name


def _named(name: str) -> type:
    return type(name, (Record,), {"__module__": __name__})


def _size(dims: Any = ()) -> tuple[int, ...]:
    dims = tuple(dims)
    if not all(type(d) is int and d >= 0 for d in dims):
        raise CorruptIndexError(f"torch.Size{shown(dims)} holds a value that is not a size")
    return dims


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def _check_tensor(storage: Any, offset: Any, size: Any, stride: Any, dtype: str) -> TensorRef:
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0:
        raise CorruptIndexError(f"a tensor rebuild names storage {shown(storage)} at offset "
                                f"{shown(offset)}, not a stored storage")
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or not all(type(v) is int and v >= 0 for v in (*size, *stride)):
        raise CorruptIndexError(f"a tensor rebuild has size {shown(size)} and stride "
                                f"{shown(stride)}, not sizes of one rank")
    return TensorRef(storage, offset, size, stride, dtype)


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    return _check_tensor(storage, offset, size, stride,
                         storage.dtype if isinstance(storage, StorageRef) else "")


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                hooks: Any = None, dtype: Any = None, *rest: Any) -> TensorRef:
    if not isinstance(dtype, TorchDType):
        raise CorruptIndexError(f"_rebuild_tensor_v3 names dtype {shown(dtype)}, not a torch "
                                "dtype")
    return _check_tensor(storage, offset, size, stride, dtype.name)


def _parameter(data: Any, *rest: Any) -> Any:
    return data


def _first(value: Any) -> Any:  # an Enum called with its value (DCP's _MEM_FORMAT_ENCODING)
    return value


LAYOUTS: Final = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr",
                            "torch.sparse_csc", "torch.sparse_bsr", "torch.sparse_bsc",
                            "torch._mkldnn", "torch.jagged"})
"""The names ``torch.serialization._get_layout`` knows (torch 2.13's ``torch.layout`` values)."""


def _layout(name: Any) -> str:
    if name not in LAYOUTS:
        raise CorruptIndexError(f"tensor layout {shown(name)} is not one of torch's")
    return name


_DCP_META: Final = "torch.distributed.checkpoint.metadata"
_DCP_FS: Final = "torch.distributed.checkpoint.filesystem"
METADATA_GLOBALS: Final[dict[tuple[str, str], Any]] = {
    **{(_DCP_META, n): _named(n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta")},
    (_DCP_META, "_MEM_FORMAT_ENCODING"): _first,
    (_DCP_FS, "_StorageInfo"): _named("_StorageInfo"),
    (_DCP_FS, "_StoragePrefix"): _named("_StoragePrefix"),
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    **{("pathlib", n): _path for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath",
                                       "PureWindowsPath")},
    ("collections", "OrderedDict"): dict,
    **{("torch", n): TorchDType(n) for n in (*TORCH_DTYPES, *_OTHER_DTYPES)},
}
"""The globals a DCP ``.metadata`` may name, and their stand-ins."""

ARCHIVE_GLOBALS: Final[dict[tuple[str, str], Any]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("collections", "OrderedDict"): dict,
    ("torch", "Size"): _size,
    **{("torch", n): TorchDType(n) for n in (*TORCH_DTYPES, *_OTHER_DTYPES)},
    **{("torch", n): ("storage", d) for n, d in STORAGES.items()},
    ("torch.storage", "UntypedStorage"): ("storage", "uint8"),
    ("torch", "UntypedStorage"): ("storage", "uint8"),
}
"""The globals a torch.save ``data.pkl`` of tensors may name (weights_only's tensor subset)."""


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:  # (a storage class's stand-in is a marker tuple: calling it fails)
            raise UnsafePickleError(
                f"{self._where}: the pickle names global {module}.{name}, which is not one of "
                "the classes and functions its format needs; refused, nothing was run (a "
                "crafted or foreign file?)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"
                and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            kind = pid[1]
            if isinstance(kind, tuple) and kind[0] == "storage":
                return StorageRef(pid[2], kind[1], pid[4])
        raise UnsafePickleError(f"{self._where}: the pickle has persistent id {shown(pid)}, "
                                "not a torch.save storage; refused")


def load_pickle(data: bytes, allowed: dict[tuple[str, str], Any], where: str) -> Any:
    """Unpickle `data` admitting only the globals of `allowed` (as their stand-ins).

    Args:
        data: the pickle's bytes.
        allowed: (module, name) -> the stand-in `find_class` returns (`METADATA_GLOBALS`,
            `ARCHIVE_GLOBALS`).
        where: the file (and key) named in errors.

    Returns:
        The unpickled value, made of builtins and stand-ins only.

    Raises:
        UnsafePickleError: the pickle names any other global, or a persistent id that is not a
            storage; nothing it names was called.
        CorruptIndexError: the pickle is malformed or truncated.
    """
    try:
        return _Restricted(data, allowed, where).load()
    except UnsafePickleError:
        raise
    except CorruptIndexError as e:
        raise CorruptIndexError(f"{where}: {e}") from None
    except Exception as e:  # a malformed pickle: any exception of the unpickler or a stand-in
        raise CorruptIndexError(f"{where}: not a valid pickle of its format "
                                f"({type(e).__name__}: {e})") from None


class _Window(io.RawIOBase):
    """Bytes ``[base, base + length)`` of a file read through `read(start, end)`, seekable.

    Its first and last `_BLOCK` bytes are read once each, on first use: zipfile's many small
    reads of the central directory (at the end) and of the first records' local headers
    (``data.pkl``'s, at the start) are served from them."""

    def __init__(self, read: Callable[[int, int], bytes], base: int, length: int) -> None:
        self._file_read, self._base, self._length, self._pos = read, base, length, 0
        self._blocks: dict[int, bytes] = {}

    def _read(self, start: int, end: int) -> bytes:
        for at in (0, max(0, self._length - _BLOCK)):
            if at <= start - self._base and end - self._base <= at + _BLOCK:
                block = self._blocks.get(at)
                if block is None:
                    block = self._blocks[at] = self._file_read(
                        self._base + at, self._base + min(self._length, at + _BLOCK))
                return block[start - self._base - at : end - self._base - at]
        return self._file_read(start, end)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, pos if whence == 0 else
                        self._pos + pos if whence == 1 else self._length + pos)
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._length if n is None or n < 0 else min(self._length, self._pos + n)
        if end <= self._pos:
            return b""
        data = self._read(self._base + self._pos, self._base + end)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


@dataclass(frozen=True, slots=True)
class Archive:
    """One torch.save archive: its unpickled ``data.pkl`` (`value`) and, per storage key,
    where its bytes begin in the file, their length and the record's CRC-32."""

    value: Any
    records: dict[str, tuple[int, int, int]]


_LOCAL: Final = struct.Struct("<4s5H3I2H")
MAX_ARCHIVE_VERSION: Final = 10
"""The newest archive version torch 2.13's reader takes (its kMaxSupportedFileFormatVersion); an
archive's ``version`` record is parsed as torch parses it (leading blanks, a sign, digits)."""
_VERSION: Final = re.compile(rb"\s*[+-]?[0-9]+")
_BLOCK: Final = 4096


def read_archive(read: Callable[[int, int], bytes], base: int, length: int,
                 where: str) -> Archive:
    """The torch.save archive at bytes ``[base, base + length)`` of a file.

    Args:
        read: ``read(start, end)``, the file's bytes (fewer at its end).
        base: where the archive begins in the file.
        length: its length.
        where: the file and key named in errors.

    Returns:
        The `Archive`: ``data.pkl`` unpickled with `ARCHIVE_GLOBALS`, and each storage record's
        (begin in the file, length, CRC-32).

    Raises:
        CorruptIndexError: not a zip archive of torch.save's layout (truncated, a compressed
            record, a big-endian archive, a record past the archive's end).
        UnsafePickleError: its ``data.pkl`` names a global torch.save of tensors never writes.
    """
    try:
        window = _Window(read, base, length)
        zf = zipfile.ZipFile(window)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptIndexError(f"{where}: bytes [{base}, {base + length}) are not a torch.save "
                                f"archive ({e}; the file truncated, or not torch.save's "
                                "serialization)") from None
    infos = zf.infolist()
    for info in infos:  # what torch's zip reader (miniz) refuses in a central directory
        if ((info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size)
                or info.header_offset + _LOCAL.size + info.compress_size > length):
            raise CorruptIndexError(
                f"{where}: record {shown(info.filename)} of the archive at bytes [{base}, "
                f"{base + length}) is {info.compress_size} bytes stored for "
                f"{info.file_size} at {info.header_offset}: its sizes disagree or run past "
                "the archive's end (damaged, or not torch.save's serialization)")
    pkl = next((i for i in infos if i.filename.endswith("/data.pkl")
                and i.filename.count("/") == 1), None)
    if pkl is None:
        raise CorruptIndexError(f"{where}: the archive has no <name>/data.pkl record (not "
                                "torch.save's serialization)")
    prefix = pkl.filename[: -len("data.pkl")]
    if pkl.file_size > MAX_PICKLE_BYTES:
        raise CorruptIndexError(f"{where}: {pkl.filename} is {pkl.file_size} bytes, over the "
                                f"{MAX_PICKLE_BYTES} shardkit reads")
    try:
        order = zf.read(prefix + "byteorder") if prefix + "byteorder" in zf.NameToInfo else b""
        version = zf.read(prefix + "version") if prefix + "version" in zf.NameToInfo else None
        data = zf.read(pkl)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise CorruptIndexError(f"{where}: a record of the archive at bytes [{base}, "
                                f"{base + length}) cannot be read ({e}; the index points at "
                                "other bytes, or the file is damaged)") from None
    number = _VERSION.match(version) if version is not None else None
    if number is None or not 1 <= int(number.group()) <= MAX_ARCHIVE_VERSION:
        raise CorruptIndexError(
            f"{where}: the archive's {prefix}version record is "
            f"{'missing' if version is None else shown(version[:20])}, not a version torch "
            f"reads (1 to {MAX_ARCHIVE_VERSION}; torch.save writes 3): not torch.save's "
            "serialization, or damaged")
    if order not in (b"", b"little"):
        raise CorruptIndexError(f"{where}: the archive is {shown(order.decode(errors='replace'))}"
                                "-endian; shardkit reads little-endian tensors only")
    value = load_pickle(data, ARCHIVE_GLOBALS, f"{where}: {pkl.filename}")
    records: dict[str, tuple[int, int, int]] = {}
    for info in infos:  # every record's local header, as torch's reader reads each record
        name = info.filename
        if not name.startswith(prefix):
            raise CorruptIndexError(f"{where}: record {shown(name)} is not in the archive's "
                                    f"directory {shown(prefix)} (damaged, or not torch.save's "
                                    "serialization)")
        is_data = name.startswith(prefix + "data/")
        if is_data and info.compress_type != zipfile.ZIP_STORED:
            raise CorruptIndexError(f"{where}: record {name} is compressed (method "
                                    f"{info.compress_type}); torch.save stores records as is")
        head = window._read(base + info.header_offset,
                            base + info.header_offset + _LOCAL.size)
        if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
            raise CorruptIndexError(f"{where}: record {name} has no local header at "
                                    f"{base + info.header_offset}")
        fields = _LOCAL.unpack(head)
        begin = info.header_offset + _LOCAL.size + fields[9] + fields[10]
        if begin + info.compress_size > length:
            raise CorruptIndexError(f"{where}: record {name}'s bytes [{base + begin}, "
                                    f"{base + begin + info.compress_size}) are past the "
                                    f"archive's end ({base + length})")
        if is_data:
            records[name[len(prefix) + 5 :]] = (base + begin, info.file_size, info.CRC)
    return Archive(value, records)


__all__ = ["ARCHIVE_GLOBALS", "METADATA_GLOBALS", "Archive", "Record", "StorageRef",
           "TORCH_DTYPES", "TensorRef", "TorchDType", "load_pickle", "read_archive"]
