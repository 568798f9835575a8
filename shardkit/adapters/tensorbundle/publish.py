"""Publishing a TensorBundle at its prefix: the ``.index`` is the commit point.

A prefix's files share a directory with other checkpoints, so there is no directory to swap:
the one atomic step is the rename of the new ``<prefix>.index`` over the old. Until it, every
file the old index names must stay as it is; from it on, every file the new index names must
be in place. The data files' names follow from the prefix and the shard count
(``<prefix>.data-00000-of-0000N``), so a new checkpoint with the old one's shard count has the
very names the old index reads. Then the new data files go in first under another count M
(hard links, plus an empty file for each shard past N), named by an index that differs from the
new one only in its header's ``num_shards``; that index is the commit. Once it is in place the
old names are no longer read: the new data files take them, and the new index replaces the
interim one (the same checkpoint under its own names). At every instant the prefix is the
complete old or the complete new checkpoint (docs/FORMAT.md, section 12).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

from ...errors import CheckpointExistsError, InvalidArgumentError
from ...storage import commit
from .names import data_file, index_file

_MAX_SHARDS = 99999  # the %05d of TensorFlow's file names


def publish(tmp: Path, parent: Path, name: str, n: int, index: Callable[[int], bytes], *,
            overwrite: bool, durable: bool) -> list[str]:
    """Publish the bundle whose `n` data files (``data_file(name, i, n)``) are in `tmp`, the
    save's locked temp directory, at the prefix ``parent/name``; `index(num_shards)` gives the
    ``.index`` bytes for a shard count (the same entries). `durable`: fsync each file and the
    directory after every step. Returns the names of the data files published: `n` of them,
    or, on a file system without hard links replacing a checkpoint of the same count, those of
    the interim count. CheckpointExistsError if a checkpoint appeared at the prefix meanwhile
    and not `overwrite`; a failed rename before the commit removes every file moved in again,
    leaving the old checkpoint as it was."""
    final_index = parent / index_file(name)
    live = os.path.lexists(final_index)
    if live and not overwrite:
        raise CheckpointExistsError(f"{final_index} was created by someone else while this "
                                    "save ran", "to replace it")
    present = _data_files(parent, name)
    new = [data_file(name, i, n) for i in range(n)]
    placed: list[Path] = []  # moved into `parent` before the commit: removed if it fails
    committed = done = False
    try:
        if live and not present.isdisjoint(new):  # the old index may read these very names
            m = _interim_count(n, present, final_index)
            interim = [data_file(name, i, m) for i in range(m)]
            linked = _stage_interim(tmp, new, interim, durable)
            _move_in(tmp, parent, interim, placed, durable)
            _commit_index(tmp, final_index, index(m), durable)
            committed = True
            if not linked:  # no hard links here: the checkpoint keeps the interim names
                new, done = interim, True
        if not done:
            _move_in(tmp, parent, new, placed, durable)
            _commit_index(tmp, final_index, index(n), durable)
            committed = True
    except BaseException:
        if not committed:
            for p in placed:
                with contextlib.suppress(OSError):
                    os.unlink(p)
        raise
    for f in sorted(_data_files(parent, name) - set(new)):  # the old ones, the interim ones
        with contextlib.suppress(FileNotFoundError):
            os.unlink(parent / f)
    if durable:
        commit.fsync_dir(parent)
    return new


def _data_files(parent: Path, name: str) -> set[str]:
    """The data files of prefix `name` in `parent`, of any shard count."""
    mine = re.compile(re.escape(name) + r"\.data-\d{5}-of-\d{5}")
    return {e for e in os.listdir(parent) if mine.fullmatch(e)}


def _interim_count(n: int, present: set[str], where: Path) -> int:
    """A shard count over `n` that names no data file present (the old index's among them)."""
    used = {int(f[-5:]) for f in present}
    m = n + 1
    while m in used:
        m += 1
    if m > _MAX_SHARDS:
        raise InvalidArgumentError(f"{where}: no free shard count above {n} to replace the "
                                   "checkpoint under (TensorFlow's names stop at 99999)")
    return m


def _stage_interim(tmp: Path, new: list[str], interim: list[str], durable: bool) -> bool:
    """The interim names in `tmp`: hard links of the new data files, then empty files. On a
    file system without hard links the new files are renamed instead; returns whether they
    were linked."""
    try:
        for f, g in zip(new, interim):
            os.link(tmp / f, tmp / g)
        linked = True
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        for f, g in zip(new, interim):
            if os.path.lexists(tmp / g):
                os.unlink(tmp / g)  # a link made before the failure
            os.rename(tmp / f, tmp / g)
        linked = False
    for g in interim[len(new):]:
        commit.write_new(tmp / g, [], durable)
    return linked


def _move_in(tmp: Path, parent: Path, files: list[str], placed: list[Path],
             durable: bool) -> None:
    """Rename `files` from `tmp` into `parent`, each added to `placed` once it is there."""
    for f in files:
        os.rename(tmp / f, parent / f)
        placed.append(parent / f)
    if durable:
        commit.fsync_dir(parent)


def _commit_index(tmp: Path, final_index: Path, table: bytes, durable: bool) -> None:
    """Write the index into `tmp` and rename it over `final_index` (the commit step)."""
    staged = tmp / final_index.name
    commit.write_new(staged, [table], durable)
    if durable:
        commit.fsync_dir(tmp)
    os.rename(staged, final_index)
    if durable:
        commit.fsync_dir(final_index.parent)
