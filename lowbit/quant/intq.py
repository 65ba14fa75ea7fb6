"""Integer formats: int2, int3, int4 and int8, symmetric or asymmetric, per group or per row.

Element codes are unsigned u in [0, 2^b - 1] and dequantize as (u - z) * scale:
  symmetric   z = 2^(b-1) fixed (int4: u - 8 in -8..7), no zero tensor stored
  asymmetric  z = the group's zero point, an integer in [0, 2^b - 1], stored uint8
Scales may be negative in symmetric formats: the Q4_0-style rule puts a group's
largest-magnitude weight m exactly on code -2^(b-1) (scale = -m / 2^(b-1)), using the extra
negative level for whichever sign m has.

Stored parts for W[N, K], group size g (g = K for per-row scales), G = ceil(K / g):
  qweight  b < 8: uint8 [N, ceil(K*b/8)], codes u packed along K as a little-endian bit stream
           (4 bits: byte i = element 2i in the LOW nibble, element 2i+1 in the high nibble;
           see quant/packing.py);  b = 8: int8 [N, K] holding u - 128 (the signed code) so
           torch's int8 matmul can read it directly
  scales   [N, G] in the spec's scale dtype (float16 by default)
  zeros    asymmetric only: uint8 [N, G]
Bits per weight = b + (scale bits [+ 8 zero bits]) / g.

Double quantization (`dq`, group scales only; llama.cpp's k-quants do the same with 6-bit codes
per 256-weight super-block): each group's scale is an 8-bit code times one float16 step per row,
scale = code · d_n (asymmetric: code in 0..255; symmetric: signed code in −127..127), and
asymmetric zero points are packed at b bits. Parts: scales uint8/int8 [N, G], scales_scale
float16 [N] (d_n), zeros uint8 [N, ceil(G·b/8)]. int4-asym-g32-dq is 4 + (8 + 4)/32 = 4.375 bits
plus 16/K per row, where int4-asym-g32 is 4.75. The scale search runs on the code grid: the
row's step comes from the best unconstrained scales, then every candidate is rounded onto it.

Scale choice (spec.scale_rule):
  absmax  symmetric: extreme → -2^(b-1) (llama.cpp Q4_0's rule); asymmetric: the group's min/max
  mse     (default) the absmax candidate plus 17 clipped/stretched ones (the extreme mapped to
          -2^(b-1) * r, r in 0.75..1.25; asymmetric: min and max shrunk together by 1..0.5, like
          AWQ's clip search);
          per group the one with the least squared error, weighted per input channel by `stats`
          when given. Rounding of elements is round-half-to-even (torch.round).
"""

from __future__ import annotations

import torch

from lowbit.native import scale_search as cpu_scale_search
from lowbit.quant import codec
from lowbit.quant.groups import (
    GroupScales,
    check_weight,
    grouped_weights,
    grouped,
    num_groups,
    round_scale,
    safe_divisor,
    scale_torch_dtype,
    search_best,
)
from lowbit.quant.packing import pack_bits, packed_width, unpack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec
from lowbit.errors import UsageError

_SYM_GRID = torch.linspace(0.75, 1.25, 17).tolist()
_ASYM_SHRINK = torch.linspace(1.0, 0.5, 21).tolist()[1:]


def group_size_of(spec: FormatSpec, in_features: int) -> int:
    return spec.group_size if spec.granularity == "group" else in_features


def part_layout(spec: FormatSpec, shape: tuple[int, int]) -> dict:
    n, k = shape
    g = num_groups(k, group_size_of(spec, k))
    if spec.bits == 8:
        layout = {"qweight": ((n, k), torch.int8)}
    else:
        layout = {"qweight": ((n, packed_width(k, spec.bits)), torch.uint8)}
    if spec.double_quant:
        layout["scales"] = ((n, g), torch.int8 if spec.symmetric else torch.uint8)
        layout["scales_scale"] = ((n,), torch.float16)
        if not spec.symmetric:
            layout["zeros"] = ((n, packed_width(g, spec.bits)), torch.uint8)
        return layout
    layout["scales"] = ((n, g), scale_torch_dtype(spec.scale_dtype))
    if not spec.symmetric:
        layout["zeros"] = ((n, g), torch.uint8)
    return layout


