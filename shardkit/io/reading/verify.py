"""Verify: every stored entry (or those of some keys, or of some boxes) against the index and
its checksums, every problem found before one is raised (`VerifyReport`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import (
    CheckpointFormatError,
    ChecksumError,
    CorruptIndexError,
    MissingShardError,
    Problem,
    ShardIOError,
    TruncatedShardError,
    UnknownCodecError,
)
from ...format import EntryLayout
from ...shards.raw import ShardSource
from .boxes import slices_in_box
from .shards import ShardSet


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `CheckpointReader.verify_report` found: entries compared, and the problems."""

    checked: int
    problems: list[Problem]
    checksums_stored: bool = True
    """False when the checkpoint records no checksum at all (a HuggingFace or single
    safetensors layout, or a save without checksums): only its structure was checked."""

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    @property
    def summary(self) -> str:
        """What was checked, in words (``shardkit verify`` prints it)."""
        if not self.checksums_stored:
            return "no checksums stored: structure checked only"
        return f"{self.checked} entries checked"

    def error(self) -> CheckpointFormatError:
        """One exception for all the problems (call it only when there are some).

        Returns:
            An error of the first problem's class, every problem a line of its message, the
            list in its ``problems`` attribute.
        """
        lines = [str(p) for p in self.problems]
        head = lines[0] if len(lines) == 1 else f"{len(lines)} problems:"
        body = "" if len(lines) == 1 else "\n" + "\n".join(lines)
        e = self.problems[0].error(head + body)
        e.problems = list(self.problems)  # type: ignore[attr-defined]
        return e


def verify_keys(shards: ShardSet, keys: Sequence[str] | None) -> VerifyReport:
    """The report of the stored entries of `keys` (stored names; None: every entry, and every
    frame of every compressed shard)."""
    index = shards.index
    strings = shards.strings
    string_rows: list[int] = []
    if keys is None:
        slices: Sequence[int] = range(len(index.slice_tensor))
        string_rows = [] if strings is None else list(range(len(strings.keys)))
    else:
        if strings is not None:
            string_rows = [strings.row(k) for k in keys if k in strings]
            keys = [k for k in keys if k not in strings]
        for k in keys:
            shards.tensor(k)  # KeyNotFoundError, with a hint
        wanted = {index.row(k) for k in keys}
        slices = [j for j, t in enumerate(index.slice_tensor) if t in wanted]
    report = _verify_slices(shards, keys is None, slices)
    if not string_rows:
        return report
    assert strings is not None
    checked, found = strings.verify(shards.directory, string_rows)
    problems = [*report.problems, *found]
    return VerifyReport(report.checked + checked, problems,
                        report.checksums_stored or checked > 0)


def verify_boxes(shards: ShardSet, boxes: Sequence[tuple[str, Sequence[int], Sequence[int]]]
                 ) -> VerifyReport:
    """The report of only the stored slices that intersect the boxes (key, offsets, lengths)."""
    ids = sorted({j for key, offsets, lengths in boxes
                  for j, *_ in slices_in_box(shards, key, offsets, lengths)})
    return _verify_slices(shards, False, ids)


def _verify_slices(shards: ShardSet, everything: bool, slices: Sequence[int]) -> VerifyReport:
    opened: list[ShardSource] = []  # sources opened for verify alone, closed after
    try:
        return _check_slices(shards, everything, slices, opened)
    finally:
        for src in opened:
            src.close()


