"""A native checkpoint with outlier side matrices runs with them: logits equal transformers' float64
logits of the dequantized weights plus the side matrices; the engine (generate / serve) uses them too."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lowbit.formats.native import save_native
from lowbit.quant.outlier_matrix import pack_outliers, unpack_outliers
from lowbit.quant.rtn import quantize_rtn
from lowbit.runtime.loader import load_model
from lowbit.runtime.quant_linear import QuantLinear

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")


def _quantize_with_outliers(src, out, label="int3-g32", percent=2.0):
    """Native checkpoint of the HF dir `src`: every projection in `label` without its largest |w|,
    which go into the side matrix. Returns {module: dense float64 weight the model should use}."""
    tensors = load_file(str(src / "model.safetensors"))
    qtensors, outliers, effective, dense = {}, {}, {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJ:
            w = t.float()
            mask = torch.zeros(w.numel(), dtype=torch.bool)
            mask[w.abs().flatten().argsort(descending=True)[: int(w.numel() * percent / 100)]] = True
            mask = mask.view(w.shape)
            qtensors[module] = quantize_rtn(w.masked_fill(mask, 0.0), label)
            outliers[module] = pack_outliers(w, mask)
            effective[module] = qtensors[module].dequantize(torch.float64) + unpack_outliers(outliers[module], w.shape).double()
        else:
            dense[name] = t
    config = json.loads((src / "config.json").read_text())
    save_native(out, qtensors, dense, config=config, outliers=outliers)
    return qtensors, effective


def _hf_logits(hf_model, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    model = hf_model.double()
    with torch.no_grad():
        for module, w in weights.items():
            model.get_submodule(module).weight.copy_(w)
        return model(ids).logits


def test_logits_equal_float64_reference_of_weight_plus_side_matrix(hf_checkpoint, llama_config, tmp_path, reference_kernels):
    src, hf_model = hf_checkpoint(llama_config())
    qtensors, effective = _quantize_with_outliers(src, tmp_path / "q")
    model = load_model(tmp_path / "q")
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(layer, QuantLinear) and layer.outliers is not None
    assert layer.outliers._nnz() == int(128 * 64 * 0.02)

    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _hf_logits(hf_model, effective, ids)
    got = model(ids).double()
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-5, float(err)
    # without the side matrices the model is measurably different (so the comparison above can fail)
    without = _hf_logits(hf_model, {m: qt.dequantize(torch.float64) for m, qt in qtensors.items()}, ids)
    assert (without - want).abs().max() / want.abs().max() > 100 * err


def test_default_kernels_and_bf16_use_the_side_matrix(hf_checkpoint, llama_config, tmp_path):
    src, hf_model = hf_checkpoint(llama_config())
    qtensors, effective = _quantize_with_outliers(src, tmp_path / "q")
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    want = _hf_logits(hf_model, effective, ids)
    without = _hf_logits(hf_model, {m: qt.dequantize(torch.float64) for m, qt in qtensors.items()}, ids)
    gap = (without - want).abs().max()
    for dtype in (torch.float32, torch.bfloat16):
        got = load_model(tmp_path / "q", dtype=dtype)(ids).double()
        assert (got - want).abs().max() < 0.2 * gap, dtype


def test_engine_greedy_decode_matches_the_reference(hf_checkpoint, llama_config, tmp_path, reference_kernels):
    """The engine behind `lowbit generate` / `lowbit serve` (paged KV cache, one token per step) runs
    the side matrices too: its greedy tokens are the float64 reference's argmax, step by step."""
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sequence import SamplingParams
    from tests.conftest import _byte_tokenizer

    src, hf_model = hf_checkpoint(llama_config(vocab_size=258, bos_token_id=256, eos_token_id=257))
    _, effective = _quantize_with_outliers(src, tmp_path / "q")
    _byte_tokenizer(tmp_path / "q")
    engine = Engine(tmp_path / "q", device="cpu", kv_memory=1 << 20, max_num_seqs=2)
    prompt = [5, 17, 99, 42, 7]
    tokens = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    assert len(tokens) == 6
    ids = list(prompt)
    for token in tokens:
        logits = _hf_logits(hf_model, effective, torch.tensor([ids]))[0, -1]
        top2 = logits.topk(2).values
        if float(top2[0] - top2[1]) > 1e-3:  # a near-tie may go either way in float32
            assert token == int(logits.argmax())
        ids.append(token)
