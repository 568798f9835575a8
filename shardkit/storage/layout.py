"""The object layout of a checkpoint in a store (docs/FORMAT.md, "Object storage").

    <prefix>/model.safetensors.index.json            the manifest, written last
    <prefix>/shards-<generation>/<shard file>         the shards of that save

The manifest is byte for byte what a local save writes; its shard files are looked up under
the directory of its own generation, so objects of other saves (older ones, crashed ones, one
in progress) are never read.
"""

from __future__ import annotations

from ..format import MANIFEST_FILE

SHARDS_PREFIX = "shards-"


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


__all__ = ["MANIFEST_FILE", "SHARDS_PREFIX", "generation_of", "object_name", "shards_dir"]
