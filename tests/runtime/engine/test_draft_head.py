"""The draft's quantized lm_head (int4-g32 by default, int8 too) with int8 activations and its best
candidates rescored in float32 against the float head's own weight."""

import pytest
import torch

from lowbit.kernels import cpu_int4dot
from lowbit.runtime.engine.draft_models import DRAFT_HEAD_FORMAT, RescoredHead, _draft_head

pytestmark = pytest.mark.skipif(not cpu_int4dot.vnni_int8_available(), reason="int8 activations need the AVX512-VNNI build")


@pytest.mark.parametrize("fmt, path", [("int4-g32", "cpu-int4dot"), ("int8", "cpu-int8dot")])
def test_top_candidates_are_exact_and_the_argmax_is_the_float_heads(fmt, path, monkeypatch):
    monkeypatch.setenv("LOWBIT_INT8_ACTIVATIONS", "int8")  # the default on VNNI (conftest pins f32)
    torch.manual_seed(0)
    w = torch.randn(4000, 192)
    head = _draft_head(w, None, "cpu", fmt)
    assert isinstance(head, RescoredHead) and head.label == fmt and head.fast.prepared.path == path
    assert head.exact is w or head.exact.data_ptr() == w.data_ptr()  # the float weight itself, no copy
    x = torch.randn(6, 192)
    x[:, 3] *= 30  # an outlier channel, as final-norm outputs have: coarse int8 steps for the rest
    ref = x.double() @ w.double().T
    y = head(x)
    approx = head.fast(x).double()
    assert (approx - ref).abs().max() > 1e-2  # the quantized weights and activations alone are visibly off
    top = approx.topk(RescoredHead.TOP, dim=-1).indices
    assert (y.double().gather(1, top) - ref.gather(1, top)).abs().max() < 1e-5 * ref.abs().max()
    assert torch.equal(y.argmax(-1), ref.argmax(-1))
    # a bf16 draft: rows come back in bf16, rescored values rounded once
    y16 = head(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16.argmax(-1), (x.to(torch.bfloat16).double() @ w.double().T).argmax(-1))


def test_the_default_draft_head_is_int4_g32():
    assert DRAFT_HEAD_FORMAT == "int4-g32"


def test_nan_logits_still_draft():
    # activations that overflowed: the head still returns its rows (the target verifies, and rejects)
    head = _draft_head(torch.randn(300, 64), None, "cpu", "int8")
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    y = head(x)
    assert y.shape == (2, 300) and y[1].isnan().all() and not y[0].isnan().any()


def test_a_bad_draft_head_format_names_the_variable(monkeypatch):
    from torch import nn

    from lowbit.errors import UsageError
    from lowbit.runtime.engine import draft_models

    monkeypatch.setattr(draft_models, "DRAFT_HEAD_FORMAT", "bogus")
    model = nn.Module()
    model.lm_head = nn.Linear(64, 300, bias=False)
    with pytest.raises(UsageError, match=r"draft head format \(LOWBIT_DRAFT_HEAD\): unknown format 'bogus'"):
        draft_models.quantize_draft_head_(model, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_vocab", [False, True])
def test_the_c_rescoring_matches_the_torch_rescoring(dtype, with_vocab, monkeypatch):
    # one C call (cpu_rowops.rescore) replaces gather + bmm + scatter: the same candidates, values
    # within float32 rounding of the torch ones, the float64 dot products' order kept
    from lowbit.kernels import cpu_rowops

    torch.manual_seed(1)
    w = torch.randn(3000, 160).to(dtype)
    bias = torch.randn(3000)
    vocab = torch.sort(torch.randperm(3000)[:1200]).values if with_vocab else None
    head = _draft_head(w, bias, "cpu", "int4-g32", vocab)
    x = torch.randn(5, 160)
    calls = []
    real = cpu_rowops.rescore
    monkeypatch.setattr(cpu_rowops, "rescore", lambda *a: calls.append(real(*a)) or calls[-1])
    got = head(x)
    assert calls == [True]  # the C call took them
    monkeypatch.setattr(cpu_rowops, "rescore", lambda *a: False)
    want = head(x)
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite())
    assert (got[finite] - want[finite]).abs().max() <= 1e-5 * want[finite].abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    ids = torch.arange(3000) if vocab is None else vocab
    ref = (x.double() @ w.double()[ids].T + bias.double()[ids])
    top = got[:, ids].double()
    rescored = (top - ref).abs() < 1e-4 * ref.abs().max()  # the 16 candidates of each row at least
    assert (rescored.sum(-1) >= RescoredHead.TOP).all()
