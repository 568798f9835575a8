"""`shardkit demo`, `inspect`, `verify` and `convert`."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shardkit.errors import SplitTensorsWarning
from shardkit.format import MANIFEST_FILE
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import load
from shardkit.io.save import save
from shardkit.sharding.policies import MaxShardSizePolicy
from shardkit.tools.cli import main


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    state = {"a": np.arange(100, dtype=np.float32).reshape(10, 10), "b": {"c": np.ones(3)}}
    with pytest.warns(SplitTensorsWarning, match=r"stored 2 tensors as slices \(e\.g\. 'a'\)"):
        save(path, state, metadata={"step": 3},
             options=CheckpointOptions(experimental_sharding_callback=MaxShardSizePolicy(200)))
    return path


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--model", "llm-tiny", "--dir", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model 'llm-tiny' (float32), 21 tensors" in out
    for row in ("max-shard-size", "bin-pack", "balanced", "all-in-one", "save (default policy",
                "verify (xxh3-64", "load (memory-mapped", "save zstd", "load zstd",
                "zstd compression ratio", "Round trip byte-exact (raw and zstd): yes"):
        assert row in out
    assert list(tmp_path.iterdir()) == []  # the temporary checkpoint is gone


def test_demo_says_what_it_builds_before_it_imports_the_save_flow(tmp_path):
    """The first line comes at once: before the save flow, the reader or tqdm are imported and
    before the model is built (a fresh interpreter; the line is flushed)."""
    code = textwrap.dedent("""
        import io, sys
        from shardkit.tools.cli import main
        class First(io.StringIO):
            seen = None
            def write(self, s):
                if First.seen is None:
                    First.seen = sorted(m for m in ("shardkit.io.save", "shardkit.io.reader",
                                                    "shardkit.io.writer", "tqdm", "orjson")
                                        if m in sys.modules)
                    print("FIRST", First.seen, repr(s), file=sys.__stderr__)
                return super().write(s)
        sys.stdout = First()
        code = main(["demo", "--model", "llm-tiny", "--dir", sys.argv[1]])
        print("EXIT", code, file=sys.__stderr__)
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    lines = [line for line in out.stderr.splitlines() if line.startswith(("FIRST", "EXIT"))]
    assert lines[0] == ("FIRST [] \"shardkit demo: model 'llm-tiny' (float32), 21 tensors, "
                        "3.4 MiB: building it\"")
    assert lines[-1] == "EXIT 0", out.stderr
    assert out.stderr.index("building: 100%") > out.stderr.index("FIRST")  # its progress bar


def test_demo_bfloat16(tmp_path, capsys):
    args = ["demo", "--model", "llm-tiny", "--dtype", "bfloat16", "--dir", str(tmp_path)]
    assert main([*args, "--no-progress"]) == 0
    assert "Round trip byte-exact (raw and zstd): yes" in capsys.readouterr().out


def test_inspect_lists_shards_and_slices(checkpoint, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "2 tensors, 3 shards" in out
    assert "metadata: {'step': 3}" in out
    generation = json.loads((checkpoint / MANIFEST_FILE).read_text())["shardkit"]["generation"]
    assert f"generation: {generation}\n" in out
    assert "model-00001-of-00003.safetensors  task 0  raw" in out
    assert "10 10 0,5:0,10" in out and "10 10 5,5:0,10" in out
    assert "F64" in out and "[10, 10]" in out


def test_verify_ok_and_corrupt(checkpoint, capsys):
    assert main(["verify", str(checkpoint)]) == 0
    assert "OK (3 entries checked, 2 tensors)" in capsys.readouterr().out
    shard = checkpoint / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(checkpoint)]) == 1
    err = capsys.readouterr().err
    assert "CORRUPT:" in err and "model-00002-of-00003.safetensors" in err
    assert "model-00002-of-00003.safetensors: 'a': checksum of slice '10 10 " in err
    assert "1 problem(s) found" in err


