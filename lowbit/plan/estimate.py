"""The numbers of a plan: memory, capacity and roofline time for one model × format × machine.

A roofline, not a simulation: every step takes max(bytes moved / bandwidth, FLOPs / peak), so
the numbers are upper bounds on speed that real kernels approach (decode GEMV kernels reach
roughly 70–90% of the bandwidth on a GPU). Assumptions, each in one place:
  - decode: each step reads every weight once (for an MoE, the experts its tokens route to,
    routing taken as uniform) and each sequence's whole KV cache at the given context;
    FLOPs per token are 2 × active Linear parameters + the logits + attention (4 × heads × head_dim
    per attended key: q·k and p·v)
  - prefill: one sequence of `context` tokens, causal attention, logits for the last token only
  - capacity: `memory_utilization` of the memory holds weights and KV cache, the rest is left to
    activations, the CUDA context and fragmentation (vLLM's default is 0.9 too);
    paging allocates 16-token blocks as sequences grow, reserving allocates the model's maximum
    context for every sequence up front
  - math runs in bf16 (weight-only quantization, as lowbit's kernels do) unless `act_quant`
    says activations are quantized too and the machine has fp8 / fp4 tensor cores
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lowbit.errors import UsageError
from lowbit.plan import kv_cache
from lowbit.plan.hardware import GIB, Hardware
from lowbit.plan.model_shape import ModelShape
from lowbit.plan.speculation import check_acceptance, expected_tokens_per_pass, speculative_cycle_seconds
from lowbit.plan.weights import PlanFormat, WeightBudget, weight_budget

MAX_DRAFT_TOKENS = 16


@dataclass(slots=True)
class Scenario:
    context: int = 4096  # tokens each sequence holds (prompt + output)
    concurrency: int = 16  # sequences decoding together
    kv_dtype: str = "bf16"
    max_context: int | None = None  # what reserving allocates per sequence; default: the model's maximum
    quantize_head: bool = False
    act_quant: bool = False
    memory_utilization: float = 0.9
    draft_tokens: int = 4
    acceptance: float | None = None

    def validate(self) -> None:
        for flag, value in (("--context", self.context), ("--concurrency", self.concurrency)):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1, not {value}")
        if self.max_context is not None and self.max_context < 1:
            raise UsageError(f"--max-context must be at least 1, not {self.max_context}")
        if not 0 < self.memory_utilization <= 1:
            raise UsageError(f"--memory-utilization must be in (0, 1], not {self.memory_utilization}")
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise UsageError(f"--draft-tokens must be between 0 and {MAX_DRAFT_TOKENS}, not {self.draft_tokens}")
        if self.acceptance is not None:
            check_acceptance(self.acceptance)
        kv_cache.kv_dtype(self.kv_dtype)

    def reserve_tokens(self, shape: ModelShape) -> int:
        """Tokens a reserve-up-front cache allocates per sequence: the maximum it may ever need."""
        return max(self.context, self.max_context or shape.max_context or self.context)


@dataclass(slots=True)
class StepCost:
    """One forward pass: what it moves, what it computes, and which of the two takes longer."""

    tokens: int
    weight_bytes: float
    kv_bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "bandwidth"

    def to_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds, "bound": self.bound}


def math_tflops(hw: Hardware, fmt: PlanFormat, act_quant: bool = False) -> float:
    """Peak TFLOPs the format's matmuls run at on this machine."""
    if act_quant and fmt.family == "fp8" and hw.tflops_fp8:
        return hw.tflops_fp8
    if act_quant and fmt.family in ("mxfp4", "nvfp4") and hw.tflops_fp4:
        return hw.tflops_fp4
    return hw.tflops_bf16


def flops_per_token(shape: ModelShape, attended: int) -> float:
    """FLOPs of one token through the Linears, the logits and `attended` (layer, key) pairs."""
    return 2 * shape.active_linear_params + 2 * shape.output_params + 4 * shape.num_heads * shape.head_dim * attended


