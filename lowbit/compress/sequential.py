"""Calibrated methods (gptq, awq, awq+gptq) as compress/pipeline.py layer methods, sequentially.

`make_layer_method(context)` is what `lowbit quantize --method gptq|awq|awq+gptq` reaches (and rtn
with --keep-outliers; compress/methods.py routes them here). It reads the run's MethodOptions (compress/options.py):
  calibration.calib  a STATS file from `lowbit calibrate` (statistics of the float model, reused as is), or
  calibration.data   a text to calibrate on now, sequentially: layer i's statistics are measured on
                     the outputs of the already-quantized layers below it (windows samples × seqlen,
                     seed, sink_weight: compress/calibrate.first_token_weight)
  work_dir           resume folder; each layer's result is saved there, and a rerun after a kill
                     replays the saved layers and continues, giving the same bytes
  outliers           see compress/outliers.py; the side matrices go into the checkpoint as
                     `<module>.outliers.indices/values` (formats/native.py)
  gptq               refit rounds, float_target
and turns them into `QuantOptions`, the per-layer knobs (damp, act_order, block_size, awq_grid and
awq_clip keep their defaults there).

`quantize_layer` is the method itself for one decoder layer, on statistics alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.errors import LowbitError, UsageError
from lowbit.compress import awq as awq_mod
from lowbit.compress.calibrate import LayerStats, LayerwiseModel, collect_stats, prepare_calibration, propagate
from lowbit.compress.gptq import DEFAULT_BLOCK, DEFAULT_DAMP, float_target, gptq_quantize, gptq_quantize_shared, prepare_hessian
from lowbit.compress.methods import LayerResult
from lowbit.compress.options import MethodOptions
from lowbit.compress.workdir import WorkDir
from lowbit.formats.moe_names import is_router
from lowbit.compress.outliers import DEFAULT_SALIENCE, outlier_mask
from lowbit.quant.outlier_matrix import pack_outliers, unpack_outliers
from lowbit.quant.qtensor import PART_NAMES, QTensor
from lowbit.quant.registry import get_format
from lowbit.quant.rtn import shared_global_scale
from lowbit.quant.spec import FormatSpec
from lowbit.compress.staged import replay_staged, run_staged, stageable
from lowbit.compress.stats import InputStats, StatsFile

METHODS = ("rtn", "gptq", "awq", "awq+gptq")
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


@dataclass(slots=True)
class QuantOptions:
    method: str = "gptq"
    damp: float = DEFAULT_DAMP
    act_order: bool = True
    block_size: int = DEFAULT_BLOCK
    refit: int = 1  # GPTQ: rounds of scale refitting (compress/gptq.py), 0 = off
    awq_grid: int = awq_mod.DEFAULT_GRID
    awq_clip: bool = True
    keep_outliers: float = 0.0  # percent of each matrix's weights kept in bf16
    keep_channels: float = 0.0  # percent of input channels kept whole in bf16
    outlier_salience: str = DEFAULT_SALIENCE
    float_target: bool = False  # GPTQ with --data: match the float model's outputs (quant/gptq.float_target)

    def __post_init__(self):
        if self.method not in METHODS:
            raise UsageError(f"unknown method '{self.method}' (known: {', '.join(METHODS)})")


@dataclass(slots=True)
class LayerOutcome:
    qtensors: dict[str, QTensor]  # full module name -> QTensor
    outliers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module -> packed side matrix
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # changed dense tensors (AWQ-folded norms, biases)
    notes: list[str] = field(default_factory=list)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # MoE block -> calibration tokens per expert

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = {}, {"modules": {}, "outliers": sorted(self.outliers), "dense": sorted(self.dense), "notes": self.notes,
                             "expert_tokens": self.expert_tokens}
        for module, qt in self.qtensors.items():
            for part, t in qt.to_tensors().items():
                tensors[f"{module}.weight.{part}"] = t
            meta["modules"][module] = qt.meta()
        for module, parts in self.outliers.items():
            for part, t in parts.items():
                tensors[f"{module}.outliers.{part}"] = t
        tensors.update({name: t for name, t in self.dense.items()})
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict) -> LayerOutcome:
        qtensors = {}
        for module, m in meta["modules"].items():
            prefix = f"{module}.weight."
            parts = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and k[len(prefix):] in PART_NAMES}
            qtensors[module] = QTensor.from_tensors(parts, m, where=module)
        outliers = {m: {p: tensors[f"{m}.outliers.{p}"] for p in ("indices", "values")} for m in meta["outliers"]}
        dense = {name: tensors[name] for name in meta["dense"]}
        return cls(qtensors=qtensors, outliers=outliers, dense=dense, notes=list(meta["notes"]),
                   expert_tokens=dict(meta.get("expert_tokens", {})))


def _site_stats(stats: LayerStats) -> dict[str, tuple[str, InputStats]]:
    """module -> (site, stats) for every Linear of the layer."""
    return {m: (site, stats.sites[site]) for site, mods in stats.site_modules.items() for m in mods}


SHARED_ROWS = 16384  # rows of one shared GPTQ pass (a dense model's q|k|v or gate|up fit in one)


def _row_chunks(jobs: list) -> list[list]:
    """jobs (module, weight, ...) cut into runs of at most SHARED_ROWS rows (a larger matrix alone)."""
    chunks, rows = [[]], 0
    for job in jobs:
        n = job[1].shape[0]
        if chunks[-1] and rows + n > SHARED_ROWS:
            chunks.append([])
            rows = 0
        chunks[-1].append(job)
        rows += n
    return chunks


def _expert_notes(modules: list[str], expert_tokens: dict[str, list[int]]) -> list[str]:
    """One note per MoE block the router left experts of idle during calibration: those without
    statistics (`unfed`: routed tokens only) are quantized with RTN; the others took theirs from
    every token run through every expert (the default)."""
    unfed: dict[str, set[int]] = {}
    for module in modules:
        block, _, rest = module.partition(".experts.")
        unfed.setdefault(block, set()).add(int(rest.split(".", 1)[0]))
    notes = []
    for block in dict.fromkeys([*unfed, *expert_tokens]):
        rtn = sorted(unfed.get(block, ()))
        idle = [e for e, count in enumerate(expert_tokens.get(block, [])) if count == 0 and e not in rtn]
        if rtn:
            notes.append(f"{block}: no calibration tokens reached {_experts(rtn)} (statistics from routed tokens only); "
                         "quantized with RTN")
        if idle:
            notes.append(f"{block}: the router sent no calibration tokens to {_experts(idle)}; "
                         "their statistics come from every token run through every expert")
    return notes


def _experts(ids: list[int]) -> str:
    return f"expert{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def quantize_layer(
    layer: nn.Module, prefix: str, stats: LayerStats, specs: dict[str, FormatSpec], options: QuantOptions
) -> LayerOutcome:
    """Quantize the Linears of one decoder layer named in `specs` (full names) from its input
    statistics. AWQ changes `layer` in place (folded scales); the quantized weights are not put
    in — `apply_outcome` does that."""
    outcome = LayerOutcome(qtensors={})
    by_module = _site_stats(stats)
    # An MoE expert the router sent no calibration token (statistics from routed tokens only) has
    # none: it is quantized with RTN, with a note; any other Linear without statistics is an error.
    # A router a recipe quantizes has none either (it is no Linear): always RTN.
    unfed = [m for m in specs if m not in by_module]
    for module in unfed:
        if ".experts." not in module and not is_router(module):
            raise LowbitError(f"no calibration statistics for {module}")
    outcome.notes.extend(_expert_notes([m for m in unfed if ".experts." in m], stats.expert_tokens or {}))
    site_stats = {site: st for site, st in stats.sites.items()}
    local = {m[len(prefix):]: m for m in specs}

    if options.method.startswith("awq"):
        for group in awq_mod.scale_groups(layer):
            members = [local.get(name) for name in group.linears]
            # the members with statistics score the search; an expert without takes the scale all the same
            quantized = [(name, m) for name, m in zip(group.linears, members) if m is not None and m in by_module]
            if not quantized:
                continue
            # The search scores only the quantized members; a dense member (a mixed-precision
            # recipe, an MoE router) takes the folded scale losslessly and is written back as a
            # changed tensor.
            site, st = by_module[quantized[0][1]]
            weights = [layer.get_submodule(name).weight.data.float() for name, _ in quantized]
            s, alpha, rel = awq_mod.search_scales(weights, [specs[m] for _, m in quantized], st, grid=options.awq_grid)
            if alpha < 0:
                continue
            awq_mod.fold_scale(layer, group, s)
            # every input the fold divided by s: one site when the members read one tensor; an MoE
            # calibrated on routed tokens only gives each expert its own
            for member_site in {by_module[m][0] for m in members if m in by_module}:
                site_stats[member_site] = site_stats[member_site].scaled(s)
            for name, m in zip(group.linears, members):
                if m is None:
                    outcome.dense[f"{prefix}{name}.weight"] = layer.get_submodule(name).weight.data.float().clone()
            prev = layer.get_submodule(group.prev)
            outcome.dense[f"{prefix}{group.prev}.weight"] = prev.weight.data.float().clone()
            if isinstance(prev, nn.Linear) and prev.bias is not None:
                outcome.dense[f"{prefix}{group.prev}.bias"] = prev.bias.data.float().clone()

    global_scales: dict[str, torch.Tensor] = {}
    for fused in FUSED:
        members = [local.get(name) for name in fused]
        if any(m is None for m in members) or len({specs[m] for m in members}) != 1:
            continue
        weights = [layer.get_submodule(name).weight.data.float() for name in fused]
        scale = shared_global_scale(weights, specs[members[0]])
        if scale is not None:
            global_scales.update(dict.fromkeys(members, scale))

    gptq_jobs: dict[tuple[str, FormatSpec], list[tuple[str, torch.Tensor, object, object]]] = {}
    prepared: dict[str, object] = {}

    def prepare(site: str):
        if site not in prepared:
            prepared[site] = prepare_hessian(site_stats[site].hessian, damp=options.damp, act_order=options.act_order)
        return prepared[site]

    for name, module in local.items():
        spec = specs[module]
        fmt = get_format(spec)
        if module in unfed:
            w = layer.get_submodule(name).weight.data.float()
            outcome.qtensors[module] = fmt.quantize(w, spec, global_scale=global_scales.get(module))
            continue
        site, _ = by_module[module]
        st = site_stats[site]
        w = layer.get_submodule(name).weight.data.float()
        if st.shift is not None and options.method in ("gptq", "awq+gptq") and prepare(site) is not None:
            w = float_target(w, st.shift, prepared[site].hessian)
        gscale = global_scales.get(module)
        keep = None
        if options.keep_outliers or options.keep_channels:
            keep = outlier_mask(w, st, options.keep_outliers, channel_percent=options.keep_channels, kind=options.outlier_salience,
                                spec=spec, own_error=options.method not in ("gptq", "awq+gptq"))
        if options.method == "awq" and options.awq_clip and keep is None:
            w = _clip_if_better(w, spec, st, gscale)
        if options.method in ("gptq", "awq+gptq"):
            gptq_jobs.setdefault((site, spec), []).append((module, w, gscale, keep))
            continue
        base = w if keep is None else w.masked_fill(keep, 0.0)
        outcome.qtensors[module] = fmt.quantize(base, spec, stats=st.sq_mean, global_scale=gscale)
        if keep is not None:
            outcome.outliers[module] = pack_outliers(torch.where(keep, w.to(torch.bfloat16).float(), 0.0), keep)

    # a site's prepared Hessian (float64 factors, ~190 MB at K = 2816) is dropped after its last job:
    # an MoE layer has one down_proj site per expert, and holding them all had peaked at 3.9 GB
    # quantizing the synthetic MoE's layers
    last_job = {key[0]: key for key in gptq_jobs}  # site -> its last (site, spec) job
    for (site, spec), jobs in gptq_jobs.items():
        st = site_stats[site]
        if prepare(site) is None:
            results = [gptq_quantize(w, spec, st.hessian, global_scale=g, keep=kp) for _, w, g, kp in jobs]
        else:
            # Linears reading the same input go through GPTQ together (rows are independent, so
            # the same results), in passes of up to SHARED_ROWS rows: an MoE layer's experts all
            # read one input, and stacking every expert's gate/up at once had taken ~1.5 GB of
            # working copies per pass on the synthetic MoE
            results = []
            for chunk in _row_chunks(jobs):
                results += gptq_quantize_shared(
                    [w for _, w, _, _ in chunk], spec, prepared[site], block_size=options.block_size,
                    global_scales=[g for _, _, g, _ in chunk], keeps=[kp for _, _, _, kp in chunk], refit=options.refit,
                )
        for (module, _, _, keep), result in zip(jobs, results):
            if result.fallback:
                outcome.notes.append(f"{module}: Hessian not positive definite even at maximum dampening; used RTN")
            outcome.qtensors[module] = result.qtensor
            if keep is not None:
                outcome.outliers[module] = pack_outliers(result.kept, keep)
        del results
        if last_job[site] == (site, spec):
            prepared.pop(site, None)
    # Keep the forward order of the modules (the checkpoint and the notes list them that way).
    outcome.qtensors = {m: outcome.qtensors[m] for m in specs if m in outcome.qtensors}
    outcome.outliers = {m: outcome.outliers[m] for m in specs if m in outcome.outliers}
    return outcome


def _clip_if_better(w: torch.Tensor, spec: FormatSpec, st: InputStats, gscale) -> torch.Tensor:
    """AWQ's clip search, kept only when it lowers the layer's output error tr(E H Eᵀ)."""
    fmt = get_format(spec)
    clipped = awq_mod.search_clip(w, spec, st, global_scale=gscale)

    def error(candidate):
        e = fmt.quantize(candidate, spec, stats=st.sq_mean, global_scale=gscale).dequantize(torch.float32) - w
        return float(((e @ st.hessian) * e).sum())

    return clipped if error(clipped) < error(w) else w


def apply_outcome(layer: nn.Module, prefix: str, outcome: LayerOutcome) -> None:
    """Put the quantized weights (plus kept outliers) and changed dense tensors into the float layer,
    so the next layer is calibrated on what the quantized model computes."""
    # Dense first: AWQ records the float weight of a Linear it folded a scale into (v_proj, up_proj),
    # which that Linear's own quantized weight must replace, as the checkpoint does (compress/pipeline.py
    # writes no dense copy of a quantized module).
    for name, tensor in outcome.dense.items():
        owner, _, leaf = name[len(prefix):].rpartition(".")
        getattr(layer.get_submodule(owner), leaf).data = tensor.float().clone()
    for module, qt in outcome.qtensors.items():
        w = qt.dequantize(torch.float32)
        if module in outcome.outliers:
            w = w + unpack_outliers(outcome.outliers[module], qt.shape)
        layer.get_submodule(module[len(prefix):]).weight.data = w


def _quantize_staged(lm, layer: nn.Module, index: int, hidden: torch.Tensor, specs: dict[str, FormatSpec], options: QuantOptions,
                     first_weight: float = 1.0, reference: torch.Tensor | None = None) -> LayerOutcome:
    """GPTQ site by site on the outputs of the already-quantized sites (compress/staged.py); `hidden`
    ends up holding the quantized layer's outputs (and `reference`, if given, the float layer's)."""
    prefix = lm.layer_prefix(index)
    outcome = LayerOutcome(qtensors={})

    def quantize_site(site: str, modules: tuple[str, ...], stats: InputStats) -> dict[str, torch.Tensor]:
        names = [prefix + m for m in modules if prefix + m in specs]
        if not names:
            return {}
        part = quantize_layer(layer, prefix, LayerStats(sites={prefix + site: stats}, site_modules={prefix + site: names}),
                              {m: specs[m] for m in names}, options)
        outcome.qtensors.update(part.qtensors)
        outcome.outliers.update(part.outliers)
        outcome.notes.extend(part.notes)
        weights = {}
        for module, qt in part.qtensors.items():
            w = qt.dequantize(torch.float32)
            if module in part.outliers:
                w = w + unpack_outliers(part.outliers[module], qt.shape)
            weights[module[len(prefix):]] = w
        return weights

    run_staged(lm, layer, index, hidden, quantize_site, first_weight=first_weight, reference=reference)
    outcome.qtensors = {m: outcome.qtensors[m] for m in specs if m in outcome.qtensors}
    outcome.outliers = {m: outcome.outliers[m] for m in specs if m in outcome.outliers}
    return outcome


def layer_options(options: MethodOptions) -> QuantOptions:
    """The per-layer knobs of a run: the typed method options, the rest at their defaults."""
    return QuantOptions(method=options.method, refit=options.gptq.refit, float_target=options.gptq.float_target,
                        keep_outliers=options.outliers.keep_outliers, keep_channels=options.outliers.keep_channels,
                        outlier_salience=options.outliers.salience)


def make_layer_method(context):
    """The pipeline's factory for gptq / awq / awq+gptq (see the module docstring)."""
    run = context.options
    source = run.calibration
    options = layer_options(run)  # MethodOptions checked the method's calibration and float target
    lm = LayerwiseModel(context.model_dir, all_experts=source.all_experts)
    identity = lm.identity()
    stats_file = hidden = None
    first_weight = 1.0
    if source.calib is not None:
        stats_file = StatsFile(source.calib)
        stats_file.check(identity)
        fingerprint = {"calib": stats_file.identity["config_hash"], "stats": stats_file.header["calibration"]}
    else:
        inputs = prepare_calibration(context.model_dir, source.data, source.samples, source.seqlen, source.seed,
                                     sink_weight=source.sink_weight, all_experts=source.all_experts)
        first_weight = inputs.first_weight
        fingerprint = {"data": inputs.data_hash, "samples": list(inputs.ids.shape), "seed": inputs.seed}
        if first_weight != 1.0:
            fingerprint["first_token_weight"] = first_weight
    # the method and every module's format too: a folder another method or recipe left must not resume
    fingerprint.update({"job": "quantize", "model": identity["config_hash"], "method": context.method,
                        "formats": context.formats, "options": {k: str(v) for k, v in sorted(run.record().items())}})
    work = WorkDir(run.work_dir, fingerprint) if run.work_dir else None
    snapshot_at = 0
    snapshot_every_s = float(run.snapshot_every_s)
    last_snapshot = [time.monotonic()]
    reference = None  # the float model's hidden states, for --float-target
    if stats_file is None:
        snap = work.load_hidden() if work is not None and work.resumed else None
        if snap is not None and options.float_target:
            ref_snap = work.load_hidden("reference")
            snap = None if ref_snap is None or ref_snap[1] != snap[1] else snap
        if snap is not None and snap[1] <= work.finished_layers() and snap[0].dtype == lm.compute_dtype:
            hidden, snapshot_at = snap[0].clone(), snap[1]
            if options.float_target:
                reference = ref_snap[0].clone()
        else:
            hidden = lm.embed(inputs.ids)
            if options.float_target:
                reference = hidden.clone()

    def snapshot(next_layer: int) -> None:
        if work is not None and next_layer < lm.num_layers and time.monotonic() - last_snapshot[0] >= snapshot_every_s:
            work.save_hidden(hidden, next_layer)
            if reference is not None:
                work.save_hidden(reference, next_layer, "reference")
            last_snapshot[0] = time.monotonic()

    def layer_method(part):
        if part.index is None:
            if part.name == "head" and work is not None:
                work.remove()
            return LayerResult(qtensors={m: get_format(s).quantize(part.weight(m), s) for m, s in part.specs.items()})
        i = part.index
        prefix = lm.layer_prefix(i)
        layer = lm.load_layer(i)
        moved = False  # whether `hidden` already holds this layer's quantized outputs
        staged = stats_file is None and options.method == "gptq" and stageable(layer)
        if reference is not None and not staged:
            raise LowbitError(f"--float-target needs the staged GPTQ pass, which {prefix.rstrip('.')} does not fit")
        if work is not None and work.has_layer(i):
            outcome = LayerOutcome.from_tensors(*work.load_layer(i))
        else:
            if stats_file is not None:
                sites = stats_file.layer_sites(prefix)
                stats = LayerStats(sites={s: stats_file.site(s) for s in sites}, site_modules=sites,
                                   expert_tokens=stats_file.layer_expert_tokens(prefix))
            elif staged:
                outcome = _quantize_staged(lm, layer, i, hidden, part.specs, options, first_weight, reference)
                moved = True
            else:
                stats = collect_stats(lm, layer, i, hidden, write_outputs=False, first_weight=first_weight)
            if not moved:
                outcome = quantize_layer(layer, prefix, stats, part.specs, options)
                outcome.expert_tokens = stats.expert_tokens
            if work is not None:
                work.save_layer(i, *outcome.to_tensors())
                outcome = LayerOutcome.from_tensors(*work.load_layer(i))
        if moved:
            snapshot(i + 1)
        elif hidden is not None and i >= snapshot_at:
            if reference is not None:  # the float layer first, then the same layer quantized
                replay_staged(lm, lm.load_layer(i), i, reference)
            layer = lm.load_layer(i)  # a fresh float layer, then exactly the saved changes
            apply_outcome(layer, prefix, outcome)
            # a staged layer moves `hidden` by the stages' own arithmetic (compress/staged.py)
            (replay_staged if staged else propagate)(lm, layer, i, hidden)
            snapshot(i + 1)
        lm.release_layer(i)
        dense = {n: t.to(part.tensors[n].dtype) if n.endswith("bias") else t for n, t in outcome.dense.items()}
        return LayerResult(qtensors=outcome.qtensors, dense=dense, notes=outcome.notes, outliers=outcome.outliers,
                           expert_tokens=outcome.expert_tokens)

    return layer_method
