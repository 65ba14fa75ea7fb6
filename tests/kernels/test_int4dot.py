"""The batch-invariant int4 kernel (native/int4_dot.c) against the float64 oracle, row by row."""

import pytest
import torch

from lowbit.kernels import cpu_int4dot, prepare, qmatmul
from tests.kernels.cases import SHAPES, oracle, quantized, rel_err

pytestmark = pytest.mark.skipif(not cpu_int4dot.bf16_available(), reason="no AVX512-BF16 build on this machine")
LABELS = ["int4", "int4-asym-g64", "int4-asym", "int4-channel"]


@pytest.fixture(autouse=True)
def bf16_activations(monkeypatch):
    # this file checks the bf16-activation route; tests/kernels/test_int4vnni.py the int8 one
    monkeypatch.setenv(cpu_int4dot.ACTIVATIONS_ENV, "bf16")


@pytest.mark.parametrize("label", LABELS)
def test_equals_float32_matmul_of_bf16_activations(label):
    # Only the activations are rounded (to bf16); products are exact and sums float32.
    for n, k in SHAPES + [(40, 576)]:
        qt = quantized(label, n, k)
        pw = prepare(qt, "cpu")
        assert pw.path == "cpu-int4dot"
        for m in (1, 2, 3, 4, 5, 8, 16, 33):  # 4-row passes, ragged ones; 33: two full 16-row passes and one row
            x = torch.randn(m, k).to(torch.bfloat16).float()
            assert rel_err(qmatmul(x, pw), oracle(x, qt)) < 1e-5, (label, n, k, m)
            y16 = qmatmul(x.to(torch.bfloat16), pw)
            assert y16.dtype == torch.bfloat16 and rel_err(y16, oracle(x, qt)) < 2**-7


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_at_once_equal_each_row_alone_bit_for_bit(label, dtype):
    qt = quantized(label, 37, 576)  # a ragged 4-row tile and a ragged group
    pw = prepare(qt, "cpu")
    for m in [*range(2, cpu_int4dot.PASS_ROWS + 1), 2 * cpu_int4dot.PASS_ROWS + 5, 100]:  # prefill sizes too
        x = torch.randn(m, 576).to(dtype)
        together = qmatmul(x, pw)
        alone = torch.cat([qmatmul(x[i : i + 1], pw) for i in range(m)])
        assert torch.equal(together, alone), (label, m)


def test_joined_weights_equal_their_parts():
    a, b, c = (quantized("int4", n, 192) for n in (64, 30, 30))
    parts = [prepare(q, "cpu") for q in (a, b, c)]
    joined = cpu_int4dot.concat(parts)
    x = torch.randn(3, 192)
    assert torch.equal(qmatmul(x, joined), torch.cat([qmatmul(x, p) for p in parts], dim=-1))
    x = torch.randn(40, 192)  # a prefill's rows: the same kernel in passes of 16 rows
    assert torch.equal(qmatmul(x, joined), torch.cat([qmatmul(x, p) for p in parts], dim=-1))
    with pytest.raises(ValueError):
        cpu_int4dot.concat([parts[0], prepare(quantized("int4-asym-g64", 8, 128), "cpu")])


@pytest.mark.parametrize("label", ["int4-g64", "int4", "int4-asym-g64", "int4-asym", "int4-channel"])
@pytest.mark.parametrize("n,k", [(17, 130), (53, 257), (80, 64)])
def test_odd_shapes_match_oracle_and_every_row_count(label, n, k):
    # Output rows padded to tiles of 16 (and groups of four tiles), K to whole 64s and to chunks
    # of 4, ragged last groups: each row of an M-row call equals the float64 dequantize-then-
    # matmul of bf16-rounded x (1e-5: float32 sums over K <= 257 exact products, cases.py) and
    # is bit-identical to that row alone, for every M the fused kernel takes.
    qt = quantized(label, n, k)
    pw = prepare(qt, "cpu")
    assert pw.path == "cpu-int4dot"
    x = torch.randn(2 * cpu_int4dot.PASS_ROWS + 3, k).to(torch.bfloat16).float()  # float32 out
    alone = torch.cat([qmatmul(x[i : i + 1], pw) for i in range(x.shape[0])])
    assert rel_err(alone, oracle(x, qt)) < 1e-5, label
    for m in range(1, x.shape[0] + 1):
        assert torch.equal(qmatmul(x[:m], pw), alone[:m]), (label, m)


def test_tiled_layout_round_trips():
    codes = torch.randint(0, 16, (53, 130), dtype=torch.uint8)
    tiled = cpu_int4dot.tile_codes(codes)
    assert tiled.shape == (1, 32 * 192)  # 53 rows -> one group of four 16-row tiles; K -> 192
    assert torch.equal(cpu_int4dot.untile_codes(tiled, 53, 130), codes)
    # byte 2i+p of chunk c of tile t: row 16t + i, code 4c + p low, 4c + 2 + p high
    t, c, i, p = 2, 5, 7, 1
    byte = int(tiled[0, (c * 4 + t) * 32 + 2 * i + p])
    assert byte == int(codes[16 * t + i, 4 * c + p]) | int(codes[16 * t + i, 4 * c + 2 + p]) << 4
    scales = torch.randn(53, 3)
    assert torch.equal(cpu_int4dot.untile_groups(cpu_int4dot.tile_groups(scales), 53), scales)