def test_verify_missing_checkpoint(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 1
    assert "no checkpoint at" in capsys.readouterr().err


def test_inspect_has_column_headers(checkpoint, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    lines = capsys.readouterr().out.splitlines()
    shards = lines.index("shards:")
    assert lines[shards + 1].split() == ["#", "file", "task", "codec", "size"]
    assert lines[shards + 2].lstrip().split()[:2] == ["[0]", "model-00001-of-00003.safetensors"]
    tensors = lines.index("tensors:")
    assert lines[tensors + 1].split() == ["key", "dtype", "shape", "slice", "size", "shard", "/",
                                          "entry"]
    header = lines[tensors + 1]
    first = lines[tensors + 2]
    assert first.split()[0] == "a"
    # Columns line up under their headers.
    assert first.index("F32") == header.index("dtype")
    assert first.index("[10, 10]") == header.index("shape")


def test_inspect_names_the_string_file_for_string_tensors(tmp_path, capsys):
    path = tmp_path / "s"
    save(path, {"a": np.arange(4.0), "s": np.array([b"ab", b"cde"], dtype=object)})
    assert main(["inspect", str(path)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith(("a ", "s "))}
    assert rows["s"][1:4] == ["STRING", "[2]", "(whole)"] and rows["s"][-1] == "strings.skstr"
    assert rows["a"][-1] == "[0]"


def _inspect_into(checkpoint, consumer):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import shardkit

    env = {**os.environ, "PYTHONPATH": str(Path(shardkit.__file__).parents[1])}
    cmd = f"{sys.executable} -m shardkit inspect {checkpoint} | {consumer}"
    return subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("consumer", ["head -c 10", "head -1"])
def test_inspect_into_a_closed_pipe_is_quiet(tmp_path, consumer):
    path = tmp_path / "many"
    # Enough rows that the output outgrows the pipe's buffer: the writes hit the closed pipe.
    save(path, {f"t{i:05d}": np.zeros(1, np.float32) for i in range(20_000)})
    proc = _inspect_into(path, consumer)
    assert proc.stderr == b""
    assert proc.returncode == 141  # the pipeline's status: shardkit's, as if ended by SIGPIPE
    assert proc.stdout.startswith(str(path).encode()[:10])


def test_inspect_into_an_open_pipe_exits_0(checkpoint):
    proc = _inspect_into(checkpoint, "cat")
    assert proc.returncode == 0 and proc.stderr == b""
    assert b"tensors:" in proc.stdout


def test_demo_lists_the_default_policy(tmp_path, capsys):
    assert main(["demo", "--model", "llm-tiny", "--dir", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\ndefault (save's) " in out
    assert "default (save's): shardkit default: near-equal shards" in out


def test_demo_shows_progress_on_stderr(tmp_path, capsys):
    assert main(["demo", "--model", "llm-tiny", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    for phase in ("building", "saving", "verifying", "restoring", "restoring zstd"):
        assert f"{phase}: 100%" in captured.err, phase
    # bars counted by their first drawing (0%): tqdm may draw 100% twice for one bar (on a
    # busy machine the last update comes after its refresh interval, then close() draws again)
    bars = captured.err.split("saving:   0%")[1:]
    assert len(bars) == 2 and all("saving: 100%" in bar for bar in bars)  # raw and zstd
    assert "100%" not in captured.out


def test_demo_holds_no_second_copy_of_the_state(tmp_path, monkeypatch):
    import io
    import tracemalloc

    from shardkit.tools import demo
    from shardkit.tools.models import state_nbytes

    monkeypatch.setattr(demo, "_GROUP_BYTES", 16 * 2**20)  # at least 16 MiB per group
    total = state_nbytes("llm-small")
    tracemalloc.start()
    try:
        demo.run_demo(io.StringIO(), model="llm-small", directory=str(tmp_path), progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The state itself, plus a group's decompressed zstd tensors and buffers: not a copy.
    assert peak < 1.5 * total, f"traced peak {peak / 2**20:.0f} MiB, state {total / 2**20:.0f} MiB"


def test_demo_unknown_dtype(tmp_path, capsys):
    assert main(["demo", "--model", "llm-tiny", "--dtype", "nope", "--dir", str(tmp_path)]) == 1
    assert "unknown dtype 'nope'; valid dtypes: float64, float32" in capsys.readouterr().err


# --- convert verifies what it reads ------------------------------------------------------------


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _corrupt_shardkit(path, codec):
    """A shardkit checkpoint whose tensor 'w' has one byte flipped in its shard's data region
    (a raw shard's entry, or an .skz shard's last frame); returns (path, the shard file)."""
    state = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(7, np.int16)}
    save(path, state, options=CheckpointOptions(compression=None if codec == "raw" else "zstd"))
    shard = next(p for p in path.iterdir() if p.name.startswith("model-"))
    data_start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")  # 'w' comes first
    _flip(shard, data_start + 100 if codec == "raw" else -40)
    return path, shard.name


def _corrupt_bundle(prefix):
    save(prefix, {"w": np.arange(4096, dtype=np.float32), "b": np.ones(7, np.int16)},
         format="tensorflow")
    data = prefix.parent / f"{prefix.name}.data-00000-of-00001"
    _flip(data, 100)  # inside 'w', the first entry (largest item size first)
    return prefix, data.name


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_convert_refuses_a_corrupt_shardkit_source(tmp_path, capsys, codec):
    src, shard = _corrupt_shardkit(tmp_path / "src", codec)
    assert main(["verify", str(src)]) == 1
    capsys.readouterr()
    dst = tmp_path / "out" / "ck"
    assert main(["convert", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert shard in err and ("'w'" if codec == "raw" else "frame") in err, err
    assert not dst.parent.exists() or os.listdir(dst.parent) == []
    # --no-verify is the explicit opt-out: raw bytes are converted as they are (a corrupt zstd
    # frame does not decode at all, so that still fails, and writes nothing either).
    if codec == "zstd":
        assert main(["convert", str(src), str(dst), "--no-verify"]) == 1
        assert not dst.parent.exists() or os.listdir(dst.parent) == []
        return
    assert main(["convert", str(src), str(dst), "--no-verify"]) == 0
    assert "(not verified)" in capsys.readouterr().out
    assert main(["verify", str(dst)]) == 0  # the fresh checksums are of the corrupt bytes


def test_convert_refuses_a_corrupt_tensorflow_source(tmp_path, capsys):
    src, data = _corrupt_bundle(tmp_path / "tf" / "ck")
    assert main(["verify", str(src)]) == 1
    capsys.readouterr()
    dst = tmp_path / "sk"
    assert main(["convert", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert data in err and "'w'" in err and "crc32c" in err, err
    assert not dst.exists() and os.listdir(tmp_path) == ["tf"]
    assert main(["convert", str(src), str(dst), "--no-verify"]) == 0
    assert main(["verify", str(dst)]) == 0


def test_convert_of_a_corrupt_source_keeps_the_earlier_destination(tmp_path, capsys):
    good = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(7, np.int16)}
    save(tmp_path / "good", good)
    dst = tmp_path / "out" / "ck"
    assert main(["convert", str(tmp_path / "good"), str(dst)]) == 0
    before = {p.name: p.read_bytes() for p in dst.parent.iterdir()}
    src, _ = _corrupt_shardkit(tmp_path / "src", "raw")
    assert main(["convert", str(src), str(dst), "--overwrite"]) == 1
    assert {p.name: p.read_bytes() for p in dst.parent.iterdir()} == before
    got = load(dst, verify=True)
    assert all(got[k].tobytes() == v.tobytes() for k, v in good.items())


def test_convert_of_an_intact_source_checks_it(tmp_path, capsys):
    src = tmp_path / "src"
    save(src, {"w": np.arange(10.0)})
    assert main(["convert", str(src), str(tmp_path / "ck")]) == 0
    assert "1 tensors" in capsys.readouterr().out
    # A HuggingFace source stores no checksums: its structure is checked, and the output says so.
    import safetensors.numpy

    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.numpy.save_file({"w": np.arange(10.0)}, str(hf / "model.safetensors"))
    assert main(["convert", str(hf), str(tmp_path / "fromhf"), "--to", "shardkit"]) == 0
    assert "no checksums stored" in capsys.readouterr().out
    assert load(tmp_path / "fromhf", verify=True)["w"].tobytes() == np.arange(10.0).tobytes()


def test_inspect_shows_each_slices_own_size_and_counts_in_the_singular(tmp_path, capsys):
    """A 4 KiB tensor in 4 slices: four rows of 1.0 KiB, not four of the whole 4.0 KiB."""
    path = tmp_path / "c"
    with pytest.warns(SplitTensorsWarning):
        save(path, {"w": np.zeros((8, 128), np.float32)},
             options=CheckpointOptions(experimental_sharding_callback=MaxShardSizePolicy(1024)))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "8 128 " in line]
    assert len(rows) == 4 and all(" 1.0 KiB " in r and "4.0 KiB" not in r for r in rows), rows
    assert f"{path}: format 2.2, 1 tensor, 4 shards, " in out
    save(tmp_path / "one", {"w": np.zeros(4)})
    assert main(["inspect", str(tmp_path / "one")]) == 0
    assert "1 tensor, 1 shard, " in capsys.readouterr().out


def test_cli_errors_name_the_flag_not_the_keyword(tmp_path, capsys):
    save(tmp_path / "src", {"w": np.ones(3)})
    args = ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "shardkit"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err == (f"shardkit: error: {tmp_path / 'dst'} already exists; pass --overwrite to "
                   "replace the checkpoint there\n")
    assert main([*args, "--overwrite"]) == 0


@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "plan"])
def test_help_says_files_are_accepted(command, capsys):
    with pytest.raises(SystemExit):
        from shardkit.tools.cli import build_parser

        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "checkpoint directory or file (shardkit's, HuggingFace's, a .safetensors file, a " \
        "PyTorch DCP directory, a torch.save .pt file, a TensorFlow checkpoint's prefix or " \
        ".index file)" in text


def test_inspect_shows_which_key_is_an_alias_of_which(tmp_path, capsys):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "tied"
    save(path, {"emb": w, "bias": np.ones(3), "head": w, "nested": {"again": w}})
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    tensors, aliases = lines.index("tensors:"), next(
        i for i, line in enumerate(lines) if line.startswith("aliases"))
    assert "tied weights" in lines[aliases]
    stored = [line.split()[0] for line in lines[tensors + 2 : aliases] if line.strip()]
    assert stored == ["emb", "bias"]  # the aliases are not listed as tensors of their own
    assert lines[aliases + 1].split() == ["key", "alias", "of"]
    assert [line.split() for line in lines[aliases + 2 :]] == [["head", "emb"],
                                                             ["nested/again", "emb"]]
    header, row = lines[aliases + 1], lines[aliases + 3]
    assert row.index("emb") == header.index("alias of")  # the columns line up


def test_inspect_without_aliases_has_no_alias_table(checkpoint, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("aliases")]
