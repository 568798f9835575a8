import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.sharding.tensors import flatten
from shardkit.tools.cli import auto_max_shard_size, main
from shardkit.tools.models import synthetic_state

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_POLICIES = ["default", "by-task", "max-shard-size", "all-in-one", "bin-pack", "balanced"]


def _rows(out: str) -> dict[str, list[str]]:
    """Table rows by policy name (the lines between the dashed rule and the blank line)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
    end = lines.index("", start)
    return {line.split()[0]: line.split()[1:] for line in lines[start:end]}


def _bytes(value: str, unit: str) -> float:
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _run(*args: str) -> subprocess.CompletedProcess:
    """``python -m shardkit ...`` in a child process that imports this very shardkit."""
    env = {**os.environ, "PYTHONPATH": str(Path(shardkit.__file__).parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_plan_model_with_chosen_policies(capsys):
    code = main(
        [
            "plan",
            "--model",
            "llm-tiny",
            "--policy",
            "all-in-one",
            "--policy",
            "max-shard-size:1MiB",
            "--policy",
            "balanced:3",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    assert out.splitlines()[0] == "model llm-tiny (float32): 21 tensors, 3.4 MiB"
    rows = _rows(out)
    assert list(rows) == ["all-in-one", "max-shard-size:1MiB", "balanced:3"]
    # shards, min, median, max (value + unit each), imbalance, split, total
    assert rows["all-in-one"][:10] == [
        "1",
        "3.4",
        "MiB",
        "3.4",
        "MiB",
        "3.4",
        "MiB",
        "1.00",
        "0",
        "3.4",
    ]
    size = rows["max-shard-size:1MiB"]
    assert int(size[0]) >= 4  # 3.4 MiB in shards of at most 1 MiB
    assert 0 < _bytes(*size[5:7]) <= 2**20  # the largest shard
    assert size[9:11] == ["3.4", "MiB"]  # total
    assert rows["balanced:3"][0] == "3"
    assert rows["balanced:3"][9:11] == ["3.4", "MiB"]


def test_plan_defaults_to_every_policy(capsys):
    assert main(["plan", "--model", "llm-tiny"]) == 0
    out = capsys.readouterr().out
    assert set(_rows(out)) == set(ALL_POLICIES)
    auto = auto_max_shard_size(sum(a.nbytes for _, a in flatten(synthetic_state("llm-tiny"))))
    assert auto == 256 * 2**10  # 3.4 MiB / 8 rounded down to a power of two
    assert "defaults: max shard size 256.0 KiB (auto), 8 shards" in out
    assert _rows(out)["balanced"][0] == "8"


def test_plan_size_and_count_options_feed_policies_without_arguments(capsys):
    code = main(
        [
            "plan",
            "--model",
            "llm-tiny",
            "--max-shard-size",
            "2MiB",
            "--num-shards",
            "2",
            "--policy",
            "bin-pack",
            "--policy",
            "balanced",
            "--policy",
            "balanced:5",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "defaults: max shard size 2.0 MiB, 2 shards" in out
    rows = _rows(out)
    assert rows["bin-pack"][0] == "2"  # 3.4 MiB into bins of 2 MiB
    assert rows["balanced"][0] == "2"
    assert rows["balanced:5"][0] == "5"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "nope"], "unknown policy 'nope' in 'nope'; known: default, by-task"),
        (["--policy", "by-task:3"], "policy 'by-task' takes no argument, got 'by-task:3'"),
        (
            ["--policy", "balanced:x"],
            "policy argument num_shards in 'balanced:x' must be an integer, got 'x'",
        ),
        (["--policy", "balanced:"], "empty argument in 'balanced:'"),
        (["--policy", "max-shard-size:lots"], "max_shard_size 'lots' is not a size"),
        (["--max-shard-size", "-3"], "--max-shard-size '-3' is not a size"),
        (["--max-shard-size", "junk"], "--max-shard-size 'junk' is not a size"),
        (["--policy", "balanced:0"], "num_shards must be >= 1, got 0"),
        (["--dtype", "complex256"], "complex256 cannot be stored"),
    ],
)
def test_plan_bad_arguments_exit_1_with_one_line(capsys, argv, message):
    code = main(["plan", "--model", "llm-tiny", *argv])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    assert err.startswith("shardkit: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_plan_unknown_model(capsys):
    assert main(["plan", "--model", "llm-9b"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "shardkit: error: unknown model 'llm-9b'; built-in models: "
        "llm-1b, llm-small, llm-tiny, many-small, mixed\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan"], "one of the arguments FILE --model is required"),
        (["plan", "x.npz", "--model", "llm-tiny"], "not allowed with argument"),
        (["plan", "x.npz", "--dtype", "float16"], "--dtype applies to built-in models"),
        (["plan", "--model", "llm-tiny", "--num-shards", "many"], "invalid int value"),
        ([], "the following arguments are required: command"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: shardkit" in err
    assert message in err


def test_help_exits_0(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "llm-1b" in out and "many-small" in out  # the model list
    assert "max-shard-size:256MiB" in out


def _tiny_flat():
    return {k: a for k, a in flatten(synthetic_state("llm-tiny", materialize=True))}


def test_plan_npz_file(tmp_path, capsys):
    path = tmp_path / "tiny.npz"
    np.savez(path, **_tiny_flat())
    assert main(["plan", str(path), "--policy", "all-in-one", "--policy", "by-task"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{path}: 21 tensors, 3.4 MiB"
    assert _rows(out)["all-in-one"][:2] == ["1", "3.4"]


def test_plan_safetensors_file(tmp_path, capsys):
    from safetensors.numpy import save_file

    path = tmp_path / "tiny.safetensors"
    save_file(_tiny_flat(), str(path))
    assert main(["plan", str(path), "--policy", "balanced:2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{path}: 21 tensors, 3.4 MiB"
    assert _rows(out)["balanced:2"][0] == "2"


def test_plan_missing_and_corrupt_files(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "absent.npz")]) == 1
    assert "shardkit: error: no such file:" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    assert main(["plan", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardkit: error: ") and "not a readable safetensors file" in err
    assert err.count("\n") == 1


def test_plan_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (the [plot] extra) is not installed")
    png = tmp_path / "sizes.png"
    assert main(["plan", "--model", "llm-tiny", "--plot", str(png)]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_python_dash_m_shardkit_plan():
    proc = _run("plan", "--model", "llm-tiny", "--policy", "all-in-one")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("model llm-tiny (float32): 21 tensors, 3.4 MiB\n")
    assert "all-in-one" in proc.stdout


def test_python_dash_m_shardkit_error_has_no_traceback():
    proc = _run("plan", "--model", "llm-tiny", "--policy", "nope")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("shardkit: error: unknown policy 'nope'")
    assert "Traceback" not in proc.stderr


def test_plan_llm_1b_uses_little_memory():
    # The 4.1 GiB model is planned with all policies without touching its memory.
    # VmHWM, not getrusage: ru_maxrss survives exec, so a child of a big pytest process would
    # report the parent's peak.
    code = (
        "import re, sys\n"
        "from shardkit.tools.cli import main\n"
        "rc = main(['plan', '--model', 'llm-1b'])\n"
        "status = open('/proc/self/status').read()\n"
        "print('peak-rss-kib', re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(shardkit.__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "model llm-1b (float32): 201 tensors, 4.1 GiB" in proc.stdout
    assert set(_rows(proc.stdout)) == set(ALL_POLICIES)
    peak_kib = int(proc.stdout.rsplit("peak-rss-kib", 1)[1])
    assert peak_kib < 512 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"


def test_multi_line_errors_are_printed_on_one_line(capsys, monkeypatch):
    from shardkit.errors import ShardingValidationError
    from shardkit.tools import profiling

    def broken(tensors, policies):
        raise ShardingValidationError("rule 'x' broken.\n  callback: c\n  key: 'k'")

    monkeypatch.setattr(profiling, "profile", broken)  # the command imports it when it runs
    assert main(["plan", "--model", "llm-tiny", "--policy", "by-task"]) == 1
    err = capsys.readouterr().err
    assert err == "shardkit: error: rule 'x' broken. callback: c key: 'k'\n"


def test_python_dash_m_shardkit_without_command_is_a_usage_error():
    proc = _run()
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "usage: shardkit [-h] [--version] {demo,plan,inspect,verify,convert,gc}")
    assert "the following arguments are required: command" in proc.stderr


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"shardkit {shardkit.__version__}\n"


@pytest.mark.parametrize("command", ["demo", "plan", "inspect", "verify", "convert", "gc"])
def test_every_subcommand_help_has_a_description(capsys, command):
    from shardkit.tools.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"demo", "plan", "inspect", "verify", "convert", "gc"}
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    description = sub.choices[command].description
    assert description and len(description) > 40
    assert description.splitlines()[0] in out


def test_unknown_dtype_lists_the_valid_ones(capsys):
    assert main(["plan", "--model", "llm-tiny", "--dtype", "float33"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardkit: error: unknown dtype 'float33'; valid dtypes: ")
    for name in ("float32", "bfloat16", "float8_e4m3fn", "int8", "uint64", "bool"):
        assert name in err
    assert err.count("\n") == 1


def test_default_policy_is_listed_first_in_plan(capsys):
    assert main(["plan", "--model", "llm-small"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert next(iter(rows)) == "default"
    assert rows["default"][0] == "2"  # 300 MiB: one shard per writer thread (2 on 2 cores)
    assert "default: shardkit default: near-equal shards" in out
    assert main(["plan", "--model", "llm-tiny", "--policy", "default:3"]) == 1
    assert "policy 'default' takes no argument" in capsys.readouterr().err


def test_plot_shares_y_scale_integer_ticks_limit_line_and_title(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the [plot] extra) is not installed")
    from shardkit.tools.cli import make_policy
    from shardkit.tools.profiling import plot_shard_sizes, profile

    state = synthetic_state("llm-small")
    defaults = {"max_shard_size": 32 * 2**20, "num_shards": 8}
    names = ["default", "all-in-one", "bin-pack", "balanced:3"]
    profiles = profile(state, {n: make_policy(n, defaults) for n in names})
    png = tmp_path / "sizes.png"
    fig = plot_shard_sizes(profiles, png, title="shard sizes of model llm-small (float32)")
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    axes = fig.axes
    assert len(axes) == 4
    assert fig.get_suptitle() == "shard sizes of model llm-small (float32)"
    ylims = {ax.get_ylim() for ax in axes}
    assert len(ylims) == 1  # one y-scale
    (bottom, top), = ylims
    assert bottom == 0 and top >= 300  # the 300 MiB all-in-one shard fits every panel
    for ax, p in zip(axes, profiles):
        ticks = ax.get_xticks()
        assert len(ticks) >= 1
        assert all(float(t).is_integer() for t in ticks), (p.name, ticks)
        assert [round(b.get_height(), 3) for b in ax.patches] == [
            round(b / 2**20, 3) for b in p.shard_bytes
        ]
        horizontal = [ln for ln in ax.get_lines() if len(set(ln.get_ydata())) == 1]
        if p.name == "bin-pack":  # its 32 MiB limit is drawn
            assert [ln.get_ydata()[0] for ln in horizontal] == [32.0]
        else:  # no limit (all-in-one, balanced), or far off scale (default: 5 GB)
            assert horizontal == []
    assert "limit 4.7 GiB (off scale)" in axes[0].get_title()
    assert axes[1].get_title().startswith("all-in-one: 1 shard,")


def test_plan_plot_names_the_model(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib (the [plot] extra) is not installed")
    from shardkit.tools import profiling

    seen = {}
    real = profiling.plot_shard_sizes

    def spy(profiles, path, **kwargs):
        seen["fig"] = real(profiles, path, **kwargs)
        return seen["fig"]

    monkeypatch.setattr(profiling, "plot_shard_sizes", spy)
    assert main(["plan", "--model", "llm-tiny", "--plot", str(tmp_path / "p.png")]) == 0
    assert seen["fig"].get_suptitle() == "shard sizes of model llm-tiny (float32)"
