"""Weight bytes per format come from the format registry, Linear by Linear."""

from __future__ import annotations

import pytest

from lowbit.errors import UsageError
from lowbit.plan.report import load_shape
from lowbit.plan.weights import PlanFormat, plan_format, weight_budget
from lowbit.quant.registry import parse_spec, weight_bytes

# Llama-3-8B's Linears written out by hand: (out, in) per layer
LLAMA3_8B_LINEARS = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
VOCAB, HIDDEN, LAYERS = 128256, 4096, 32


@pytest.fixture(scope="module")
def llama8b():
    return load_shape("llama-3-8b")[0]


@pytest.mark.parametrize("text", ["int4-g128", "int4-asym-g64", "int8", "fp8", "nf4", "mxfp4", "nvfp4"])
def test_linear_bytes_are_the_registrys(llama8b, text):
    spec = parse_spec(text)
    budget = weight_budget(llama8b, plan_format(text))
    assert budget.linear_bytes == LAYERS * sum(weight_bytes(spec, shape) for shape in LLAMA3_8B_LINEARS)
    # embedding and lm_head stay bf16, norms too
    assert budget.embedding_bytes == budget.head_bytes == VOCAB * HIDDEN * 2
    assert budget.other_bytes == (2 * LAYERS + 1) * HIDDEN * 2
    assert budget.linear_bits_per_weight == pytest.approx(8 * budget.linear_bytes / llama8b.linear_params)


def test_bf16_is_two_bytes_per_parameter(llama8b):
    assert weight_budget(llama8b, PlanFormat("bf16", None)).total_bytes == 2 * llama8b.total_params


def test_quantize_head_uses_the_registry_for_the_head(llama8b):
    spec = parse_spec("int4")
    budget = weight_budget(llama8b, plan_format("int4"), quantize_head=True)
    assert budget.head_bytes == weight_bytes(spec, (VOCAB, HIDDEN))
    assert budget.embedding_bytes == VOCAB * HIDDEN * 2  # untied: the embedding is gathered, not multiplied


def test_tied_head_is_counted_once():
    shape = load_shape("smollm2-135m")[0]
    plain = weight_budget(shape, plan_format("int4"))
    assert plain.head_bytes == 0 and plain.embedding_bytes == 49152 * 576 * 2
    quantized = weight_budget(shape, plan_format("int4"), quantize_head=True)
    assert quantized.embedding_bytes == weight_bytes(parse_spec("int4"), (49152, 576))


def test_group_size_applies_where_the_format_takes_one():
    assert plan_format("int4", 64).spec == parse_spec("int4-g64")
    assert plan_format("int4", 64).label == "int4-g64"
    assert plan_format("mxfp4", 64).spec == parse_spec("mxfp4")  # fixed blocks of 32
    with pytest.raises(UsageError, match="unknown format"):
        plan_format("int7")
