"""quantize_model: a float Hugging Face checkpoint -> lowbit's native quantized checkpoint.

The checkpoint is walked part by part (embeddings, each decoder layer, final norm + lm_head):
each part's tensors are read lazily from the safetensors files (memory-mapped), the method
(compress/methods.py) quantizes the part's Linear weights, and NativeWriter streams the result into
shards, so the process holds the output plus one layer — never the float model twice.

What gets quantized: every 2-D `.weight` inside a decoder layer (`...layers.<i>.`) — the attention
and MLP projections. Embeddings, norms and biases stay as stored; lm_head too unless
`quantize_head`. A head tied to the embeddings stays tied: the one matrix is quantized and stored
once, as lm_head, and the runtime reads embedding rows from it (never untied, which would store
the matrix twice). Modules that run fused (q/k/v, gate/up) in a format with a
per-tensor global scale (nvfp4) share one, computed from all of them.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.formats.atomic import atomic_dir, check_output_path
from lowbit.formats.checkpoint import copy_side_files
from lowbit.formats.hf_files import read_config
from lowbit.formats.native import NativeWriter
from lowbit.formats.resolve import resolve_model
from lowbit.compress.methods import LayerWork, MethodContext, get_method
from lowbit.compress.options import MethodOptions
from lowbit.compress.recipe import Recipe, match_rules, single_format
from lowbit.quant.registry import get_format, part_layout
from lowbit.quant.rtn import shared_global_scale
from lowbit.quant.spec import FormatSpec, parse_spec
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.loader import check_weights_fit
from lowbit.formats.moe_names import is_router
from lowbit.formats.source_tensors import SourceTensors

ProgressFn = Callable[[int, int, str], None]

HEAD = "lm_head"
# Projections that read the same input and run as one fused matmul.
FUSED_SETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_LAYER = re.compile(r"^(.*?\blayers\.(\d+))\.")
_FOREIGN_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


@dataclass(slots=True)
class ModuleRecord:
    name: str
    format: str  # spec label, or "dense"
    shape: tuple[int, int]
    bytes_before: int
    bytes_after: int  # the outlier side matrix included (48 bits per kept weight)
    outliers: int = 0  # weights kept in bf16 beside the format

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.bytes_after / (self.shape[0] * self.shape[1])


@dataclass(slots=True)
class QuantizeSummary:
    model: str
    output: str
    method: str
    modules: list[ModuleRecord]
    params: int  # every stored element of the output model (a tied matrix once)
    bytes_before: int  # tensor bytes of the source checkpoint
    bytes_after: int  # tensor bytes written (packed weights, scales, dense tensors)
    seconds: float
    recipe: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # MoE block -> calibration tokens its router sent to each expert (methods that run calibration text)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def formats(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in self.modules:
            counts[m.format] = counts.get(m.format, 0) + 1
        return counts

    @property
    def outliers(self) -> int:
        return sum(m.outliers for m in self.modules)

    @property
    def linear_params(self) -> int:
        return sum(m.shape[0] * m.shape[1] for m in self.modules)

    @property
    def linear_bits_per_weight(self) -> float:
        """Bits per weight over the quantizable Linears (dense ones count at their stored width)."""
        return 8.0 * sum(m.bytes_after for m in self.modules) / max(1, self.linear_params)

    @property
    def bits_per_weight(self) -> float:
        """Bits per parameter over the whole model: embeddings, norms and dense layers included."""
        return 8.0 * self.bytes_after / max(1, self.params)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "output": self.output,
            "method": self.method,
            "formats": self.formats,
            "recipe": self.recipe,
            "linear_params": self.linear_params,
            "linear_bits_per_weight": self.linear_bits_per_weight,
            "params": self.params,
            "bits_per_weight": self.bits_per_weight,
            "outliers": self.outliers,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "seconds": self.seconds,
            "modules": [
                {"name": m.name, "format": m.format, "shape": list(m.shape), "bytes": m.bytes_after,
                 "bits_per_weight": m.bits_per_weight, "outliers": m.outliers}
                for m in self.modules
            ],
            "notes": self.notes,
            "expert_tokens": self.expert_tokens,
        }


@dataclass(slots=True)
class _Part:
    name: str
    index: int | None
    tensors: list[str]


def quantize_model(
    model: str | os.PathLike,
    spec_or_recipe: FormatSpec | str | Recipe | None,
    *,
    out_dir: str | os.PathLike,
    method: str = "rtn",
    skip: list[str] | tuple[str, ...] = (),
    quantize_head: bool = False,
    overwrite: bool = False,
    method_options: MethodOptions | None = None,
    progress: ProgressFn | None = None,
) -> QuantizeSummary:
    """Quantize `model` (demo name, directory or hub id) into `out_dir`; see the module docstring.

    `spec_or_recipe`: one format for every module ("int4-g64", a FormatSpec) or a Recipe
    (compress/recipe.py) for mixed precision. `skip`: module-name patterns kept dense.
    `progress(done, total, part_name)` is called after each part. Everything that can be wrong
    with the inputs is checked before the output directory is created; the output appears only
    when complete.
    """
    started = time.perf_counter()
    recipe = _as_recipe(spec_or_recipe).with_skips(list(skip))
    source_dir = _source_dir(resolve_model(model))
    config = read_config(source_dir)
    _refuse_quantized(source_dir, config)
    # The architecture check GPTQ gets from LayerwiseModel, for every method: RTN would otherwise write
    # a checkpoint of an architecture no lowbit command can load.
    model_config = ModelConfig.from_dict(config)
    out = Path(out_dir).expanduser()
    _check_output(out, source_dir, overwrite)
    factory = get_method(method)
    options = method_options if method_options is not None else MethodOptions(method=method)
    if options.method != method:
        raise UsageError(f"method_options are for method {options.method}, not {method}")
    source_windows = options.calibration
    if source_windows is not None and source_windows.data is not None:
        check_calibration_windows(model_config, source_windows.samples, source_windows.seqlen,
                                  sink_weight=source_windows.sink_weight, float_target=options.gptq.float_target,
                                  name=source_dir.name)

    source = SourceTensors(source_dir)
    check_weights_fit(model_config, source.shapes, source_dir)
    if quantize_head and model_config.tie_word_embeddings:
        # the embedding matrix is read as lm_head.weight and written only there (the runtime
        # reads the embedding rows from it: runtime/quant_embedding.py); a stored copy is dropped
        if "model.embed_tokens.weight" not in source:
            raise LowbitError(f"{source_dir}: the head is tied, but there is no model.embed_tokens.weight to quantize as it")
        source.rename("model.embed_tokens.weight", f"{HEAD}.weight")
    linears, routers = _linear_modules(source, quantize_head)
    specs = _assign(recipe, linears, source, routers)
    if quantize_head and model_config.tie_word_embeddings and specs.get(HEAD) is None:
        # a recipe or --skip kept the tied head dense: it stays the embedding table, as stored
        source = SourceTensors(source_dir)
        linears.remove(HEAD)
        specs.pop(HEAD)
    parts = _parts(source.names)
    context = MethodContext(method=method, model_dir=source_dir, config=config,
                            num_layers=sum(p.index is not None for p in parts), options=options,
                            formats={module: spec.label if spec is not None else "dense" for module, spec in sorted(specs.items())})
    layer_method = factory(context)

    records: list[ModuleRecord] = []
    notes: list[str] = []
    expert_tokens: dict[str, list[int]] = {}
    bytes_after = 0
    params = 0
    with atomic_dir(out, overwrite=overwrite) as tmp:
        writer = NativeWriter(tmp)
        for done, part in enumerate(parts, start=1):
            tensors = {name: source.get(name) for name in part.tensors}
            part_specs = {m: specs[m] for m in _modules_in(part) if specs.get(m) is not None}
            work = LayerWork(name=part.name, index=part.index, tensors=tensors, specs=part_specs,
                             fused=_fused_groups(part_specs), global_scales={})
            work.global_scales = _global_scales(work)
            result = layer_method(work)
            _check_result(part, part_specs, result, tensors)
            notes.extend(result.notes)
            expert_tokens.update(result.expert_tokens)
            for module, qt in result.qtensors.items():
                writer.add_quantized(module, qt)
                bytes_after += qt.nbytes
                params += math.prod(qt.shape)
            for module, side in result.outliers.items():
                writer.add_outliers(module, side)
                bytes_after += _outlier_bytes(side)
            for name, tensor in tensors.items():
                if name.endswith(".weight") and name[: -len(".weight")] in part_specs:
                    continue
                tensor = result.dense.get(name, tensor)
                writer.add_dense(name, tensor)
                bytes_after += tensor.numel() * tensor.element_size()
                params += tensor.numel()
            for module in _modules_in(part):
                if module not in specs:
                    continue
                shape = source.shapes[f"{module}.weight"]
                qt = result.qtensors.get(module)
                after = qt.nbytes if qt is not None else source.nbytes[f"{module}.weight"]
                side = result.outliers.get(module)
                kept = 0 if side is None else int(side["indices"].numel())
                records.append(ModuleRecord(module, qt.spec.label if qt is not None else "dense", shape,
                                            source.nbytes[f"{module}.weight"],
                                            after + (0 if side is None else _outlier_bytes(side)), kept))
            del tensors, work, result
            if progress is not None:
                progress(done, len(parts), part.name)
        copy_side_files(source_dir, tmp)
        writer.close({k: v for k, v in config.items() if k != "quantization_config"})
        _add_provenance(tmp, method, recipe, source_dir, options)

    return QuantizeSummary(
        model=str(model), output=str(out), method=method, modules=records, params=params,
        bytes_before=sum(source.nbytes.values()), bytes_after=bytes_after,
        seconds=time.perf_counter() - started, recipe=recipe.to_list(), notes=notes, expert_tokens=expert_tokens,
    )


# ---------------------------------------------------------------------------------------------
# checks and planning (all before anything is written)


def check_calibration_windows(config: ModelConfig | dict, samples: int, seqlen: int, *, sink_weight: float | None = None,
                              float_target: bool = False, available: int | None = None, name: str = "the model") -> None:
    """Refuse calibration windows the model cannot take or this machine cannot hold, before the text
    is read or any activation allocated (`lowbit quantize --data` and `lowbit calibrate`).

    Windows longer than max_position_embeddings calibrate positions the model never saw (and their
    attention is quadratic); `calibration_bytes` of activations beyond the memory available (psutil)
    would end in swapping or the OOM killer after minutes of work. `available` overrides psutil;
    `name` is the model as the error names it."""
    from lowbit.compress.calibrate import first_token_weight

    config = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
    first_token_weight(seqlen, sink_weight)  # its range error first, as when the windows are cut
    if samples < 1:
        raise UsageError(f"--samples must be at least 1, got {samples}")
    if seqlen < 2:
        raise UsageError(f"--seqlen must be at least 2, got {seqlen}")
    limit = config.max_position_embeddings
    if seqlen > limit:
        raise UsageError(f"--seqlen {seqlen} is more than {name}'s {limit} positions (max_position_embeddings)")
    need = calibration_bytes(config, samples, seqlen, float_target=float_target)
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if need > available:
        raise UsageError(f"--samples {samples} x --seqlen {seqlen} needs about {need / 2**30:.1f} GiB for the calibration "
                         f"activations, more than the {available / 2**30:.1f} GiB of memory available; use fewer or shorter samples")


def calibration_bytes(config: ModelConfig, samples: int, seqlen: int, *, float_target: bool = False) -> int:
    """About what a calibration run over samples x seqlen tokens holds at once (compress/calibrate.py):
    the token ids, the hidden states [S, T, D] of every window (twice with float_target: the float
    model's stream beside them), one batch of a layer's activations and one layer's weights (float32,
    plus the 16-bit copy the passes run). Attention scores are left out (SDPA's fused kernels never hold
    them; a masked sliding window may), so this is a floor, not a bound: refusing a run that would fit
    is worse than letting one through that swaps."""
    from lowbit.compress.calibrate import DEFAULT_BATCH_TOKENS

    d, i = config.hidden_size, config.intermediate_size
    stored = str(config.raw.get("torch_dtype") or config.raw.get("dtype") or "bfloat16")
    width = 4 if stored in ("float32", "float64") else 2  # LayerwiseModel runs in the stored width
    tokens = samples * seqlen
    hidden = tokens * d * width * (2 if float_target else 1)
    batch = min(samples, max(1, DEFAULT_BATCH_TOKENS // seqlen)) * seqlen
    activations = batch * (4 * d + 3 * i) * 4
    attn = config.num_attention_heads * config.head_dim + 2 * config.num_key_value_heads * config.head_dim
    layer = (d * attn + config.num_attention_heads * config.head_dim * d + 3 * d * i) * (4 + width)
    return tokens * 8 + hidden + activations + layer


def _as_recipe(spec_or_recipe) -> Recipe:
    if isinstance(spec_or_recipe, Recipe):
        return spec_or_recipe
    if isinstance(spec_or_recipe, FormatSpec):
        return single_format(spec_or_recipe)
    if isinstance(spec_or_recipe, str):
        return single_format(parse_spec(spec_or_recipe))
    raise UsageError("give a format (--format) or a recipe (--recipe)")


def _source_dir(path: Path) -> Path:
    if path.is_file():
        hint = " (convert a GGUF first with `lowbit convert`)" if path.suffix.lower() == ".gguf" else ""
        raise LowbitError(f"{path} is a file; lowbit quantize reads a Hugging Face model directory{hint}")
    if not (path / "config.json").is_file():
        raise LowbitError(f"{path} is not a model directory: it has no config.json")
    return path


def _refuse_quantized(path: Path, config: dict) -> None:
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc:
        method = qc.get("quant_method", "unknown")
        raise LowbitError(f"{path} is already quantized (quant_method '{method}'); lowbit quantize needs a float checkpoint")
    for name, kind in _FOREIGN_FILES.items():
        if (path / name).is_file():
            raise LowbitError(f"{path} is already quantized ({kind}: it has {name}); lowbit quantize needs a float checkpoint")


def _check_output(out: Path, source: Path, overwrite: bool) -> None:
    check_output_path(out, overwrite)
    resolved, src = out.resolve(), source.resolve()
    if resolved == src or src in resolved.parents or resolved in src.parents:
        raise UsageError(f"output {out} would overwrite the model being quantized ({source})")


def _linear_modules(source: SourceTensors, quantize_head: bool) -> tuple[list[str], list[str]]:
    """(the projections to quantize, the MoE routers: quantized only by a rule naming them alone)."""
    modules, routers = [], []
    for name in source.names:
        if not name.endswith(".weight") or len(source.shapes[name]) != 2:
            continue
        module = name[: -len(".weight")]
        if is_router(module):
            routers.append(module)  # dense unless a rule names routers alone (see _assign)
            continue
        if _LAYER.match(name) or (quantize_head and module == HEAD):
            modules.append(module)
    if quantize_head and HEAD not in modules:
        raise UsageError("--quantize-head: this checkpoint stores no lm_head.weight (its head is tied to the embeddings)")
    if not modules:
        raise LowbitError(f"{source.directory}: no decoder-layer Linear weights found (expected names like model.layers.0.mlp.down_proj.weight)")
    return modules, routers


def _assign(recipe: Recipe, modules: list[str], source: SourceTensors, routers: list[str] = ()) -> dict[str, FormatSpec | None]:
    """module -> spec (None: dense), every spec checked against the module's shape.

    An MoE router (and Qwen2-MoE's shared-expert gate) stays dense, as llm-compressor's recipes
    keep it, unless a rule that matches routers and nothing else names it (`re:.*mlp\\.gate$`):
    a rule like `*` leaves it dense. A quantized router is RTN-quantized whatever the method, and the
    runtime routes with its dequantized weight (runtime/quant_linear.py)."""
    router_rules = [r for r in recipe.rules if r.spec is not None and not any(r.matches(m) for m in modules)]
    chosen = {}
    for router in routers:
        rule = next((r for r in recipe.rules if r.matches(router)), None)
        if rule is not None and rule in router_rules:
            chosen[router] = rule
    specs = {}
    for module, rule in {**match_rules(recipe, modules, also=list(chosen)), **chosen}.items():
        spec = rule.spec if rule is not None else None
        shape = source.shapes[f"{module}.weight"]
        if spec is not None:
            try:
                part_layout(spec, shape)
            except UsageError as exc:
                raise UsageError(f"{module} {shape[0]}x{shape[1]}: {exc}") from None
        specs[module] = spec
    return specs


def _parts(names: list[str]) -> list[_Part]:
    """Embeddings (and anything else before the layers), each decoder layer, then the head."""
    first, head = _Part("embeddings", None, []), _Part("head", None, [])
    layers: dict[int, _Part] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            index = int(match.group(2))
            layers.setdefault(index, _Part(match.group(1), index, [])).tensors.append(name)
        elif name.startswith(HEAD + ".") or re.search(r"(^|\.)norm\.weight$", name):
            head.tensors.append(name)
        else:
            first.tensors.append(name)
    ordered = [layers[i] for i in sorted(layers)]
    return [p for p in (first, *ordered, head) if p.tensors]


def _modules_in(part: _Part) -> list[str]:
    return [n[: -len(".weight")] for n in part.tensors if n.endswith(".weight")]


def _fused_groups(specs: dict[str, FormatSpec]) -> list[tuple[str, ...]]:
    groups = []
    by_parent: dict[str, dict[str, str]] = {}
    for module in specs:
        parent, _, leaf = module.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = module
    for leaves in by_parent.values():
        for fused in FUSED_SETS:
            members = tuple(leaves[leaf] for leaf in fused if leaf in leaves)
            if len(members) > 1:
                groups.append(members)
    return groups


def _global_scales(work: LayerWork) -> dict[str, torch.Tensor]:
    """nvfp4's per-tensor scale, shared by fused modules that use the same format."""
    out = {}
    for group in work.fused:
        spec = work.specs[group[0]]
        if any(work.specs[m] != spec for m in group):
            continue  # different formats never run as one matmul
        if not hasattr(get_format(spec), "global_scale_for"):
            continue  # no global scale: reading the weights would only map their pages for the whole run
        scale = shared_global_scale([work.weight(m) for m in group], spec)
        if scale is not None:
            out.update(dict.fromkeys(group, scale))
    return out


def _check_result(part: _Part, specs: dict, result, tensors: dict) -> None:
    got, want = set(result.qtensors), set(specs)
    if got != want:
        raise LowbitError(f"{part.name}: the method returned {sorted(got)} but was asked for {sorted(want)}")
    for module, qt in result.qtensors.items():
        if qt.spec != specs[module] or tuple(qt.shape) != tuple(tensors[f"{module}.weight"].shape):
            raise LowbitError(f"{module}: the method returned {qt.spec.label} {qt.shape}, expected {specs[module].label}")
    extra = set(result.dense) - set(tensors)
    if extra:
        raise LowbitError(f"{part.name}: the method returned unknown dense tensors {sorted(extra)}")
    stray = set(result.outliers) - got
    if stray:
        raise LowbitError(f"{part.name}: the method returned outliers for modules it did not quantize: {sorted(stray)}")


def _outlier_bytes(side: dict[str, torch.Tensor]) -> int:
    """Stored bytes of a side matrix: int32 index + bf16 value, 48 bits per kept weight."""
    return sum(t.numel() * t.element_size() for t in side.values())


def _add_provenance(directory: Path, method: str, recipe: Recipe, source: Path, options: MethodOptions) -> None:
    """Record how the checkpoint was made beside the per-module specs (informational only)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    qc = config["quantization_config"]
    qc["method"] = method
    qc["recipe"] = recipe.to_list()
    qc["source"] = source.name
    recorded = {k: v if isinstance(v, (bool, int, float)) or v is None else str(v) for k, v in sorted(options.record().items())}
    if recorded:  # calibration text, windows, GPTQ/outlier settings: `--data wiki-calib --samples 128 ...`
        qc["method_options"] = recorded
    path.write_text(json.dumps(config, indent=2) + "\n")