def weight_bytes_read(shape: ModelShape, budget: WeightBudget, tokens: int) -> float:
    """Weight bytes one pass over `tokens` tokens streams from memory.

    Dense weights and the output matrix are read once however many tokens share the pass; the
    embedding (when not tied) is only gathered row by row, which is negligible. Routed experts are
    read when at least one token picks them: 1 − (1 − k/E)^tokens of them, uniform routing.
    """
    dense = budget.linear_bytes - budget.expert_bytes + budget.output_bytes + budget.other_bytes
    if not shape.is_moe:
        return float(dense)
    touched = 1 - (1 - shape.experts_per_token / shape.num_experts) ** max(tokens, 1)
    return dense + budget.expert_bytes * touched


def decode_step(
    shape: ModelShape,
    budget: WeightBudget,
    hw: Hardware,
    tflops: float,
    sequences: int,
    context: int,
    kv: kv_cache.KVDtype,
    tokens_per_sequence: int = 1,
) -> StepCost:
    """One decode (or verify) step of `sequences` sequences at `context` tokens each."""
    tokens = sequences * tokens_per_sequence
    weights = weight_bytes_read(shape, budget, tokens)
    kv_read = sequences * kv_cache.kv_bytes_per_sequence(shape, kv, context)
    flops = tokens * flops_per_token(shape, kv_cache.attended_tokens(shape, context))
    return StepCost(tokens, weights, kv_read, flops, (weights + kv_read) / hw.bandwidth_bytes, flops / (tflops * 1e12))


def prefill_cost(
    shape: ModelShape, budget: WeightBudget, hw: Hardware, tflops: float, tokens: int, kv: kv_cache.KVDtype
) -> StepCost:
    """One sequence's prompt of `tokens` tokens in one pass; only the last position gets logits."""
    weights = weight_bytes_read(shape, budget, tokens)
    kv_written = kv_cache.kv_bytes_per_sequence(shape, kv, tokens)
    flops = (
        2 * shape.active_linear_params * tokens
        + 2 * shape.output_params
        + 4 * shape.num_heads * shape.head_dim * kv_cache.causal_attended_pairs(shape, tokens)
    )
    return StepCost(tokens, weights, kv_written, flops, (weights + kv_written) / hw.bandwidth_bytes, flops / (tflops * 1e12))


@dataclass(slots=True)
class Capacity:
    usable_bytes: float  # memory × utilization
    free_bytes: float  # what is left for KV after the weights (negative: weights do not fit)
    kv_paged_bytes: int  # one sequence at the context, in whole blocks
    kv_reserved_bytes: int  # one sequence's reservation of the maximum context
    max_sequences_paged: int
    max_sequences_reserved: int

    @property
    def weights_fit(self) -> bool:
        return self.free_bytes >= 0


