"""Number formats: what every other floor asks about a format (compress/'s GPTQ and AWQ, kernels,
exporters, `lowbit plan`); nothing re-derives a bit layout elsewhere. The methods that quantize
whole models are in lowbit/compress/ (its package docstring).

One interface for all formats
-----------------------------
`FormatSpec` (quant/spec.py, frozen): name ("int4", "int4-asym", "int8", "int3", "int2",
"nf4", "fp8", "fp8-e5m2", "mxfp4", "nvfp4"), bits, group_size (None = per row / per tensor),
symmetric, scale_dtype, granularity ("group" | "channel" | "tensor" | "block"), scale_rule,
double_quant, layout_version. `parse_spec("int4-asym-g64")` builds one; `spec.label` prints it back.

`QTensor` (quant/qtensor.py): packed parts (qweight, scales, zeros, global_scale,
scales_scale, scales_offset — which exist depends on the spec), the logical shape
(out_features, in_features) and the spec. `to_tensors()` + `meta()` ⇄ `QTensor.from_tensors()`
is lossless; `dequantize(dtype)`, `nbytes`, `bits_per_weight`.

Each format module (intq, nf4, fp8, mxfp4, nvfp4) has the same functions; get one with
`registry.get_format(spec)`:
  quantize(w[N,K], spec, *, scales=None, stats=None, global_scale=None) -> QTensor
  compute_scales(w, spec, *, stats=None, global_scale=None) -> GroupScales
      stats: optional per-input-channel error weights [K] (E[x^2], diag H) for the scale search
  quantize_group_values(x, scale, zero, spec) -> (codes uint8, values float32)   element quantizer
  fake_quantize_column(column[N], scales, k, spec) -> (codes[N], values[N])       GPTQ's column step
  dequantize_codes(codes, scale, zero, spec), scales_from_parts(qt) -> GroupScales
  pack(codes[N,K], spec) / unpack(packed, spec, K)   bit order in each module's docstring
  part_layout(spec, (N, K)) -> {part: (shape, dtype)}  the exact stored layout
  dequantize(qt, dtype) ; bits_per_weight(spec, in_features, out_features)
`GroupScales` (quant/groups.py) carries decoded float32 scales [N, G] (+ zero points) and the
exact stored scale tensors; `scale[:, k // group_size]` applies to input column k.

Registry (quant/registry.py): get_format, parse_spec, list_formats, part_layout,
weight_bytes(spec, shape), bits_per_weight(spec, shape).
Round to nearest: quant/rtn.py `quantize_rtn(w, spec, stats=None, global_scale=None)`,
`shared_global_scale(weights, spec)` for fused nvfp4 layers, `relative_error(w, qt)`.

Shared conventions
------------------
- Groups run along the input dimension K; G = ceil(K / g). A ragged last group (K = 576,
  g = 128 → 64 columns) gets exactly the result a 64-wide group would; stored tensors are never
  padded (quant/groups.py).
- Sub-byte codes are packed along K as a little-endian bit stream: 4-bit element 2i is the low
  nibble of byte i (quant/packing.py).
- Element rounding: integers round half to even; E2M1/E4M3/E5M2 round to nearest, ties to the
  even code, saturating (quant/minifloat.py).
- Scales are searched by default (scale_rule "mse": least squared error per group over the
  plain rule and clipped candidates); "absmax" (and mxfp4's "floor"/"roundup") give the plain rules.
- NaN/inf weights raise LowbitError naming the first position; a group size a format cannot
  use raises UsageError.
"""

from lowbit.quant.groups import GroupScales
from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import bits_per_weight, get_format, list_formats, parse_spec, weight_bytes
from lowbit.quant.spec import FormatSpec

__all__ = [
    "FormatSpec",
    "GroupScales",
    "QTensor",
    "bits_per_weight",
    "get_format",
    "list_formats",
    "parse_spec",
    "weight_bytes",
]
