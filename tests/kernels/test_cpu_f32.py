"""native/f32_dot.c through kernels/cpu_f32.py: float32 Linears at any number of rows, batch-invariant."""

import pytest
import torch

from lowbit.kernels import cpu_f32

pytestmark = pytest.mark.skipif(not cpu_f32.available(), reason="no AVX-512 or AVX2 build on this machine")


@pytest.mark.parametrize("n, k", [(33, 200), (64, 576), (7, 15), (130, 1536)])
def test_matches_float64_and_every_row_count_gives_the_same_bits(n, k):
    g = torch.Generator().manual_seed(n + k)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(16, k, generator=g)
    full = cpu_f32.matmul(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    # float32 accumulation over k: error grows like sqrt(k) ulps of the terms
    assert ((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    for m in range(1, 17):
        for start in (0, 16 - m):
            assert torch.equal(cpu_f32.matmul(x[start : start + m], w, b), full[start : start + m]), (m, start)


def test_strided_rows_and_no_bias():
    w = torch.randn(40, 96)[:, :80]  # rows 96 apart, 80 used
    x = torch.randn(3, 100)[:, :80]
    y = cpu_f32.matmul(x, w)
    torch.testing.assert_close(y, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


def test_invariant_linear_keeps_parameters_and_falls_back_where_it_must():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Linear(32, 48, bias=False))
    model[1].weight = torch.nn.Parameter(model[0].weight.T.contiguous())  # any shared parameter stays shared
    shared = model[1].weight
    reference = [torch.nn.Linear.forward(m, torch.ones(1, m.in_features)) for m in model]
    assert cpu_f32.use_invariant_linears(model) == 2
    assert all(isinstance(m, cpu_f32.InvariantLinear) and isinstance(m, torch.nn.Linear) for m in model)
    assert model[1].weight is shared
    with torch.no_grad():
        for m, ref in zip(model, reference):
            torch.testing.assert_close(m(torch.ones(1, m.in_features)), ref, rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 20, 48)  # 40 rows (a prefill): still the kernel, each row as it is alone
        torch.testing.assert_close(model(x), torch.nn.functional.linear(torch.nn.functional.linear(x, model[0].weight, model[0].bias), shared))
        rows = x.reshape(40, 48)
        assert torch.equal(model(rows), torch.cat([model(rows[i : i + 1]) for i in range(40)]))
    assert model[0](torch.randn(3, 48)).requires_grad  # training keeps torch's differentiable route


@pytest.mark.parametrize("n, k", [(33, 200), (64, 576), (7, 15), (49152, 64)])
def test_bf16_weights_give_the_bits_of_their_float32_copy(n, k):
    g = torch.Generator().manual_seed(n * k)
    w, b, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g), torch.randn(6, k, generator=g)
    for m in (1, 2, 6):
        assert torch.equal(cpu_f32.matmul(x[:m], w, b), cpu_f32.matmul(x[:m], w.float(), b)), m


def test_bf16_exact_weights_are_compacted_and_a_tied_model_gives_the_same_logits(tiny_float_model, monkeypatch):
    from lowbit.runtime.loader import load_model

    src = tiny_float_model(tie=True)  # bf16 checkpoint: every weight is a bf16 number
    before = load_model(src, torch.float32)
    with monkeypatch.context() as m:
        m.setattr(cpu_f32, "_compact", lambda linear: None)  # the same kernels on float32 weights
        cpu_f32.use_invariant_linears(before)
    assert before.lm_head.weight.dtype is torch.float32
    after = load_model(src, torch.float32)
    assert cpu_f32.use_invariant_linears(after) > 0
    assert after.lm_head.weight.dtype is torch.bfloat16
    assert after.lm_head.weight is after.model.embed_tokens.weight  # still tied: one table, half the bytes
    ids = torch.tensor([[256, 104, 101, 108, 108, 111, 32, 119]])
    with torch.no_grad():
        for rows in (ids[:, :1], ids):  # one row, and a prefill's eight
            assert torch.equal(after(rows), before(rows))

    odd = torch.nn.Linear(16, 8, bias=False)  # float32 values that bf16 cannot hold stay float32
    model = torch.nn.Sequential(odd)
    cpu_f32.use_invariant_linears(model)
    assert odd.weight.dtype is torch.float32


def test_compaction_checks_every_chunk(monkeypatch):
    # bf16-exact values everywhere but the last element: kept float32; all exact: bf16, same values
    monkeypatch.setattr(cpu_f32, "_COMPACT_CHUNK", 16)
    exact = torch.randn(9, 7).bfloat16().float()
    linear = torch.nn.Linear(7, 9, bias=False)
    linear.weight.data = exact.clone()
    linear.weight.requires_grad_(False)
    cpu_f32._compact(linear)
    assert linear.weight.dtype is torch.bfloat16 and torch.equal(linear.weight.float(), exact)
    almost = exact.clone()
    almost[-1, -1] = 1 + 2.0**-10  # between two bf16 values (their step at 1 is 2**-7)
    linear.weight.data = almost.clone()
    cpu_f32._compact(linear)
    assert linear.weight.dtype is torch.float32 and torch.equal(linear.weight, almost)


@pytest.mark.skipif(not cpu_f32.bf16_available(), reason="no AVX512-BF16 on this machine")
@pytest.mark.parametrize("n, k", [(33, 200), (64, 576), (7, 15), (130, 1536), (5, 33)])
def test_bf16_kernel_is_the_float64_product_rounded_once_and_batch_invariant(n, k):
    # bf16 x and w: every product is exact in float32, so the only roundings are the float32 sums
    # and the final bf16 one; each row gives the same bits in any call.
    g = torch.Generator().manual_seed(n * 7 + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    x = torch.randn(cpu_f32.BF16_MAX_ROWS, k, generator=g).bfloat16()
    y = cpu_f32.bf16_matmul(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    assert y.dtype is torch.bfloat16
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * k**0.5).all()
    alone = torch.cat([cpu_f32.bf16_matmul(x[i : i + 1], w, b) for i in range(x.shape[0])])
    assert torch.equal(y, alone)
    for m in (2, 6, 7, 13):
        assert torch.equal(cpu_f32.bf16_matmul(x[:m], w, b), y[:m]), m


@pytest.mark.skipif(not cpu_f32.bf16_available(), reason="no AVX512-BF16 on this machine")
@pytest.mark.parametrize("n, k", [(33, 200), (64, 576), (7, 15), (130, 1536)])
def test_bf16_activations_round_x_as_torch_does_and_stay_batch_invariant(n, k):
    # --dense-activations bf16: float32 x rounded to bf16 inside the call (nearest even, torch's
    # rounding, NaN kept), then the bf16 x bf16 kernel's float32 sums; every row alone gives its bits
    g = torch.Generator().manual_seed(n * 5 + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    x = torch.randn(70, k, generator=g) * 3
    x[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-9), 2**-130])  # ties to even, a denormal
    y = cpu_f32.matmul(x, w, b, bf16_x=True)
    exact = x.bfloat16().double() @ w.double().T + b.double()
    assert y.dtype is torch.float32
    assert ((y.double() - exact).abs() <= 1e-5 * (exact.abs() + k**0.5)).all()
    # the C rounding is torch's: the bf16 kernel fed torch's bf16 x gives the very same float32 y
    same, xb = torch.empty(70, n), x.bfloat16()
    rc = cpu_f32.f32_dot.library().lowbit_bf16_matmul(w.data_ptr(), n, k, k, b.data_ptr(), xb.data_ptr(), k, 70,
                                                      same.data_ptr(), 0, n, torch.get_num_threads())
    assert rc == 0 and torch.equal(y, same)
    for m in (1, 2, 5, 17):
        assert torch.equal(cpu_f32.matmul(x[:m], w, b, bf16_x=True), y[:m]), m
    assert torch.equal(torch.cat([cpu_f32.matmul(x[i : i + 1], w, b, bf16_x=True) for i in range(70)]), y)


@pytest.mark.skipif(not cpu_f32.bf16_available(), reason="no AVX512-BF16 on this machine")
def test_dense_activations_setting_reaches_bf16_linears_only(tiny_float_model):
    from lowbit.kernels.dispatch import use_settings
    from lowbit.runtime.loader import load_model

    path = tiny_float_model(dtype=torch.bfloat16, layers=2)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    logits = {}
    for act in ("f32", "bf16"):
        with use_settings(dense_activations=act):
            model = load_model(path, torch.float32, bf16_linears=True)
            assert cpu_f32.use_invariant_linears(model, bf16_weights=True) > 0
        linears = [m for m in model.modules() if isinstance(m, cpu_f32.InvariantLinear)]
        assert all(m.bf16_x == (act == "bf16") for m in linears)
        with torch.no_grad():
            logits[act] = model(ids)
    # the rounding of x moves the logits a little, never a lot
    diff = (logits["bf16"] - logits["f32"]).abs().max().item()
    assert 0 < diff < 0.05 * logits["f32"].abs().max().item()


@pytest.mark.skipif(not cpu_f32.bf16_available(), reason="no AVX512-BF16 on this machine")
def test_a_bf16_model_takes_the_bf16_kernel_and_stays_close_to_torch(tiny_float_model):
    from lowbit.runtime.loader import load_model

    src = tiny_float_model(tie=True)
    reference = load_model(src, torch.bfloat16)
    model = load_model(src, torch.bfloat16)
    assert cpu_f32.use_invariant_linears(model) > 0
    assert model.lm_head.weight.dtype is torch.bfloat16 and isinstance(model.lm_head, cpu_f32.InvariantLinear)
    ids = torch.tensor([[256, 104, 101, 108, 108, 111, 32, 119]])
    with torch.no_grad():
        ours, theirs = model(ids).float(), reference(ids).float()
        torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05)
        # two sequences in one forward: the first gets the bits it gets alone
        two = torch.cat([ids, ids.flip(1)])
        assert torch.equal(model(two)[0], model(ids)[0])


def test_the_avx2_build_matches_float64_and_is_batch_invariant(tmp_path):
    # CPUs without AVX-512 run f32_dot.c's AVX2 section: 8-lane sums of their own, checked here
    # on any machine that can run AVX2 (through the same kernel entry points).
    from lowbit.native import f32_dot
    from tests.kernels.cases import avx2_library

    lib = avx2_library("f32_dot", f32_dot.SIGNATURES, tmp_path)
    if lib is None:
        pytest.skip("no compiler or no AVX2 here")
    assert lib.lowbit_f32dot_available() == 1 and lib.lowbit_bf16dot_available() == 0
    g = torch.Generator().manual_seed(3)
    for n, k in [(33, 200), (7, 15), (130, 576)]:
        w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(8, k, generator=g)
        for weight in (w, w.to(torch.bfloat16)):
            fn = lib.lowbit_bf16w_matmul if weight.dtype is torch.bfloat16 else lib.lowbit_f32_matmul

            def run(rows):
                y = torch.empty(rows.shape[0], n)
                assert fn(weight.data_ptr(), n, k, k, b.data_ptr(), rows.data_ptr(), k, rows.shape[0], y.data_ptr(), n, 2) == 0
                return y

            full = run(x)
            ref = x.double() @ weight.double().T + b.double()
            assert ((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6, (n, k, weight.dtype)
            for m in range(1, 8):
                assert torch.equal(run(x[8 - m :].contiguous()), full[8 - m :]), (n, k, m)


def _rows_alone_equal_the_block(run, x, full):
    for m in range(x.shape[0]):
        assert torch.equal(run(x[m : m + 1].contiguous()), full[m : m + 1]), m


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_prefill_sized_calls_give_each_row_its_own_bits(weight_dtype):
    # 250 rows of K = 2100 cross the kernel's row blocks (x kept in L2) and, on AVX2, its K blocks
    # of 1024 with a ragged tail: no row's numbers may depend on either.
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(37, 2100, generator=g).to(weight_dtype), torch.randn(250, 2100, generator=g)
    full = cpu_f32.matmul(x, w)
    ref = x.double() @ w.double().T
    assert ((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    _rows_alone_equal_the_block(lambda rows: cpu_f32.matmul(rows, w), x, full)


def test_the_avx2_build_is_batch_invariant_at_prefill_sizes(tmp_path):
    from lowbit.native import f32_dot
    from tests.kernels.cases import avx2_library

    lib = avx2_library("f32_dot", f32_dot.SIGNATURES, tmp_path)
    if lib is None:
        pytest.skip("no compiler or no AVX2 here")
    g = torch.Generator().manual_seed(8)
    n, k = 37, 2100
    w, x = torch.randn(n, k, generator=g).to(torch.bfloat16), torch.randn(250, k, generator=g)

    def run(rows):
        y = torch.empty(rows.shape[0], n)
        assert lib.lowbit_bf16w_matmul(w.data_ptr(), n, k, k, None, rows.data_ptr(), k, rows.shape[0], y.data_ptr(), n, 2) == 0
        return y

    full = run(x)
    ref = x.double() @ w.double().T
    assert ((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    _rows_alone_equal_the_block(run, x, full)
