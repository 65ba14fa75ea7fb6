"""lowbit's runtime loads GPTQ, AWQ and compressed-tensors directories directly (load_foreign via
runtime/loader.py), giving the same logits as the native checkpoint they were converted from."""

import json

import pytest
import torch

from lowbit.formats.convert import convert
from lowbit.runtime.loader import load_model

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 14, 95, 40, 41]])


@pytest.mark.parametrize("target", ["gptq", "awq", "compressed-tensors", "gguf"])
def test_runtime_loads_foreign_checkpoints_with_native_logits(make_native, add_tiny_tokenizer, tmp_path, target):
    src, _ = make_native("int4-g32")
    add_tiny_tokenizer(src)
    out = tmp_path / ("m.gguf" if target == "gguf" else "m")
    assert convert(src, out, target).exact
    want = load_model(src)(IDS)
    model = load_model(out)
    assert type(model.get_submodule("model.layers.0.mlp.up_proj")).__name__ == "QuantLinear"
    assert torch.equal(model(IDS), want)


def test_eval_cli_runs_on_a_gptq_directory(make_native, add_tiny_tokenizer, tmp_path, capsys):
    from lowbit.cli.main import main

    src, _ = make_native("int4-g32")
    add_tiny_tokenizer(src)
    convert(src, tmp_path / "gptq", "gptq")
    text = tmp_path / "text.txt"
    text.write_text("0123456789 !#$%&()*+,-./:;<=>?@[]^_`{|}~ " * 20)
    reports = []
    for model in (src, tmp_path / "gptq"):
        try:
            main(["eval", str(model), "--data", str(text), "--ctx", "32", "--chunks", "3", "--json"])
        except SystemExit as exc:
            assert exc.code == 0, capsys.readouterr().err
        reports.append(json.loads(capsys.readouterr().out))
    native, gptq = reports
    assert gptq["ppl"] == native["ppl"] and gptq["ppl"] > 1
