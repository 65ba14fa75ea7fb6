"""One spelling per concept across the commands (#25 item 9), and docs that say what the code does
(item 10): --version, --debug in the help, Unix placeholders instead of Python types, one dtype
vocabulary, one --threads, and the documented recipes, formats, outputs and conversions."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from lowbit.cli.main import COMMAND_MODULES

ROOT = Path(__file__).resolve().parents[2]


def _flat(help_text: str) -> str:
    """The help as one line of words: rich's boxes gone, wrapped cells joined."""
    return " ".join(re.sub(r"[│╭╮╰╯─┃━]", " ", help_text).split())


def test_version_and_debug_are_in_the_top_level_help(run_cli):
    code, out, _ = run_cli(["--version"])
    assert code == 0 and re.fullmatch(r"lowbit \d+\.\d+\.\d+\S*\n", out)
    code, out, _ = run_cli(["--help"])
    assert code == 0 and "--version" in out and "--debug" in out and "LOWBIT_DEBUG" in out


def test_the_command_list_gives_each_command_its_first_sentence(run_cli):
    """`lowbit --help` lists a command by its docstring's first sentence, on one line of words: typer
    had listed the whole first paragraph with the docstring's own line breaks."""
    from lowbit.cli import main

    main._register_commands()
    code, out, _ = run_cli(["--help"])
    listing = _flat(out)
    assert code == 0
    for info in main.app.registered_commands:
        assert info.short_help and info.short_help.endswith(".") and "\n" not in info.short_help
        assert info.short_help in listing, info.name
    assert "Train a student on TEACHER's outputs." in listing
    assert "With a quantized --student" not in listing  # the rest of distill's paragraph: its own --help


@pytest.mark.parametrize("command", COMMAND_MODULES)
def test_help_shows_placeholders_not_python_types(command, run_cli):
    code, out, _ = run_cli([command, "--help"])
    assert code == 0
    assert not re.search(r"<(bool|str|int|float|path|list\[\w+\])>", out), out  # was: --json <bool>
    assert not re.search(r"\{[a-z_]+\}", out.split("\n", 3)[1] if out.count("\n") > 1 else out), out  # was: {model}


def test_one_dtype_vocabulary(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model()
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh " * 64)
    for spelling in ("float32", "f32", "fp32"):  # eval took only f32, generate only float32
        code, out, err = run_cli(["eval", str(src), "--data", str(text), "--ctx", "32", "--chunks", "1",
                                  "--dtype", spelling, "--json"])
        assert code == 0 and json.loads(out)["dtype"] == "f32", err
    for spelling in ("f32", "float32", "bf16"):
        code, _, err = run_cli(["generate", str(src), "ab", "--max-tokens", "2", "--dtype", spelling])
        assert code == 0, err
    for command in (["eval", str(src), "--data", str(text)], ["generate", str(src), "ab"], ["bench", str(src), "--prefill-tokens", "16"],
                    ["convert", str(src), "-o", str(tmp_path / "x"), "--to", "hf"]):
        code, _, err = run_cli([*command, "--dtype", "float64"])
        assert code == 2 and "--dtype must be one of" in err and err.count("\n") == 1, (command, err)
    for command in ("generate", "bench", "eval"):
        _, out, _ = run_cli([command, "--help"])
        assert "[default: f32]" in _flat(out), command


@pytest.mark.parametrize("command", ["quantize", "calibrate", "eval", "generate", "bench"])
def test_threads_means_the_same_everywhere(command, tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model()
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh " * 64)
    args = {"quantize": ["--format", "int4", "-o", str(tmp_path / "q")], "calibrate": ["--data", str(text), "-o", str(tmp_path / "s")],
            "eval": ["--data", str(text)], "generate": ["ab"], "bench": ["--prefill-tokens", "16"]}[command]
    code, _, err = run_cli([command, str(src), *args, "--threads", "0"])  # calibrate took 0 as "default"
    assert code == 2 and "--threads must be >= 1, got 0" in err and err.count("\n") == 1, err
    _, out, _ = run_cli([command, "--help"])
    assert "CPU threads for torch (default: torch's, one per core)" in _flat(out)


# --- docs agree with the code -------------------------------------------------------------------

def _readme_table_rows() -> list[tuple[str, set[str]]]:
    rows = []
    for line in (ROOT / "README.md").read_text().splitlines():
        match = re.match(r"\| `lowbit (\w+)[^`]*` \|", line)
        if match:
            rows.append((match[1], set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line))))
    return rows


def test_readme_command_table_names_real_commands_and_options():
    from typer.main import get_command

    from lowbit.cli import main as cli_main

    cli_main._register_commands()
    group = get_command(cli_main.app)
    rows = _readme_table_rows()
    assert {name for name, _ in rows} == set(group.commands), "the table lists every command, once"
    for name, options in rows:
        known = {opt for param in group.commands[name].params for opt in param.opts}
        assert options <= known, f"README row `lowbit {name}` names {sorted(options - known)}"


