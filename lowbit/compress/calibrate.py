"""Run a model one decoder layer at a time and measure every Linear input.

Only the embedding, one layer's weights and the samples' hidden states [S, T, D] (float32) are
in memory at once: the hidden states are updated in place, batch by batch, as each layer runs.
Forward pre-hooks on the layer's Linears feed `StatsAccumulator`s; Linears that receive the very
same tensor (q/k/v, gate/up) form one input site.

`run_layers` is the loop both `lowbit calibrate` and the sequential quantizer use: for each layer
it collects the statistics on the current hidden states, asks `process` for the layer's result
(saved in the work folder), lets `apply` change the layer (e.g. put quantized weights in) and
then moves the hidden states through the layer — so layer i is calibrated on the outputs of the
already-processed layers below it. A killed run resumes from the work folder.
"""

from __future__ import annotations

import hashlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.compress.stats import InputStats, StatsAccumulator, model_identity, save_stats
from lowbit.compress.token_cache import encode_cached
from lowbit.compress.workdir import WorkDir, work_dir_for
from lowbit.data.text import load_text
from lowbit.errors import LowbitError, UsageError
from lowbit.formats.atomic import atomic_file, check_output_path
from lowbit.formats.hf_files import model_dir, read_json
from lowbit.formats.resolve import resolve_model
from lowbit.kernels import hugepages
from lowbit.kernels.dispatch import fast_bf16_matmuls
from lowbit.runtime.attention import AttentionContext
from lowbit.runtime.config import ModelConfig
from lowbit.formats.source_tensors import SourceTensors
from lowbit.runtime.models import build_model
from lowbit.runtime.tokenizer import load_tokenizer

DEFAULT_BATCH_TOKENS = 8192
# A window's first position weighs seqlen / SINK_DIVISOR tokens in the statistics (at least 1),
# about 3 % of the window's total weight: see `first_token_weight`.
SINK_DIVISOR = 32


def first_token_weight(seqlen: int, requested: float | None = None) -> float:
    """How many tokens a calibration window's first position counts for in Σxxᵀ and mean |x|.

    The first position is the attention sink: every later token of the window attends to it, so
    an error in what the Linears make of it reaches all of them, and as one token among thousands
    it hardly shows in a plain average. Measured on SmolLM2-135M (int4 g64 GPTQ through
    `--data`, wiki-eval KLD vs bf16, ctx 2048, 10 chunks; docs/calibrate.md): 128 × 512 windows
    0.163 with W = 1, 0.113 with W = 16, 0.118 with W = 64; 32 × 2048 windows 0.224 with W = 1,
    0.171 with 4, 0.114 with 64, 0.121 with 256. Both optima sit near seqlen / 32, which also
    makes the result depend little on the window length. `requested` overrides the rule (≥ 1).
    """
    if requested is not None:
        if not requested >= 1.0:
            raise UsageError(f"--sink-weight must be at least 1, got {requested}")
        return float(requested)
    return max(1.0, seqlen / SINK_DIVISOR)


