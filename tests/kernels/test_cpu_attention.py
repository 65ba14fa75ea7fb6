"""The fused CPU decode attention (native/paged_decode.c) against the float64 oracle, and its
batch invariance (rows of a step alone == together, bit for bit)."""

import pytest
import torch

from lowbit.kernels import cpu_attention
from lowbit.runtime.engine.paged_attention import reference_attention
from lowbit.runtime.layers import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_attention.supported(torch.float32, 64), reason="no C compiler")
BS = 4
# (query heads, KV heads, head size): the generic vector path, the register paths of head sizes
# 64/128/256 (SmolLM2's 9/3 grouping, Gemma-3's 4/1), and the scalar path of a size that is not
# a multiple of 16
SHAPES = [(6, 2, 16), (9, 3, 64), (8, 2, 128), (4, 1, 256), (4, 2, 24)]


def setup(dtype, spans, shape, seed=0):
    h, kvh, d = shape
    g = torch.Generator().manual_seed(seed)
    slots_total = 64
    pools = [torch.randn(slots_total, kvh, d, generator=g).to(dtype) for _ in range(2)]
    tables = [torch.randperm(16, generator=g)[:6].tolist() for _ in spans]
    rows = []
    for b, (start, n) in enumerate(spans):
        for i in range(n):
            p = start + i
            rows.append((b, p, tables[b][p // BS] * BS + p % BS))
    t = len(rows)
    q = torch.randn(t, h * d, generator=g).to(dtype)
    k = torch.randn(t, kvh * d, generator=g).to(dtype)
    v = torch.randn(t, kvh * d, generator=g).to(dtype)
    ang = torch.rand(t, d // 2, generator=g) * 6
    return pools, tables, rows, q, k, v, ang.cos().to(dtype), ang.sin().to(dtype)


def run(pools, tables, rows, q, k, v, cos, sin, window):
    kp, vp = pools[0].clone(), pools[1].clone()
    pos = torch.tensor([r[1] for r in rows])
    out = cpu_attention.paged_decode(q, k, v, cos, sin, pos, torch.tensor([r[2] for r in rows]), torch.tensor([r[0] for r in rows]),
                                     torch.tensor(tables), kp, vp, BS, window, 0.25)
    return out, kp, vp


def rotated(x, heads, d, cos, sin):
    return apply_rotary(x.view(-1, heads, d)[None].transpose(1, 2), cos[None, None], sin[None, None])[0].transpose(0, 1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_attention_after_rope_and_write(window, shape, pool_dtype):
    # a bf16 pool under float32 rows is --kv-dtype bf16: k rotated in float32, then k and v rounded
    # to bf16 as they are written; attention in float32 over the stored values
    h, kvh, d = shape
    spans = [(5, 1), (9, 3), (0, 2)]
    pools, tables, rows, q, k, v, cos, sin = setup(torch.float32, spans, shape)
    out, kp, vp = run([p.to(pool_dtype) for p in pools], tables, rows, q, k, v, cos, sin, window)
    assert kp.dtype == vp.dtype == pool_dtype and out.dtype == torch.float32
    qr, kr = rotated(q, h, d, cos, sin), rotated(k, kvh, d, cos, sin)
    for i, (b, p, slot) in enumerate(rows):  # RoPE as torch does it
        assert torch.equal(kp[slot], kr[i].to(pool_dtype)) and torch.equal(vp[slot], v[i].view(kvh, d).to(pool_dtype))
    for i, (b, p, _) in enumerate(rows):
        ctx = [tables[b][j // BS] * BS + j % BS for j in range(p + 1)]
        ref = reference_attention(qr[i : i + 1].double(), kp[ctx].double(), vp[ctx].double(), torch.tensor([p]), 0.25, window)
        assert (out[i].view(h, d).double() - ref[0]).abs().max() < 1e-5


def test_a_pool_of_another_dtype_is_refused():
    pools, tables, rows, q, k, v, cos, sin = setup(torch.bfloat16, [(5, 1)], SHAPES[1])
    with pytest.raises(ValueError, match="float32 KV pool under torch.bfloat16 queries"):
        run([p.float() for p in pools], tables, rows, q, k, v, cos, sin, None)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_bf16_rope_rounds_like_torch(shape):
    h, kvh, d = shape
    pools, tables, rows, q, k, v, cos, sin = setup(torch.bfloat16, [(5, 3)], shape)
    _, kp, _ = run(pools, tables, rows, q, k, v, cos, sin, None)
    kr = rotated(k, kvh, d, cos, sin)
    for i, (_, _, slot) in enumerate(rows):
        assert torch.equal(kp[slot], kr[i])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_each_row_alone_equals_rows_together(dtype, pool_dtype, shape):
    # 5 rows take a KV head's query heads in one pass, 1 row takes them one by one: same bits
    spans = [(7, 5)]  # a speculative verify of 1 + 4 rows
    pools, tables, rows, q, k, v, cos, sin = setup(dtype, spans, shape, seed=1)
    pools = [p.to(pool_dtype) for p in pools]
    together, kp, vp = run(pools, tables, rows, q, k, v, cos, sin, None)
    for i in range(len(rows)):
        # row i alone, with the earlier rows' keys already in the pool (as plain decoding has them)
        alone, _, _ = run([kp, vp], tables, rows[i : i + 1], q[i : i + 1], k[i : i + 1], v[i : i + 1],
                          cos[i : i + 1], sin[i : i + 1], None)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_heads_split_any_way_give_the_same_bits(pool_dtype, shape):
    # few rows: each thread takes a contiguous run of the rows' query heads, cut by the positions
    # they read (paged_decode.c heads_share), so 1-5 threads cut a KV head's group in different
    # places and read it in runs of different sizes; a head's numbers must not change. Two rows of
    # different lengths (a long one and a short one) make the cuts uneven.
    pools, tables, rows, q, k, v, cos, sin = setup(torch.float32, [(20, 1), (2, 1)], shape, seed=2)
    pools = [p.to(pool_dtype) for p in pools]
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in range(1, 6):
            torch.set_num_threads(n)
            outs.append(run(pools, tables, rows, q, k, v, cos, sin, None)[0])
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    h, kvh, d = shape
    qr = rotated(q, h, d, cos, sin)
    kp, vp = run(pools, tables, rows, q, k, v, cos, sin, None)[1:]
    for i, (b, p, _) in enumerate(rows):
        ctx = [tables[b][j // BS] * BS + j % BS for j in range(p + 1)]
        ref = reference_attention(qr[i : i + 1].double(), kp[ctx].double(), vp[ctx].double(), torch.tensor([p]), 0.25, None)
        assert (outs[0][i].view(h, d).double() - ref[0]).abs().max() < 1e-5
