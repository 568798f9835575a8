"""The ``shardkit`` command.

Each subcommand is one ``_add_<command>_parser(subparsers)`` (listed in ``_SUBCOMMANDS``; it sets
``func=cmd_<command>``) and one ``cmd_<command>(args) -> int``. Handlers raise ShardkitError (or
OSError) for failures; `main` turns those into a one-line message and exit code 1.

    shardkit demo [--model llm-small] [--dtype float32] [--dir DIR]
    shardkit plan --model llm-1b [--policy NAME[:ARG]]... [--max-shard-size 1GiB] [--num-shards 8]
    shardkit plan FILE.safetensors|FILE.npz|CHECKPOINT [--plot sizes.png]
    shardkit inspect CHECKPOINT
    shardkit verify CHECKPOINT
    shardkit convert SRC DST [--to tensorflow|shardkit] [--overwrite] [--no-verify]
    shardkit gc URL [--older-than SECONDS]
    shardkit --version

CHECKPOINT is anything the reader opens (docs/FORMAT.md section 11), or the URL of a shardkit
checkpoint (credentials and endpoint from the store's environment, e.g. AWS_* variables).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import CheckpointExistsError, PolicyError, ShardkitError
from ..sharding.policies import POLICIES, get_policy, parse_size
from .models import MODELS, load_state_file, synthetic_state

if TYPE_CHECKING:
    from ..sharding.callback import ShardingCallback

# The handlers import what they use (the save flow, the reader, the profiler), so that the
# parser alone, `shardkit --version` and `--help`, imports little.

__all__ = [
    "build_parser", "cmd_convert", "cmd_demo", "cmd_inspect", "cmd_plan", "cmd_verify", "main",
    "make_policy",
]

PROG = "shardkit"
CHECKPOINT_HELP = ("checkpoint directory or file (shardkit's, HuggingFace's, a .safetensors "
                   "file, a PyTorch DCP directory, a torch.save .pt file, a TensorFlow "
                   "checkpoint's prefix or .index file)")
"""What a checkpoint argument takes: anything the reader opens (commands that read through the
reader also take a checkpoint URL)."""
DEFAULT_NUM_SHARDS = 8
TO_SHARDKIT = ("tensorbundle", "dcp", "torch-save")
"""Source layouts `convert` writes as shardkit's by default (the others: as TensorFlow's)."""
DEFAULT_POLICY = "default"
"""The name `plan` and `demo` give `DefaultShardingPolicy`, the policy `save` uses."""
_AUTO_MIN, _AUTO_MAX = 64 * 2**10, 2**30


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 1 shardkit error, 2 usage error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except SystemExit as e:  # --help (0) or a usage error (2): argparse already printed
        return e.code if isinstance(e.code, int) else 2
    except BrokenPipeError:  # the reader went away (`shardkit inspect CKPT | head`): stop quietly
        _silence_stdout()
        return 141  # what a shell reports for a command ended by SIGPIPE
    except (ShardkitError, OSError) as e:
        message = " ".join(line.strip() for line in _worded(e).splitlines() if line.strip())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1


FLAGS = {"overwrite": "--overwrite"}
"""The flag of each keyword argument an error may tell the caller to pass."""


def _worded(e: BaseException) -> str:
    """The message of `e`, naming this command's flags where it names an API argument."""
    if isinstance(e, CheckpointExistsError) and e.keyword in FLAGS:
        return e.worded(FLAGS[e.keyword])
    return str(e)


def _silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's final flush of
    what is still buffered does not fail again ("Exception ignored ... BrokenPipeError")."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured in a test)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand adds itself and sets ``func`` to its handler."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Sharded ML checkpoints: plan, save, inspect and verify them."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], help: str,
             description: str, **kw: Any) -> argparse.ArgumentParser:
    """Subcommand `name`, run by `func`; its description is printed as written."""
    p = sub.add_parser(name, help=help, description=description,
                       formatter_class=argparse.RawDescriptionHelpFormatter, **kw)
    p.set_defaults(func=func, parser=p)
    return p


# ---------------------------------------------------------------------------------------- plan