def test_documented_recipes_exist_and_load():
    from lowbit.compress.recipe import load_recipe

    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    named = {m for page in pages for m in re.findall(r"(?:--recipe |load_recipe\(\")([\w./-]+\.(?:ya?ml|json))", page.read_text())}
    assert "bench/recipes/mixed.yaml" in named
    for path in named:
        assert (ROOT / path).is_file(), f"the docs use {path}, which is not shipped"
        assert load_recipe(ROOT / path).rules


def test_formats_the_docs_call_unknown_are_unknown_and_int5_works():
    from lowbit.errors import LowbitError
    from lowbit.quant.spec import parse_spec

    text = (ROOT / "docs" / "quantize.md").read_text()
    unknown = re.search(r"unknown format or option \(([^)]*)\)", " ".join(text.split()))[1]
    names = re.findall(r"`([\w-]+)`", unknown)
    assert names
    for name in names:
        with pytest.raises(LowbitError):
            parse_spec(name, None)
    assert parse_spec("int5", None).bits == 5  # docs/quantize.md called it unknown


def test_readme_outputs_are_ignored_by_git():
    script = (ROOT / "README.md").read_text().split("<!-- command-1 -->", 1)[1].split("```", 2)[1]
    outputs = re.findall(r"-o (\S+)", script)
    assert outputs
    for out in outputs:
        done = subprocess.run(["git", "check-ignore", "-q", f"{out}/model.safetensors"], cwd=ROOT)
        assert done.returncode == 0, f"README command 1 writes {out}/ into the repository, and .gitignore misses it"


def test_convert_page_examples_work_on_an_int4_g64_checkpoint(tiny_float_model, tmp_path, run_cli, monkeypatch):
    """docs/convert.md's first block, on what README command 1 makes (int4, group 64)."""
    src = tiny_float_model(hidden=128, intermediate=256)
    monkeypatch.chdir(tmp_path)
    assert run_cli(["quantize", str(src), "--format", "int4", "--group-size", "64", "-o", "smollm2-int4"])[0] == 0
    block = (ROOT / "docs" / "convert.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line, comments=True) for line in block.splitlines() if "./smollm2-int4 " in line]
    assert len(lines) >= 3
    for argv in lines:
        code, _, err = run_cli(argv[1:])
        assert code == 0, f"{shlex.join(argv)}: {err}"


@pytest.mark.demo
def test_speculative_page_states_the_measured_accepted_length(smollm2_dir, run_cli):
    page = (ROOT / "docs" / "speculative.md").read_text()
    from lowbit.native import build

    # the page's example is an AVX-512 CPU's (its AVX2 figure predates the current drafts)
    if "avx512f" not in build._cpu_flags().split():
        pytest.skip("docs/speculative.md states no current figure for a CPU without AVX-512")
    stated = re.search(r"--draft self:int4-g32\n.*\n.*mean accepted length ([\d.]+)", page)
    assert stated, "docs/speculative.md lost its self:int4-g32 figure"
    code, out, err = run_cli(["generate", "smollm2-135m", "The three primary colors are", "--max-tokens", "32",
                              "--threads", "1", "--draft", "self:int4-g32", "--json"])
    assert code == 0, err
    assert json.loads(out)["mean_accepted_length"] == pytest.approx(float(stated[1]), abs=0.005)


def test_serve_refuses_a_prefill_cap_below_one(tiny_float_model, run_cli):
    code, _, err = run_cli(["serve", str(tiny_float_model()), "--max-prefill-tokens", "0"])
    assert code == 2 and "--max-prefill-tokens must be >= 1, got 0" in err and err.count("\n") == 1, err


def test_serve_refuses_a_port_past_65535_before_loading(tiny_float_model, run_cli):
    code, _, err = run_cli(["serve", str(tiny_float_model()), "--port", "70000"])  # was: OverflowError from bind()
    assert code == 2 and "--port must be a TCP port, 1 to 65535, got 70000" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", [["serve"], ["bench", "--batches", "1"], ["generate", "hi"]])
def test_a_negative_draft_vocab_is_one_line(tiny_float_model, run_cli, command):
    code, out, err = run_cli([command[0], str(tiny_float_model()), *command[1:], "--draft", "self:int8", "--draft-vocab", "-1"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--draft-vocab -1: give a token count (0 = the whole vocabulary)" in err


@pytest.mark.parametrize("command", [["serve"], ["bench", "--batches", "1"], ["generate", "hi"]])
def test_an_unknown_kv_dtype_is_one_line_before_loading(tiny_float_model, run_cli, command):
    code, out, err = run_cli([command[0], str(tiny_float_model()), *command[1:], "--kv-dtype", "f8"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "unknown KV cache dtype 'f8' (choose from auto, bf16, f32, int8, fp8)" in err


def test_serve_builds_its_engine_over_the_kv_dtype(tiny_float_model):
    import torch

    from lowbit.runtime.server.launch import engine_factory

    engine = engine_factory(tiny_float_model(), kv_dtype="bf16", kv_memory=1 << 20, max_running=2)()
    assert engine.cache.keys[0].dtype == torch.bfloat16 and engine.cache.fused_decode
