"""native/gptq_columns.c against its torch twin (quant/gptq.int_block_torch): the integers, their
values, the scaled errors, the updated block and the weights kept in bf16, for symmetric bounds
(two numbers) and asymmetric ones (per element), with rows split over threads. Bit for bit, except where torch's addr_ runs a
scalar tail (the last elements of a row, or of a thread's share of it) without fusing the
multiply-add: there the block and the errors may differ by a rounding, on well under 1 % of
the elements (a C loop that did not fuse would differ on 5-50 %)."""

from __future__ import annotations

import pytest
import torch

from lowbit.native import gptq_columns as cpu_gptq
from lowbit.compress.gptq import int_block_torch


def _case(b: int, n: int, asymmetric: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(b, n, generator=gen)
    a = torch.randn(b, b, generator=gen)
    u = torch.linalg.cholesky(a @ a.T / b + torch.eye(b)).T.contiguous()  # an upper factor like GPTQ's
    scale = 0.02 + 0.1 * torch.rand(b, n, generator=gen)
    scale[0, :5] = 0.0  # all-zero groups: GPTQ's safe divisor turns 0 into 1
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    if asymmetric:
        zero = torch.randint(0, 16, (b, n), generator=gen).float()
        return block, u, divisor, scale, -zero, 15.0 - zero
    return block, u, divisor, scale, -128.0, 127.0


@pytest.mark.parametrize("with_keep", [False, True], ids=["coded", "kept"])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["bounds", "per-element"])
@pytest.mark.parametrize("b, n", [(1, 7), (32, 304), (128, 1000), (64, 3072)])
def test_c_block_is_the_torch_block_bit_for_bit(b, n, asymmetric, with_keep):
    assert cpu_gptq.available(), "the C library did not build"
    block, u, divisor, scale, lo, hi = _case(b, n, asymmetric)
    keep = torch.rand(b, n, generator=torch.Generator().manual_seed(5)) < 0.05 if with_keep else None
    outs = []
    for run in (cpu_gptq.int_block, int_block_torch):
        x = block.clone()
        ints, values, errors, kept = (torch.full((b, n), float("nan")) for _ in range(4))
        run(x, u, divisor, scale, lo, hi, ints, values, errors, *((keep, kept) if with_keep else ()))
        outs.append((x, ints, values, errors) + ((kept,) if with_keep else ()))
    for c_out, torch_out, name in zip(*outs, ("block", "ints", "values", "errors", "kept")):
        torch.testing.assert_close(c_out, torch_out, rtol=1e-4, atol=1e-5, msg=name)
        assert (c_out != torch_out).float().mean() < 0.01, name
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][2], outs[1][2])  # ints, values
    if with_keep:
        kept = outs[0][4]
        assert torch.equal(kept, outs[1][4])
        assert not outs[0][1][keep].any() and not outs[0][2][keep].any() and not kept[~keep].any()
    x, ints, values, errors = outs[0][:4]
    low = lo if isinstance(lo, float) else lo.min().item()
    assert ints.min() >= low and torch.equal(ints, ints.round())
    assert torch.equal(values, ints * scale)


def test_transposed_factor_is_read_by_rows():
    """u may come as a view with a non-unit column stride (GPTQ's factor is a transpose)."""
    block, u, divisor, scale, lo, hi = _case(16, 40, False)
    results = []
    for factor in (u, u.T.contiguous().T):
        x = block.clone()
        ints, values, errors = (torch.empty(16, 40) for _ in range(3))
        cpu_gptq.int_block(x, factor, divisor, scale, lo, hi, ints, values, errors)
        results.append(errors)
    assert torch.equal(*results)


def test_bad_layouts_are_refused():
    block, u, divisor, scale, lo, hi = _case(8, 16, False)
    ints, values, errors = (torch.empty(8, 16) for _ in range(3))
    with pytest.raises(ValueError, match="float32"):
        cpu_gptq.int_block(block.double(), u, divisor, scale, lo, hi, ints, values, errors)
    with pytest.raises(ValueError, match="stride"):
        cpu_gptq.int_block(block.T.contiguous().T, u, divisor, scale, lo, hi, ints, values, errors)
    with pytest.raises(ValueError, match="together"):
        cpu_gptq.int_block(block, u, divisor, scale, lo, hi, ints, values, errors, torch.zeros(8, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        cpu_gptq.int_block(block, u, divisor, scale, lo, hi, ints, values, errors, torch.zeros(8, 16), torch.empty(8, 16))


def test_grid_block_refuses_bad_tables_and_codes():
    from lowbit.quant import get_format, parse_spec

    grid = get_format(parse_spec("nvfp4")).element_grid(parse_spec("nvfp4"))
    block, u, divisor, scale, _, _ = _case(8, 16, False)
    values, errors = torch.empty(8, 16), torch.empty(8, 16)
    with pytest.raises(ValueError, match="uint8"):
        cpu_gptq.grid_block(block, u, divisor, scale, grid, torch.empty(8, 16), values, errors)
    import dataclasses

    short = dataclasses.replace(grid, tie_up=grid.tie_up[:-1])
    with pytest.raises(ValueError, match="tables"):
        cpu_gptq.grid_block(block, u, divisor, scale, short, torch.empty(8, 16, dtype=torch.uint8), values, errors)
