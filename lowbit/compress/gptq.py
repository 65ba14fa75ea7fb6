"""GPTQ for every format: quantize one column at a time and push each column's error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

With H = E[x xᵀ] of the Linear's input, the output error of a weight error E is tr(E H Eᵀ).
GPTQ visits the columns in order; after rounding column j it spreads the error e_j over the
remaining columns through row j of the upper Cholesky factor U of H⁻¹ (U = chol(H⁻¹)ᵀ):
    err = (w_j − q_j) / U[j, j];   W[:, j+1:] −= err ⊗ U[j, j+1:]
Columns go in blocks of 128: inside a block the update is applied column by column, the rest of
the matrix gets the block's errors in one product (lazy batch updates).

Format independence: the format computes the group scales once, up front, from the original
weight (weighted by diag H), and `fake_quantize_column` rounds one column with those scales.
With act-order the columns are visited by decreasing diag H, but every column keeps the scale of
its own group in the original order ("static groups"), so the stored checkpoint has the usual
layout and needs no permutation at run time.

Dampening: λ = 1% of mean(diag H) is added to the diagonal; when the Cholesky fails λ grows
tenfold up to `max_damp`; if it still fails the layer falls back to RTN (result.fallback).
Dead columns (diag H = 0: an input that is always zero) get H_jj = 1 and weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.native import gptq_columns as cpu_gptq
from lowbit.quant import intq
from lowbit.quant.groups import GroupScales, check_weight, safe_divisor
from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import as_spec, get_format
from lowbit.quant.spec import FormatSpec

DEFAULT_BLOCK = 128
DEFAULT_DAMP = 0.01
MAX_DAMP = 10.0


@dataclass(slots=True)
class PreparedHessian:
    """What GPTQ needs from H, computed once per input site and shared by its Linears."""

    upper: torch.Tensor  # U: upper Cholesky factor of (H + λI)⁻¹ in visiting order, float32 [K, K]
    perm: torch.Tensor  # visiting order of the columns (long [K])
    dead: torch.Tensor  # bool [K]: inputs that never fire
    diag: torch.Tensor  # diag H (float32 [K]), the per-column weights for the scale search
    damp: float  # the λ / mean(diag H) that worked
    hessian: torch.Tensor | None = None  # H + λ·mean(diag H)·I in the original column order (the refit's metric)


def prepare_hessian(
    hessian: torch.Tensor, *, damp: float = DEFAULT_DAMP, act_order: bool = True, max_damp: float = MAX_DAMP
) -> PreparedHessian | None:
    """Factor H for GPTQ; None when no dampening up to `max_damp` makes it positive definite."""
    # float32 throughout: the factorisation runs faster than in float64, and with 1%
    # dampening U agrees with the float64 one to 2e-7 relative (SmolLM2); a failed factorisation
    # still raises the dampening.
    h = hessian.detach().float().clone()
    k = h.shape[0]
    diag = torch.diagonal(h)
    dead = diag == 0
    h[dead, dead] = 1.0
    weights = torch.diagonal(h).clone()
    weights[dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(k)
    unpermuted = h
    h = h[perm][:, perm]
    mean_diag = torch.diagonal(h).mean()
    eye = torch.eye(k, dtype=h.dtype)
    lam = damp
    while torch.isfinite(mean_diag) and lam <= max_damp * (1 + 1e-9):
        # With J the reversal, J H J = M Mᵀ gives H = R Rᵀ for the upper triangular R = J M J, so
        # H⁻¹ = R⁻ᵀ R⁻¹ and U = R⁻¹ is the upper Cholesky factor of H⁻¹ (unique): one factorisation
        # and one triangular inverse, a third of the work of forming H⁻¹ and factoring it again.
        lower, info = torch.linalg.cholesky_ex((h + lam * mean_diag * eye).flip(0, 1))
        if int(info) == 0:
            upper = torch.linalg.solve_triangular(lower.flip(0, 1), eye, upper=True)
            if torch.isfinite(upper).all():
                damped = unpermuted + lam * mean_diag * eye
                return PreparedHessian(upper=upper, perm=perm, dead=dead, diag=weights, damp=lam, hessian=damped)
        lam *= 10.0
    return None


def float_target(w: torch.Tensor, shift: torch.Tensor, damped_hessian: torch.Tensor) -> torch.Tensor:
    """The weight GPTQ should approximate when its inputs x come from the quantized model but its
    outputs should match the float model's W x_float (asymmetric calibration, as in GPTAQ).

    Minimising E‖W' x − W x_float‖² + λ‖W' − W‖² (λ: GPTQ's dampening) over W' gives
    W' (H + λI) = W (H + λI) + W E[(x_float − x) xᵀ], that is W' = W + W · shift · (H + λI)⁻¹, and
    for any Q, E‖Q x − W x_float‖² = E‖(Q − W') x‖² + const without the λ term: GPTQ on W' with
    the quantized inputs' H minimises the error against the float model. W' = W when the inputs
    agree."""
    correction = (w.double() @ shift.double()).T
    return (w.double() + torch.linalg.solve(damped_hessian.double(), correction).T).float()


@dataclass(slots=True)
class GPTQResult:
    qtensor: QTensor
    values: torch.Tensor  # the dequantized weight float32 [N, K] (kept weights excluded: 0 there)
    kept: torch.Tensor | None  # float32 [N, K], the bf16 values of the kept weights (0 elsewhere), or None
    damp: float | None  # dampening used; None when the layer fell back to RTN
    fallback: bool


def gptq_quantize(
    w: torch.Tensor,
    spec: FormatSpec | str,
    hessian: torch.Tensor | None = None,
    *,
    prepared: PreparedHessian | None = None,
    block_size: int = DEFAULT_BLOCK,
    damp: float = DEFAULT_DAMP,
    act_order: bool = True,
    global_scale: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    scales: GroupScales | None = None,
    refit: int = 1,
) -> GPTQResult:
    """Quantize W[N, K] with GPTQ against H [K, K] (or an already `prepared` one).

    keep: optional bool mask [N, K] of weights held exactly (rounded to bf16) as outliers; they
    are not quantized (their code is the format's zero) but do take part in the error feedback.
    """
    spec = as_spec(spec)
    if prepared is None:
        prepared = prepare_hessian(hessian, damp=damp, act_order=act_order)
    if prepared is None:
        return _rtn_fallback(check_weight(w).clone(), spec, hessian, global_scale, keep)
    return gptq_quantize_shared(
        [w], spec, prepared, block_size=block_size, global_scales=[global_scale], keeps=[keep], scales=[scales], refit=refit
    )[0]


def gptq_quantize_shared(
    weights: list[torch.Tensor],
    spec: FormatSpec | str,
    prepared: PreparedHessian,
    *,
    block_size: int = DEFAULT_BLOCK,
    global_scales: list[torch.Tensor | None] | None = None,
    keeps: list[torch.Tensor | None] | None = None,
    scales: list[GroupScales | None] | None = None,
    refit: int = 1,
) -> list[GPTQResult]:
    """GPTQ for several matrices that read the same input (q/k/v, gate/up) in one pass.

    Rows never interact in GPTQ (the error feedback runs along a row, through H), so stacking
    the matrices' rows gives each matrix exactly the result it gets alone, with one column loop
    instead of one per matrix. Each keeps its own scales (and global scale).

    refit: rounds of scale refitting (0: none). For formats whose scales can take any value of
    their storage dtype (`fmt.scales_from_values`), the scales are refitted to the codes GPTQ chose
    (least squares in the H metric, `refit_scales`), and each round runs GPTQ again with the
    refitted scales and refits once more; each row keeps whichever candidate has the least output
    error tr(E H Eᵀ).
    """
    spec = as_spec(spec)
    fmt = get_format(spec)
    count = len(weights)
    global_scales = global_scales or [None] * count
    keeps = keeps or [None] * count
    scales = scales or [None] * count
    ws, member_scales = [], []
    for w, gscale, keep, sc in zip(weights, global_scales, keeps, scales):
        w = check_weight(w).clone()
        w[:, prepared.dead] = 0.0
        if sc is None:
            base = w if keep is None else w.masked_fill(keep, 0.0)
            sc = fmt.compute_scales(base, spec, stats=prepared.diag, global_scale=gscale)
        ws.append(w)
        member_scales.append(sc)
    state = _column_pass(ws, member_scales, keeps, prepared, spec, fmt, block_size)
    if refit > 0 and prepared.hessian is not None and hasattr(fmt, "scales_from_values"):
        state = _refit_pass(ws, keeps, state, prepared, spec, fmt, block_size, refit)
    results = []
    for n, (codes, values, kept, sc), keep in zip([w.shape[0] for w in ws], state, keeps):
        qt = QTensor(spec=spec, shape=(n, ws[0].shape[1]), qweight=fmt.pack(codes, spec), **sc.stored)
        results.append(GPTQResult(qtensor=qt, values=values, kept=kept, damp=prepared.damp, fallback=False))
    return results


def _column_pass(ws, member_scales, keeps, prepared: PreparedHessian, spec: FormatSpec, fmt, block_size: int):
    """One GPTQ sweep over the stacked rows of `ws` with fixed scales.

    Returns per matrix (codes [N, K] uint8, values [N, K] float32 with kept weights at 0, kept
    values [N, K] or None, its GroupScales).
    """
    k = ws[0].shape[1]
    rows = [w.shape[0] for w in ws]
    perm = prepared.perm
    upper = prepared.upper
    group_of = perm // member_scales[0].group_size  # the scale group of each visited column
    # Column-major working copies ([K, N]): column j is one contiguous row here.
    work = torch.cat([w.T[perm] for w in ws], dim=1).contiguous()
    scale_t = torch.cat([sc.scale.T[group_of] for sc in member_scales], dim=1).contiguous()
    has_zero = member_scales[0].zero is not None
    zero_t = torch.cat([sc.zero.T[group_of] for sc in member_scales], dim=1).contiguous() if has_zero else None
    any_keep = any(kp is not None for kp in keeps)
    keep_t = None
    if any_keep:
        keep_t = torch.cat(
            [(kp if kp is not None else torch.zeros_like(w, dtype=torch.bool)).T[perm] for kp, w in zip(keeps, ws)], dim=1
        ).contiguous()
    values = torch.zeros_like(work)
    kept = torch.zeros_like(work) if any_keep else None
    codes = None
    if fmt.quantize_group_values is intq.quantize_group_values:
        codes = _integer_loop(work, values, upper, scale_t, zero_t, spec, block_size, keep_t, kept)
    elif hasattr(fmt, "element_grid") and cpu_gptq.available():
        codes = _grid_loop(work, values, upper, scale_t, fmt.element_grid(spec), block_size, keep_t, kept)
    for b0 in range(0, k if codes is None else 0, block_size):
        b1 = min(b0 + block_size, k)
        block = work[b0:b1].clone()
        errors = torch.empty_like(block)
        u = upper[b0:b1, b0:b1]
        for i in range(b1 - b0):
            j = b0 + i
            col = block[i]
            zero = None if zero_t is None else zero_t[j, :, None]
            if keep_t is None:
                c, q = fmt.quantize_group_values(col[:, None], scale_t[j, :, None], zero, spec)
                q = q[:, 0]
                effective = q
            else:
                mask = keep_t[j]
                c, q = fmt.quantize_group_values(col.masked_fill(mask, 0.0)[:, None], scale_t[j, :, None], zero, spec)
                held = col.to(torch.bfloat16).float()
                q = q[:, 0].masked_fill(mask, 0.0)
                kept[j] = torch.where(mask, held, 0.0)
                effective = torch.where(mask, held, q)
            if codes is None:
                codes = torch.empty(work.shape, dtype=c.dtype)
            codes[j] = c[:, 0]
            values[j] = q
            err = errors[i]
            torch.sub(col, effective, out=err).div_(u[i, i])
            if i + 1 < b1 - b0:
                block[i + 1 :].addr_(u[i, i + 1 :], err, alpha=-1.0)
        if b1 < k:
            work[b1:].addmm_(upper[b0:b1, b1:].T, errors, alpha=-1.0)

    inverse = torch.argsort(perm)
    out = []
    start = 0
    for n, sc, keep in zip(rows, member_scales, keeps):
        part = slice(start, start + n)
        start += n
        out.append((
            codes[inverse, part].T.contiguous(),
            values[inverse, part].T.contiguous(),
            None if keep is None else kept[inverse, part].T.contiguous(),
            sc,
        ))
    return out


def _refit_pass(ws, keeps, state, prepared: PreparedHessian, spec: FormatSpec, fmt, block_size: int, rounds: int):
    """GPTQ → refit → (GPTQ with the refitted scales → refit) × rounds, keeping the best candidate
    per row (ties keep the earlier one, so plain GPTQ wins ties).

    Measured on SmolLM2 (int4-asym-g64, layers 15/27, output error against plain GPTQ): one round
    v_proj 0.93–0.95, down_proj 0.96–0.98; five rounds 0.83–0.88 and 0.93–0.96.
    """
    h = prepared.hessian
    if any(fmt.scales_from_values(sc.scale, sc, spec) is None for _, _, _, sc in state):
        return state  # this spec's scales cannot take arbitrary values (e.g. nf4 double quantization)
    # t H for the rows' own weights, shared by every round (with kept weights t changes: recomputed)
    hts = [(w @ h).double() if keep is None else None for w, keep in zip(ws, keeps)]
    best: list[_RowBest | None] = [None] * len(ws)
    current = state
    for r in range(rounds + 1):
        refitted = []
        for m, (w, keep, cand) in enumerate(zip(ws, keeps, current)):
            codes, values, kept, sc = cand
            k = w.shape[1]
            unit = fmt.dequantize_codes(codes, torch.ones(()), _expand(sc.zero, sc.group_size, k), spec)
            target, new_kept = w, None
            if keep is not None:
                unit = unit.masked_fill(keep, 0.0)
                new_kept = torch.where(keep, w.to(torch.bfloat16).float(), 0.0)
                target = w - new_kept
            system = _NormalEquations(target, unit, sc.group_size, h, ht=hts[m])
            new = fmt.scales_from_values(system.solve(fallback=sc.scale), sc, spec)
            new_values = unit * _expand(new.scale, sc.group_size, k)
            if keep is None:  # both candidates are these codes at some scales: errors from the system
                errors, new_errors = system.errors(sc.scale), system.errors(new.scale)
            else:  # GPTQ's kept values differ from the refit's: measure both directly
                errors, new_errors = _row_errors(w, values, kept, h), _row_errors(w, new_values, new_kept, h)
            if best[m] is None:
                best[m] = _RowBest(cand, errors)
            else:
                best[m].offer(cand, errors)
            best[m].offer((codes, new_values, new_kept, new), new_errors)
            refitted.append(new)
        if r == rounds:
            break
        current = _column_pass(ws, refitted, keeps, prepared, spec, fmt, block_size)
    return [(b.codes, b.values, b.kept, fmt.scales_from_values(b.scale, b.scales, spec)) for b in best]


class _RowBest:
    """Per row, the candidate (codes, values, kept, scales) with the least output error so far."""

    __slots__ = ("codes", "values", "kept", "scale", "scales", "errors")

    def __init__(self, cand, errors):
        codes, values, kept, scales = cand
        self.codes, self.values, self.scales = codes.clone(), values.clone(), scales
        self.kept = None if kept is None else kept.clone()
        self.scale = scales.scale.clone()
        self.errors = errors

    def offer(self, cand, errors):
        codes, values, kept, scales = cand
        rows = errors < self.errors
        if not rows.any():
            return
        self.codes[rows], self.values[rows], self.scale[rows] = codes[rows], values[rows], scales.scale[rows]
        if self.kept is not None:
            self.kept[rows] = kept[rows]
        self.errors = torch.where(rows, errors, self.errors)


class _NormalEquations:
    """For fixed codes, the output error of every row as a function of its group scales s [G]:
    e(s) = tᵀHt − 2 sᵀv + sᵀMs, with M_ab = Σ_{i∈a, j∈b} u_i H_ij u_j and v_a = Σ_{i∈a} u_i (H t)_i
    (u: the codes' values at scale 1, t: the weights they stand for). e(s) is a small difference
    of large terms: the products H t and M are float32 GEMMs (2-4x faster than float64; their
    rounding, ~1e-7 of tᵀHt, is far below the 0.5-10 % of e(s) by which candidates differ, even at
    8 bits where e(s) is ~1e-4 of tᵀHt), the sums over them and the solve are float64. `ht` (t H, float64) may be passed in when several code sets share t."""

    __slots__ = ("m", "v", "tht", "group_size")

    def __init__(self, target: torch.Tensor, unit: torch.Tensor, group_size: int, hessian: torch.Tensor,
                 ht: torch.Tensor | None = None):
        n, k = target.shape
        g = self.group_size = group_size
        groups = -(-k // g)
        pad = groups * g - k
        t = target.double()
        if ht is None:
            ht = (target.float() @ hessian.float()).double()  # rows of (H t)
        self.tht = (ht * t).sum(1)
        u32 = torch.nn.functional.pad(unit.float(), (0, pad))
        u = u32.double().reshape(n, groups, g)
        self.v = (u * torch.nn.functional.pad(ht, (0, pad)).reshape(n, groups, g)).sum(-1)  # [N, G]
        hp = torch.nn.functional.pad(hessian.float(), (0, pad, 0, pad))
        m = torch.empty(n, groups, groups)
        ug = u32.view(n, groups, g)
        for a in range(groups):
            # row a of every M: (u_a H_a,:) summed within each group b against u_b; one GEMM per
            # group beats a single einsum over all of them (3-4x, its [N, G, Kp] temporaries)
            p = u32[:, a * g : (a + 1) * g] @ hp[a * g : (a + 1) * g]  # [N, Kp]
            m[:, a] = (p.view(n, groups, g) * ug).sum(-1)
        self.m = m.double()

    def solve(self, fallback: torch.Tensor | None = None) -> torch.Tensor:
        """The least-squares scales float32 [N, G]; a group whose codes are all zero keeps its
        `fallback` scale (0 without one)."""
        diag = torch.diagonal(self.m, dim1=1, dim2=2)
        empty = diag <= 0
        ridge = 1e-9 * diag.mean(-1, keepdim=True).clamp(min=1e-300)
        m = self.m + torch.diag_embed(torch.where(empty, torch.ones_like(diag), ridge))
        rhs = torch.where(empty, torch.zeros_like(self.v), self.v)
        solved = torch.linalg.solve(m, rhs.unsqueeze(-1)).squeeze(-1)
        if fallback is not None:
            solved = torch.where(empty, fallback.double(), solved)
        return solved.float()

    def errors(self, scale: torch.Tensor) -> torch.Tensor:
        """e(s) per row for scales float [N, G]."""
        s = scale.double()
        return self.tht - 2 * (s * self.v).sum(1) + torch.einsum("ra,rab,rb->r", s, self.m, s)


def _expand(t, group_size: int, k: int):
    return None if t is None else t.repeat_interleave(group_size, dim=1)[:, :k]


def refit_scales(
    target: torch.Tensor, unit: torch.Tensor, group_size: int, hessian: torch.Tensor, fallback: torch.Tensor | None = None
) -> torch.Tensor:
    """Per row, the group scales s [N, G] minimising (t − ŵ) H (t − ŵ)ᵀ for ŵ_j = unit_j · s_g(j).

    unit [N, K] are the chosen codes' values at scale 1 and target [N, K] the weights they stand
    for. Each row is a G×G least-squares problem M s = v (`_NormalEquations`). A group whose codes
    are all zero keeps its `fallback` scale (0 without one).
    """
    return _NormalEquations(target, unit, group_size, hessian).solve(fallback)


def _row_errors(w, values, kept, h):
    e = w - values if kept is None else w - values - kept
    return ((e @ h) * e).sum(1)


def _integer_loop(work, values, upper, scale_t, zero_t, spec: FormatSpec, block_size: int, keep_t=None,
                  kept=None) -> torch.Tensor:
    """The column loop for integer grids, writing `values` (and `kept` where keep_t marks weights
    held in bf16) and returning the codes [K, N] (uint8).

    It computes what intq.quantize_group_values computes, (clamp(round(x / s) + z, 0, top) − z)·s,
    as clamp(round(x / s), −z, top − z)·s, which is the same in float32 bit for bit (both sides are
    exact integers below 2^24, and beyond that both clamp to the same bound), with the safe
    divisor taken once for the matrix and the codes formed once at the end. A block of columns is
    one C call where the library is built (native/gptq_columns.py), else `int_block_torch`: the same
    operations (bit for bit but for torch's unfused scalar tail, see native/gptq_columns.c) in a
    Python iteration of 7 torch calls per column (the C blocks save those calls' fixed cost, which
    is much of the loop's time at SmolLM2's sizes; docs/benchmarks.md). Which one runs is fixed
    per machine, so a run's bytes are reproducible there.
    """
    top = float((1 << spec.bits) - 1)
    divisor = safe_divisor(scale_t).float().contiguous()
    scale_t = scale_t.float().contiguous()
    if zero_t is None:
        mid = float(1 << (spec.bits - 1))
        lows, highs = -mid, top - mid
    else:
        mid = zero_t
        lows, highs = (-zero_t).float().contiguous(), (top - zero_t).float().contiguous()
    native = cpu_gptq.available() and work.dtype == torch.float32 and upper.dtype == torch.float32
    int_block = cpu_gptq.int_block if native else int_block_torch
    ints = torch.empty_like(work)

    def run(b0, b1, block, u, errors):
        bounds = (lows, highs) if zero_t is None else (lows[b0:b1], highs[b0:b1])
        held = () if keep_t is None else (keep_t[b0:b1], kept[b0:b1])
        int_block(block, u, divisor[b0:b1], scale_t[b0:b1], *bounds, ints[b0:b1], values[b0:b1], errors, *held)

    _by_blocks(work, upper, block_size, run)
    return ints.add_(mid).to(torch.uint8)


def _grid_loop(work, values, upper, scale_t, grid, block_size: int, keep_t=None, kept=None) -> torch.Tensor:
    """The column loop in C for formats with an element grid (ElementGrid (quant/element_grid.py): minifloats, NF4),
    writing `values` (and `kept`) and returning the codes [K, N]: the generic loop's operations
    without its 16 torch calls a column (tested against it)."""
    divisor = safe_divisor(scale_t).float().contiguous()
    scale_t = scale_t.float().contiguous()
    codes = torch.empty(work.shape, dtype=torch.uint8)

    def run(b0, b1, block, u, errors):
        held = () if keep_t is None else (keep_t[b0:b1], kept[b0:b1])
        cpu_gptq.grid_block(block, u, divisor[b0:b1], scale_t[b0:b1], grid, codes[b0:b1], values[b0:b1], errors, *held)

    _by_blocks(work, upper, block_size, run)
    return codes


def _by_blocks(work, upper, block_size: int, run) -> None:
    """GPTQ's lazy batches: run(b0, b1, block, u, errors) does the columns b0..b1 of a copy of
    `work` in place, then their errors reach every later column in one product."""
    k = work.shape[0]
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        block = work[b0:b1].clone()
        errors = torch.empty_like(block)
        run(b0, b1, block, upper[b0:b1, b0:b1], errors)
        if b1 < k:
            work[b1:].addmm_(upper[b0:b1, b1:].T, errors, alpha=-1.0)


def int_block_torch(block, u, divisor, scale, lo, hi, ints, values, errors, keep=None, kept=None) -> None:
    """GPTQ over the columns of one block [b, n] in place, torch's twin of cpu_gptq.int_block:
    ints = clamp(round(x / divisor), lo, hi), values = ints · scale, errors = (x − values) / u_ii,
    and the later columns of the block take −u_ir · errors (addr_, fused on FMA machines). Where
    `keep` is set: ints = values = 0, kept = bf16(x), errors = (x − kept) / u_ii."""
    diag = torch.diagonal(u).tolist()
    bounded = isinstance(lo, torch.Tensor)
    for i in range(block.shape[0]):
        col, t, err = block[i], ints[i], errors[i]
        torch.div(col, divisor[i], out=t).round_().clamp_(lo[i] if bounded else lo, hi[i] if bounded else hi)
        if keep is None:
            torch.sub(col, torch.mul(t, scale[i], out=values[i]), out=err).div_(diag[i])
        else:
            mask = keep[i]
            t.masked_fill_(mask, 0.0)
            torch.mul(t, scale[i], out=values[i]).masked_fill_(mask, 0.0)
            held = torch.where(mask, col.to(torch.bfloat16).float(), 0.0)
            kept[i] = held
            torch.sub(col, torch.where(mask, held, values[i]), out=err).div_(diag[i])
        if i + 1 < block.shape[0]:
            block[i + 1 :].addr_(u[i, i + 1 :], err, alpha=-1.0)


def _rtn_fallback(w, spec, hessian, global_scale, keep) -> GPTQResult:
    fmt = get_format(spec)
    stats = None
    if hessian is not None:
        diag = torch.diagonal(hessian).float()
        if torch.isfinite(diag).all() and (diag >= 0).all():
            stats = diag
    base = w if keep is None else w.masked_fill(keep, 0.0)
    qt = fmt.quantize(base, spec, stats=stats, global_scale=global_scale)
    values = qt.dequantize(torch.float32)
    kept = None
    if keep is not None:
        values = values.masked_fill(keep, 0.0)
        kept = torch.where(keep, w.to(torch.bfloat16).float(), 0.0)
    return GPTQResult(qtensor=qt, values=values, kept=kept, damp=None, fallback=True)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(E H Eᵀ) for E = Ŵ − W: the mean squared output error over the calibration tokens, summed over outputs."""
    e = (w_hat.double() - w.double())
    return float(((e @ hessian.double()) * e).sum())
