"""Outlier side matrices in lowbit's native checkpoint: bit-exact round trip, malformed parts refused,
and what each converter does with them (native keeps, hf adds them in, quantized targets refuse or fold)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.native import NativeReader, load_native, save_native
from lowbit.quant.outlier_matrix import pack_outliers, unpack_outliers
from lowbit.quant.rtn import quantize_rtn
from tests.formats.conftest import TINY_CONFIG, tiny_weights


def _with_outliers(w: torch.Tensor, label: str, percent: float = 2.0):
    """(QTensor of W without its largest |w|, packed side matrix of those weights)."""
    count = int(w.numel() * percent / 100)
    mask = torch.zeros(w.numel(), dtype=torch.bool)
    mask[w.abs().flatten().argsort(descending=True)[:count]] = True
    mask = mask.view(w.shape)
    return quantize_rtn(w.masked_fill(mask, 0.0), label), pack_outliers(w, mask)


@pytest.fixture
def native_with_outliers(tmp_path):
    def make(label="int4-g32", name="ckpt", every=2):
        weights, dense = tiny_weights()
        qtensors, outliers = {}, {}
        for i, (module, w) in enumerate(weights.items()):
            if i % every == 0:  # some layers with a side matrix, some without
                qtensors[module], outliers[module] = _with_outliers(w * 1.0, label)
            else:
                qtensors[module] = quantize_rtn(w, label)
        out = tmp_path / name
        save_native(out, qtensors, dense, config=dict(TINY_CONFIG), outliers=outliers, max_shard_bytes=30_000)
        return out, qtensors, outliers, weights

    return make


def test_round_trip_is_bit_exact(native_with_outliers):
    out, qtensors, outliers, _ = native_with_outliers()
    assert (out / "model.safetensors.index.json").exists()  # sharded: the side matrices may sit in any shard
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["version"] == 2
    assert qc["outliers"] == {m: {"count": int(p["indices"].numel())} for m, p in outliers.items()}
    reader = NativeReader(out)
    assert not any(".outliers." in n for n in reader.dense_names)
    ckpt = load_native(out)
    assert ckpt.outliers.keys() == outliers.keys()
    for module, parts in outliers.items():
        for part in ("indices", "values"):
            got = ckpt.outliers[module][part]
            assert got.dtype == parts[part].dtype and torch.equal(got, parts[part])
    for module, qt in qtensors.items():
        assert torch.equal(ckpt.qtensors[module].dequantize(), qt.dequantize())
    assert reader.outliers("model.layers.0.self_attn.k_proj") is None  # index 1: no side matrix


def test_no_outliers_stays_version_1(tmp_path):
    weights, dense = tiny_weights()
    out = tmp_path / "plain"
    qc = save_native(out, {m: quantize_rtn(w, "int8") for m, w in weights.items()}, dense, config=dict(TINY_CONFIG))
    assert qc["version"] == 1 and "outliers" not in qc


def test_malformed_side_matrices_are_refused(native_with_outliers, tmp_path):
    weights, dense = tiny_weights()
    module = "model.layers.0.self_attn.q_proj"
    qt, parts = _with_outliers(weights[module], "int4-g32")
    bad = [
        ({**parts, "indices": parts["indices"].flip(0)}, "strictly ascending"),
        ({**parts, "indices": parts["indices"] + 64 * 64}, "inside the 64x64"),
        ({**parts, "values": parts["values"].float()}, "bf16"),
        ({"indices": parts["indices"]}, "need parts"),
    ]
    for i, (side, message) in enumerate(bad):
        with pytest.raises(LowbitError, match=message):
            save_native(tmp_path / f"bad{i}", {module: qt}, config=dict(TINY_CONFIG), outliers={module: side})
        assert not (tmp_path / f"bad{i}").exists()

    # a checkpoint whose config.json disagrees with its tensors
    out, *_ = native_with_outliers()
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["outliers"][module]["count"] += 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(LowbitError, match="config.json says"):
        load_native(out)


def test_tampered_indices_in_the_file_are_refused(tmp_path):
    weights, dense = tiny_weights()
    module = "model.layers.0.self_attn.q_proj"
    qt, parts = _with_outliers(weights[module], "int4-g32")
    out = tmp_path / "ckpt"
    save_native(out, {module: qt}, config=dict(TINY_CONFIG), outliers={module: parts})
    tensors = load_file(str(out / "model.safetensors"))
    tensors[f"{module}.outliers.indices"] = tensors[f"{module}.outliers.indices"].flip(0).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LowbitError, match="strictly ascending"):
        NativeReader(out).outliers(module)


def test_convert_to_native_keeps_them_exactly(native_with_outliers, tmp_path):
    src, qtensors, outliers, _ = native_with_outliers()
    result = convert(src, tmp_path / "copy", "native")
    assert result.exact
    back = load_native(tmp_path / "copy")
    for module, parts in outliers.items():
        assert torch.equal(back.outliers[module]["indices"], parts["indices"])
        assert torch.equal(back.outliers[module]["values"].view(torch.int16), parts["values"].view(torch.int16))


def test_convert_to_hf_adds_them_into_the_weights(native_with_outliers, tmp_path):
    src, qtensors, outliers, _ = native_with_outliers()
    result = convert(src, tmp_path / "hf", "hf", dtype="float32")
    assert result.exact and any("outlier" in n for n in result.notes)
    dense = read_checkpoint(tmp_path / "hf").dense
    for module, qt in qtensors.items():
        want = qt.dequantize(torch.float32)
        if module in outliers:
            want = want + unpack_outliers(outliers[module], tuple(qt.shape))
        assert torch.equal(dense[f"{module}.weight"], want), module
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert not any(".outliers." in k for k in f.keys())


@pytest.mark.parametrize("target, name", [("gptq", "GPTQ"), ("awq", "AWQ"), ("compressed-tensors", "compressed-tensors"),
                                          ("gguf", "GGUF")])
def test_quantized_targets_refuse_then_fold_with_allow_requant(native_with_outliers, tmp_path, target, name):
    src, qtensors, outliers, weights = native_with_outliers()
    out = tmp_path / ("out.gguf" if target == "gguf" else "out")
    with pytest.raises(LowbitError) as info:
        convert(src, out, target)
    message = str(info.value)
    assert "\n" not in message and f"as {name}" in message and "outlier" in message and "--allow-requant" in message
    assert not out.exists()

    result = convert(src, out, target, allow_requant=True)
    folded = {c.module: c for c in result.changes if c.reason == "outliers folded into the weight"}
    assert set(folded) == set(outliers)
    back = read_checkpoint(out)
    for module in outliers:
        # requantizing Ŵ + S in the layer's format is a plain RTN of the float weight: error of int4 g32
        assert 0 < folded[module].rel_error < 0.2
        w = weights[module].double()
        got = back.qtensors[module].dequantize(torch.float64) if module in back.qtensors else back.dense[f"{module}.weight"].double()
        assert (got - w).norm() / w.norm() < 0.2
