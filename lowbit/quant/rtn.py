"""Round-to-nearest quantization with searched scales: the baseline method for every format.

RTN here means: each format's `compute_scales` picks per-group scales (by default the
candidate with the least squared error, optionally weighted per input channel by
calibration statistics such as E[x^2]), then every element rounds to its nearest code.
GPTQ and AWQ reuse the same pieces: GPTQ takes the scales and quantizes column by column
with `fake_quantize_column`; AWQ rescales the weight first and calls `quantize_rtn`.
"""

from __future__ import annotations

import torch

from lowbit.quant.groups import check_weight
from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import as_spec, get_format
from lowbit.quant.spec import FormatSpec


def quantize_rtn(
    w: torch.Tensor,
    spec: FormatSpec | str,
    *,
    stats: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> QTensor:
    """Quantize W[N, K] to `spec`. `stats`: optional per-input-channel error weights [K];
    `global_scale`: nvfp4's shared tensor scale for fused layers (see `shared_global_scale`)."""
    spec = as_spec(spec)
    return get_format(spec).quantize(w, spec, stats=stats, global_scale=global_scale)


def shared_global_scale(weights: list[torch.Tensor], spec: FormatSpec | str) -> torch.Tensor | None:
    """The global scale that layers running fused (q/k/v, gate/up) must share, or None when
    the format has none."""
    spec = as_spec(spec)
    fmt = get_format(spec)
    if not hasattr(fmt, "global_scale_for"):
        return None
    return fmt.global_scale_for(*weights)


def tensor_relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """‖approx − reference‖ / ‖reference‖ in float64 (the plain difference norm for an all-zero reference)."""
    ref = reference.double()
    diff = (approx.double() - ref).norm()
    norm = ref.norm()
    return float(diff / norm) if norm > 0 else float(diff)


def relative_error(w: torch.Tensor, qt: QTensor) -> float:
    """‖W − Ŵ‖ / ‖W‖ of a quantized weight, in float64 (0 for an all-zero W that dequantizes to zeros)."""
    return tensor_relative_error(check_weight(w), qt.dequantize(torch.float64))