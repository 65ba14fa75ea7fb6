"""AWQ for every format: per-channel input scales that protect salient channels, found by search
and folded into the preceding norm or Linear, then a clip search on the scaled weights.

For Linears sharing an input x (q/k/v, gate/up) multiplying their weight columns by s and the
input by 1/s leaves the float output unchanged; after quantization the output error is
    E = Q(W·diag(s))·diag(1/s) − W,   error = tr(E H Eᵀ)   with H = E[x xᵀ],
which is exactly the mean squared output error over the calibration tokens, so the search is
scored on the calibration activations through their Hessian and needs no stored activations.
Candidates: s = mean|x|^α / w̄^(1−α) (w̄: mean |w| relative to its group's max, the weight
term) for `grid` values of α in [0, 1], normalised to geometric mean 1, plus s = 1 (so AWQ never
does worse than RTN on its own score).

Folding: into an RMSNorm's weight (w/s, or for Gemma's (1 + w) norm w' = (1 + w)/s − 1) or into
the rows (and bias) of the Linear that produces the input (v_proj → o_proj, up_proj →
down_proj; o_proj only when its input width equals v_proj's output, i.e. without GQA sharing).
Inference cost is unchanged: no extra op is added.

Clip search: per (row, group) the weights are clamped to r·max|w| for r in `clip_ratios`; each
group keeps the r whose quantized group gives the least output error e_g H_gg e_gᵀ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from lowbit.quant.groups import grouped, num_groups
from lowbit.quant.registry import as_spec, get_format
from lowbit.quant.spec import FormatSpec
from lowbit.compress.stats import InputStats

DEFAULT_GRID = 20
DEFAULT_CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 … 0.55
SCORE_ROWS = 256  # rows of each Linear that score the α grid (see score_rows)


@dataclass(slots=True)
class ScaleGroup:
    prev: str  # local name of the norm or Linear the scale folds into
    linears: list[str]  # local names of the Linears reading that input


def scale_groups(layer: nn.Module) -> list[ScaleGroup]:
    """The foldable groups of a Llama- or Gemma-3-style decoder layer, its MLP dense or a
    mixture of experts (runtime/models/moe.py).

    In an MoE block the norm's output feeds the router, every expert's gate/up and the shared
    expert with its gate, so all of them take the norm's scale: the router and the shared-expert gate
    stay dense and take it losslessly (written back in float32, so the logits that route a token are
    the ones before the fold up to rounding), as llm-compressor's MoE mappings fold it. Each expert's
    up_proj takes its own down_proj's scale."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [ScaleGroup("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(ScaleGroup("self_attn.v_proj", ["self_attn.o_proj"]))
    mlp_norm = "pre_feedforward_layernorm" if hasattr(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"
    mlps = {"mlp": mlp}
    readers = []
    if hasattr(mlp, "experts"):
        mlps = {f"mlp.experts.{e}": expert for e, expert in enumerate(mlp.experts)}
        readers.append("mlp.gate")
        if mlp.shared_expert is not None:
            mlps["mlp.shared_expert"] = mlp.shared_expert
            readers.append("mlp.shared_expert_gate")
    readers += [f"{name}.{proj}" for name in mlps for proj in ("gate_proj", "up_proj")]
    groups.append(ScaleGroup(mlp_norm, readers))
    for name, m in mlps.items():
        if m.up_proj.out_features == m.down_proj.in_features:
            groups.append(ScaleGroup(f"{name}.up_proj", [f"{name}.down_proj"]))
    return groups


def _group_width(spec: FormatSpec, k: int) -> int:
    return spec.group_size if spec.granularity in ("group", "block") and spec.group_size else k


def weight_term(weights: list[torch.Tensor], specs: list[FormatSpec]) -> torch.Tensor:
    """w̄ [K]: the mean over all rows of |w| / max |w| of its quantization group."""
    rows = []
    for w, spec in zip(weights, specs):
        g = _group_width(spec, w.shape[1])
        wg = grouped(w.abs(), g)
        rel = wg / wg.amax(-1, keepdim=True).clamp_min(1e-12)
        rows.append(rel.reshape(w.shape[0], -1)[:, : w.shape[1]])
    return torch.cat(rows).mean(0)


def fake_quantize(
    w: torch.Tensor, spec: FormatSpec, *, stats: torch.Tensor | None = None, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """dequantize(quantize(W)) without packing and unpacking the codes (the searches call it often)."""
    fmt = get_format(spec)
    n, k = w.shape
    scales = fmt.compute_scales(w, spec, stats=stats, global_scale=global_scale)
    zero = None if scales.zero is None else scales.zero.unsqueeze(-1)
    _, values = fmt.quantize_group_values(grouped(w, scales.group_size), scales.scale.unsqueeze(-1), zero, spec)
    return values.reshape(n, -1)[:, :k].float()


def quantized_error(
    w: torch.Tensor, spec: FormatSpec, stats: InputStats, s: torch.Tensor | None, *, rows: torch.Tensor | None = None
) -> float:
    """tr(E H Eᵀ) of quantizing W·diag(s) (RTN, scales searched with diag H weights) then dividing s
    back out; over the given rows of W only when `rows` is set."""
    if rows is not None:
        w = w[rows]
    scaled = w if s is None else w * s
    col_weights = stats.sq_mean if s is None else stats.sq_mean / (s * s)  # E[(x/s)²]
    q = fake_quantize(scaled, spec, stats=col_weights)
    e = q if s is None else q / s
    e = e - w
    return float(((e @ stats.hessian) * e).sum())


def score_rows(n: int, spec: FormatSpec, limit: int = SCORE_ROWS) -> torch.Tensor | None:
    """Evenly spread rows for scoring the α grid, or None for all of them. The score's cost is
    rows × K², and which α wins shows on a few hundred rows as well as on all; block formats
    (scales shared by 2-D tiles of rows) are always scored whole."""
    if n <= limit or spec.granularity == "block":
        return None
    return torch.linspace(0, n - 1, limit).round().long().unique()


def search_scales(
    weights: list[torch.Tensor],
    specs: list[FormatSpec | str],
    stats: InputStats,
    *,
    grid: int = DEFAULT_GRID,
) -> tuple[torch.Tensor, float, float]:
    """The best per-channel scale s [K] for Linears sharing one input: (s, α, error/identity error)."""
    specs = [as_spec(s) for s in specs]
    x_mean = stats.mean_abs.float().clamp_min(1e-8)
    w_mean = weight_term(weights, specs).clamp_min(1e-8)

    fast = [fast_spec(sp) for sp in specs]

    subsets = [score_rows(w.shape[0], sp) for w, sp in zip(weights, specs)]

    def score(s, which, rows):
        return sum(quantized_error(w, sp, stats, s, rows=r) for w, sp, r in zip(weights, which, rows))

    # The grid is scored on a spread of rows with each format's plain scale rule (one candidate
    # instead of a search); the winner must then also beat s = 1 on all rows under the real rule,
    # or s = 1 is kept.
    best_s, best_err, best_alpha = None, score(None, fast, subsets), -1.0
    for alpha in torch.linspace(0.0, 1.0, grid).tolist():
        s = x_mean.pow(alpha) / w_mean.pow(1.0 - alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp_min(1e-4)
        err = score(s, fast, subsets)
        if err < best_err:
            best_s, best_err, best_alpha = s, err, alpha
    if best_s is None:
        return torch.ones_like(x_mean), -1.0, 1.0
    everything = [None] * len(weights)
    base = score(None, specs, everything)
    final = score(best_s, specs, everything)
    if final >= base:
        return torch.ones_like(x_mean), -1.0, 1.0
    return best_s, best_alpha, final / base if base > 0 else 1.0


_PLAIN_RULE = {"mxfp4": "floor"}


def fast_spec(spec: FormatSpec) -> FormatSpec:
    """The spec with its format's plain (unsearched) scale rule."""
    return dataclasses.replace(spec, scale_rule=_PLAIN_RULE.get(spec.family, "absmax"))


def search_clip(
    w: torch.Tensor,
    spec: FormatSpec | str,
    stats: InputStats,
    *,
    ratios: tuple[float, ...] = DEFAULT_CLIP_RATIOS,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """W with each (row, group) clamped to the ratio of its max |w| that quantizes best.

    The ratios are scored with the format's plain scale rule: the clip ratio is itself the search
    a searched rule would repeat (ten times over), and the caller keeps the clipped W only if it
    also wins under the real rule."""
    spec = fast_spec(as_spec(spec))
    n, k = w.shape
    g = _group_width(spec, k)
    groups = num_groups(k, g)
    h = torch.nn.functional.pad(stats.hessian.float(), (0, groups * g - k, 0, groups * g - k))
    blocks = torch.stack([h[j * g : (j + 1) * g, j * g : (j + 1) * g] for j in range(groups)])  # [G, g, g]
    wg = grouped(w, g)
    amax = wg.abs().amax(-1, keepdim=True)
    best = wg.clone()
    best_err = None
    for r in ratios:
        limit = amax * r
        clipped = torch.maximum(torch.minimum(wg, limit), -limit)
        flat = clipped.reshape(n, -1)[:, :k]
        q = fake_quantize(flat, spec, stats=stats.sq_mean, global_scale=global_scale)
        e = grouped(q - w, g)  # error against the unclipped weight
        err = (torch.einsum("ngc,gcd->ngd", e, blocks) * e).sum(-1, keepdim=True)  # [N, G, 1]
        if best_err is None:
            best_err = err
            best = clipped
            continue
        better = err < best_err
        best = torch.where(better, clipped, best)
        best_err = torch.minimum(err, best_err)
    return best.reshape(n, -1)[:, :k].contiguous()


def fold_scale(layer: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """Divide the producer of the group's input by s and multiply the group's weight columns by s."""
    prev = layer.get_submodule(group.prev)
    s = s.to(torch.float64)  # fold in float64 so only the final cast to the weight's dtype rounds
    if isinstance(prev, nn.Linear):
        prev.weight.data = (prev.weight.data.double() / s[:, None]).to(prev.weight.dtype)
        if prev.bias is not None:
            prev.bias.data = (prev.bias.data.double() / s).to(prev.bias.dtype)
    elif getattr(prev, "unit_offset", False):
        prev.weight.data = ((1.0 + prev.weight.data.double()) / s - 1.0).to(prev.weight.dtype)
    else:
        prev.weight.data = (prev.weight.data.double() / s).to(prev.weight.dtype)
    for name in group.linears:
        lin = layer.get_submodule(name)
        lin.weight.data = (lin.weight.data.double() * s[None, :]).to(lin.weight.dtype)