def _add_plan_parser(sub: Any) -> None:
    models = "\n".join(f"  {name:<12} {desc}" for name, desc in MODELS.items())
    p = _command(
        sub, "plan", cmd_plan,
        "compare sharding policies on a model or a state file (no data is written)",
        "Run sharding policies on a state and print, per policy, the number of shards,\n"
        "their sizes, the imbalance (largest over mean shard), the number of tensors\n"
        "split and the planning time. Only shapes and dtypes are read: files are not\n"
        "loaded and built-in models take no memory.",
        epilog=(
            f"built-in models:\n{models}\n\n"
            f"policies: {', '.join(_policy_names())}\n"
            f"  {DEFAULT_POLICY} is the policy save() uses when given no callback\n"
            "  NAME:ARG sets the policy's argument, e.g. max-shard-size:256MiB, bin-pack:1GiB, "
            "balanced:4"
        ),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "file", nargs="?", metavar="FILE",
        help=f"a .npz file, or what a reader opens ({CHECKPOINT_HELP}), to plan for"
    )
    source.add_argument("--model", metavar="NAME", help="a built-in synthetic model (see below)")
    p.add_argument("--dtype", help="dtype of the built-in model (default: float32)")
    p.add_argument(
        "--policy",
        action="append",
        metavar="NAME[:ARG]",
        dest="policies",
        help="a policy to profile; repeat for several "
        f"(default: every built-in policy, {DEFAULT_POLICY} first)",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="size for policies without :ARG that take one, e.g. 1GiB "
        "(default: about total/8, a power of two between 64 KiB and 1 GiB)",
    )
    p.add_argument(
        "--num-shards",
        type=int,
        default=DEFAULT_NUM_SHARDS,
        metavar="N",
        help=f"shard count for policies without :ARG that take one (default: {DEFAULT_NUM_SHARDS})",
    )
    p.add_argument("--plot", metavar="PNG", help="also write a bar chart of shard sizes here")


def cmd_plan(args: argparse.Namespace) -> int:
    from ..sharding.tensors import shardable_tensors
    from .profiling import format_table, human_size, plot_shard_sizes, plural, profile

    if args.model is not None:
        dtype = args.dtype or "float32"
        state = synthetic_state(args.model, dtype=dtype)
        source = f"model {args.model} ({dtype})"
    elif args.dtype is not None:
        args.parser.error("--dtype applies to built-in models (--model) only")
    elif (os.path.isdir(args.file) or args.file.endswith((".safetensors", ".index"))
          or os.path.isfile(args.file + ".index")):  # a checkpoint; a TensorFlow prefix
        state = _stored_shapes(args.file)
        source = args.file
    else:
        state = load_state_file(args.file, materialize=False)
        source = args.file
    tensors = shardable_tensors(state)
    total = sum(t.nbytes for t in tensors)
    if args.max_shard_size:
        max_size, how = parse_size(args.max_shard_size, "--max-shard-size"), ""
    else:
        max_size, how = auto_max_shard_size(total), " (auto)"
    defaults = {"max_shard_size": max_size, "num_shards": args.num_shards}
    specs = args.policies or _policy_names()
    policies = {spec: make_policy(spec, defaults) for spec in specs}
    print(f"{source}: {len(tensors)} tensors, {human_size(total)}")
    print(f"defaults: max shard size {human_size(max_size)}{how}, "
          f"{plural(args.num_shards, 'shard')}\n")
    profiles = profile(tensors, policies)
    print(format_table(profiles))
    if args.plot:
        plot_shard_sizes(profiles, args.plot, title=f"shard sizes of {source}")
        print(f"\nplot written to {args.plot}")
    return 0


def _stored_shapes(path: str) -> dict[str, Any]:
    """Untouched arrays of the dtypes and shapes stored at `path` (anything the reader opens;
    only its index and headers are read)."""
    from ..errors import CheckpointFormatError
    from ..io.reader import open_checkpoint
    from ..values.dtypes import numpy_dtype
    from .models import _carve

    try:
        with open_checkpoint(path) as reader:
            index = reader.index
            specs = list(zip(index.keys, index.shapes))
            return _carve(specs, [numpy_dtype(d) for d in index.dtypes])
    except CheckpointFormatError as e:
        if os.path.isdir(path):
            raise
        raise type(e)(f"{path!r}: not a readable safetensors file: {e}") from None