def quantize_group_values(x, scale, zero, spec: FormatSpec):
    """Codes u = clamp(round(x / scale) + z) and their values (u - z) * scale (float32)."""
    top = (1 << spec.bits) - 1
    mid = zero if zero is not None else float(1 << (spec.bits - 1))
    codes = (torch.round(x / safe_divisor(scale)) + mid).clamp(0, top)
    return codes.to(torch.uint8), (codes - mid) * scale


def _fake_quantize(x, scale, zero, spec: FormatSpec):
    """The values of quantize_group_values without the codes, in place (the scale search's hot loop)."""
    top = (1 << spec.bits) - 1
    mid = zero if zero is not None else float(1 << (spec.bits - 1))
    q = torch.round(x / safe_divisor(scale)).add_(mid).clamp_(0, top)
    return q.sub_(mid).mul_(scale)


def dequantize_codes(codes, scale, zero, spec: FormatSpec):
    mid = zero if zero is not None else float(1 << (spec.bits - 1))
    return (codes.float() - mid) * scale


def compute_scales(w, spec: FormatSpec, *, stats=None, global_scale=None) -> GroupScales:
    if global_scale is not None:
        raise UsageError(f"{spec.label} has no global scale")
    w = check_weight(w)
    k = w.shape[1]
    g = group_size_of(spec, k)
    wg = grouped(w, g)
    weight = grouped_weights(stats, k, g, w.device)
    rounder = lambda x: round_scale(x, spec.scale_dtype)  # noqa: E731
    best = _search(wg, weight, spec, rounder)
    if spec.double_quant:
        step = _row_step(best[0].squeeze(-1), spec)
        best = _search(wg, weight, spec, lambda x: _on_grid(x, step[:, None, None], spec))
        return _double_quantized(best[0].squeeze(-1), None if spec.symmetric else best[1].squeeze(-1), step, g, spec)
    scale = best[0].squeeze(-1)
    stored = {"scales": scale.to(scale_torch_dtype(spec.scale_dtype))}
    zero = None
    if not spec.symmetric:
        zero = best[1].squeeze(-1)
        stored["zeros"] = zero.to(torch.uint8)
    return GroupScales(scale=scale, zero=zero, group_size=g, stored=stored)


def _search(wg, weight, spec: FormatSpec, rounder):
    candidates = _symmetric_candidates(wg, spec, rounder) if spec.symmetric else _asymmetric_candidates(wg, spec, rounder)
    if not cpu_scale_search.available() or wg.dtype != torch.float32:
        return search_best(wg, weight, candidates, lambda x, s, z=None: _fake_quantize(x, s, z, spec))
    # The same errors in one C pass per group (native/scale_search.c), summed in double; ties keep
    # the earlier candidate, as search_best does.
    candidates = list(candidates)
    parts = [torch.stack([c[p].squeeze(-1) for c in candidates]) for p in range(len(candidates[0]))]
    errors = cpu_scale_search.candidate_errors(wg, weight, parts[0], parts[1] if len(parts) > 1 else None,
                                               float(1 << (spec.bits - 1)), float((1 << spec.bits) - 1))
    best = errors.argmin(0, keepdim=True)  # the first of equal minima
    return tuple(p.gather(0, best).squeeze(0).unsqueeze(-1) for p in parts)


def _code_max(spec: FormatSpec) -> int:
    return 127 if spec.symmetric else 255


