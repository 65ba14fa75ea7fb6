"""The C mixture-of-experts routing (native/moe_route.c, kernels/cpu_moe.py): its choice and
weights against a float64 reference, and the AVX-512 build's four-experts-at-once logits against
the portable build's one-expert loop, bit for bit."""

import pytest
import torch

from lowbit.kernels import cpu_moe
from lowbit.native import moe_route

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="no C compiler")


def _route(lib, rows, weight, top_k, norm_topk):
    n, hidden = rows.shape
    weights = torch.empty(n, top_k, dtype=torch.float32)
    experts = torch.empty(n, top_k, dtype=torch.long)
    assert lib.lowbit_moe_route(rows.data_ptr(), hidden, n, hidden, weight.data_ptr(), weight.shape[0], top_k,
                                int(norm_topk), weights.data_ptr(), experts.data_ptr(), 1) == 0
    return weights, experts


# 8 experts: two blocks of four; 6: a block and two alone; hidden 1027: a tail past the groups of 4
@pytest.mark.parametrize("experts, hidden", [(8, 1024), (6, 1027), (3, 64)])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_routing_matches_float64_and_the_portable_build(experts, hidden, norm_topk):
    g = torch.Generator().manual_seed(experts * hidden)
    rows = torch.randn(5, hidden, generator=g)
    weight = torch.randn(experts, hidden, generator=g) * 0.05
    top_k = 2
    weights, chosen = cpu_moe.route(rows, weight, top_k, norm_topk)
    probs = (rows.double() @ weight.double().T).softmax(dim=-1)
    ref_w, ref_e = probs.topk(top_k, dim=-1)
    if norm_topk:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert torch.equal(chosen, ref_e)
    assert (weights.double() - ref_w).abs().max() < 1e-6
    portable = moe_route.library(portable=True)
    if portable is None:
        pytest.skip("no portable build")
    for a, b in zip(_route(moe_route.library(), rows, weight, top_k, norm_topk), _route(portable, rows, weight, top_k, norm_topk)):
        assert torch.equal(a, b)
