"""The commands in docs/*.md and README.md are real: every `lowbit …` line parses against the CLI,
and every code block marked runnable runs and exits 0.

Convention (docs/index.md says it too): a fenced ```bash or ```python block whose opening fence
comes right after a line `<!-- run -->` is run by this test — bash blocks with `bash -euo pipefail`,
python blocks with this interpreter — in a temporary directory shared by the blocks of one page, in
page order (so a later block may use what an earlier one wrote). Keep those cheap: plan, inspect,
--help, a few tokens of generate. Heavy commands stay unmarked; their options are still checked by
parsing them (typos in a subcommand or option name fail here without running anything).
docs/plan.md's commands are also run by tests/plan/test_docs.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command

from lowbit.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
RUN_MARK = "<!-- run -->"
FENCE = re.compile(r"^(?P<mark><!-- run -->\n)?```(?P<lang>bash|python)\n(?P<body>.*?)^```", re.S | re.M)
SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}


def code_blocks(page: Path) -> list[tuple[str, str, bool]]:
    """(language, body, runnable) of each bash/python block on the page, in order."""
    return [(m["lang"], m["body"], bool(m["mark"])) for m in FENCE.finditer(page.read_text())]


def _without_substitutions(text: str) -> str:
    """`$(…)` (nested parentheses allowed) replaced by one word: its value is unknown until run."""
    out, i = [], 0
    while (start := text.find("$(", i)) >= 0:
        depth, j = 0, start + 1
        while j < len(text):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        out += [text[i:start], "SUBSTITUTED"]
        i = j + 1
    return "".join(out) + text[i:]


def lowbit_invocations(script: str) -> list[list[str]]:
    """argv (after `lowbit`) of every lowbit command in a bash script, across && | ; & and line continuations."""
    joined = _without_substitutions(re.sub(r"\\\n", " ", script))
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        segment: list[str] = []
        for token in [*lexer, ";"]:
            if token not in SEPARATORS:
                segment.append(token)
                continue
            while segment and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0]):
                segment.pop(0)  # VAR=value before the command
            if segment and segment[0] == "lowbit":
                found.append(segment[1:])
            segment = []
    return found


def _all_invocations() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for lang, body, _ in code_blocks(page):
            if lang == "bash":
                out += [(f"{page.relative_to(ROOT)}: lowbit {' '.join(args)}", args) for args in lowbit_invocations(body)]
    return out


INVOCATIONS = _all_invocations()
RUNNABLE_PAGES = [page for page in PAGES if any(runnable for _, _, runnable in code_blocks(page))]


def test_helpers_find_commands():
    script = "X=1 lowbit plan a --gpu h100 && echo ok | lowbit eval b \\\n  --chunks 2 &\n# lowbit not-this\nlowbit serve m --port 1 &"
    assert lowbit_invocations(script) == [["plan", "a", "--gpu", "h100"], ["eval", "b", "--chunks", "2"], ["serve", "m", "--port", "1"]]
    assert lowbit_invocations("lowbit convert $(python -c 'print(f(g(1)))')/x.gguf -o y") == [["convert", "SUBSTITUTED/x.gguf", "-o", "y"]]
    assert len(INVOCATIONS) >= 20
    assert RUNNABLE_PAGES, f"no block marked {RUN_MARK} in docs/"


@pytest.fixture(scope="module")
def cli_group():
    cli_main._register_commands()
    return get_command(cli_main.app)


@pytest.mark.parametrize("args", [args for _, args in INVOCATIONS], ids=[name for name, _ in INVOCATIONS])
def test_documented_command_parses(args, cli_group):
    name, rest = args[0], args[1:]
    assert name in cli_group.commands, f"no subcommand '{name}' (have {sorted(cli_group.commands)})"
    command = cli_group.commands[name]
    try:
        command.make_context(name, list(rest))
    except cli_main._EXIT:
        pass  # --help
    except cli_main._USAGE as exc:
        pytest.fail(f"lowbit {shlex.join(args)}: {exc.format_message()}")


@pytest.mark.demo
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE_PAGES])
def test_runnable_blocks_run(page, tmp_path):
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    for lang, body, runnable in code_blocks(page):
        if not runnable:
            continue
        argv = ["bash", "-euo", "pipefail", "-c", body] if lang == "bash" else [sys.executable, "-c", body]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{page.name} block failed (exit {done.returncode}):\n{body}\n{done.stderr[-2000:]}"
        assert "lowbit: error" not in done.stderr, done.stderr[-2000:]


def test_parse_check_catches_a_typo(cli_group):
    plan = cli_group.commands["plan"]
    plan.make_context("plan", ["llama-3-8b", "--gpu", "h100"])
    with pytest.raises(cli_main._USAGE):
        plan.make_context("plan", ["llama-3-8b", "--gpuu", "h100"])
