"""What shardkit deletes at a URL: only its own objects (docs/FORMAT.md section 13).

An object is shardkit's when a shardkit manifest names it or a staging marker does: before a
save uploads anything, each of its uploads writes a marker listing the names it is about to
create, so a crashed or superseded save's objects (and its unfinished multipart uploads) are
found again; anything else under the prefix is never deleted or aborted.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterable

from .. import format as fmt
from ..errors import CheckpointFormatError, ShardkitError
from .base import Storage
from .commit import is_shardkit_manifest
from .layout import SHARDS_PREFIX, generation_of, is_marker, new_marker_name, object_name

MARKER_FORMAT = "shardkit-staging"
MAX_MARKER_BYTES = 64 * 1024 * 1024


def mark_staging(store: Storage, generation: str, files: Iterable[str]) -> None:
    """Record that the save of `generation` is about to upload `files` (shard file names), in
    a staging marker of its own, before any of them is created."""
    body = {"format": MARKER_FORMAT, "generation": generation,
            "objects": [object_name(f, generation) for f in files]}
    store.write_file(new_marker_name(generation), [json.dumps(body).encode()])


def _marked(store: Storage, marker: str) -> set[str] | None:
    """The object names staging marker `marker` lists (only names in its own generation's
    directory count); None when it cannot be read as one (then nothing it names is touched)."""
    gen = generation_of(marker)
    try:
        found = store.fetch(marker, MAX_MARKER_BYTES)
        doc = json.loads(found.data) if found is not None else None
    except (ShardkitError, ValueError):
        return None
    if (not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT
            or doc.get("generation") != gen or not isinstance(doc.get("objects"), list)):
        return None
    own = object_name("", gen)
    return {n for n in doc["objects"] if isinstance(n, str) and n.startswith(own)
            and "/" not in n[len(own):] and n != own and not is_marker(n)}


def manifest_objects(index: fmt.CheckpointIndex) -> list[str]:
    """The objects the manifest of `index` names: its shards and its string file."""
    return [object_name(f, index.generation) for f in index.files()]


def remove_owned(store: Storage, keep: str | None, *, older_than: float | None = None,
                 only: str | None = None) -> list[str]:
    """Delete what the staging markers of every generation but `keep` name (with `only`: of
    that generation alone), abort their unfinished multipart uploads, then the markers. With
    `older_than`, only objects and uploads at least that many seconds old, and a marker only
    once nothing it names is younger (a save in progress keeps its objects). Returns the names
    deleted, markers last."""
    now = time.time()

    def old(age: float) -> bool:
        return older_than is None or age >= older_than

    listing = {s.name: s for s in store.list(SHARDS_PREFIX)}
    uploads = store.unfinished_uploads()
    doomed: list[str] = []
    markers: list[str] = []
    for name, stored in listing.items():
        gen = generation_of(name)
        if not is_marker(name) or gen == keep or (only is not None and gen != only):
            continue
        names = _marked(store, name)
        if names is None:
            continue
        young = False
        for obj in sorted(names):
            if obj in listing:
                if old(now - listing[obj].mtime):
                    doomed.append(obj)
                else:
                    young = True
        for obj, upload, age in uploads:
            if obj in names:
                if old(age):
                    store.abort_upload(obj, upload)
                else:
                    young = True
        if not young and old(now - stored.mtime):
            markers.append(name)
    store.delete(doomed)
    store.delete(markers)  # after what they name: a crash in between loses no record
    return doomed + markers


def gc(store: Storage, *, older_than: float = 3600.0) -> list[str]:
    """Remove the objects in `store` (``open_storage(url)``) of crashed or superseded saves
    (`remove_owned`: what their staging markers name) last modified at least `older_than`
    seconds ago, so a save in progress keeps its objects; the current manifest's generation is
    kept. Returns the names removed.

    Raises:
        CorruptIndexError: the manifest in `store` cannot be read (nothing is deleted).
    """
    found = store.fetch(fmt.MANIFEST_FILE, fmt.MAX_INDEX_BYTES)
    keep = None
    if found is not None:
        keep = fmt.decode_index(found.data, store.join(fmt.MANIFEST_FILE)).generation
    return remove_owned(store, keep, older_than=older_than)


def list_checkpoints(store: Storage) -> list[tuple[str, float]]:
    """The committed shardkit checkpoints directly under the prefix of `store` (a HuggingFace
    export's manifest is not one): (name, manifest mtime)."""
    tail = "/" + fmt.MANIFEST_FILE
    out = []
    for s in store.list(""):
        if s.name.endswith(tail) and s.name.count("/") == 1:
            head = store.read_range(s.name, 0, min(s.size, 4096))
            if is_shardkit_manifest(head, functools.partial(store.read_range, s.name,
                                                            len(head), s.size)):
                out.append((s.name[: -len(tail)], s.mtime))
    return out


def remove_checkpoint(store: Storage) -> None:
    """Delete the checkpoint in `store`: the manifest first (it stops being a checkpoint at
    once), then the objects it names and those its staging markers (and any crashed save's
    there) name. Other objects under the prefix stay.

    Raises:
        CorruptIndexError: the manifest cannot be read, so what it names is unknown (nothing
            is deleted).
    """
    found = store.fetch(fmt.MANIFEST_FILE, fmt.MAX_INDEX_BYTES)
    named: list[str] = []
    if found is not None:
        try:
            named = manifest_objects(fmt.decode_index(found.data,
                                                      store.join(fmt.MANIFEST_FILE)))
        except CheckpointFormatError as e:
            raise type(e)(f"{e}; not deleted, since what it names is unknown") from None
    store.delete([fmt.MANIFEST_FILE])
    store.delete(named)
    remove_owned(store, None)


__all__ = ["gc", "list_checkpoints", "manifest_objects", "mark_staging", "remove_checkpoint",
           "remove_owned"]
