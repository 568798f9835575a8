"""The object layout of a checkpoint in a store (docs/FORMAT.md section 13): the manifest at
the prefix, each save's shards and staging markers under ``shards-<generation>/``."""

from __future__ import annotations

import uuid

from ..format import MANIFEST_FILE

SHARDS_PREFIX = "shards-"
STAGING_MARK = ".shardkit-staging-"


def shards_dir(generation: str) -> str:
    return f"{SHARDS_PREFIX}{generation}/"


def object_name(file: str, generation: str | None) -> str:
    """The object holding shard `file` of the checkpoint of `generation` (None: a layout
    without generations, whose shards sit next to the manifest)."""
    return f"{shards_dir(generation)}{file}" if generation else file


def generation_of(name: str) -> str | None:
    """The generation whose shard directory holds object `name`, else None."""
    if not name.startswith(SHARDS_PREFIX) or "/" not in name:
        return None
    return name[len(SHARDS_PREFIX) : name.index("/")]


def new_marker_name(generation: str) -> str:
    """A fresh name for a staging marker of the save of `generation`."""
    return f"{shards_dir(generation)}{STAGING_MARK}{uuid.uuid4().hex}.json"


def is_marker(name: str) -> bool:
    """Whether object `name` is a staging marker (`new_marker_name`)."""
    gen = generation_of(name)
    return (gen is not None and name.endswith(".json")
            and name[len(shards_dir(gen)):].startswith(STAGING_MARK)
            and "/" not in name[len(shards_dir(gen)):])


__all__ = ["MANIFEST_FILE", "SHARDS_PREFIX", "STAGING_MARK", "generation_of", "is_marker",
           "new_marker_name", "object_name", "shards_dir"]