def auto_max_shard_size(total_bytes: int) -> int:
    """About an eighth of the state, as a power of two between 64 KiB and 1 GiB."""
    target = max(total_bytes // 8, 1)
    return min(max(1 << (target.bit_length() - 1), _AUTO_MIN), _AUTO_MAX)


def _policy_names() -> list[str]:
    return [DEFAULT_POLICY, *(name for name in POLICIES if name != DEFAULT_POLICY)]


def make_policy(spec: str, defaults: dict[str, Any]) -> ShardingCallback:
    """A policy from ``NAME`` or ``NAME:ARG``; ARG is the policy's one constructor argument.

    Without ARG the argument comes from `defaults` (keyed by parameter name). ``default`` is
    `DefaultShardingPolicy` as `save` uses it; it takes no argument.
    """
    name, sep, arg = spec.partition(":")
    if name != DEFAULT_POLICY and name not in POLICIES:
        raise PolicyError(
            f"unknown policy {name!r} in {spec!r}; known: {', '.join(_policy_names())}"
        )
    params = [] if name == DEFAULT_POLICY else [
        p
        for p in inspect.signature(POLICIES[name]).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if not params and sep:
        raise PolicyError(f"policy {name!r} takes no argument, got {spec!r}")
    if name == DEFAULT_POLICY:
        from ..io.save import DefaultShardingPolicy

        return DefaultShardingPolicy()
    if not params:
        return get_policy(name)
    if len(params) > 1 and sep:
        raise PolicyError(f"policy {name!r} takes {len(params)} arguments; NAME:ARG sets only one")
    config = {p.name: defaults[p.name] for p in params if p.name in defaults}
    if sep:
        param = params[0]
        if not arg:
            raise PolicyError(f"empty argument in {spec!r}; expected {name}:<{param.name}>")
        config[param.name] = _convert(arg, param, spec)
    return get_policy(name, **config)


def _convert(arg: str, param: inspect.Parameter, spec: str) -> Any:
    annotation = param.annotation
    if annotation in (int, "int"):
        try:
            return int(arg)
        except ValueError:
            raise PolicyError(
                f"policy argument {param.name} in {spec!r} must be an integer, got {arg!r}"
            ) from None
    return arg  # sizes stay strings: the policy parses "256MiB"


# ------------------------------------------------------------------------------ demo


def _add_demo_parser(sub: Any) -> None:
    p = _command(
        sub, "demo", cmd_demo,
        "build a transformer-like state, plan, save, verify and restore it, and report",
        "Build a synthetic transformer-like state (a few hundred MB), compare the sharding\n"
        "policies, save it with a progress bar into a temporary directory, verify every\n"
        "checksum, restore it by memory-mapping, check it byte for byte and print the\n"
        "sizes, throughputs and shard counts. The temporary directory is removed after.",
    )
    p.add_argument("--model", default="llm-small", choices=sorted(MODELS),
                   help="built-in model to use (default: llm-small, 300 MiB as float32)")
    p.add_argument("--dtype", default="float32", help="dtype of the model (default: float32)")
    p.add_argument("--dir", help="where to create the temporary checkpoint (default: system tmp)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(sys.stdout, model=args.model, dtype=args.dtype, directory=args.dir,
             progress=not args.no_progress)
    return 0


# ---------------------------------------------------------------------------- inspect


def _add_inspect_parser(sub: Any) -> None:
    p = _command(
        sub, "inspect", cmd_inspect, "list a checkpoint's shards and tensors",
        "Print a checkpoint's format version, sharding callback and user metadata, a table\n"
        "of its shard files (task, codec, size) and a table of its tensors (dtype, shape,\n"
        "stored slices, size, the shard each slice is in), then its aliases (tied weights:\n"
        "each alias key and the stored tensor it names). Reads the manifest only\n"
        "(model.safetensors.index.json; index.json for checkpoints of format 2.0/2.1) and,\n"
        "for HuggingFace and safetensors layouts, which have no dtypes in their index, the\n"
        "shard headers.",
    )
    p.add_argument("path", metavar="CHECKPOINT", help=f"{CHECKPOINT_HELP}, or its URL")


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..io.reader import open_checkpoint
    from ..values.dtypes import nbytes as dtype_nbytes
    from ..values.slices import parse_slice_spec
    from .profiling import human_size, plural

    with open_checkpoint(args.path) as reader:
        index = reader.index
        total = sum(s.bytes for s in index.shards)
        if reader.format == "shardkit":
            print(f"{args.path}: format {index.version}, {plural(len(reader), 'tensor')}, "
                  f"{plural(len(index.shards), 'shard')}, {human_size(total)}")
            print(f"callback: {index.callback}")
            print(f"generation: {index.generation or 'none (format 2.0)'}")
        else:
            print(f"{args.path}: {reader.layout.description}, {plural(len(reader), 'tensor')}, "
                  f"{plural(len(index.shards), 'shard')}, {human_size(total)}")
            kinds = sorted(set(index.slice_checksum_kind or ())) if reader.layout.checksums else []
            print(f"checksums: {', '.join(kinds)}" if kinds
                  else "checksums: none stored (the format has none)")
        if index.user_metadata:
            print(f"metadata: {index.user_metadata}")
        print("\nshards:")
        shard_rows = [
            (f"[{i}]", shard.file, f"task {shard.task}", shard.codec, human_size(shard.bytes))
            for i, shard in enumerate(index.shards)
        ]
        _print_table(INSPECT_SHARD_COLUMNS, shard_rows)
        print("\ntensors:")
        rows = []
        aliases = index.aliases or {}
        for key in reader.keys():
            if key in aliases:  # listed below, with the tensor it names
                continue
            info = reader.info(key)
            for s in info.slices:
                nbytes = info.nbytes  # a whole tensor's, or a string tensor's block
                if s.shard < 0:  # a string tensor: in the string file, not in a shard
                    where = s.file
                else:
                    where = f"[{s.shard}] {s.entry}" if s.entry != key else f"[{s.shard}]"
                    if s.spec:  # this slice's own bytes
                        lengths = parse_slice_spec(s.spec, info.shape).lengths
                        nbytes = dtype_nbytes(info.dtype_name, lengths)
                rows.append((key, info.dtype_name, str(list(info.shape)), s.spec or "(whole)",
                             human_size(nbytes), where))
                key = ""  # further slices of the same tensor: key shown once
        _print_table(INSPECT_TENSOR_COLUMNS, rows)
        if aliases:
            print("\naliases (tied weights: other names of a stored tensor, not stored again):")
            _print_table(INSPECT_ALIAS_COLUMNS, list(aliases.items()))
    return 0


INSPECT_SHARD_COLUMNS = ("#", "file", "task", "codec", "size")
INSPECT_TENSOR_COLUMNS = ("key", "dtype", "shape", "slice", "size", "shard / entry")
INSPECT_ALIAS_COLUMNS = ("key", "alias of")


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns, two spaces apart, under a header line; the last column unpadded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(row, widths)]
        print("  " + "  ".join([*cells, row[-1]]))


# ----------------------------------------------------------------------------- verify


def _add_verify_parser(sub: Any) -> None:
    p = _command(
        sub, "verify", cmd_verify,
        "check every shard header and checksum; exit 0 if intact, 1 naming what is corrupt",
        "Read every shard of a checkpoint, check its header against the manifest and the\n"
        "xxh3-64 checksum of every stored entry. Exit 0 if all is intact; otherwise name\n"
        "each corrupt tensor on stderr and exit 1.",
    )
    p.add_argument("path", metavar="CHECKPOINT", help=f"{CHECKPOINT_HELP}, or its URL")


def cmd_verify(args: argparse.Namespace) -> int:
    """Every problem on its own line on stderr, ``CORRUPT: <file>: <key or ->: <what>, expected
    <x> vs found <y>`` (``UNSUPPORTED:`` for a format this shardkit does not read), each once,
    then a count; exit 1 if there is any, else 0."""
    from ..errors import CorruptIndexError, UnsupportedVersionError
    from ..format import MANIFEST_FILE, find_manifest
    from ..io.reader import Problem, open_checkpoint

    try:
        reader = open_checkpoint(args.path)
    except (CorruptIndexError, UnsupportedVersionError) as e:
        manifest = find_manifest(args.path) or MANIFEST_FILE
        index_path = os.path.join(args.path, manifest)
        message = " ".join(str(e).split())
        named, sep, rest = message.partition(": ")
        if sep and named.startswith(os.path.join(args.path, "")):  # the manifest found
            index_path, message = named, rest
        name = os.path.basename(index_path)
        expected = ("a format this shardkit reads" if isinstance(e, UnsupportedVersionError)
                    else "a valid index")
        problems = [Problem(index_path, None, name, expected, message, type(e))]
        checked, tensors = "", 0
    else:
        with reader:
            report = reader.verify_report()
        problems, tensors = report.problems, len(reader)
        checked = report.summary
    if problems:
        for p in problems:
            print(f"{p.label}: {p}", file=sys.stderr)
        print(f"{args.path}: {len(problems)} problem(s) found", file=sys.stderr)
        return 1
    print(f"{args.path}: OK ({checked}, {tensors} tensors)")
    return 0


# ---------------------------------------------------------------------------- convert


def _add_convert_parser(sub: Any) -> None:
    p = _command(
        sub, "convert", cmd_convert,
        "convert between shardkit and TensorFlow (TensorBundle) checkpoints",
        "Read the checkpoint SRC (anything the reader opens) and write it as DST: a\n"
        "TensorFlow checkpoint (DST is a prefix: DST.index + DST.data-*) or a shardkit\n"
        "checkpoint directory. --to defaults to shardkit for a TensorFlow, PyTorch DCP or\n"
        "torch.save SRC, else tensorflow. Every checksum SRC stores is checked first (as\n"
        "`shardkit verify` does): a corrupt SRC is an error naming the file and the entry,\n"
        "and DST is not written (--no-verify skips the check). Tensors are memory-mapped\n"
        "and written one by one from the maps, so memory stays bounded by the page cache,\n"
        "not by the checkpoint's size. Sliced tensors are written whole.",
    )
    p.add_argument("src", metavar="SRC", help=f"checkpoint to read: {CHECKPOINT_HELP}, or its URL")
    p.add_argument("dst", metavar="DST", help="checkpoint to write (a prefix for tensorflow)")
    p.add_argument("--to", choices=("tensorflow", "shardkit"), default=None,
                   help="format of DST (default: the other one)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check SRC's checksums before writing DST")


def cmd_convert(args: argparse.Namespace) -> int:
    from ..io.reader import load, open_checkpoint
    from ..io.save import save
    from .profiling import human_size

    with open_checkpoint(args.src) as reader:
        to = args.to or ("shardkit" if reader.format in TO_SHARDKIT else "tensorflow")
        count = len(reader)
        unchecked = reader.format != "shardkit" and not reader.layout.checksums
        metadata = reader.metadata
    # views of the source's maps, read as they are written; checked first, so that nothing
    # corrupt is written out under fresh checksums
    state = load(args.src, verify=args.verify)
    if to == "tensorflow":
        state = _with_object_graph(state, metadata)
    info = save(args.dst, state, format=to, overwrite=args.overwrite)
    note = ""
    if not args.verify:
        note = " (not verified)"
    elif unchecked:
        note = " (no checksums stored in the source: its structure was checked only)"
    print(f"{args.src} -> {info.path} ({to}): {count} tensors, {human_size(info.bytes)}{note}")
    return 0


def _with_object_graph(state: dict[str, Any], metadata: Any) -> dict[str, Any]:
    """`state` as TensorFlow restores it: a shardkit `Checkpoint`'s save counter under
    ``tf.train.Checkpoint``'s key, and, when it has none, the ``_CHECKPOINTABLE_OBJECT_GRAPH``
    rebuilt from its object keys (``adapters.tensorbundle.object_graph``)."""
    import numpy as np

    from ..adapters.tensorbundle.object_graph import object_graph
    from ..sharding.tensors import OBJECT_GRAPH_KEY
    from ..training.checkpoint import METADATA_KEY, SAVE_COUNTER, TF_SAVE_COUNTER

    if OBJECT_GRAPH_KEY in state:
        return state
    if isinstance(metadata, dict) and METADATA_KEY in metadata and SAVE_COUNTER in state \
            and TF_SAVE_COUNTER not in state:
        state = {(TF_SAVE_COUNTER if k == SAVE_COUNTER else k): v for k, v in state.items()}
    graph = object_graph(state)
    if graph is None:
        return state
    value = np.empty((), object)
    value[()] = graph
    return {**state, OBJECT_GRAPH_KEY: value}


# ------------------------------------------------------------------------------------ gc


def _add_gc_parser(sub: Any) -> None:
    p = _command(
        sub, "gc", cmd_gc, "remove objects of crashed or superseded saves from a checkpoint URL",
        "Delete the shard objects at a checkpoint URL that its manifest does not name\n"
        "(left by a save that crashed, or by one that lost a race), once they are at least\n"
        "--older-than seconds old, so that a save still uploading keeps its objects.\n"
        "Only objects a shardkit staging marker names are deleted (and only their\n"
        "unfinished multipart uploads aborted): other objects under the prefix stay.",
    )
    p.add_argument("url", metavar="URL", help="checkpoint URL (s3://bucket/prefix, ...)")
    p.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                   help="only objects at least this old (default: 3600)")


def cmd_gc(args: argparse.Namespace) -> int:
    from ..errors import InvalidArgumentError
    from ..storage import is_url, open_storage
    from ..storage.housekeeping import gc

    if not is_url(args.url):
        raise InvalidArgumentError(f"{args.url}: gc works on checkpoint URLs (local saves "
                                   "clean up after themselves)")
    removed = gc(open_storage(args.url), older_than=args.older_than)
    for name in removed:
        print(f"removed {name}")
    print(f"{args.url}: {len(removed)} object(s) removed")
    return 0


_SUBCOMMANDS: list[Callable[[Any], None]] = [
    _add_demo_parser,
    _add_plan_parser,
    _add_inspect_parser,
    _add_verify_parser,
    _add_convert_parser,
    _add_gc_parser,
]


if __name__ == "__main__":
    sys.exit(main())
