"""Each format's ElementGrid (quant/element_grid.py) against its own quantize_group_values, on every grid value,
every midpoint (ties) and its float32 neighbours, ±0, saturation and random values: the tables
GPTQ's C loop reads must be the format's rounding, code for code."""

from __future__ import annotations

import pytest
import torch

from lowbit.quant import get_format, parse_spec

FORMATS = ["nvfp4", "mxfp4", "fp8", "fp8-block128", "nf4"]


def grid_quantize(y: torch.Tensor, grid) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, values at scale 1) by the grid's rule, written independently of the C code."""
    mag = y.double().abs() if grid.sign_bit else y.double()
    index = torch.bucketize(mag, grid.mids, right=False)  # how many midpoints lie below
    on_mid = (index < grid.mids.numel()) & (mag == grid.mids[index.clamp(max=grid.mids.numel() - 1)])
    index = index + (on_mid & grid.tie_up.bool()[index.clamp(max=grid.mids.numel() - 1)]).long()
    codes, values = grid.codes[index], grid.values[index]
    if grid.sign_bit:
        negative = torch.signbit(y)
        codes = torch.where(negative, codes | grid.sign_bit, codes)
        values = torch.where(negative, -values, values)
    return codes, values


def probes(grid) -> torch.Tensor:
    mids = grid.mids.float()
    points = torch.cat([grid.values, mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                        torch.nextafter(mids, torch.full_like(mids, -1e9)), grid.values[-1:] * 1.5, grid.values[-1:] * 100,
                        torch.randn(4000, generator=torch.Generator().manual_seed(0)) * grid.values.abs().max() / 3])
    return torch.cat([points, -points, torch.tensor([0.0, -0.0])])


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_grid_is_the_formats_element_quantizer(fmt_name):
    spec = parse_spec(fmt_name)
    fmt = get_format(spec)
    grid = fmt.element_grid(spec)
    assert grid.values.dtype == torch.float32 and grid.mids.dtype == torch.float64
    assert torch.all(grid.values[1:] > grid.values[:-1]) and torch.all(grid.mids[1:] > grid.mids[:-1])
    y = probes(grid)
    codes, values = fmt.quantize_group_values(y[:, None], torch.ones(y.numel(), 1), None, spec)
    want_codes, want_values = grid_quantize(y, grid)
    assert torch.equal(codes[:, 0], want_codes.to(codes.dtype))
    assert torch.equal(values[:, 0], want_values) and torch.equal(torch.signbit(values[:, 0]), torch.signbit(want_values))


def test_formats_without_a_grid_are_the_integer_ones():
    """Integer grids run their own loop (native/gptq_columns.c int_block); every other format
    offers an ElementGrid, so no format is left on the slow generic loop."""
    from lowbit.quant import intq
    from lowbit.quant.registry import _MODULES

    for family in _MODULES:
        fmt = get_format(family)
        assert hasattr(fmt, "element_grid") != (fmt.quantize_group_values is intq.quantize_group_values), family
