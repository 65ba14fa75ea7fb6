"""Words from numbers: which format to pick, and what each trick buys and what it costs."""

from __future__ import annotations

from dataclasses import dataclass, field

from lowbit.plan.early_exit import ExitEstimate
from lowbit.plan.estimate import FormatEstimate, Scenario
from lowbit.plan.hardware import GIB, Hardware

# Among formats within this fraction of the fastest, the one with more bits wins: the speed
# difference is noise next to the accuracy a bit buys.
NEAR_BEST = 0.9


@dataclass(slots=True)
class Trick:
    name: str
    buys: str
    costs: str
    numbers: dict = field(default_factory=dict)


def gib(value: float) -> str:
    """Three significant figures, enough to tell 0.0107 GiB from 0.0054 GiB and 131 from 132."""
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def choose(rows: list[FormatEstimate], scenario: Scenario) -> FormatEstimate | None:
    """The format to recommend: serves the whole concurrency, fastest, more bits when nearly tied."""
    serving = [r for r in rows if r.fits and r.sequences >= scenario.concurrency]
    pool = serving or [r for r in rows if r.fits]
    if not pool:
        return None
    best = max(r.decode_tok_s_aggregate for r in pool)
    near = [r for r in pool if r.decode_tok_s_aggregate >= NEAR_BEST * best]
    # bits rounded: a per-tensor global scale must not outrank a format of the same nominal size
    return max(near, key=lambda r: (round(r.bits_per_weight, 1), r.decode_tok_s_aggregate))


def recommendation(rows: list[FormatEstimate], chosen: FormatEstimate | None, scenario: Scenario, hw: Hardware) -> str:
    if chosen is None:
        if not rows:
            return "no format to compare"
        smallest = min(rows, key=lambda r: r.weight_bytes)
        usable = hw.memory_gib * scenario.memory_utilization
        return (
            f"nothing fits on {hw.name}: the smallest, {smallest.format}, needs {gib(smallest.weight_gib)} GiB of weights "
            f"and {gib(smallest.kv_gib_per_sequence)} GiB per sequence in {usable:.1f} GiB usable; "
            "split the model over more GPUs, shorten --context, or pick a smaller model"
        )
    text = (
        f"recommend {chosen.format}: {gib(chosen.weight_gib)} GiB of weights, "
        f"{chosen.max_sequences_paged} sequences of {scenario.context} tokens fit (paged), "
        f"{chosen.decode_tok_s_per_sequence:,.1f} tok/s per sequence and {chosen.decode_tok_s_aggregate:,.0f} tok/s "
        f"at {chosen.sequences} sequence{'s' if chosen.sequences != 1 else ''}; {chosen.bottleneck}-bound"
    )
    if chosen.bottleneck == "capacity":
        text += " (fewer bits, fp8 KV or a shorter context fit more sequences)"
    elif chosen.bottleneck == "bandwidth" and chosen.max_sequences_paged > chosen.sequences:
        text += f" (more concurrent sequences cost little: up to {chosen.max_sequences_paged} fit)"
    elif chosen.bottleneck == "compute":
        text += " (fewer weight bits no longer speed it up; fewer sequences per GPU would)"
    return text


