"""GPTQ checkpoints in the Hugging Face layout (AutoGPTQ / GPTQModel / transformers / vLLM).

Per quantized Linear `<m>` with W[N, K], b bits, group size g, G = K / g:
  <m>.qweight  int32 [K*b/32, N]: codes packed along the INPUT dimension, word r of column n
               holding rows (32/b)*r + i at bits b*i (first row lowest)
  <m>.qzeros   int32 [G, N*b/32]: zero points packed along the OUTPUT dimension the same way,
               stored as zero − 1 (the "v1" convention of checkpoint_format "gptq"; GPTQModel's
               "gptq_v2" stores the zero itself)
  <m>.scales   float16 [G, N]
  <m>.g_idx    int32 [K]: the group of each input row; k // g unless quantized with act-order
  value[n, k] = (code − zero[g_idx[k], n]) * scales[g_idx[k], n]
Symmetric GPTQ stores zero 2^(b-1) (qzeros 0x77777777 for 4 bits) and says "sym": true.
v1 cannot hold a zero point of 0 (it would read back as 2^b); such groups need requantization.
quantize_config.json and config.json's quantization_config carry bits, group_size (-1 per
channel), desc_act, sym, checkpoint_format.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.formats.checkpoint import Checkpoint, keep_the_rest_dense, packed_config, packed_modules, read_safetensors
from lowbit.formats.int32pack import pack_last, unpack_last
from lowbit.quant.dtypes import fits_float16
from lowbit.quant.packing import pack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import get_format
from lowbit.quant.spec import FormatSpec, parse_spec

BITS = (2, 4, 8)


def model_scheme(specs: list[FormatSpec]) -> tuple[int, int, bool]:
    """(bits, group_size, sym) for the whole checkpoint: the most common integer layout."""
    ints = [s for s in specs if s.family == "int" and s.bits in BITS]
    if not ints:
        return 4, 128, True
    bits, group = Counter((s.bits, s.group_size if s.granularity == "group" else -1) for s in ints).most_common(1)[0][0]
    return bits, group, all(s.symmetric for s in ints)


def why_not_exact(qt: QTensor, scheme: tuple[int, int, bool]) -> str | None:
    bits, group, _ = scheme
    spec, (n, k) = qt.spec, qt.shape
    if spec.family != "int":
        return f"GPTQ holds integer codes with fp16 scales, not {spec.name}"
    if spec.double_quant:
        return f"GPTQ holds fp16 scales, not {spec.label}'s 8-bit scale codes"
    g = spec.group_size if spec.granularity == "group" else -1
    if (spec.bits, g) != (bits, group):
        return f"the checkpoint is {bits}-bit with group size {group}, this layer is {spec.label}"
    per = 32 // bits
    if k % per or n % per:
        return f"shape {n}x{k} does not pack into int32 words of {per} codes"
    if g > 0 and k % g:
        return f"in_features {k} is not a multiple of group size {g} (vLLM's GPTQ loader requires it)"
    if spec.scale_dtype != "float16" and not fits_float16(qt.scales):
        return f"GPTQ scales are float16 and this layer's {spec.scale_dtype} scales do not all fit it"
    if not spec.symmetric and bool((qt.zeros == 0).any()):
        return "a zero point of 0 cannot be stored as zero − 1 in GPTQ's v1 format"
    return None


def requant_spec(scheme: tuple[int, int, bool]) -> FormatSpec:
    bits, group, sym = scheme
    return parse_spec(f"int{bits}" + ("" if sym else "-asym"), group, scale_dtype="float16")


def fit_v1_zeros(qt: QTensor) -> QTensor:
    """Move a requantized asymmetric group with zero 0 to zero 1 (codes shift up, 15 clips)."""
    if qt.spec.symmetric or not bool((qt.zeros == 0).any()):
        return qt
    fmt = get_format(qt.spec)
    n, k = qt.shape
    codes = fmt.unpack(qt.qweight, qt.spec, k).to(torch.int16)
    g = qt.spec.group_size if qt.spec.granularity == "group" else k
    shift = (qt.zeros == 0).to(torch.int16).repeat_interleave(g, 1)[:, :k]
    top = (1 << qt.spec.bits) - 1
    codes = (codes + shift).clamp(max=top).to(torch.uint8)
    zeros = qt.zeros.clamp(min=1)
    return QTensor(spec=qt.spec, shape=qt.shape, qweight=fmt.pack(codes, qt.spec), scales=qt.scales, zeros=zeros)


def codes_of(qt: QTensor) -> torch.Tensor:
    return get_format(qt.spec).unpack(qt.qweight, qt.spec, qt.shape[1])


def zeros_of(qt: QTensor) -> torch.Tensor:
    """Integer zero points [N, G] (symmetric formats: 2^(b-1))."""
    if qt.zeros is not None:
        return qt.zeros.to(torch.int32)
    return torch.full(tuple(qt.scales.shape), 1 << (qt.spec.bits - 1), dtype=torch.int32)


def module_tensors(module: str, qt: QTensor) -> dict[str, torch.Tensor]:
    bits = qt.spec.bits
    n, k = qt.shape
    g = qt.spec.group_size if qt.spec.granularity == "group" else k
    stored_zeros = (zeros_of(qt) - 1) & ((1 << bits) - 1)
    return {
        f"{module}.qweight": pack_last(codes_of(qt), bits).t().contiguous(),
        f"{module}.qzeros": pack_last(stored_zeros.t().contiguous(), bits),
        f"{module}.scales": qt.scales.to(torch.float16).t().contiguous(),
        f"{module}.g_idx": (torch.arange(k) // g).to(torch.int32),
    }


def quantize_config(scheme: tuple[int, int, bool]) -> dict:
    bits, group, sym = scheme
    return {
        "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": sym,
        "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
        "checkpoint_format": "gptq", "model_file_base_name": "model",
    }


# ---------------------------------------------------------------- import


def read_gptq(directory: Path) -> Checkpoint:
    config, settings = packed_config(directory, "gptq", "quantize_config.json", ("bits",), "GPTQ")
    bits = int(settings.get("bits", 4))
    group = int(settings.get("group_size", 128))
    v2 = str(settings.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    if bits not in BITS:
        raise LowbitError(f"{directory}: lowbit imports GPTQ with {', '.join(map(str, BITS))} bits, not {bits}")
    tensors = read_safetensors(directory)
    ckpt = Checkpoint(config=config, source_dir=directory, kind="gptq")
    used: set[str] = set()
    for m, parts in packed_modules(directory, tensors, ("qweight", "qzeros", "scales", "g_idx"), used):
        value = import_module(m, parts, bits, group, v2)
        if isinstance(value, QTensor):
            ckpt.qtensors[m] = value
        else:
            ckpt.dense[f"{m}.weight"], label, reason = value
            ckpt.unexpressed[m] = (label, reason)
    return keep_the_rest_dense(ckpt, tensors, used)


def import_module(module: str, parts: dict, bits: int, group: int, v2: bool = False):
    """GPTQ tensors of one module → QTensor, or (dense float32 weight, label, reason)."""
    qweight, qzeros, scales, g_idx = parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"]
    k = qweight.shape[0] * 32 // bits
    n = qweight.shape[1]
    codes = unpack_last(qweight.t().contiguous(), bits)[:, :k]  # [N, K]
    zeros = unpack_last(qzeros, bits)[:, :n].t().to(torch.int32)  # [N, G]
    if not v2:
        zeros = zeros + 1
    scales = scales.t().contiguous()  # [N, G]
    groups = scales.shape[1]
    g = k if group <= 0 else group
    trivial = torch.arange(k) // g
    if g_idx is not None and g_idx.numel() == k and not torch.equal(g_idx.long(), trivial):
        return _dense(codes, zeros, scales, g_idx.long()), f"int{bits} g{group} act-order", "act-order groups (g_idx) are not contiguous column ranges"
    if groups != -(-k // g):
        raise LowbitError(f"{module}: {groups} scale groups do not fit {k} inputs with group size {group}")
    top = (1 << bits) - 1
    if bool((zeros > top).any()):
        return _dense(codes, zeros, scales, trivial), f"int{bits} g{group}", f"a v1 zero point of {top + 1} is outside lowbit's 0..{top}"
    symmetric = bool((zeros == 1 << (bits - 1)).all())
    name = f"int{bits}" + ("" if symmetric else "-asym")
    spec = parse_spec(name, group if group > 0 else -1, scale_dtype="float16")
    qweight_out = (codes.to(torch.int16) - 128).to(torch.int8) if bits == 8 else pack_bits(codes, bits)
    tensors = {"qweight": qweight_out, "scales": scales.to(torch.float16)}
    if not symmetric:
        tensors["zeros"] = zeros.to(torch.uint8)
    return QTensor.from_tensors(tensors, {"spec": spec.to_dict(), "shape": [n, k]}, where=module)


def _dense(codes, zeros, scales, g_idx) -> torch.Tensor:
    s = scales.float()[:, g_idx]
    z = zeros.float()[:, g_idx]
    return (codes.float() - z) * s