def capacity(usable_bytes: float, resident_weight_bytes: float, kv_paged_bytes: int, kv_reserved_bytes: int) -> Capacity:
    free = usable_bytes - resident_weight_bytes
    paged = int(free // kv_paged_bytes) if free > 0 and kv_paged_bytes else 0
    reserved = int(free // kv_reserved_bytes) if free > 0 and kv_reserved_bytes else 0
    return Capacity(usable_bytes, free, kv_paged_bytes, kv_reserved_bytes, paged, reserved)


@dataclass(slots=True)
class Draft:
    """A draft model for speculation; `fmt` None means 'in the same format as the target row'."""

    shape: ModelShape
    name: str
    fmt: PlanFormat | None = None


@dataclass(slots=True)
class SpeculationEstimate:
    draft: str
    draft_format: str
    draft_tokens: int
    acceptance: float
    tokens_per_pass: float
    draft_weight_bytes: int
    draft_kv_bytes_per_sequence: int
    max_sequences_paged: int  # with the draft's weights and KV beside the target's
    sequences: int
    cycle_s: float
    tok_s_per_sequence: float
    tok_s_aggregate: float
    speedup_per_sequence: float  # against plain decode at the same number of sequences
    speedup_aggregate: float  # against plain decode at its own concurrency
    best_draft_tokens: int
    best_speedup_per_sequence: float


@dataclass(slots=True)
class FormatEstimate:
    format: str
    family: str
    bits_per_weight: float  # the quantized Linears, scales included
    bits_per_weight_overall: float  # every parameter, embeddings and norms included
    weight_bytes: int
    fits: bool  # weights fit and at least one sequence of the context beside them
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int  # exact, at the context
    max_sequences_paged: int
    max_sequences_reserved: int
    sequences: int  # min(concurrency, what fits)
    decode_tok_s_single: float | None  # one sequence alone
    decode_tok_s_per_sequence: float | None  # at `sequences`
    decode_tok_s_aggregate: float | None
    prefill_s: float | None
    bottleneck: str  # "compute", "bandwidth" or "capacity"
    math_tflops: float
    decode: StepCost | None = None
    prefill: StepCost | None = None
    capacity: Capacity | None = None
    speculation: SpeculationEstimate | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def weight_gib(self) -> float:
        return self.weight_bytes / GIB

    @property
    def kv_gib_per_sequence(self) -> float:
        return self.kv_bytes_per_sequence / GIB

    def to_dict(self) -> dict:
        data = asdict(self)
        data["weight_gib"] = self.weight_gib
        data["kv_gib_per_sequence"] = self.kv_gib_per_sequence
        for key in ("decode", "prefill"):
            step = getattr(self, key)
            data[key] = step.to_dict() if step else None
        return data


def estimate_format(
    shape: ModelShape, fmt: PlanFormat, hw: Hardware, scenario: Scenario, draft: Draft | None = None
) -> FormatEstimate:
    kv = kv_cache.kv_dtype(scenario.kv_dtype)
    budget = weight_budget(shape, fmt, scenario.quantize_head)
    tflops = math_tflops(hw, fmt, scenario.act_quant)
    usable = hw.memory_bytes * scenario.memory_utilization
    cap = capacity(
        usable,
        budget.total_bytes,
        kv_cache.kv_bytes_paged(shape, kv, scenario.context),
        kv_cache.kv_bytes_per_sequence(shape, kv, scenario.reserve_tokens(shape)),
    )
    sequences = min(scenario.concurrency, cap.max_sequences_paged)
    row = FormatEstimate(
        format=fmt.label,
        family=fmt.family,
        bits_per_weight=budget.linear_bits_per_weight,
        bits_per_weight_overall=8 * budget.total_bytes / shape.total_params,
        weight_bytes=budget.total_bytes,
        fits=sequences > 0,
        kv_bytes_per_token=kv_cache.kv_bytes_per_token(shape, kv),
        kv_bytes_per_sequence=kv_cache.kv_bytes_per_sequence(shape, kv, scenario.context),
        max_sequences_paged=cap.max_sequences_paged,
        max_sequences_reserved=cap.max_sequences_reserved,
        sequences=sequences,
        decode_tok_s_single=None,
        decode_tok_s_per_sequence=None,
        decode_tok_s_aggregate=None,
        prefill_s=None,
        bottleneck="capacity",
        math_tflops=tflops,
        capacity=cap,
    )
    if not cap.weights_fit:
        row.notes.append(f"weights need {budget.total_bytes / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable")
        return row
    if sequences == 0:
        row.notes.append(f"no room for one sequence of {scenario.context} tokens beside the weights")
        return row
    single = decode_step(shape, budget, hw, tflops, 1, scenario.context, kv)
    step = decode_step(shape, budget, hw, tflops, sequences, scenario.context, kv)
    row.decode = step
    row.prefill = prefill_cost(shape, budget, hw, tflops, scenario.context, kv)
    row.decode_tok_s_single = 1 / single.seconds
    row.decode_tok_s_per_sequence = 1 / step.seconds
    row.decode_tok_s_aggregate = sequences / step.seconds
    row.prefill_s = row.prefill.seconds
    if scenario.concurrency > cap.max_sequences_paged:
        row.bottleneck = "capacity"
        row.notes.append(f"only {cap.max_sequences_paged} of {scenario.concurrency} sequences fit")
    else:
        row.bottleneck = step.bound
    if draft is not None and scenario.acceptance is not None:
        row.speculation = estimate_speculation(shape, budget, fmt, hw, scenario, draft, row)
    return row


def estimate_speculation(
    shape: ModelShape,
    budget: WeightBudget,
    fmt: PlanFormat,
    hw: Hardware,
    scenario: Scenario,
    draft: Draft,
    row: FormatEstimate,
) -> SpeculationEstimate:
    kv = kv_cache.kv_dtype(scenario.kv_dtype)
    draft_fmt = draft.fmt or fmt
    draft_budget = weight_budget(draft.shape, draft_fmt, scenario.quantize_head)
    draft_tflops = math_tflops(hw, draft_fmt, scenario.act_quant)
    tflops = row.math_tflops
    # the draft's weights and KV share the memory with the target's
    cap = capacity(
        row.capacity.usable_bytes,
        budget.total_bytes + draft_budget.total_bytes,
        row.capacity.kv_paged_bytes + kv_cache.kv_bytes_paged(draft.shape, kv, scenario.context),
        row.capacity.kv_reserved_bytes + kv_cache.kv_bytes_per_sequence(draft.shape, kv, scenario.reserve_tokens(shape)),
    )
    sequences = min(scenario.concurrency, cap.max_sequences_paged)
    acceptance = scenario.acceptance

    def per_sequence_rate(k: int, seqs: int) -> tuple[float, float]:
        draft_step = decode_step(draft.shape, draft_budget, hw, draft_tflops, seqs, scenario.context, kv)
        verify = decode_step(shape, budget, hw, tflops, seqs, scenario.context, kv, tokens_per_sequence=k + 1)
        cycle = speculative_cycle_seconds(draft_step.seconds, verify.seconds, k)
        return expected_tokens_per_pass(acceptance, k) / cycle, cycle

    k = scenario.draft_tokens
    if sequences == 0:
        rate = cycle = 0.0
        plain_same = 0.0
    else:
        rate, cycle = per_sequence_rate(k, sequences)
        plain_same = 1 / decode_step(shape, budget, hw, tflops, sequences, scenario.context, kv).seconds
    best_k, best_rate = k, rate
    if sequences:
        for candidate in range(0, MAX_DRAFT_TOKENS + 1):
            candidate_rate, _ = per_sequence_rate(candidate, sequences)
            if candidate_rate > best_rate * (1 + 1e-12):
                best_k, best_rate = candidate, candidate_rate
    aggregate = rate * sequences
    return SpeculationEstimate(
        draft=draft.name,
        draft_format=draft_fmt.label,
        draft_tokens=k,
        acceptance=acceptance,
        tokens_per_pass=expected_tokens_per_pass(acceptance, k),
        draft_weight_bytes=draft_budget.total_bytes,
        draft_kv_bytes_per_sequence=kv_cache.kv_bytes_per_sequence(draft.shape, kv, scenario.context),
        max_sequences_paged=cap.max_sequences_paged,
        sequences=sequences,
        cycle_s=cycle,
        tok_s_per_sequence=rate,
        tok_s_aggregate=aggregate,
        speedup_per_sequence=rate / plain_same if plain_same else 0.0,
        speedup_aggregate=aggregate / row.decode_tok_s_aggregate if row.decode_tok_s_aggregate else 0.0,
        best_draft_tokens=best_k,
        best_speedup_per_sequence=best_rate / plain_same if plain_same else 0.0,
    )