class LayerwiseModel:
    """A model directory opened for layer-at-a-time work: the module tree lives on the meta device
    and a layer gets real float32 weights only between `load_layer` and `release_layer`."""

    def __init__(self, path: str | Path, dtype: torch.dtype | None = None, all_experts: bool = True):
        self.path = model_dir(path)
        self.config_dict = read_json(self.path / "config.json")
        if "quantization_config" in self.config_dict:
            raise UsageError(f"{self.path} is already quantized; calibrate and quantize the float model")
        self.config = ModelConfig.from_dict(self.config_dict)
        self.source = SourceTensors(self.path)
        with torch.device("meta"):
            self.model = build_model(self.config)
        for module in self.model.modules():
            if hasattr(module, "every_expert"):
                # MoE: statistics for every expert (runtime/models/moe.py), or (all_experts False)
                # each expert's from the tokens routed to it alone
                module.every_expert = all_experts
        self.num_layers = self.config.num_hidden_layers
        self.compute_dtype = dtype or self._stored_dtype()

    def _stored_dtype(self) -> torch.dtype:
        """bfloat16 when the decoder layers are stored in 16 bits, else float32.

        The forward passes run the way the model itself runs (llm-compressor does the same);
        on a CPU with AVX512-BF16 or AMX a bfloat16 matmul is 2-3x a float32 one. Without them
        (AVX2: Zen 2/3, most laptops) torch emulates bf16 and is slower than float32, so the
        passes run in float32 there (a GPTQ layer of SmolLM2 took ~140 s in bf16 on 2 AVX2 cores).
        The weights the methods work on are always loaded in float32 (`load_layer`); only the
        passes use a 16-bit copy.
        """
        if not fast_bf16_matmuls():
            return torch.float32
        prefix = self.layer_prefix(0)
        for name, stored in self.source.dtypes.items():
            if name.startswith(prefix) and name.endswith(".weight"):
                return torch.bfloat16 if stored in ("BF16", "F16") else torch.float32
        return torch.float32

    @property
    def name(self) -> str:
        return self.path.name

    def tensor_names(self) -> list[str]:
        return self.source.names

    def tensor(self, name: str) -> torch.Tensor:
        """A checkpoint tensor as stored (its own dtype): a view of the memory-mapped file, opened for
        this read alone (formats/source_tensors.py: ~270 MB of SmolLM2 stayed in RSS by its last
        layer through a kept handle), so the mapping goes as soon as the view is dropped (load_layer copies)."""
        return self.source.get(name)

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def linear_shapes(self) -> dict[str, list[int]]:
        """[out_features, in_features] of every Linear inside the decoder layers."""
        shapes = {}
        for i, layer in enumerate(self.model.model.layers):
            for local, mod in layer.named_modules():
                if isinstance(mod, nn.Linear):
                    shapes[f"{self.layer_prefix(i)}{local}"] = [mod.out_features, mod.in_features]
        return shapes

    def identity(self) -> dict:
        return model_identity(self.config_dict, self.linear_shapes(), self.name)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The samples' input hidden states [S, T, D] in the compute dtype.

        Rows are looked up in the stored dtype and widened to float32 a batch of samples at a
        time: the same numbers as widening the whole table first, without a float32 copy of the
        table (113 MB for SmolLM2, 671 MB for Gemma-3) or of all the hidden states (604 MB at
        128 x 2048) beside the result.
        """
        weight = self.tensor("model.embed_tokens.weight")
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).item() if self.model.model.scale_embeddings else None
        out = torch.empty(*ids.shape, weight.shape[1], dtype=self.compute_dtype)
        for start, end in _batches(ids.shape[0], ids.shape[1], DEFAULT_BATCH_TOKENS):
            h = F.embedding(ids[start:end], weight).float()
            if scale is not None:
                h = h * scale
            out[start:end] = h
        return out

    def forward_copy(self, layer: nn.Module) -> nn.Module:
        """The layer in the compute dtype, for the forward passes (the float32 layer itself when that is the dtype)."""
        if self.compute_dtype == torch.float32:
            return layer
        return copy.deepcopy(layer).to(self.compute_dtype)

    def load_layer(self, index: int) -> nn.Module:
        layer = self.model.model.layers[index]
        prefix = self.layer_prefix(index)
        state = {name: self.tensor(prefix + name).float() for name in layer.state_dict()}
        layer.load_state_dict(state, strict=True, assign=True)
        return layer

    def release_layer(self, index: int) -> None:
        self.model.model.layers[index].to("meta")
        hugepages.return_freed_memory()

    def rope(self, index: int, t: int, dtype: torch.dtype, device=None):
        """(cos, sin, attention context) for layer `index` on windows of t tokens from position 0."""
        rotary = self.model.model.rotaries[self.model.model.layer_rotary[index]]
        cos, sin = rotary.cos_sin(torch.arange(t), t - 1, dtype)
        return cos, sin, AttentionContext(0, t, device or torch.device("cpu"))

    def run_layer(self, layer: nn.Module, index: int, x: torch.Tensor) -> torch.Tensor:
        cos, sin, ctx = self.rope(index, x.shape[1], x.dtype, x.device)
        return layer(x, cos, sin, ctx, None)


def calibration_samples(tokenizer, text: str, samples: int, seqlen: int, seed: int, what: str = "text",
                        ids: list[int] | None = None) -> torch.Tensor:
    """`samples` windows of `seqlen` tokens, drawn without overlap from the text by `seed`.

    Each window starts with BOS when the tokenizer adds one, like every evaluation window does.
    `ids`: the text already encoded (without BOS), e.g. from compress/token_cache.py.
    """
    if samples < 1 or seqlen < 2:
        raise UsageError(f"need at least 1 sample of at least 2 tokens, got --samples {samples} --seqlen {seqlen}")
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    body = seqlen - len(bos)
    if ids is None:
        ids = tokenizer.encode(text, add_bos=False)
    vocab = getattr(tokenizer, "model_vocab", None)
    if vocab is not None and ids and max(ids) >= vocab:  # cached ids skip encode's own check
        raise LowbitError(f"{what} encodes to token id {max(ids)}, but the model has only {vocab} embeddings "
                          "(config.json vocab_size): the tokenizer does not belong to this model or is damaged")
    windows = len(ids) // body
    if windows < samples:
        raise LowbitError(
            f"{what} has {len(ids)} tokens, fewer than --samples {samples} x {body} = {samples * body}; "
            f"use fewer or shorter samples (at most {windows} of this length) or more text"
        )
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(windows, generator=gen)[:samples].sort().values
    flat = torch.tensor(ids[: windows * body], dtype=torch.long).view(windows, body)[chosen]
    if bos:
        flat = torch.cat([torch.full((samples, 1), bos[0], dtype=torch.long), flat], dim=1)
    return flat


@dataclass(slots=True)
class LayerStats:
    sites: dict[str, InputStats]  # site name (its first Linear) -> statistics
    site_modules: dict[str, list[str]]  # site name -> the Linears reading that input, in forward order
    # MoE block (`model.layers.L.mlp`) -> calibration tokens its router sent to each expert
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)


def _batches(total: int, seqlen: int, batch_tokens: int):
    step = max(1, batch_tokens // seqlen)
    for start in range(0, total, step):
        yield start, min(total, start + step)


def _check_finite(t: torch.Tensor, where: str, start: int) -> None:
    if not torch.isfinite(t).all():
        sample = start + int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0])
        raise LowbitError(f"non-finite activations (NaN/inf) {where}, calibration sample {sample}; cannot calibrate on them")


def collect_stats(
    lm: LayerwiseModel,
    layer: nn.Module,
    index: int,
    hidden: torch.Tensor,
    *,
    write_outputs: bool,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    first_weight: float = 1.0,
) -> LayerStats:
    """Statistics of every Linear input of `layer` over all samples; with `write_outputs` the
    layer's outputs replace `hidden` in the same pass. Each window's first position counts
    `first_weight` tokens (see `first_token_weight`)."""
    prefix = lm.layer_prefix(index)
    layer = lm.forward_copy(layer)
    linears = [(prefix + local, mod) for local, mod in layer.named_modules() if isinstance(mod, nn.Linear)]
    accumulators: dict[str, StatsAccumulator] = {}
    site_modules: dict[str, list[str]] = {}
    seen: list[tuple[torch.Tensor, str]] = []  # inputs of this batch, held so ids are not reused

    def hook_for(name: str):
        def hook(_module, args):
            x = args[0]
            for other, site in seen:
                if other is x:
                    if name not in site_modules[site]:
                        site_modules[site].append(name)
                    return
            site = next((s for s, mods in site_modules.items() if name in mods), name)
            site_modules.setdefault(site, [name])
            if site not in accumulators:
                accumulators[site] = StatsAccumulator(x.shape[-1], first_weight=first_weight)
            accumulators[site].add(x)
            seen.append((x, site))

        return hook

    handles = [mod.register_forward_pre_hook(hook_for(name)) for name, mod in linears]
    # MoE blocks (runtime/models/moe.py): count the tokens the router sends to each expert (the
    # every-expert pass gives every expert statistics; this tells how many tokens it really gets)
    routed: dict[str, torch.Tensor] = {}

    def count_routes(name: str):
        def hook(block, args):
            _, experts = block.route(args[0].reshape(-1, args[0].shape[-1]))
            counts = torch.bincount(experts.flatten(), minlength=len(block.experts))
            routed[name] = routed[name] + counts if name in routed else counts
        return hook

    handles += [mod.register_forward_pre_hook(count_routes(prefix + local)) for local, mod in layer.named_modules()
                if hasattr(mod, "every_expert") and hasattr(mod, "route")]
    try:
        with torch.inference_mode():
            for start, end in _batches(hidden.shape[0], hidden.shape[1], batch_tokens):
                out = lm.run_layer(layer, index, hidden[start:end])
                seen.clear()
                _check_finite(out, f"after layer {index}", start)
                if write_outputs:
                    hidden[start:end] = out
    finally:
        for h in handles:
            h.remove()
    return LayerStats(sites={s: a.finish() for s, a in accumulators.items()}, site_modules=site_modules,
                      expert_tokens={name: counts.tolist() for name, counts in routed.items()})


def propagate(lm: LayerwiseModel, layer: nn.Module, index: int, hidden: torch.Tensor, batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
    """hidden ← layer(hidden), in place, batch by batch."""
    layer = lm.forward_copy(layer)
    with torch.inference_mode():
        for start, end in _batches(hidden.shape[0], hidden.shape[1], batch_tokens):
            out = lm.run_layer(layer, index, hidden[start:end])
            _check_finite(out, f"after layer {index}", start)
            hidden[start:end] = out


ProcessFn = Callable[[int, nn.Module, LayerStats], tuple[dict[str, torch.Tensor], dict]]
ApplyFn = Callable[[int, nn.Module, dict[str, torch.Tensor], dict], None]


def run_layers(
    lm: LayerwiseModel,
    ids: torch.Tensor,
    work: WorkDir,
    process: ProcessFn,
    apply: ApplyFn | None = None,
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    snapshot_every_s: float = 60.0,
    on_layer: Callable[[int, int, bool], None] | None = None,
    first_weight: float = 1.0,
) -> None:
    """Process every layer in order, resuming from `work`; results end up in `work`'s layer files.

    process(i, layer, stats) -> (tensors, meta) is the layer's result; apply(i, layer, tensors,
    meta), when given, changes the layer before the hidden states move through it (None: the
    layer's float outputs are used and computed in the statistics pass itself).
    on_layer(done, total, replayed) reports progress.
    """
    finished = min(work.finished_layers(), lm.num_layers)
    snapshot = work.load_hidden() if work.resumed else None
    if (snapshot is not None and snapshot[1] <= finished and tuple(snapshot[0].shape[:2]) == tuple(ids.shape)
            and snapshot[0].dtype == lm.compute_dtype):
        hidden, start = snapshot[0].clone(), snapshot[1]
    else:
        hidden = lm.embed(ids)
        _check_finite(hidden, "from the embedding", 0)
        start = 0

    def finish(i: int, layer: nn.Module, replayed: bool) -> None:
        # The saved result is re-read (not reused) so a first run and a resumed one apply exactly the
        # same tensors; without `apply` a fresh layer's outputs came from the statistics pass itself.
        if apply is not None:
            tensors, meta = work.load_layer(i)
            apply(i, layer, tensors, meta)
        if replayed or apply is not None:
            propagate(lm, layer, i, hidden, batch_tokens)
        lm.release_layer(i)
        if on_layer:
            on_layer(i + 1, lm.num_layers, replayed)

    for i in range(start, finished if finished < lm.num_layers else start):
        # Replay finished layers from their saved results, exactly as the first run moved through them.
        finish(i, lm.load_layer(i), replayed=True)
    last_snapshot = time.monotonic()
    for i in range(finished, lm.num_layers):
        layer = lm.load_layer(i)
        stats = collect_stats(lm, layer, i, hidden, write_outputs=apply is None, batch_tokens=batch_tokens,
                              first_weight=first_weight)
        work.save_layer(i, *process(i, layer, stats))
        finish(i, layer, replayed=False)
        if i + 1 < lm.num_layers and time.monotonic() - last_snapshot >= snapshot_every_s:
            work.save_hidden(hidden, i + 1)
            last_snapshot = time.monotonic()


@dataclass(slots=True)
class CalibrationInputs:
    """A model opened layer-wise plus the token windows to run through it."""

    model: LayerwiseModel
    ids: torch.Tensor  # [samples, seqlen]
    data: str
    data_hash: str
    seed: int
    first_weight: float = 1.0  # what each window's first position counts for (`first_token_weight`)
    all_experts: bool = True  # MoE: every token through every expert for the statistics


def prepare_calibration(model: str | Path, data: str, samples: int = 128, seqlen: int = 2048, seed: int = 0,
                        sink_weight: float | None = None, all_experts: bool = True) -> CalibrationInputs:
    """Open the model and draw the calibration windows (all input checks happen here, before any output).
    sink_weight: what each window's first position counts for (None: `first_token_weight`'s rule).
    all_experts: MoE statistics from every token through every expert (False: the routed tokens)."""
    first_weight = first_token_weight(seqlen, sink_weight)

    path = resolve_model(model)
    lm = LayerwiseModel(path, all_experts=all_experts)
    text = load_text(data)
    tokenizer = load_tokenizer(path)
    encoded = encode_cached(tokenizer, Path(path) / "tokenizer.json", text)
    ids = calibration_samples(tokenizer, text, samples, seqlen, seed, what=f"calibration text '{data}'", ids=encoded)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return CalibrationInputs(model=lm, ids=ids, data=str(data), data_hash=digest, seed=seed, first_weight=first_weight,
                             all_experts=all_experts)


def calibration_settings(inputs: CalibrationInputs) -> dict:
    s, t = inputs.ids.shape
    settings = {"data": inputs.data, "data_sha256": inputs.data_hash, "samples": s, "seqlen": t, "seed": inputs.seed}
    if inputs.first_weight != 1.0:  # absent when 1, as in STATS files from before the weight existed
        settings["first_token_weight"] = inputs.first_weight
    if not inputs.all_experts:  # absent when every expert saw every token, the default
        settings["all_experts"] = False
    return settings


def calibrate(
    inputs: CalibrationInputs,
    output: str | Path,
    *,
    overwrite: bool = False,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    snapshot_every_s: float = 60.0,
    on_layer: Callable[[int, int, bool], None] | None = None,
) -> dict:
    """Measure every Linear input of the model on the windows and write the STATS file.

    Progress is kept per layer beside the output; rerunning after a kill resumes. Returns a summary.
    """
    output = Path(output)
    check_output_path(output, overwrite, directory=False)
    lm = inputs.model
    identity = lm.identity()
    settings = calibration_settings(inputs)
    work = WorkDir(work_dir_for(output), {"job": "calibrate", "model": identity["config_hash"], **settings, "batch_tokens": batch_tokens})
    began = time.perf_counter()

    def process(index: int, layer: nn.Module, stats: LayerStats):
        tensors = {f"{site}.{field}": getattr(st, field) for site, st in stats.sites.items() for field in ("hessian", "mean_abs", "sq_mean", "max_abs")}
        meta = {"sites": stats.site_modules, "tokens": {s: st.tokens for s, st in stats.sites.items()},
                "expert_tokens": stats.expert_tokens}
        return tensors, meta

    run_layers(lm, inputs.ids, work, process, None, batch_tokens=batch_tokens, snapshot_every_s=snapshot_every_s, on_layer=on_layer,
               first_weight=inputs.first_weight)

    sites: dict[str, InputStats] = {}
    site_modules: dict[str, list[str]] = {}
    expert_tokens: dict[str, list[int]] = {}
    for i in range(lm.num_layers):
        tensors, meta = work.load_layer(i)
        expert_tokens.update(meta.get("expert_tokens", {}))
        for site, mods in meta["sites"].items():
            site_modules[site] = mods
            fields = {f: tensors[f"{site}.{f}"] for f in ("hessian", "mean_abs", "sq_mean", "max_abs")}
            sites[site] = InputStats(tokens=int(meta["tokens"][site]), **fields)
    with atomic_file(output, overwrite=overwrite) as tmp:
        save_stats(tmp, sites, site_modules, identity, settings, expert_tokens)
    work.remove()
    summary = {
        "model": str(lm.path),
        "output": str(output),
        **settings,
        "tokens": int(inputs.ids.numel()),
        "layers": lm.num_layers,
        "sites": len(sites),
        "bytes": output.stat().st_size,
        "seconds": round(time.perf_counter() - began, 2),
    }
    if expert_tokens:
        summary["expert_tokens"] = expert_tokens
    return summary