def _row_step(scale: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """dq: each row's float16 step d (as float32) so that its largest |scale| is the top code."""
    step = (scale.abs().amax(-1) / _code_max(spec)).to(torch.float16).float()
    # a step that rounds down would clip the largest scale by a code; one ulp up never does
    bumped = torch.nextafter(step.half(), torch.tensor(float("inf"), dtype=torch.float16)).float()
    step = torch.where(step * _code_max(spec) < scale.abs().amax(-1), bumped, step)
    return torch.where(step > 0, step, torch.ones_like(step))


def _on_grid(scale: torch.Tensor, step: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    top = _code_max(spec)
    return (torch.round(scale / step).clamp(-top, top)) * step


def _double_quantized(scale, zero, step, group_size: int, spec: FormatSpec) -> GroupScales:
    """GroupScales for dq from scales already on each row's grid (or any, rounded onto it)."""
    top = _code_max(spec)
    codes = torch.round(scale / step[:, None]).clamp(-top, top)
    stored = {
        "scales": codes.to(torch.int8 if spec.symmetric else torch.uint8),
        "scales_scale": step.to(torch.float16),
    }
    decoded = codes * step[:, None]
    if zero is not None:
        stored["zeros"] = pack_bits(zero.to(torch.uint8), spec.bits)
    return GroupScales(scale=decoded, zero=zero, group_size=group_size, stored=stored)


def _symmetric_candidates(wg, spec: FormatSpec, rounder):
    neg = float(1 << (spec.bits - 1))
    extreme = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))  # signed largest-magnitude value
    yield (rounder(-extreme / neg),)
    if spec.scale_rule == "mse":
        # Only the orientation that gives the extreme the wider (negative) side: on SmolLM2 adding
        # the other orientation halves the speed for 0.1% less error.
        for r in _SYM_GRID:
            yield (rounder(-extreme / (neg * r)),)


def _asymmetric_candidates(wg, spec: FormatSpec, rounder):
    top = float((1 << spec.bits) - 1)
    lo = wg.amin(-1, keepdim=True).clamp(max=0)
    hi = wg.amax(-1, keepdim=True).clamp(min=0)
    shrinks = [1.0] + (_ASYM_SHRINK if spec.scale_rule == "mse" else [])
    for p in shrinks:
        scale = rounder((hi - lo) * p / top)
        zero = torch.round(-lo * p / safe_divisor(scale)).clamp(0, top)
        yield scale, zero


def scales_from_values(scale: torch.Tensor, sc: GroupScales, spec: FormatSpec) -> GroupScales:
    """`sc` with new float32 scales [N, G] (zeros kept), rounded to the storage dtype (GPTQ's refit)."""
    if spec.double_quant:
        if not spec.symmetric:
            scale = scale.clamp(min=0)
        return _double_quantized(scale, sc.zero, _row_step(scale, spec), sc.group_size, spec)
    dtype = scale_torch_dtype(spec.scale_dtype)
    s = round_scale(scale.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max), spec.scale_dtype)
    stored = {"scales": s.to(dtype)}
    if sc.zero is not None:
        stored["zeros"] = sc.stored["zeros"]
    return GroupScales(scale=s, zero=sc.zero, group_size=sc.group_size, stored=stored)


def scales_from_parts(qt: QTensor) -> GroupScales:
    g = group_size_of(qt.spec, qt.shape[1])
    if qt.spec.double_quant:
        scale = qt.scales.float() * qt.scales_scale.float()[:, None]
        zero = None
        if qt.zeros is not None:
            zero = unpack_bits(qt.zeros, qt.spec.bits, qt.scales.shape[1]).float()
        return GroupScales(scale=scale, zero=zero, group_size=g, stored=qt.scale_parts())
    zero = None if qt.zeros is None else qt.zeros.float()
    return GroupScales(scale=qt.scales.float(), zero=zero, group_size=g, stored=qt.scale_parts())


def pack(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    if spec.bits == 8:
        return (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    return pack_bits(codes, spec.bits)


def unpack(packed: torch.Tensor, spec: FormatSpec, in_features: int) -> torch.Tensor:
    if spec.bits == 8:
        return (packed.to(torch.int16) + 128).to(torch.uint8)
    return unpack_bits(packed, spec.bits, in_features)


# The whole-matrix functions are the same for every format (quant/codec.py).
quantize, dequantize, fake_quantize_column, bits_per_weight = codec.public_functions(__name__)
