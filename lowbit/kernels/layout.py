"""Layout facts every kernel path reads from the format layer, never from its own constants.

`code_table(qt)` asks the format module what each element code is worth (scale 1, zero point
0), `group_scales(qt)` returns the decoded float32 scales [N, G] and zero points the reference
dequantizes with, and `codes(qt)` the unpacked element codes [N, K]. A kernel that keeps the
stored one-byte scale codes instead gets their value table from `scale_code_table(qt)`.
"""

from __future__ import annotations

import torch

from lowbit.quant.groups import GroupScales
from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import get_format


def codes(qt: QTensor) -> torch.Tensor:
    """uint8 element codes [N, K], unpacked from the stored bit stream."""
    return get_format(qt.spec).unpack(qt.qweight, qt.spec, qt.shape[1]).to(torch.uint8)


def code_table(qt: QTensor) -> torch.Tensor:
    """float32 [2**bits]: the value of each element code at scale 1 (zero point 0 when asymmetric)."""
    fmt = get_format(qt.spec)
    all_codes = torch.arange(1 << qt.spec.bits, dtype=torch.int32).to(torch.uint8).reshape(1, -1)
    zero = None if qt.spec.symmetric else torch.zeros(1, 1)
    return fmt.dequantize_codes(all_codes, torch.ones(1, 1), zero, qt.spec).reshape(-1).float()


def group_scales(qt: QTensor) -> GroupScales:
    """Decoded float32 scales [N, G] (and zero points) with the group size they apply to."""
    return get_format(qt.spec).scales_from_parts(qt.to("cpu"))


def scale_code_table(qt: QTensor, unit_global: bool = False) -> torch.Tensor | None:
    """float32 [256]: decoded value of each stored scale byte, when scales are one-byte codes per row group.

    None when scales are wider than a byte or are not one code per (row, group). `unit_global`
    decodes with the per-tensor global scale (nvfp4) set to 1, for kernels that apply it last.
    """
    scales = qt.scales
    n, k = qt.shape
    if scales.element_size() != 1 or scales.dim() != 2 or scales.shape[0] != n or qt.spec.double_quant:
        return None
    codes_row = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(scales.dtype).reshape(1, 256)
    others = {name: t.cpu() for name, t in qt.parts().items() if name not in ("qweight", "scales", "zeros")}
    if unit_global and "global_scale" in others:
        others["global_scale"] = torch.ones_like(others["global_scale"])
    fake = QTensor(spec=qt.spec, shape=(1, 256 * (qt.spec.group_size or k)), qweight=qt.qweight[:1].cpu(), scales=codes_row, **others)
    table = get_format(qt.spec).scales_from_parts(fake).scale.reshape(-1).float()
    return table if table.numel() == 256 else None