def _check_slices(shards: ShardSet, everything: bool, slices: Sequence[int],
                  opened: list[ShardSource]) -> VerifyReport:
    index = shards.index
    problems: dict[Problem, None] = {}
    checked = 0
    by_shard: dict[int, list[int]] = {}
    for j in slices:
        by_shard.setdefault(index.slice_shard[j], []).append(j)
    names = index.entry_names()
    shapes = index.slice_shapes()
    index_path = shards.manifest_path
    manifest = shards.manifest
    kinds = index.slice_checksum_kind
    for i, js in sorted(by_shard.items()):
        src = shards.sources.get(i) or _verify_source(shards, i, problems, opened)
        if src is None:
            continue
        file = index.shards[i].file
        good: list[tuple[int, EntryLayout]] = []
        for j in js:
            key = index.keys[index.slice_tensor[j]]
            dtype_name = index.dtypes[index.slice_tensor[j]]
            entry = src.entries.get(names[j])
            where = f"entry {names[j]!r} in shard {file}"
            if entry is None:
                problems[Problem(index_path, key, where, "an entry of the shard's header",
                                 "none by that name", CorruptIndexError)] = None
            elif entry.dtype_name != dtype_name:
                problems[Problem(index_path, key, f"dtype of {where}",
                                 f"{entry.dtype_name} (the shard's)", dtype_name,
                                 CorruptIndexError)] = None
            elif entry.shape != shapes[j]:
                problems[Problem(index_path, key, f"shape of {where}",
                                 f"{list(entry.shape)} (the shard's)", str(list(shapes[j])),
                                 CorruptIndexError)] = None
            else:
                good.append((j, entry))
        # one pass per shard: the entries' xxh3 (and a codec's frames, every one for a
        # whole verify), each source as it reads best (a map, batches in flight, chunks)
        digests, bad = src.verify_entries(
            {e.name for j, e in good if index.slice_xxh3[j] is not None
             and (kinds is None or kinds[j] == "xxh3")}, shards.worker_pool(), everything)
        for _, e in bad:
            problems[Problem(src.path, None, getattr(e, "frame", "frame"),
                             getattr(e, "expected", "an intact frame"),
                             getattr(e, "found", str(e)), ChecksumError)] = None
        for j, entry in good:
            recorded = index.slice_xxh3[j]
            if recorded is None:
                continue
            kind = kinds[j] if kinds is not None else "xxh3"
            found = (digests.get(entry.name) if kind == "xxh3"
                     else shards.layout.checksum(kind, src, entry))
            if found is None:  # in a corrupt frame: reported once, as the frame
                continue
            checked += 1
            if found != recorded:
                spec = index.slice_spec[j]
                what = (f"checksum of slice {spec!r} (entry {entry.name!r})" if spec
                        else f"checksum of entry {entry.name!r}")
                problems[Problem(src.path, index.keys[index.slice_tensor[j]], what,
                                 f"{kind} {recorded} ({manifest})", found, ChecksumError)] = None
    return VerifyReport(checked, list(problems),
                        any(x is not None for x in index.slice_xxh3))


def _verify_source(shards: ShardSet, i: int, problems: dict[Problem, None],
                   opened: list[ShardSource]) -> ShardSource | None:
    """Shard `i` opened for verification (not cached, headers parsed in full), or None
    with its problem recorded. A size that differs from the index is the index's fault
    when the file opens and is whole at its own size, else the shard's."""
    info = shards.index.shards[i]
    path = shards.shard_paths[i]
    manifest, index_path = shards.manifest, shards.manifest_path
    try:
        opener = shards.directory.opener(info.codec, path)
        file = shards.open_file(i)  # the reader's directory handle, its symlink rule
    except MissingShardError:
        problems[Problem(path, None, "shard file", f"a file ({manifest} lists it)",
                         "no such file", MissingShardError)] = None
        return None
    except UnknownCodecError as e:
        problems[Problem(index_path, None, f"codec of shard {info.file}",
                         "a codec this shardkit reads", repr(info.codec), type(e))] = None
        return None
    except (CheckpointFormatError, ShardIOError) as e:  # not a regular file, a symlink...
        problems[Problem(path, None, "shard file", "a readable regular file",
                         _without_path(str(e), path),
                         type(e) if isinstance(e, CheckpointFormatError)
                         else CheckpointFormatError)] = None
        return None
    size = file.size
    try:
        sized = dataclasses.replace(info, bytes=size)
        src = (shards.layout.open_source(shards.index, i, path, sized, mmap=shards.mmap,
                                         file=file)
               or opener(path, sized, mmap=shards.mmap, file=file))
    except CheckpointFormatError as e:
        file.close()
        if size != info.bytes:
            problems[Problem(path, None, "file size", f"{info.bytes} bytes ({manifest})",
                             f"{size} bytes", TruncatedShardError if size < info.bytes
                             else CheckpointFormatError)] = None
        else:
            problems[Problem(path, None, f"{info.codec} shard header",
                             "a valid header", _without_path(str(e), path), type(e))] = None
        return None
    except BaseException:
        file.close()
        raise
    if size != info.bytes:
        problems[Problem(index_path, None, f"size of shard {info.file}",
                         f"{size} bytes (the file's)", f"{info.bytes} bytes",
                         CorruptIndexError)] = None
    opened.append(src)
    return src


def _without_path(message: str, path: str) -> str:
    return message[len(path) + 2 :] if message.startswith(path + ": ") else message
