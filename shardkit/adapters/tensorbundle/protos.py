"""The protocol buffer messages of TensorFlow's checkpoints, built without TensorFlow.

The descriptors are those of TensorFlow's ``tensor_bundle.proto`` (BundleHeaderProto,
BundleEntryProto), ``tensor_shape.proto``, ``tensor_slice.proto``, ``versions.proto``, the
``types.proto`` DataType values shardkit stores, and ``checkpoint_state.proto``
(CheckpointState, the text-format ``checkpoint`` file): same package, names, field numbers and
types, so that messages encode and decode byte for byte as TensorFlow's do. They are built once,
with the ``protobuf`` package (`descriptor_pb2` + `message_factory`), in a private descriptor
pool, so they never clash with TensorFlow's own classes when both are imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any, Final

from ...optional import require
from .datatypes import DATA_TYPE_NAMES, DATA_TYPES

# the one import of protobuf: the other modules of the package take its names from here
require("google.protobuf", "reading or writing a TensorFlow checkpoint (TensorBundle)")
from google.protobuf import (  # type: ignore[import-untyped]  # noqa: E402
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    text_format,
)
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # noqa: E402

_F: Any = descriptor_pb2.FieldDescriptorProto
_OPT, _REP = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED


def _field(name: str, number: int, kind: int, label: int = _OPT, type_name: str = "",
           oneof: int | None = None) -> Any:
    f = _F(name=name, number=number, label=label, type=kind)
    if type_name:
        f.type_name = type_name
    if oneof is not None:
        f.oneof_index = oneof
    return f


def _file(name: str, deps: list[str], messages: list[Any], enums: Sequence[Any] = ()) -> Any:
    return descriptor_pb2.FileDescriptorProto(
        name=name, package="tensorflow", syntax="proto3", dependency=deps,
        message_type=messages, enum_type=list(enums))


def _enum(name: str, values: dict[str, int]) -> Any:
    return descriptor_pb2.EnumDescriptorProto(name=name, value=[
        descriptor_pb2.EnumValueDescriptorProto(name=k, number=v) for k, v in values.items()])


def _msg(name: str, fields: list[Any], nested: Sequence[Any] = (), enums: Sequence[Any] = (),
         oneofs: Sequence[str] = ()) -> Any:
    return descriptor_pb2.DescriptorProto(
        name=name, field=fields, nested_type=list(nested), enum_type=list(enums),
        oneof_decl=[descriptor_pb2.OneofDescriptorProto(name=o) for o in oneofs])


def _build() -> dict[str, Any]:
    I32, I64, STR, BOOL, ENUM, MSG, FX32, DBL = (
        _F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_STRING, _F.TYPE_BOOL, _F.TYPE_ENUM,
        _F.TYPE_MESSAGE, _F.TYPE_FIXED32, _F.TYPE_DOUBLE)
    files = [
        _file("tensorflow/core/framework/types.proto", [], [], [_enum("DataType", DATA_TYPES)]),
        _file("tensorflow/core/framework/tensor_shape.proto", [], [_msg(
            "TensorShapeProto",
            [_field("dim", 2, MSG, _REP, ".tensorflow.TensorShapeProto.Dim"),
             _field("unknown_rank", 3, BOOL)],
            [_msg("Dim", [_field("size", 1, I64), _field("name", 2, STR)])])]),
        _file("tensorflow/core/framework/tensor_slice.proto", [], [_msg(
            "TensorSliceProto",
            [_field("extent", 1, MSG, _REP, ".tensorflow.TensorSliceProto.Extent")],
            [_msg("Extent", [_field("start", 1, I64), _field("length", 2, I64, oneof=0)],
                  oneofs=["has_length_hack"])])]),
        _file("tensorflow/core/framework/versions.proto", [], [_msg(
            "VersionDef", [_field("producer", 1, I32), _field("min_consumer", 2, I32),
                           _field("bad_consumers", 3, I32, _REP)])]),
        _file("tensorflow/core/protobuf/tensor_bundle.proto", [
            "tensorflow/core/framework/tensor_shape.proto",
            "tensorflow/core/framework/tensor_slice.proto",
            "tensorflow/core/framework/types.proto",
            "tensorflow/core/framework/versions.proto"], [
            _msg("BundleHeaderProto",
                 [_field("num_shards", 1, I32),
                  _field("endianness", 2, ENUM,
                         type_name=".tensorflow.BundleHeaderProto.Endianness"),
                  _field("version", 3, MSG, type_name=".tensorflow.VersionDef")],
                 enums=[_enum("Endianness", {"LITTLE": 0, "BIG": 1})]),
            _msg("BundleEntryProto",
                 [_field("dtype", 1, ENUM, type_name=".tensorflow.DataType"),
                  _field("shape", 2, MSG, type_name=".tensorflow.TensorShapeProto"),
                  _field("shard_id", 3, I32), _field("offset", 4, I64),
                  _field("size", 5, I64), _field("crc32c", 6, FX32),
                  _field("slices", 7, MSG, _REP, ".tensorflow.TensorSliceProto")])]),
        _file("tensorflow/python/training/checkpoint_state.proto", [], [_msg(
            "CheckpointState",
            [_field("model_checkpoint_path", 1, STR),
             _field("all_model_checkpoint_paths", 2, STR, _REP),
             _field("all_model_checkpoint_timestamps", 3, DBL, _REP),
             _field("last_preserved_timestamp", 4, DBL)])]),
        # tensorflow/core/protobuf/trackable_object_graph.proto, without the fields a graph
        # rebuilt from checkpoint keys never sets (registered_saver, has_checkpoint_values)
        _file("tensorflow/core/protobuf/trackable_object_graph.proto", [], [_msg(
            "TrackableObjectGraph",
            [_field("nodes", 1, MSG, _REP, ".tensorflow.TrackableObjectGraph.TrackableObject")],
            [_msg("TrackableObject", [
                _field("children", 1, MSG, _REP,
                       ".tensorflow.TrackableObjectGraph.TrackableObject.ObjectReference"),
                _field("attributes", 2, MSG, _REP,
                       ".tensorflow.TrackableObjectGraph.TrackableObject.SerializedTensor"),
                _field("slot_variables", 3, MSG, _REP,
                       ".tensorflow.TrackableObjectGraph.TrackableObject."
                       "SlotVariableReference")], [
                _msg("ObjectReference", [_field("node_id", 1, I32),
                                         _field("local_name", 2, STR)]),
                _msg("SerializedTensor", [_field("name", 1, STR), _field("full_name", 2, STR),
                                          _field("checkpoint_key", 3, STR)]),
                _msg("SlotVariableReference", [
                    _field("original_variable_node_id", 1, I32), _field("slot_name", 2, STR),
                    _field("slot_variable_node_id", 3, I32)])])])]),
        # shardkit's own: many entries in one message, so that protobuf decodes them in one
        # call (their bytes framed as the repeated field; see `parse_entries`)
        # A BundleEntryProto read with its shape and slices left as their encoded bytes (the
        # same wire format: a message field is length-delimited bytes), so that one decode of
        # each distinct shape serves every entry of that shape. `slices` is not repeated here:
        # it only tells whether there are any (the entry is then decoded in full).
        _file("shardkit/tensorbundle_entries.proto",
              ["tensorflow/core/protobuf/tensor_bundle.proto"], [
                  _msg("BundleEntryColumns",
                       [_field("dtype", 1, I32), _field("shape", 2, _F.TYPE_BYTES),
                        _field("shard_id", 3, I32), _field("offset", 4, I64),
                        _field("size", 5, I64), _field("crc32c", 6, FX32),
                        _field("slices", 7, _F.TYPE_BYTES)]),
                  _msg("BundleEntries",
                       [_field("entry", 1, MSG, _REP, ".tensorflow.BundleEntryColumns")]),
                  _msg("TensorShapes",
                       [_field("shape", 1, MSG, _REP, ".tensorflow.TensorShapeProto")]),
                  # BundleEntryProto's fields, each repeated: many entries' encodings one
                  # after the other parse as one message whose fields list every entry's
                  # values in order (`parse_columns`)
                  _msg("BundleEntryFields",
                       [_field("dtype", 1, I32, _REP), _field("shape", 2, _F.TYPE_BYTES, _REP),
                        _field("shard_id", 3, I32, _REP), _field("offset", 4, I64, _REP),
                        _field("size", 5, I64, _REP), _field("crc32c", 6, FX32, _REP),
                        _field("slices", 7, _F.TYPE_BYTES, _REP)])]),
    ]
    pool = descriptor_pool.DescriptorPool()
    for f in files:
        pool.Add(f)
    names = ["BundleHeaderProto", "BundleEntryProto", "TensorShapeProto", "TensorSliceProto",
             "VersionDef", "CheckpointState", "BundleEntries", "TensorShapes",
             "BundleEntryFields", "TrackableObjectGraph"]
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tensorflow.{n}"))
            for n in names}


_CLASSES: Final = _build()
BundleHeaderProto: Final[Any] = _CLASSES["BundleHeaderProto"]
BundleEntryProto: Final[Any] = _CLASSES["BundleEntryProto"]
TensorShapeProto: Final[Any] = _CLASSES["TensorShapeProto"]
TensorSliceProto: Final[Any] = _CLASSES["TensorSliceProto"]
VersionDef: Final[Any] = _CLASSES["VersionDef"]
CheckpointState: Final[Any] = _CLASSES["CheckpointState"]
BundleEntries: Final[Any] = _CLASSES["BundleEntries"]
TensorShapes: Final[Any] = _CLASSES["TensorShapes"]
BundleEntryFields: Final[Any] = _CLASSES["BundleEntryFields"]
TrackableObjectGraph: Final[Any] = _CLASSES["TrackableObjectGraph"]


def _framed(values: list[bytes]) -> bytes:
    """`values` framed as field 1 of a message (tag, length, bytes each: what protobuf's
    encoder writes for a repeated message field)."""
    lengths = list(map(len, values))
    if not lengths or max(lengths) >= len(_HEADS):
        framed = bytearray()
        for v in values:
            framed += _head(len(v))
            framed += v
        return bytes(framed)
    return b"".join(chain.from_iterable(zip(map(_HEADS.__getitem__, lengths), values)))


def _head(n: int) -> bytes:
    out = bytearray([0x0A])  # field 1, wire type 2 (length-delimited), then varint n
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_HEADS: Final = [_head(n) for n in range(1 << 14)]  # one- and two-byte lengths: any entry


def parse_entries(values: list[bytes]) -> Any:
    """The BundleEntryProtos whose encodings are `values`, decoded by one protobuf call (as
    the repeated field of a BundleEntries message, shapes and slices left encoded).
    DecodeError if any is malformed: decode them one by one then to find which."""
    return BundleEntries.FromString(_framed(values)).entry


def parse_shapes(values: list[bytes]) -> Any:
    """The TensorShapeProtos whose encodings are `values`, decoded by one protobuf call (as
    the repeated field of a TensorShapes message). DecodeError if any is malformed."""
    return TensorShapes.FromString(_framed(values)).shape


SHAPE_MARK: Final = b"\xff"  # the shape in MARKS: one byte, which no TensorShapeProto is
MARKS: Final = bytes.fromhex("0800" "1201") + SHAPE_MARK + bytes.fromhex(
    "1800" "2000" "2800" "3500000000")
"""Put before each entry by `parse_columns`: an explicit zero of each scalar field of a
BundleEntryProto (dtype, shard_id, offset, size, crc32c), and a shape of one byte (no valid
TensorShapeProto encoding is one byte long): an encoder omits zeros and may omit an empty
shape, so without marks nobody could tell whose values a column holds."""


def parse_columns(framed: bytes | bytearray | memoryview) -> Any:
    """The BundleEntryFields message of `framed`: BundleEntryProto encodings, each after
    `MARKS`, decoded by one protobuf call. Each scalar field and the shapes then list, per
    entry, its mark (0, or a one-byte shape) followed by the entry's own values of that field
    (none when the entry leaves it out); the slices are listed as they come. DecodeError if
    the bytes do not parse."""
    return BundleEntryFields.FromString(framed)


__all__ = ["DATA_TYPES", "DATA_TYPE_NAMES", "MARKS", "DecodeError", "SHAPE_MARK", "BundleEntries",
           "BundleEntryFields", "BundleEntryProto",
           "BundleHeaderProto", "CheckpointState", "TensorShapeProto", "TensorShapes",
           "TensorSliceProto", "TrackableObjectGraph", "VersionDef", "parse_columns",
           "parse_entries", "parse_shapes",
           "text_format"]
