"""AWQ checkpoints, GEMM version (AutoAWQ, transformers, vLLM).

Per quantized Linear `<m>` with W[N, K], 4 bits, group size g, G = K / g:
  <m>.qweight  int32 [K, N/8]: codes packed along the OUTPUT dimension; word j of row k holds
               columns 8j..8j+7 in AWQ's interleaved order — slot i (bits 4i..4i+3) holds column
               8j + [0, 2, 4, 6, 1, 3, 5, 7][i]
  <m>.qzeros   int32 [G, N/8]: zero points packed the same way (the zero itself, no offset)
  <m>.scales   float16 [G, N]
  value[n, k] = (code − zero[k // g, n]) * scales[k // g, n]
config.json's quantization_config: quant_method "awq", version "gemm", zero_point, and the
group size / bits under both spellings (transformers' group_size/bits, AutoAWQ's
q_group_size/w_bit); AutoAWQ's quant_config.json repeats them.
A symmetric lowbit int4 layer is an AWQ layer whose zero points are all 8.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.formats.checkpoint import Checkpoint, keep_the_rest_dense, packed_config, packed_modules, read_safetensors
from lowbit.formats.gptq import codes_of, zeros_of
from lowbit.formats.int32pack import AWQ_ORDER, pack_last, unpack_last
from lowbit.quant.dtypes import fits_float16
from lowbit.quant.packing import pack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec, parse_spec


def model_group(specs: list[FormatSpec]) -> int:
    groups = [s.group_size for s in specs if s.family == "int" and s.bits == 4 and s.granularity == "group"]
    return Counter(groups).most_common(1)[0][0] if groups else 128


def why_not_exact(qt: QTensor, group: int) -> str | None:
    spec, (n, k) = qt.spec, qt.shape
    if spec.family != "int" or spec.bits != 4:
        return f"AWQ holds 4-bit integer codes, not {spec.name}"
    if spec.double_quant:
        return f"AWQ holds fp16 scales, not {spec.label}'s 8-bit scale codes"
    if spec.granularity != "group" or spec.group_size != group:
        return f"the checkpoint uses group size {group}, this layer is {spec.label}"
    if k % group:
        return f"in_features {k} is not a multiple of group size {group}"
    if n % 8:
        return f"out_features {n} is not a multiple of 8"
    if spec.scale_dtype != "float16" and not fits_float16(qt.scales):
        return f"AWQ scales are float16 and this layer's {spec.scale_dtype} scales do not all fit it"
    return None


def requant_spec(group: int) -> FormatSpec:
    return parse_spec("int4-asym", group, scale_dtype="float16")


def module_tensors(module: str, qt: QTensor) -> dict[str, torch.Tensor]:
    return {
        f"{module}.qweight": pack_last(codes_of(qt).t().contiguous(), 4, AWQ_ORDER),
        f"{module}.qzeros": pack_last(zeros_of(qt).t().contiguous(), 4, AWQ_ORDER),
        f"{module}.scales": qt.scales.to(torch.float16).t().contiguous(),
    }


def quantization_config(group: int) -> dict:
    return {"quant_method": "awq", "version": "gemm", "zero_point": True, "bits": 4, "group_size": group,
            "w_bit": 4, "q_group_size": group, "modules_to_not_convert": None}


# ---------------------------------------------------------------- import


def read_awq(directory: Path) -> Checkpoint:
    config, settings = packed_config(directory, "awq", "quant_config.json", ("w_bit", "q_group_size"), "AWQ")
    version = str(settings.get("version", "gemm")).lower()
    if version != "gemm":
        raise LowbitError(f"{directory}: lowbit imports AWQ version 'gemm', not '{version}'")
    bits = int(settings.get("bits", settings.get("w_bit", 4)))
    group = int(settings.get("group_size", settings.get("q_group_size", 128)))
    if bits != 4:
        raise LowbitError(f"{directory}: lowbit imports 4-bit AWQ, not {bits}-bit")
    tensors = read_safetensors(directory)
    ckpt = Checkpoint(config=config, source_dir=directory, kind="awq")
    used: set[str] = set()
    for m, parts in packed_modules(directory, tensors, ("qweight", "qzeros", "scales"), used):
        ckpt.qtensors[m] = import_module(m, parts, group)
    return keep_the_rest_dense(ckpt, tensors, used)


def import_module(module: str, parts: dict, group: int) -> QTensor:
    codes = unpack_last(parts["qweight"], 4, AWQ_ORDER).t().contiguous()  # [N, K]
    zeros = unpack_last(parts["qzeros"], 4, AWQ_ORDER).t().contiguous()  # [N, G]
    scales = parts["scales"].t().contiguous()
    n, k = codes.shape
    if scales.shape != zeros.shape or scales.shape[1] * group != k:
        raise LowbitError(f"{module}: AWQ scales {tuple(parts['scales'].shape)} do not fit {k} inputs with group size {group}")
    symmetric = bool((zeros == 8).all())
    spec = parse_spec("int4" if symmetric else "int4-asym", group, scale_dtype="float16")
    tensors = {"qweight": pack_bits(codes, 4), "scales": scales.to(torch.float16)}
    if not symmetric:
        tensors["zeros"] = zeros
    return QTensor.from_tensors(tensors, {"spec": spec.to_dict(), "shape": [n, k]}, where=module)
