"""The C row ops (native/rowops.c) against torch's reference arithmetic and a float64 oracle, and
their batch invariance (a row alone == the same row among others, bit for bit, threaded or not)."""

import pytest
import torch
import torch.nn.functional as F

from lowbit.kernels import cpu_rowops

pytestmark = pytest.mark.skipif(not cpu_rowops.available(), reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def torch_norm(x, w, unit_offset):
    """runtime/layers.py RMSNorm.reference, written out."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (h * (1.0 + w.float())).type_as(x) if unit_offset else w * h.to(x.dtype)


def f64_norm(x, w, unit_offset):
    h = x.double()
    h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return h * ((1.0 + w.double()) if unit_offset else w.double())


def data(dtype, rows=5, dim=576, seed=0, unit_offset=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = (torch.randn(dim, generator=g) * 0.2 + (0.0 if unit_offset else 1.0)).to(dtype)
    return x, w


def ulps_apart(a, b):
    """Per element: how many representable values of a's dtype lie between a and b (same sign)."""
    if a.dtype == torch.bfloat16:
        ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    else:
        ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    return (ia - ib).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm_matches_torch_to_the_last_bit_of_the_sum(dtype, unit_offset):
    x, w = data(dtype, unit_offset=unit_offset)
    with torch.inference_mode():
        out = cpu_rowops.rmsnorm(x, w, EPS, unit_offset)
    ref = torch_norm(x, w, unit_offset)
    assert out.dtype == dtype and out.shape == x.shape
    exact = f64_norm(x, w, unit_offset)
    if dtype == torch.float32:
        # the float32 sum of squares is summed in another order: a few ulps of 1/rms, each as close to float64 as torch's
        assert ulps_apart(out, ref).max() <= 4
        assert ((out.double() - exact).abs() / exact.abs()).max() < 4e-7
        assert ((ref.double() - exact).abs() / exact.abs()).max() < 4e-7
    else:
        assert ulps_apart(out, ref).max() <= 1
        assert (out != ref).float().mean() < 0.02  # those few ulps rarely move a bf16 value
        assert ((out.double() - exact).abs() / exact.abs()).max() < 2 * 2**-8  # two roundings to bf16


def test_rmsnorm_per_head_of_strided_rows_in_place():
    """q/k norms: heads of head_dim values inside rows of a joined q|k|v output, normed in place."""
    heads, d = 4, 16
    joined = torch.randn(3, heads * d + 32)
    w = torch.randn(d) * 0.1 + 1
    q = joined[:, : heads * d]
    expected = torch_norm(q.reshape(3, heads, d), w, False).reshape(3, heads * d)
    rest = joined[:, heads * d :].clone()
    with torch.inference_mode():
        out = cpu_rowops.rmsnorm(q, w, EPS, False, heads=heads, out=q)
    assert out.data_ptr() == joined.data_ptr()
    assert ulps_apart(joined[:, : heads * d], expected).max() <= 4
    assert torch.equal(joined[:, heads * d :], rest)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_sum_is_torchs_add_and_norm_is_rmsnorm(dtype):
    x, w = data(dtype, seed=1)
    r, _ = data(dtype, seed=2)
    with torch.inference_mode():
        s, normed = cpu_rowops.add_rmsnorm(x, r, w, EPS, False)
        alone = cpu_rowops.rmsnorm(x + r, w, EPS, False)
    assert torch.equal(s, x + r)  # one rounding of the float32 sum, ties to even, as torch
    assert torch.equal(normed, alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_with_branch_norm_is_gemmas_sandwich(dtype):
    """x + norm(r, r_w) then norm(·, w), all (1 + w) norms; in place into x; w None skips the second norm."""
    x, w = data(dtype, seed=3, unit_offset=True)
    r, rw = data(dtype, seed=4, unit_offset=True)
    with torch.inference_mode():
        expected_s = x + cpu_rowops.rmsnorm(r, rw, EPS, True)
        expected_n = cpu_rowops.rmsnorm(expected_s, w, EPS, True)
        s, normed = cpu_rowops.add_rmsnorm(x.clone(), r, w, EPS, True, r_weight=rw)
        x2 = x.clone()
        s2, none = cpu_rowops.add_rmsnorm(x2, r, None, EPS, True, r_weight=rw, inplace=True)
    assert torch.equal(s, expected_s) and torch.equal(normed, expected_n)
    assert none is None and s2 is x2 and torch.equal(x2, expected_s)
    ref = x + torch_norm(r, rw, True)
    if dtype == torch.float32:
        assert (s - ref).abs().max() < 1e-5
    else:
        assert (s != ref).float().mean() < 0.02


def f64_act(g, act):
    g = g.double()
    if act == "silu":
        return g / (1 + torch.exp(-g))
    # 0.5 g (1 + tanh u) as g * sigmoid(2u): the same function without float64's cancellation for g << 0
    return g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g**3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_against_torch_and_float64(dtype, act):
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(4, 1536, generator=g) * 4).to(dtype)
    gate[0, :6] = torch.tensor([-100.0, -90.0, 0.0, 90.0, 100.0, -1e-3]).to(dtype)  # the exp's clamps and zero
    up = torch.randn(4, 1536, generator=g).to(dtype)
    with torch.inference_mode():
        out = cpu_rowops.act_mul(gate, up, act)
    torch_act = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    ref = torch_act(gate).mul_(up)
    if dtype == torch.float32:
        exact = f64_act(gate, act) * up.double()
        rel = (out.double() - exact).abs() / (exact.abs() + 1e-30)
        if act == "gelu_tanh":
            # far left, gelu ~ g e^(2u): float32's rounding of u costs ~|u| ulps relative, tiny absolutely
            # (torch's 1 + tanh(u) returns 0 there)
            assert (out.double() - exact).abs()[gate <= -5].max() < 4e-6
            rel = rel[gate > -5] / 4
        assert rel.max() < 1e-6
        assert (out - ref).abs().max() < 1e-5
    else:
        # act(g) rounded to bf16, then the product rounded: torch's two roundings of values within ~1e-6
        # (except where torch's 1 + tanh(u) cancels, g < -3)
        kept = gate > -3 if act == "gelu_tanh" else torch.ones_like(gate, dtype=torch.bool)
        assert ulps_apart(out, ref)[kept].max() <= 1
        assert (out != ref)[kept].float().mean() < 0.02
        exact = f64_act(gate, act) * up.double()
        assert ((out.double() - exact).abs() / (exact.abs() + 1e-30)).max() < 2 * 2**-8


def test_act_mul_of_joined_halves_equals_separate_tensors():
    joined = torch.randn(3, 2 * 100).to(torch.bfloat16)
    with torch.inference_mode():
        a = cpu_rowops.act_mul(joined, None, "silu")
        b = cpu_rowops.act_mul(joined[:, :100].contiguous(), joined[:, 100:].contiguous(), "silu")
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 96])  # 96 x 576 crosses the threaded threshold
def test_each_row_alone_equals_rows_together(dtype, rows):
    x, w = data(dtype, rows=rows, seed=6)
    r, rw = data(dtype, rows=rows, seed=7)
    gate, _ = data(dtype, rows=rows, dim=1152, seed=8)
    with torch.inference_mode():
        together = (cpu_rowops.rmsnorm(x, w, EPS, False), *cpu_rowops.add_rmsnorm(x, r, w, EPS, True, r_weight=rw),
                    cpu_rowops.act_mul(gate, None, "silu"), cpu_rowops.act_mul(gate, None, "gelu_tanh"))
        for i in [0, rows // 2, rows - 1]:
            alone = (cpu_rowops.rmsnorm(x[i : i + 1], w, EPS, False),
                     *cpu_rowops.add_rmsnorm(x[i : i + 1], r[i : i + 1], w, EPS, True, r_weight=rw),
                     cpu_rowops.act_mul(gate[i : i + 1], None, "silu"), cpu_rowops.act_mul(gate[i : i + 1], None, "gelu_tanh"))
            for a, t in zip(alone, together):
                assert torch.equal(a[0], t[i])


def test_usable_only_without_autograd_on_cpu_float_weights_of_the_same_dtype():
    x = torch.randn(2, 8)
    w = torch.nn.Parameter(torch.ones(8))
    assert not cpu_rowops.usable(x, w)  # grad mode on and w requires grad: torch records the graph
    with torch.no_grad():
        assert cpu_rowops.usable(x, w)
        assert not cpu_rowops.usable(x.half(), w.half())
        assert not cpu_rowops.usable(x.bfloat16(), w)
    with torch.inference_mode():
        assert cpu_rowops.usable(x, w)


def test_portable_build_computes_the_same_bits(monkeypatch):
    """No FMA contraction or reassociation: the AVX-512 build's vector lanes and the portable
    build's (x86-64-v2) compute every value identically."""
    from lowbit.native import rowops

    portable = rowops.library(portable=True)
    if portable is None:
        pytest.skip("no C compiler")
    results = []
    for lib in (cpu_rowops._lib(), portable):
        monkeypatch.setattr(cpu_rowops, "_lib", lambda lib=lib: lib)
        ops = []
        for dtype in DTYPES:
            x, w = data(dtype, rows=3, seed=9)
            r, rw = data(dtype, rows=3, seed=10, unit_offset=True)
            gate, _ = data(dtype, rows=3, dim=1000, seed=11)
            # the exp's clamps and selects too: past both ends of its range, at them, signed zeros
            edge = torch.tensor([100.0, -100.0, 88.5, 88.8, -86.9, -87.5, 44.0, -44.0, 0.0, -0.0, 1e-30, float("inf")])
            gate[1, 3 : 3 + len(edge)] = edge.to(dtype)
            with torch.inference_mode():
                ops += [cpu_rowops.rmsnorm(x, w, EPS, False), *cpu_rowops.add_rmsnorm(x, r, rw, EPS, True, r_weight=rw),
                        cpu_rowops.act_mul(gate, None, "silu"), cpu_rowops.act_mul(gate, None, "gelu_tanh")]
        logits = torch.randn(3, 1003, generator=torch.Generator().manual_seed(12))
        logits[1, 500] = logits[1, 900] = 9.0
        ops += [cpu_rowops.argmax(logits), torch.tensor(cpu_rowops.nonfinite(logits)), cpu_rowops.top_indices(logits, 16)]
        logits[2, 1002] = float("nan")
        ops.append(torch.tensor(cpu_rowops.nonfinite(logits)))
        results.append(ops)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [49152, 1000, 7, 1])
