"""make_plan: the whole answer for one model on one machine, as data the CLI prints or dumps."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowbit.errors import UsageError
from lowbit.plan import kv_cache
from lowbit.plan.advice import Trick, choose, recommendation, tricks
from lowbit.plan.config_source import load_config
from lowbit.plan.early_exit import check_exit, estimate_exit
from lowbit.plan.estimate import Draft, FormatEstimate, Scenario, estimate_format, weight_bytes_read
from lowbit.plan.hardware import Hardware
from lowbit.plan.model_shape import ModelShape, shape_from_config
from lowbit.plan.weights import PlanFormat, plan_format, weight_budget

DEFAULT_FORMATS = ("bf16", "int8", "fp8", "int4-g128", "nf4", "mxfp4", "nvfp4")


@dataclass(slots=True)
class Plan:
    shape: ModelShape
    source: str
    hardware: Hardware
    scenario: Scenario
    rows: list[FormatEstimate]
    tricks: list[Trick]
    recommended: str | None
    recommendation: str
    draft: str | None = None
    exit_layer: int | None = None
    exit_rate: float | None = None

    def to_dict(self) -> dict:
        s = self.shape
        windows = sorted({w for w in s.layer_windows if w is not None})
        return {
            "model": {
                "name": s.name,
                "source": self.source,
                "model_type": s.model_type,
                "total_params": s.total_params,
                "active_params": s.active_params,
                "linear_params": s.linear_params,
                "embedding_params": s.embedding_params,
                "lm_head_params": s.lm_head_params,
                "tied_embeddings": s.tied_embeddings,
                "layers": s.num_layers,
                "attention_heads": s.num_heads,
                "kv_heads": s.num_kv_heads,
                "head_dim": s.head_dim,
                "sliding_window_layers": sum(w is not None for w in s.layer_windows),
                "sliding_windows": windows,
                "max_context": s.max_context,
                "experts": s.num_experts,
                "experts_per_token": s.experts_per_token,
            },
            "hardware": self.hardware.to_dict(),
            "settings": {
                "context": self.scenario.context,
                "concurrency": self.scenario.concurrency,
                "kv_dtype": self.scenario.kv_dtype,
                "reserve_tokens": self.scenario.reserve_tokens(self.shape),
                "quantize_head": self.scenario.quantize_head,
                "act_quant": self.scenario.act_quant,
                "memory_utilization": self.scenario.memory_utilization,
                "draft": self.draft,
                "draft_tokens": self.scenario.draft_tokens if self.draft else None,
                "acceptance": self.scenario.acceptance,
                "exit_layer": self.exit_layer,
                "exit_rate": self.exit_rate,
            },
            "formats": [row.to_dict() for row in self.rows],
            "tricks": [{"name": t.name, "buys": t.buys, "costs": t.costs, "numbers": t.numbers} for t in self.tricks],
            "recommended": self.recommended,
            "recommendation": self.recommendation,
        }


def load_shape(model: str) -> tuple[ModelShape, str]:
    config, source = load_config(model)
    return shape_from_config(config, name=model), source


def load_draft(arg: str, target: ModelShape, group_size: int | None) -> Draft:
    """`self:FORMAT` drafts with a quantized copy of the target; anything else names a model."""
    if arg.lower().startswith("self"):
        _, _, fmt_text = arg.partition(":")
        fmt = plan_format(fmt_text, group_size) if fmt_text else None
        return Draft(target, arg, fmt)
    shape, _ = load_shape(arg)
    return Draft(shape, arg)


def make_plan(
    model: str,
    hardware: Hardware,
    scenario: Scenario,
    formats: list[str] | tuple[str, ...] | None = None,
    group_size: int | None = None,
    draft: str | None = None,
    exit_layer: int | None = None,
    exit_rate: float | None = None,
) -> Plan:
    """exit_layer / exit_rate: price an early exit at that layer taken by that fraction of tokens
    (plan/early_exit.py) for the recommended format."""
    scenario.validate()
    if draft is not None and scenario.acceptance is None:
        raise UsageError("--draft needs --acceptance A (the probability a draft token is accepted, in (0, 1])")
    if scenario.acceptance is not None and draft is None:
        raise UsageError("--acceptance needs --draft MODEL")
    if group_size is not None and (group_size == 0 or group_size < -1):
        raise UsageError("--group-size must be positive, or -1 for one scale per output row")
    fmts = _formats(formats or DEFAULT_FORMATS, group_size)
    shape, source = load_shape(model)
    check_exit(exit_layer, exit_rate, shape.num_layers)
    draft_model = load_draft(draft, shape, group_size) if draft else None

    rows = [estimate_format(shape, fmt, hardware, scenario, draft_model) for fmt in fmts]
    chosen = choose(rows, scenario)
    focus = chosen or min(rows, key=lambda r: r.weight_bytes)
    focus_fmt = next(f for f in fmts if f.label == focus.format)
    baseline = next((r for r in rows if r.family == "bf16"), None) or estimate_format(shape, PlanFormat("bf16", None), hardware, scenario)
    quantized = focus
    if focus.family == "bf16":
        fitting = [r for r in rows if r.family != "bf16" and r.fits]
        quantized = max(fitting, key=lambda r: r.decode_tok_s_single) if fitting else focus
    kv_bf16 = estimate_format(shape, focus_fmt, hardware, replace(scenario, kv_dtype="bf16"))
    kv_fp8 = estimate_format(shape, focus_fmt, hardware, replace(scenario, kv_dtype="fp8"))
    exit_estimate = None
    if exit_layer is not None:
        budget = weight_budget(shape, focus_fmt, scenario.quantize_head)
        exit_estimate = estimate_exit(shape, focus_fmt, budget, weight_bytes_read(shape, budget, 1), exit_layer,
                                      exit_rate)
    trick_list = tricks(focus, quantized, baseline, kv_bf16, kv_fp8, scenario, scenario.reserve_tokens(shape),
                        exit_estimate)
    return Plan(
        shape=shape,
        source=source,
        hardware=hardware,
        scenario=scenario,
        rows=rows,
        tricks=trick_list,
        recommended=chosen.format if chosen else None,
        recommendation=recommendation(rows, chosen, scenario, hardware),
        draft=draft,
        exit_layer=exit_layer,
        exit_rate=exit_rate,
    )


def _formats(texts, group_size: int | None) -> list[PlanFormat]:
    seen: dict[str, PlanFormat] = {}
    for text in texts:
        fmt = plan_format(text, group_size)
        seen.setdefault(fmt.label, fmt)
    return list(seen.values())


def kv_dtype_names() -> list[str]:
    return list(kv_cache.KV_DTYPES)
