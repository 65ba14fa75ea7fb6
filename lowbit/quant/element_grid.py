"""ElementGrid: a format's element quantizer written as tables (values, codes, midpoints, tie rule),
so that code outside the format (GPTQ's C column loop, native/gptq_columns.c) can run it. A module
of its own, below codec and the minifloat tables, which both build grids."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ElementGrid:
    """An element quantizer that rounds y = x / scale to the nearest of a fixed set of values and
    returns (code, value · scale), described as tables so other layers can run it (kernels/
    gptq_columns.c): index j = how many midpoints lie below y (|y| when sign_bit is set), plus one
    when y equals midpoint j and tie_up[j]; past the last midpoint the largest value (saturation).
    With sign_bit set the grid holds magnitudes and a negative y (−0 included) takes the code
    codes[j] | sign_bit and the value −values[j]. Each format's tests check it against the
    format's own quantize_group_values."""

    values: torch.Tensor  # float32 [G], ascending
    codes: torch.Tensor  # uint8 [G], the code of each value (without the sign bit)
    mids: torch.Tensor  # float64 [G − 1], ascending: the boundaries between neighbouring values
    tie_up: torch.Tensor  # uint8 [G − 1]: 1 where y exactly on mids[j] takes values[j + 1]
    sign_bit: int  # 0: values are signed; else the code bit of a negative y