def tricks(
    chosen: FormatEstimate,
    quantized: FormatEstimate,
    baseline: FormatEstimate,
    kv_bf16: FormatEstimate,
    kv_fp8: FormatEstimate,
    scenario: Scenario,
    reserve_tokens: int,
    early_exit: ExitEstimate | None = None,
) -> list[Trick]:
    """What quantized weights, fp8 KV, paging, speculation and early exit each change for the chosen format.

    `quantized` is the chosen row, or the fastest quantized one when bf16 was chosen, so the
    first line always shows what quantizing would change.
    """
    return [
        _quantized_weights(quantized, baseline),
        _fp8_kv(kv_bf16, kv_fp8),
        _paging(chosen, scenario, reserve_tokens),
        _speculation(chosen, scenario),
        _early_exit(early_exit),
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _times(x: float | None) -> str:
    return f"×{x:.2f}" if x else "—"


def _quantized_weights(row: FormatEstimate, bf16: FormatEstimate) -> Trick:
    speed = _ratio(row.decode_tok_s_single, bf16.decode_tok_s_single)
    if row.family == "bf16":
        return Trick("quantized weights", "nothing: the chosen format is bf16", "—", {"format": row.format})
    speed_text = f"decode {_times(speed)} alone" if speed else ("bf16 does not fit, this does" if row.fits else "neither fits")
    return Trick(
        f"quantized weights ({row.format})",
        f"weights {gib(bf16.weight_gib)} → {gib(row.weight_gib)} GiB; {speed_text}; "
        f"sequences {bf16.max_sequences_paged} → {row.max_sequences_paged}",
        f"{row.bits_per_weight:.2f} bits/weight with scales; accuracy loss: measure with `lowbit eval --base`",
        {
            "format": row.format,
            "weight_gib_before": bf16.weight_gib,
            "weight_gib_after": row.weight_gib,
            "decode_speedup_single": speed,
            "sequences_before": bf16.max_sequences_paged,
            "sequences_after": row.max_sequences_paged,
        },
    )


def _fp8_kv(bf16: FormatEstimate, fp8: FormatEstimate) -> Trick:
    speed = _ratio(fp8.decode_tok_s_aggregate, bf16.decode_tok_s_aggregate)
    return Trick(
        "fp8 KV cache",
        f"KV {gib(bf16.kv_gib_per_sequence)} → {gib(fp8.kv_gib_per_sequence)} GiB per sequence; "
        f"sequences {bf16.max_sequences_paged} → {fp8.max_sequences_paged}; aggregate decode {_times(speed)}",
        "keys and values rounded to e4m3 (a small KLD; measure with `lowbit eval`); a convert in the attention kernel",
        {
            "kv_gib_per_sequence_bf16": bf16.kv_gib_per_sequence,
            "kv_gib_per_sequence_fp8": fp8.kv_gib_per_sequence,
            "sequences_bf16": bf16.max_sequences_paged,
            "sequences_fp8": fp8.max_sequences_paged,
            "aggregate_speedup": speed,
        },
    )


def _paging(row: FormatEstimate, scenario: Scenario, reserve_tokens: int) -> Trick:
    return Trick(
        "paged KV cache",
        f"sequences {row.max_sequences_reserved} → {row.max_sequences_paged} "
        f"(blocks of 16 as {scenario.context} tokens arrive, instead of {reserve_tokens} reserved each)",
        "up to 15 unused tokens per sequence and layer; a block-table lookup in attention",
        {"sequences_reserved": row.max_sequences_reserved, "sequences_paged": row.max_sequences_paged, "reserve_tokens": reserve_tokens},
    )


def _speculation(row: FormatEstimate, scenario: Scenario) -> Trick:
    spec = row.speculation
    if spec is None:
        return Trick("speculative decoding", "not evaluated: pass --draft MODEL --acceptance A", "—")
    return Trick(
        f"speculative decoding ({spec.draft}, k={spec.draft_tokens}, A={spec.acceptance:g})",
        f"{spec.tokens_per_pass:.2f} tokens per target pass; decode {_times(spec.speedup_per_sequence)} per sequence "
        f"at {spec.sequences} (best k={spec.best_draft_tokens}: {_times(spec.best_speedup_per_sequence)})",
        f"draft weights {gib(spec.draft_weight_bytes / GIB)} GiB + {gib(spec.draft_kv_bytes_per_sequence / GIB)} GiB KV per sequence "
        f"(sequences {row.max_sequences_paged} → {spec.max_sequences_paged}); {spec.draft_tokens} draft steps per pass; "
        f"aggregate {_times(spec.speedup_aggregate)} at the concurrency",
        {
            "tokens_per_pass": spec.tokens_per_pass,
            "speedup_per_sequence": spec.speedup_per_sequence,
            "speedup_aggregate": spec.speedup_aggregate,
            "best_draft_tokens": spec.best_draft_tokens,
        },
    )


def _early_exit(estimate: ExitEstimate | None) -> Trick:
    if estimate is None:
        return Trick("early exit", "not evaluated: pass --exit-layer L --exit-rate R", "—")
    e = estimate
    mb = 1e6
    even = f"break-even at {100 * e.break_even_rate:.0f} % of tokens exiting"
    return Trick(
        f"early exit (layer {e.exit_layer}, {100 * e.exit_rate:.0f} % of tokens)",
        f"batch-1 decode {_times(e.speedup)}: {e.bytes_plain / mb:.1f} → {e.bytes_expected / mb:.1f} MB read per "
        f"token ({e.bytes_exited / mb:.1f} MB when a token exits); {even}",
        f"every token pays one more head read for the check ({e.bytes_not_exited / mb:.1f} MB when it does not exit); "
        "the skipped layers' K/V still filled; quality: measure with `lowbit eval --early-exit`",
        e.to_dict(),
    )
