"""A dense head's greedy argmax through its int8 copy (kernels/screened_head.py, native/decode_layers.c
screened_argmax, int4_vnni.c lowbit_i4v_screen8): the copy is the published int8 rounding in groups
of 32 (float16 scales), its bound tables bound the true row errors and norms, the bound holds between
the copy's logits and the head kernel's own on every vocabulary entry, and the chosen tokens are the
whole head's first largest logit (ties, near ties, outlier features, packed and unpacked heads,
float32 and bf16 weights); where the screen cannot decide it says so."""

from __future__ import annotations

import math

import pytest
import torch

from lowbit.kernels import cpu_bf16pack, cpu_f32, cpu_int4dot, decode_chain, screened_head

pytestmark = pytest.mark.skipif(screened_head.build(torch.zeros(16, 32), False) is None,
                                reason="no AVX512-VNNI here (the copy's kernel)")


def _head(v: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Head-like rows: small weights, a few wide input channels (as trained embeddings have)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * 0.04
    w[:, 3] *= 25
    w[:, k // 2] *= 8
    return w.to(dtype).contiguous()


def _hidden(m: int, k: int, seed: int) -> torch.Tensor:
    """Final-norm outputs: mostly O(1), one massive channel (SmolLM2's reach ~37)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 1.5
    x[:, 11] = 37.0 * torch.sign(torch.randn(m, generator=g))
    return x


def _kernel_logits(w: torch.Tensor, x: torch.Tensor, bf16_x: bool) -> torch.Tensor:
    return cpu_f32.matmul(x, w, None, bf16_x and w.dtype is torch.bfloat16)


def _screen(w: torch.Tensor, bf16_x: bool):
    s = screened_head.build(w, bf16_x and w.dtype is torch.bfloat16)
    assert s is not None
    return s, decode_chain.dense_linear(w, None, bf16_x)


def test_the_copy_is_int8_in_groups_of_32_and_its_tables_bound_the_rows():
    w = _head(200, 96, 1)  # 200 rows: a ragged last group of 64 rows
    s = screened_head.build(w, True)
    pw = s.approx.keep
    codes = cpu_int4dot.untile_codes_vnni(pw.tensors["codes"], 200, 96, bits=8).long() - 128
    scales = cpu_int4dot.untile_groups(pw.tensors["scales"].float(), 200)  # [200, 3]
    wf = w.double().view(200, 3, 32)
    want_scale = (wf.abs().amax(-1) / 127).float().half().float()
    assert torch.equal(scales, want_scale)
    want_codes = torch.round(wf / want_scale.double()[..., None]).clamp(-127, 127).long().view(200, 96)
    assert torch.equal(codes, want_codes)
    back = (codes.view(200, 3, 32).double() * scales.double()[..., None]).view(200, 96)
    err = (w.double() - back).norm(dim=1)
    norm = torch.maximum(w.double().norm(dim=1), back.norm(dim=1))
    assert bool((s.err2.double() >= err).all()) and bool((s.err2.double() <= err * (1 + 1e-3) + 1e-30).all())
    assert bool((s.norm2.double() >= norm).all()) and bool((s.norm2.double() <= norm * (1 + 1e-3)).all())


@pytest.mark.parametrize("dtype, bf16_x", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
def test_the_bound_holds_between_the_copy_and_the_head_kernel(dtype, bf16_x):
    """|e_v - a_v| <= X2 err2_v + (D2 + gamma (2 X2 + D2)) norm2_v on every entry, X2 and D2 from
    x as each kernel rounds it (the C side's formula, in float64 here)."""
    v, k = 1024, 576
    w = _head(v, k, 2, dtype)
    s, _ = _screen(w, bf16_x)
    x = _hidden(8, k, 3)
    exact = _kernel_logits(w, x, bf16_x).double()
    approx = cpu_int4dot.matmul(x, s.approx.keep).double()
    xh = x.bfloat16().double() if bf16_x and dtype is torch.bfloat16 else x.double()
    xg = x.view(8, -1, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    q = torch.round(xg * (127.0 / amax)).double() * (amax / 127.0).double()  # int4_vnni.c's rounding of x
    x2 = xh.norm(dim=1, keepdim=True)
    d2 = (xh - q.view(8, k)).norm(dim=1, keepdim=True)
    gamma = (k + k // 32 + 48) * 2.0**-23
    bound = x2 * s.err2.double()[None] + (d2 + gamma * (2 * x2 + d2)) * s.norm2.double()[None]
    gap = (exact - approx).abs()
    assert bool((gap <= bound).all()), float((gap - bound).max())
    assert float((gap / bound).max()) > 0.05  # a bound, not a blanket: the rounding error reaches it
    # the C side's per-row numbers are these, rounded up by at most 2^-19
    for r in range(8):
        got = screened_head.row_bound(s, x[r])
        want = (float(x2[r]), float(d2[r] + gamma * (2 * x2[r] + d2[r])))
        for g_, w_ in zip(got[:2], want):
            assert w_ <= g_ <= w_ * (1 + 2.0**-19) + 1e-30
        assert 0 < got[2] < 1e-30


@pytest.mark.parametrize("dtype, bf16_x, packed", [(torch.bfloat16, True, True), (torch.bfloat16, True, False),
                                                   (torch.bfloat16, False, False), (torch.float32, False, False)])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 64, 70])  # 70: a pass of 64 rows, then one of 6
def test_tokens_are_the_whole_heads_argmax(dtype, bf16_x, packed, m):
    if packed and not cpu_bf16pack.enabled():
        pytest.skip("no packed bf16 kernel here")
    v, k = 4000, 640  # 4000: the last block of 16 rows and the last group of 64 rows are ragged
    w = _head(v, k, 4, dtype)
    s = screened_head.build(w, bf16_x and dtype is torch.bfloat16)
    head = decode_chain.dense_linear(w, None, bf16_x, cpu_bf16pack.pack(w) if packed else None)
    for seed in range(6):
        x = _hidden(m, k, 10 + seed)
        got = screened_head.argmax(s, head, x)
        assert got is not None
        assert torch.equal(got, _kernel_logits(w, x, bf16_x).argmax(dim=1)), seed


def test_ties_and_near_ties_pick_the_first_index():
    v, k = 2048, 576
    w = _head(v, k, 5)
    x = _hidden(4, k, 6)
    target = 1500
    w[target] = (x[0] * 0.02).bfloat16()  # row 0's clear winner
    w[700] = w[target]                    # the same logits: the first index wins
    w[1800] = w[target]
    w[1200] = w[target]
    w[1200, 0] = torch.nextafter(w[1200, 0].float(), torch.tensor(-math.inf)).bfloat16()  # just below, or above
    s, head = _screen(w, True)
    got = screened_head.argmax(s, head, x)
    logits = _kernel_logits(w, x, True)
    assert torch.equal(got, logits.argmax(dim=1))
    assert int(got[0]) in (700, 1200)  # whichever of the two near-equal rows the kernel ranks first


def test_x_that_is_not_finite_defers_to_the_whole_head():
    w = _head(512, 64, 7)
    s, head = _screen(w, True)
    x = _hidden(2, 64, 8)
    x[1, 5] = float("nan")
    assert screened_head.argmax(s, head, x) is None
    x[1, 5] = float("inf")
    assert screened_head.argmax(s, head, x) is None
    # in a later pass of rows (the first 64 screen, row 100 is not finite): the whole head for all
    x = _hidden(130, 64, 9)
    x[100, 3] = float("nan")
    assert screened_head.argmax(s, head, x) is None


def test_all_equal_logits_defer_or_pick_the_first():
    """x = 0: every logit is 0, every row a candidate: too many for the screen, or row 0."""
    w = _head(40000, 64, 10)
    s, head = _screen(w, True)
    got = screened_head.argmax(s, head, torch.zeros(1, 64))
    assert got is None or int(got[0]) == 0


def test_build_declines_what_it_cannot_screen():
    assert screened_head.build(torch.zeros(64, 48), False) is None  # K not a multiple of 32
    assert screened_head.build(torch.zeros(64, 64, dtype=torch.float16), False) is None
    assert screened_head.build(torch.zeros(64, 128)[:, :64], False) is None  # not contiguous


@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_of_near_equal_rows_past_the_records_falls_back_to_the_tiles_bounds(threads):
    """40000 equal rows first (every tile of them reaches the running bound, so a thread's records
    run out: 2048 tiles) and the winner near the end: the token still comes out of the screen,
    from the tiles' upper bounds, and matches the whole head."""
    v, k = 70000, 64
    w = _head(v, k, 11)
    x = _hidden(2, k, 12)
    w[:40000] = (x[0] * 0.001).bfloat16()
    w[69990] = (x[0] * 0.02).bfloat16()  # row 0's clear winner
    w[65000] = (x[1] * 0.02).bfloat16()  # row 1's
    s, head = _screen(w, True)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = screened_head.argmax(s, head, x)
        assert got is not None and got.tolist() == [69990, 65000]
        assert torch.equal(got, _kernel_logits(w, x, True).argmax(dim=1))
        w2 = w.clone()
        w2[:] = w[0]  # all equal: every row a candidate, more than the screen rescores
        s2, head2 = _screen(w2, True)
        assert screened_head.argmax(s2, head2, x) is None
    finally:
        torch.set_num_threads(old)
