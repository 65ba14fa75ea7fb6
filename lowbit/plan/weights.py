"""Weight bytes of a model in a number format, asked of the format registry Linear by Linear.

Plan owns no format arithmetic: what a quantized [out, in] matrix costs on disk and in memory
(packed codes, scales, zero points, global scales) comes from lowbit.quant.registry. Plan only
decides which tensors are quantized: the Linears of the decoder layers. Embeddings, the lm_head,
norms, biases and MoE routers stay in bf16 unless `quantize_head` asks for the head too.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.errors import LowbitError, UsageError
from lowbit.plan.model_shape import ModelShape

BF16_BYTES = 2
UNQUANTIZED = ("bf16", "fp16", "float16", "bfloat16")


@dataclass(slots=True, frozen=True)
class PlanFormat:
    label: str  # the row name the user sees: what they typed, e.g. "int4-g128"
    spec: object | None  # the registry's FormatSpec; None for the unquantized bf16 baseline

    @property
    def family(self) -> str:
        return "bf16" if self.spec is None else self.spec.family

    @property
    def quantized(self) -> bool:
        return self.spec is not None


def plan_format(text: str, group_size: int | None = None) -> PlanFormat:
    """Parse a --format value with the registry; --group-size applies where the format takes one."""
    label = text.strip().lower()
    if label in UNQUANTIZED:
        return PlanFormat("bf16", None)
    from lowbit.quant.registry import parse_spec  # here, not at the top: `lowbit plan` starts without torch

    if group_size is None:
        return PlanFormat(label, parse_spec(label))
    try:
        spec = parse_spec(label, group_size)
    except UsageError:
        # mxfp4/nvfp4 have fixed blocks: a global --group-size is meant for the formats that take one
        spec = parse_spec(label)
    else:
        if spec != parse_spec(label):
            label = spec.label
    return PlanFormat(label, spec)


def linear_bytes(fmt: PlanFormat, out_features: int, in_features: int) -> int:
    """Bytes of one [out, in] Linear weight in this format, as the registry stores it."""
    if fmt.spec is None:
        return out_features * in_features * BF16_BYTES
    from lowbit.quant.registry import weight_bytes  # here: see parse_format

    try:
        return int(weight_bytes(fmt.spec, (out_features, in_features)))
    except LowbitError as exc:
        raise LowbitError(f"{fmt.label} cannot store a {out_features}x{in_features} weight: {exc}") from None


@dataclass(slots=True, frozen=True)
class WeightBudget:
    """Bytes of every weight of one model in one format."""

    format: str
    linear_bytes: int  # every quantized Linear (routed experts included)
    expert_bytes: int  # the routed experts' share of linear_bytes
    embedding_bytes: int
    head_bytes: int  # a separate lm_head; 0 when tied to the embedding
    other_bytes: int  # norms, biases, routers (bf16)
    linear_params: int
    head_quantized: bool

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.embedding_bytes + self.head_bytes + self.other_bytes

    @property
    def output_bytes(self) -> int:
        """The matrix read to produce logits each step: the lm_head, or the embedding when tied."""
        return self.head_bytes or self.embedding_bytes

    @property
    def linear_bits_per_weight(self) -> float:
        return 8 * self.linear_bytes / self.linear_params if self.linear_params else 0.0


def weight_budget(shape: ModelShape, fmt: PlanFormat, quantize_head: bool = False) -> WeightBudget:
    linear = expert = 0
    for lin in shape.linears:
        nbytes = linear_bytes(fmt, lin.out_features, lin.in_features) * lin.copies
        linear += nbytes
        expert += nbytes if lin.expert else 0
    matrix = (shape.vocab_size, shape.hidden_size)
    if quantize_head and fmt.quantized:
        head_matrix_bytes = linear_bytes(fmt, *matrix)
    else:
        head_matrix_bytes = matrix[0] * matrix[1] * BF16_BYTES
    embedding = shape.embedding_params * BF16_BYTES
    head = 0
    if shape.tied_embeddings:
        embedding = head_matrix_bytes  # one matrix serves both; quantizing the head quantizes it
    else:
        head = head_matrix_bytes
    return WeightBudget(
        format=fmt.label,
        linear_bytes=linear,
        expert_bytes=expert,
        embedding_bytes=embedding,
        head_bytes=head,
        other_bytes=shape.other_params * BF16_BYTES,
        linear_params=shape.linear_params,
        head_quantized=quantize_head and fmt.quantized,
    )
