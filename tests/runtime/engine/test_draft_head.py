"""The draft's int8 lm_head with int8 activations and its best candidates rescored in float32."""

import pytest
import torch

from lowbit.kernels import cpu_int4dot
from lowbit.quant.rtn import quantize_rtn
from lowbit.quant.spec import parse_spec
from lowbit.runtime.engine.draft_models import RescoredHead

pytestmark = pytest.mark.skipif(not cpu_int4dot.vnni_int8_available(), reason="8-bit codes need the AVX512-VNNI build")


def test_top_candidates_are_exact_and_the_argmax_is_the_float_heads():
    torch.manual_seed(0)
    w = torch.randn(4000, 192)
    qt = quantize_rtn(w, parse_spec("int8"))
    head = RescoredHead(qt, None, "cpu")
    assert head.fast.prepared.path == "cpu-int8dot"
    exact_w = qt.dequantize(torch.float64)
    x = torch.randn(6, 192)
    x[:, 3] *= 30  # an outlier channel, as final-norm outputs have: coarse int8 steps for the rest
    ref = x.double() @ exact_w.T
    y = head(x)
    approx = head.fast(x).double()
    assert (approx - ref).abs().max() > 1e-2  # the int8 activations alone are visibly off
    top = approx.topk(RescoredHead.TOP, dim=-1).indices
    assert (y.double().gather(1, top) - ref.gather(1, top)).abs().max() < 1e-3 * ref.abs().max()
    assert torch.equal(y.argmax(-1), ref.argmax(-1))
    # a bf16 draft: rows come back in bf16, rescored values rounded once
    y16 = head(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16 and torch.equal(y16.argmax(-1), (x.to(torch.bfloat16).double() @ exact_w.T).argmax(-1))
