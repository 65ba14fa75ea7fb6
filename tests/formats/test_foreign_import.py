"""Importing GPTQ / AWQ / compressed-tensors checkpoints built here from known weights gives those weights back."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert
from lowbit.formats.foreign import detect_checkpoint_kind, load_foreign, read_checkpoint
from lowbit.quant.qtensor import QTensor

N, K, G = 16, 64, 32
AWQ_SLOT_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ's word slot i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]


def _known(seed=0, zero_low=1):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g)
    zeros = torch.randint(zero_low, 16, (N, K // G), generator=g)
    scales = (torch.rand(N, K // G, generator=g) * 0.01 + 0.001).half()
    return codes, zeros, scales


def _words(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.uint32).view(np.int32))


def _write(directory, tensors, qconfig, extra=None):
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"model_type": "llama", "hidden_size": K, "quantization_config": qconfig}
    (directory / "config.json").write_text(json.dumps(config))
    for name, content in (extra or {}).items():
        (directory / name).write_text(json.dumps(content))


def _gptq_tensors(codes, zeros, scales, g_idx, v1=True):
    qweight = np.zeros((K // 8, N), dtype=np.uint64)
    for k in range(K):
        for n in range(N):
            qweight[k // 8, n] |= int(codes[n, k]) << (4 * (k % 8))
    qzeros = np.zeros((K // G, N // 8), dtype=np.uint64)
    for j in range(K // G):
        for n in range(N):
            stored = (int(zeros[n, j]) - 1) & 0xF if v1 else int(zeros[n, j])
            qzeros[j, n // 8] |= stored << (4 * (n % 8))
    return {
        "model.layers.0.mlp.up_proj.qweight": _words(qweight), "model.layers.0.mlp.up_proj.qzeros": _words(qzeros),
        "model.layers.0.mlp.up_proj.scales": scales.t().contiguous(), "model.layers.0.mlp.up_proj.g_idx": g_idx.to(torch.int32),
        "model.norm.weight": torch.ones(K),
    }


def _expected(codes, zeros, scales, g_idx):
    return (codes.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_import_gives_back_known_weights(tmp_path, v1):
    codes, zeros, scales = _known()
    g_idx = torch.arange(K) // G
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": False,
               "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    _write(tmp_path / "g", _gptq_tensors(codes, zeros, scales, g_idx, v1), qconfig)
    assert detect_checkpoint_kind(tmp_path / "g") == "gptq"
    config, tensors = load_foreign(tmp_path / "g")
    qt = tensors["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(qt, QTensor) and qt.spec.label == "int4-asym-g32"
    assert torch.equal(qt.dequantize(), _expected(codes, zeros, scales, g_idx))
    assert torch.equal(tensors["model.norm.weight"], torch.ones(K)) and "quantization_config" not in config


def test_gptq_act_order_is_kept_exact_and_needs_requant_for_native(tmp_path):
    codes, zeros, scales = _known(1)
    g_idx = torch.randperm(K, generator=torch.Generator().manual_seed(2)) // G  # act-order: groups scattered over K
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": True, "sym": False}
    _write(tmp_path / "g", _gptq_tensors(codes, zeros, scales, g_idx), qconfig)
    ckpt = read_checkpoint(tmp_path / "g")
    weight = ckpt.dense["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(weight, _expected(codes, zeros, scales, g_idx))  # eval sees the exact values
    assert "act-order" in ckpt.unexpressed["model.layers.0.mlp.up_proj"][1]
    with pytest.raises(LowbitError, match="act-order"):
        convert(tmp_path / "g", tmp_path / "n", "native")
    result = convert(tmp_path / "g", tmp_path / "n", "native", allow_requant=True)
    assert result.changes[0].target == "int4-asym-g32" and 0 < result.changes[0].rel_error < 0.1


def test_gptq_symmetric_and_quantize_config_json(tmp_path):
    codes, _, scales = _known(3)
    zeros = torch.full((N, K // G), 8)
    g_idx = torch.arange(K) // G
    _write(tmp_path / "g", _gptq_tensors(codes, zeros, scales, g_idx), {"quant_method": "gptq", "bits": 4, "group_size": G},
           extra={"quantize_config.json": {"bits": 4, "group_size": G, "sym": True, "desc_act": False}})
    qt = read_checkpoint(tmp_path / "g").qtensors["model.layers.0.mlp.up_proj"]
    assert qt.spec.symmetric and qt.zeros is None
    assert torch.equal(qt.dequantize(), _expected(codes, zeros, scales, g_idx))


def test_awq_import_gives_back_known_weights(tmp_path):
    codes, zeros, scales = _known(4, zero_low=0)
    qweight = np.zeros((K, N // 8), dtype=np.uint64)
    for k in range(K):
        for n in range(N):
            qweight[k, n // 8] |= int(codes[n, k]) << (4 * AWQ_SLOT_OF_COLUMN[n % 8])
    qzeros = np.zeros((K // G, N // 8), dtype=np.uint64)
    for j in range(K // G):
        for n in range(N):
            qzeros[j, n // 8] |= int(zeros[n, j]) << (4 * AWQ_SLOT_OF_COLUMN[n % 8])
    tensors = {"model.layers.0.mlp.up_proj.qweight": _words(qweight), "model.layers.0.mlp.up_proj.qzeros": _words(qzeros),
               "model.layers.0.mlp.up_proj.scales": scales.t().contiguous()}
    _write(tmp_path / "a", tensors, {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": G, "zero_point": True})
    assert detect_checkpoint_kind(tmp_path / "a") == "awq"
    qt = read_checkpoint(tmp_path / "a").qtensors["model.layers.0.mlp.up_proj"]
    assert torch.equal(qt.dequantize(), _expected(codes, zeros, scales, torch.arange(K) // G))


def test_compressed_tensors_checkpoint_made_by_the_package(tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(N, K)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=G)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    scale = ((w.reshape(N, -1, G).amax(-1) - w.reshape(N, -1, G).amin(-1)) / 15).half()
    zp = (-8 - torch.round(w.reshape(N, -1, G).amin(-1) / scale.float())).clamp(-8, 7).to(torch.int8)
    compressor = BaseCompressor.load_from_registry("pack-quantized")
    packed = compressor.compress({"weight": w.half(), "weight_scale": scale, "weight_zero_point": zp}, scheme)
    want = compressor.decompress(dict(packed), scheme)["weight"]
    tensors = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in packed.items()}
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump()}}}
    _write(tmp_path / "c", tensors, qconfig)
    qt = read_checkpoint(tmp_path / "c").qtensors["model.layers.0.mlp.up_proj"]
    assert qt.spec.label == "int4-asym-g32"
    assert torch.equal(qt.dequantize(torch.float16), want)
