"""shardkit.format as a package: every name of the former single module is still importable
from it, each defined once, and its modules import one way (docs/ARCHITECTURE.md)."""

import ast
import importlib
import re
from pathlib import Path

import shardkit.format as fmt

PACKAGE = Path(fmt.__file__).parent
ROOT = PACKAGE.parent.parent
MODULES = ("common", "strictjson", "header", "manifest")  # each imports only those before it

# The names the single module `shardkit/format.py` defined, as the rest of shardkit, its tests
# and other code imported them; plus `safetensors_name`, which it imported and tests use from it.
PUBLIC = """
FORMAT_NAME FORMAT_VERSION STRINGS_VERSION STRINGS_MINOR FORMAT_MAJOR MANIFEST_FILE
LEGACY_MANIFEST_FILE MANIFEST_FILES INDEX_FILE HEADER_FORMAT SHARDKIT_KEY MAX_HEADER_BYTES
MAX_INDEX_BYTES RAW_SUFFIX ZSTD_SUFFIX CODEC_SUFFIXES HEADER_ALIGNMENT MAX_DEPTH MAX_NDIM
MAX_NBYTES METADATA_KEY GENERATION_KEY find_manifest shard_file_name entry_name
new_generation shard_metadata legacy_shard_metadata check_generation EntryLayout
layout_entries entry_layouts entries_at data_size encode_safetensors_header
encode_header_columns header_parts header_length nesting_within decode_safetensors_header
read_safetensors_header read_expected_safetensors_header ShardInfo SliceInfo TensorInfo
CheckpointIndex encode_index index_chunks encode_index_parts parse_version
check_shard_file_name decode_index
""".split()
PRIVATE = """
_INT_DIGITS _ITEMSIZE _XXH3_RE _GENERATION_RE _LEN _Shown _SHOWN _shown _LEGACY_HEAD
_new_entry_layouts _Columns _layout_columns _first _second _third _header_text _parse_object
_too_deep _DOC_CONTAINERS _loads_pairs _object _plain _CONTAINERS _Slow _is_int _INT_ONLY
_decode_safetensors_header _ENTRY_KEYS _decode_entries_fast _decode_entry_checked
_shape_problem _check_tiling _match_header _pread _new_slice_infos _new_tensor_infos
_INDEX_FIELDS _dumps _decode_index _document_within_depth _canonical_document _COLUMNS
_index_objects _decode_shards _check_slices _field _nonneg_int _column _str_list _all_in
_nonneg_ints _check_ids _HEX_RUN
""".split()


def _defined(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def test_every_former_name_is_the_one_defined_in_its_module():
    where: dict[str, str] = {}
    for mod in MODULES:
        for name in _defined(ast.parse((PACKAGE / f"{mod}.py").read_text())):
            assert name not in where, f"{name} is defined in both {where[name]} and {mod}"
            where[name] = mod
    # the modules define exactly the former module's names: nothing lost, nothing new unlisted
    assert sorted(where) == sorted(PUBLIC + PRIVATE)
    for name, mod in where.items():
        assert getattr(fmt, name) is getattr(importlib.import_module(f"shardkit.format.{mod}"),
                                             name), name
    assert fmt.safetensors_name is importlib.import_module("shardkit.dtypes").safetensors_name
    assert sorted(fmt.__all__) == sorted(["safetensors_name", *PUBLIC])


def test_modules_import_one_way():
    for i, mod in enumerate(MODULES):
        tree = ast.parse((PACKAGE / f"{mod}.py").read_text())
        siblings = {node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert siblings <= set(MODULES[:i]), f"{mod} imports {sorted(siblings)}"


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([^"]+)"', re.search(
        r"^packages = \[(.*?)\]", text, re.MULTILINE | re.DOTALL).group(1)))
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "shardkit").rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)
