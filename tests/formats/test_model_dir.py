"""model_dir: the one-line reasons a path is not a Hugging Face model directory."""

from __future__ import annotations

import pytest

from lowbit.errors import LowbitError
from lowbit.formats.hf_files import model_dir


def test_each_reason_names_the_path(tmp_path):
    with pytest.raises(LowbitError, match=r"^model not found: .*nowhere$"):
        model_dir(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(LowbitError, match=r"notes\.txt is not a model directory \(expected a folder"):
        model_dir(tmp_path / "notes.txt")
    # a GGUF file, where a command reads directories only (calibrate, distill): how to get one
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(LowbitError, match=r"m\.gguf is a GGUF file; .*lowbit convert .*m\.gguf -o DIR\)$"):
        model_dir(tmp_path / "m.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LowbitError, match="has no config.json"):
        model_dir(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert model_dir(tmp_path / "empty") == tmp_path / "empty"
