"""Every command and Python example in docs/plan.md runs as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lowbit.cli.main import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


COMMANDS = [line for block in _blocks("bash") for line in block.strip().splitlines() if line.startswith("lowbit plan")]


def test_docs_have_commands():
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize("command", COMMANDS)
def test_doc_command_runs(command, capsys):
    args = shlex.split(command)[1:]
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code == 0, capsys.readouterr().err
    assert "lowbit: error" not in capsys.readouterr().err


def test_doc_python_runs(capsys):
    for block in _blocks("python"):
        exec(compile(block, str(DOC), "exec"), {})
    assert "int4-g128" in capsys.readouterr().out
