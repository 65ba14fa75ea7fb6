"""load_text: demo names, files, and the one-line errors for bad texts."""

from __future__ import annotations

import pytest

from lowbit.data.shakespeare import markdown_to_text
from lowbit.data.text import load_text
from lowbit.errors import LowbitError


def test_load_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("\ufeffHello, wörld.\n", encoding="utf-8")
    assert load_text(path) == "Hello, wörld.\n"


def test_demo_name(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path))
    with pytest.raises(LowbitError, match="run `lowbit assets`"):
        load_text("wiki-eval")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "wiki-eval.txt").write_text("Some text.", encoding="utf-8")
    assert load_text("wiki-eval") == "Some text."


@pytest.mark.parametrize(
    ("content", "needle"),
    [(None, "not found"), (b"", "empty"), (b" \n\t\n", "empty"), (b"ok \xff\xfe bad", "not valid UTF-8")],
)
def test_bad_texts(tmp_path, content, needle):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(LowbitError, match=needle) as info:
        load_text(path)
    assert "\n" not in str(info.value)


def test_directory_is_not_a_text(tmp_path):
    with pytest.raises(LowbitError, match="not a file"):
        load_text(tmp_path)


def test_shakespeare_markdown():
    markdown = (
        "# Hamlet\n\n## ACT I\n\n_Enter BERNARDO and\nFRANCISCO_\n\n**BERNARDO**  \nWho's there?  \n"
        "_\\[Aside]_  \n\\--Nay, answer me.\n\n\n\n*Exit.*\n"
    )
    assert markdown_to_text(markdown) == (
        "Hamlet\n\nACT I\n\nEnter BERNARDO and\nFRANCISCO\n\nBERNARDO\nWho's there?\n[Aside]\n--Nay, answer me.\n\nExit."
    )