def test_logit_argmax_is_torchs_first_index_among_ties(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[1] = 0.5  # a row of ties: index 0
    if n > 10:
        x[2, 3] = x[2, n - 2] = 100.0  # two tied maxima: the first
        x[3, n - 1] = 100.0  # the max in the scalar tail
    x[4] = -torch.arange(n, dtype=torch.float32)  # the max at index 0
    assert torch.equal(cpu_rowops.argmax(x), x.argmax(dim=-1))
    assert not cpu_rowops.nonfinite(x)
    strided = torch.randn(3, n + 5, generator=g)[:, :n]  # rows with a stride
    assert torch.equal(cpu_rowops.argmax(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [0, 5, 49151])
def test_logit_nonfinite_finds_one_bad_value_anywhere(bad, at):
    x = torch.randn(2, 49152)
    assert not cpu_rowops.nonfinite(x)
    x[1, at] = bad
    assert cpu_rowops.nonfinite(x)
    assert cpu_rowops.nonfinite(x[1:])
    assert not cpu_rowops.nonfinite(x[:1])


@pytest.mark.parametrize("n", [49152, 1003, 16])
@pytest.mark.parametrize("k", [1, 16])
def test_top_indices_are_torch_topks_set(n, k):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(5, n, generator=g)
    x[1] = torch.arange(n, dtype=torch.float32)  # ascending: every value enters, the best at the end
    x[2] = -torch.arange(n, dtype=torch.float32)  # the best first, then nothing enters
    x[3, n - 1] = 50.0  # the best in the scalar tail
    if n > 100:
        x[4, :: n // 40] = float("nan")  # NaN never enters
    got = cpu_rowops.top_indices(x, k)
    assert got.shape == (5, k)
    want = torch.where(x.isnan(), float("-inf"), x).topk(k, dim=-1).indices
    for row in range(5):
        assert set(got[row].tolist()) == set(want[row].tolist())
    strided = torch.randn(2, n + 3, generator=g)[:, :n]
    assert [set(r) for r in cpu_rowops.top_indices(strided, k).tolist()] == \
        [set(r) for r in strided.topk(k, dim=-1).indices.tolist()]


def test_top_indices_refuses_k_out_of_range_and_rows_of_too_few_numbers():
    x = torch.randn(2, 10)
    for k in (0, 11, cpu_rowops.TOP_MAX + 1):
        with pytest.raises(ValueError, match="top_indices: k must be in"):
            cpu_rowops.top_indices(torch.randn(2, 100) if k > 11 else x, k)
    x[1, :8] = float("nan")  # two numbers left in the row: no top 3
    with pytest.raises(RuntimeError, match="lowbit_top_rows failed"):
        cpu_rowops.top_indices(x, 3)


def test_act_mul_split_into_pieces_changes_no_bits():
    """A row is split into pieces a team shares (rowops.c ACT_PIECE): a one-row call computed as two
    part calls (as the decode chain makes them), a many-row call on two threads, and rows alone
    give the same bits, and every piece boundary is covered (2816 = 2 x 1024 + 768)."""
    g = torch.Generator().manual_seed(9)
    gate = torch.randn(40, 2816, generator=g) * 3
    up = torch.randn(40, 2816, generator=g)
    with torch.inference_mode():
        torch.set_num_threads(1)
        alone = torch.stack([cpu_rowops.act_mul(gate[i : i + 1], up[i : i + 1], "silu")[0] for i in range(40)])
        torch.set_num_threads(2)
        together = cpu_rowops.act_mul(gate, up, "silu")  # 40 x 2816 values: threaded
    assert torch.equal(alone, together)
    assert ulps_apart(alone, F.silu(gate) * up).max() <= 4
    # part calls (lowbit_native.h LOWBIT_PART): each writes only its share of the one row's pieces
    lib = cpu_rowops._lib()
    out = torch.full((1, 2816), float("nan"))
    for part in range(2):
        assert lib.lowbit_act_mul(gate.data_ptr(), 2816, up.data_ptr(), 2816, 1, 2816, 0, 0, out.data_ptr(), 2816,
                                  -(part * 4096 + 2)) == 0
        if part == 0:
            assert out[0, :1024].isfinite().all() and out[0, 1024:].isnan().all()  # part 0: one of three pieces
    assert torch.equal(out[0], alone[0])
