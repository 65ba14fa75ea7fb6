"""Roofline, capacity and speculation numbers on hand-computed cases."""

from __future__ import annotations

import pytest

from lowbit.errors import UsageError
from lowbit.plan.estimate import Scenario, estimate_format
from lowbit.plan.hardware import GIB, Hardware
from lowbit.plan.report import load_shape, make_plan
from lowbit.plan.speculation import expected_tokens_per_pass
from lowbit.plan.weights import PlanFormat

BF16 = PlanFormat("bf16", None)
L8_TOTAL, L8_EMBED = 8_030_261_248, 128256 * 4096
L8_LINEAR = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
L8_KV_TOKEN = 131072


def machine(bandwidth=100.0, memory=1000.0, tflops=1e9) -> Hardware:
    return Hardware("test", memory_gib=memory, bandwidth_gbs=bandwidth, tflops_bf16=tflops)


@pytest.fixture(scope="module")
def llama8b():
    return load_shape("llama-3-8b")[0]


def test_decode_roofline_is_bandwidth_over_bytes_per_step(llama8b):
    row = estimate_format(llama8b, BF16, machine(), Scenario(context=1024, concurrency=4))
    # each step reads every weight but the (untied) embedding, plus each sequence's KV
    weights = 2 * (L8_TOTAL - L8_EMBED)
    kv = L8_KV_TOKEN * 1024
    assert row.decode_tok_s_single == pytest.approx(100e9 / (weights + kv), rel=1e-12)
    assert row.decode_tok_s_aggregate == pytest.approx(4 * 100e9 / (weights + 4 * kv), rel=1e-12)
    assert row.decode_tok_s_per_sequence == pytest.approx(100e9 / (weights + 4 * kv), rel=1e-12)
    assert row.bottleneck == "bandwidth"


def test_compute_bound_when_flops_are_scarce(llama8b):
    row = estimate_format(llama8b, BF16, machine(bandwidth=1e9, tflops=0.001), Scenario(context=1024, concurrency=1))
    flops = 2 * L8_LINEAR + 2 * L8_EMBED + 4 * 32 * 128 * (32 * 1024)
    assert row.decode_tok_s_single == pytest.approx(1e9 / flops, rel=1e-12)
    assert row.bottleneck == "compute"


def test_prefill_counts_causal_attention(llama8b):
    row = estimate_format(llama8b, BF16, machine(bandwidth=1e9, tflops=1.0), Scenario(context=1000, concurrency=1))
    flops = 2 * L8_LINEAR * 1000 + 2 * L8_EMBED + 4 * 32 * 128 * 32 * (1000 * 1001 // 2)
    assert row.prefill_s == pytest.approx(flops / 1e12, rel=1e-12)


def test_capacity_paged_versus_reserved(llama8b):
    scenario = Scenario(context=1024, concurrency=32)
    row = estimate_format(llama8b, BF16, machine(memory=20), scenario)
    free = 0.9 * 20 * GIB - 2 * L8_TOTAL
    assert row.max_sequences_paged == int(free // (L8_KV_TOKEN * 1024)) == 24
    assert row.max_sequences_reserved == int(free // (L8_KV_TOKEN * 8192)) == 3  # max_position_embeddings 8192
    assert row.sequences == 24 and row.bottleneck == "capacity" and row.fits


def test_weights_that_do_not_fit(llama8b):
    row = estimate_format(llama8b, BF16, machine(memory=10), Scenario())
    assert not row.fits and row.bottleneck == "capacity"
    assert row.decode_tok_s_aggregate is None and row.max_sequences_paged == 0


def test_moe_reads_only_routed_experts():
    mixtral = load_shape("mixtral-8x7b")[0]
    row = estimate_format(mixtral, BF16, machine(), Scenario(context=16, concurrency=1))
    weights = 2 * (mixtral.active_params - 32000 * 4096)
    assert row.decode.weight_bytes == pytest.approx(weights, rel=1e-12)
    # many tokens in one step touch nearly every expert
    big = estimate_format(mixtral, BF16, machine(), Scenario(context=16, concurrency=64))
    assert big.decode.weight_bytes == pytest.approx(2 * (mixtral.total_params - 32000 * 4096), rel=1e-6)


def test_expected_tokens_per_pass():
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2) == pytest.approx(3.3616)
    assert expected_tokens_per_pass(0.5, 1) == 1.5
    assert expected_tokens_per_pass(1.0, 4) == 5
    for bad in (0, -0.1, 1.5):
        with pytest.raises(UsageError):
            expected_tokens_per_pass(bad, 4)


def test_speculation_speedup_hand_case():
    hw = machine(bandwidth=1000, memory=10000)
    scenario = Scenario(context=1024, concurrency=1, acceptance=0.8, draft_tokens=4)
    plan = make_plan("llama-3-70b", hw, scenario, formats=["bf16"], draft="llama-3-8b")
    spec = plan.rows[0].speculation
    target = 2 * (70_553_706_496 - 128256 * 8192) + 327_680 * 1024  # weights but the embedding, KV of 80 layers
    draft = 2 * (L8_TOTAL - L8_EMBED) + L8_KV_TOKEN * 1024
    t_target, t_draft = target / 1e12, draft / 1e12
    # bandwidth-bound: checking 5 tokens costs one target step; 4 draft steps precede it
    assert spec.cycle_s == pytest.approx(4 * t_draft + t_target, rel=1e-9)
    assert spec.tokens_per_pass == pytest.approx(3.3616)
    assert spec.speedup_per_sequence == pytest.approx(3.3616 * t_target / (4 * t_draft + t_target), rel=1e-9)
    assert spec.best_draft_tokens >= 4


def test_speculation_needs_both_flags():
    with pytest.raises(UsageError, match="--acceptance"):
        make_plan("llama-3-8b", machine(), Scenario(), formats=["bf16"], draft="llama-3-8b")
    with pytest.raises(UsageError, match="--draft"):
        make_plan("llama-3-8b", machine(), Scenario(acceptance=0.5), formats=["bf16"])


def test_recommendation_serves_the_concurrency():
    plan = make_plan("llama-3-70b", machine(bandwidth=3350, memory=80, tflops=989), Scenario(concurrency=8))
    assert plan.recommended is not None
    chosen = next(r for r in plan.rows if r.format == plan.recommended)
    assert chosen.fits and chosen.sequences == 8
    assert plan.recommendation.startswith(f"recommend {plan.recommended}:")
    assert not next(r for r in plan.rows if r.format == "bf16").fits  # 131 GiB of bf16 weights
