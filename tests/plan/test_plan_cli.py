"""`lowbit plan` end to end: JSON that parses, one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from lowbit.cli.main import main


def run(args, capsys):
    code = 0
    try:
        main(["plan", *args])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_json_numbers(capsys):
    code, out, _ = run(["llama-3-8b", "--gpu", "h100", "-f", "bf16", "-f", "int4-g128", "--context", "2048", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["model"]["total_params"] == 8_030_261_248
    assert [f["format"] for f in data["formats"]] == ["bf16", "int4-g128"]
    bf16 = data["formats"][0]
    assert bf16["kv_bytes_per_token"] == 131072
    assert bf16["kv_bytes_per_sequence"] == 131072 * 2048
    assert bf16["weight_bytes"] == 2 * 8_030_261_248
    assert data["formats"][1]["weight_bytes"] < bf16["weight_bytes"] / 2.5
    assert data["recommended"] in ("bf16", "int4-g128")
    assert {t["name"].split(" (")[0] for t in data["tricks"]} >= {"fp8 KV cache", "paged KV cache", "speculative decoding"}


def test_default_formats_and_human_tables(capsys):
    code, out, err = run(["mixtral-8x7b", "--gpu", "h200", "--draft", "self:int4", "--acceptance", "0.7"], capsys)
    assert code == 0 and out == ""
    for fmt in ("bf16", "int8", "fp8", "int4-g128", "nf4", "mxfp4", "nvfp4"):
        assert fmt in err
    assert "recommend" in err and "12.88B active" in err


def test_custom_machine_json(capsys):
    code, out, _ = run(["qwen2.5-7b", "--bandwidth", "100", "--memory", "64GiB", "--tflops", "50", "-f", "int8", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["hardware"]["bandwidth_gbs"] == 100 and data["hardware"]["name"] == "custom"


def test_checkpoint_directory(tmp_path, capsys):
    from lowbit.plan.config_source import BUNDLED_DIR

    (tmp_path / "config.json").write_text((BUNDLED_DIR / "qwen3-8b.json").read_text())
    code, out, _ = run([str(tmp_path), "-f", "fp8", "--json"], capsys)
    assert code == 0 and json.loads(out)["model"]["head_dim"] == 128


def test_gguf_file_plans_as_its_config(tmp_path, capsys):
    """A GGUF file's metadata is its config: the same plan as the directory it converts to, its
    name said once in the header, and a damaged file one line."""
    from lowbit.formats.gguf_import import convert_gguf
    from tests.formats.test_gguf_tiny import write_tiny

    write_tiny(tmp_path / "tiny.gguf", tied=False)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="bf16")
    plans = []
    for model in (tmp_path / "tiny.gguf", tmp_path / "hf"):
        code, out, _ = run([str(model), "-f", "int4-g32", "--json"], capsys)
        assert code == 0
        plans.append(json.loads(out))
    shape = {k: v for k, v in plans[0]["model"].items() if k not in ("name", "source")}
    assert shape == {k: v for k, v in plans[1]["model"].items() if k not in ("name", "source")}
    assert shape["layers"] == 2 and shape["tied_embeddings"] is False
    assert plans[0]["formats"] == plans[1]["formats"]
    code, _, err = run([str(tmp_path / "tiny.gguf"), "-f", "int4-g32"], capsys)
    assert code == 0 and f"{tmp_path / 'tiny.gguf'}: " in err and f"({tmp_path / 'tiny.gguf'})" not in err
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    code, out, err = run([str(tmp_path / "bad.gguf")], capsys)
    assert code == 1 and out == "" and err.count("\n") == 1 and "truncated" in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["llama-3-8b", "--gpu", "tpu"], "unknown GPU"),
        (["llama-3-8b", "-f", "int7"], "unknown format"),
        (["llama-3-8b", "--draft", "llama-3-8b"], "--draft needs --acceptance"),
        (["llama-3-8b", "--draft", "llama-3-8b", "--acceptance", "1.5"], "(0, 1]"),
        (["llama-3-8b", "--draft", "llama-3-8b", "--acceptance", "0"], "(0, 1]"),
        (["llama-3-8b", "--context", "-5"], "--context"),
        (["llama-3-8b", "--concurrency", "0"], "--concurrency"),
        (["llama-3-8b", "--memory", "-3"], "--memory"),
        (["llama-3-8b", "--kv-dtype", "fp4"], "KV cache dtype"),
        (["no-such-model"], "model not found"),
        (["./no/such/dir"], "model not found"),
    ],
)
def test_bad_input_is_one_line(args, needle, capsys):
    code, out, err = run(args, capsys)
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowbit: error:") and needle in lines[0]


def test_unreachable_hub_is_one_line(capsys, monkeypatch):
    from lowbit.plan import config_source

    monkeypatch.setattr(config_source, "_reachable", lambda *a, **k: False)
    code, _, err = run(["nobody-here/not-a-model-xyz", "-f", "int4"], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0]
