"""`convert(IN, OUT, to=...)`: any supported checkpoint into native, compressed-tensors, GPTQ, AWQ, GGUF or HF.

Each target first checks every projection weight; anything it cannot hold exactly stops the
conversion (one line naming the layer and why) unless `allow_requant`, in which case that
weight is requantized from its dequantized values and the result lists what changed with
the relative Frobenius error per layer. Outputs are written atomically.

A native checkpoint's outlier side matrices (`--keep-outliers`) have no place in the other
formats: `--to native` copies them, `--to hf` adds them into the dense weights (exact), and the
quantized targets refuse unless `allow_requant`, which folds each into its weight (Ŵ + S) and
requantizes that in the layer's own format before the target's usual checks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from lowbit.errors import UsageError
from lowbit.formats import awq, gptq
from lowbit.formats import compressed_tensors as ct
from lowbit.formats.atomic import atomic_dir, atomic_file, check_output_path
from lowbit.formats.checkpoint import Checkpoint, copy_side_files, write_config
from lowbit.formats.dense_cast import RoundingTally, cast_dense
from lowbit.formats.foreign import detect_checkpoint_kind, read_checkpoint
from lowbit.formats.gguf_export import write_gguf
from lowbit.formats.gguf_import import convert_gguf
from lowbit.formats.moe_names import is_router
from lowbit.quant.dtypes import parse_dtype
from lowbit.formats.gguf_tokenizer import write_tokenizer_files
from lowbit.formats.native import NativeWriter
from lowbit.formats.requant import (
    LayerChange,
    dequantized,
    refuse_unless_allowed,
    requantized,
    source_label,
)
from lowbit.quant.outlier_matrix import unpack_outliers
from lowbit.quant.qtensor import QTensor
from lowbit.quant.rtn import tensor_relative_error
from lowbit.quant.spec import FormatSpec, parse_spec

TARGETS = ("native", "compressed-tensors", "gptq", "awq", "gguf", "hf")
_ALIASES = {"ct": "compressed-tensors", "compressed_tensors": "compressed-tensors", "lowbit": "native"}

ProgressFn = Callable[[int, int, str], None]


@dataclass(slots=True)
class ConvertResult:
    input: Path
    input_format: str
    output: Path
    target: str
    changes: list[LayerChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rounded: RoundingTally | None = None  # --to hf: what its dtype rounded

    @property
    def exact(self) -> bool:
        return not self.changes and not (self.rounded and self.rounded.tensors)

    def to_dict(self) -> dict:
        out = self.output
        files = sorted(p.name for p in out.iterdir()) if out.is_dir() else [out.name]
        size = sum(p.stat().st_size for p in out.iterdir()) if out.is_dir() else out.stat().st_size
        return {
            "input": str(self.input), "input_format": self.input_format, "output": str(out), "target": self.target,
            "exact": self.exact, "requantized": [c.to_dict() for c in self.changes],
            "rounded": self.rounded.to_dict() if self.rounded else None, "notes": self.notes,
            "files": files, "bytes": size, "seconds": round(self.seconds, 3),
        }


def parse_target(name: str) -> str:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in TARGETS:
        raise UsageError(f"unknown target format '{name}' (choose {', '.join(TARGETS)})")
    return key


def convert(
    source: str | os.PathLike,
    output: str | os.PathLike,
    to: str,
    *,
    allow_requant: bool = False,
    overwrite: bool = False,
    gguf_type: str | None = None,
    dtype: str = "bfloat16",
    progress: ProgressFn | None = None,
    stored_as: dict[str, str] | None = None,
) -> ConvertResult:
    """stored_as: the GGUF block types the source's modules were first read from (a distilled GGUF
    student goes through a native checkpoint, which does not keep them): `--to gguf` writes each
    back in its own type where its codes still fit."""
    source, output = Path(source).expanduser(), Path(output).expanduser()
    target = parse_target(to)
    if gguf_type is not None and target != "gguf":
        raise UsageError("--gguf-type applies only to --to gguf")
    check_output_path(output, overwrite, directory=target != "gguf")
    kind = detect_checkpoint_kind(source)
    started = time.perf_counter()
    result = ConvertResult(input=source, input_format=kind, output=output, target=target)
    if target == "hf":
        result.rounded = RoundingTally(parse_dtype(dtype))
    if kind == "gguf" and target == "hf":
        convert_gguf(source, output, dtype=dtype, overwrite=overwrite, progress=progress, tally=result.rounded)
    else:
        ckpt = read_checkpoint(source, kind)
        ckpt.stored_as.update(stored_as or {})
        _dense_routers(ckpt, target)
        _fold_outliers(ckpt, target, allow_requant, result)
        _place_tied_head(ckpt, target, result)
        if target == "gguf":
            with atomic_file(output, overwrite=overwrite) as tmp:
                changes, notes = write_gguf(ckpt, tmp, gguf_type, allow_requant, progress)
                result.changes.extend(changes)
                result.notes.extend(notes)
        else:
            writer = {"native": _write_native, "compressed-tensors": _write_ct, "gptq": _write_gptq,
                      "awq": _write_awq, "hf": _write_hf}[target]
            with atomic_dir(output, overwrite=overwrite) as tmp:
                writer(ckpt, tmp, allow_requant, result, dtype)
                if ckpt.source_dir is not None:
                    copy_side_files(ckpt.source_dir, tmp)
                elif ckpt.gguf is not None and ckpt.gguf.has("tokenizer.ggml.tokens"):
                    write_tokenizer_files(ckpt.gguf, tmp)
                else:
                    result.notes.append("the input has no tokenizer; none was written")
    result.seconds = time.perf_counter() - started
    return result


# ------------------------------------------------------------------ shared steps


_TARGET_NAMES = {"compressed-tensors": "compressed-tensors", "gptq": "GPTQ", "awq": "AWQ", "gguf": "GGUF"}


def _dense_routers(ckpt: Checkpoint, target: str) -> None:
    """MoE routers a recipe quantized leave lowbit's format dense: vLLM's and llama.cpp's routers are
    dense weights, so each is written as its dequantized values in float32 (exact: a code times a
    float16 scale has at most 19 significant bits)."""
    if target == "native":
        return
    for module in [m for m in ckpt.qtensors if is_router(m)]:
        ckpt.dense[f"{module}.weight"] = ckpt.qtensors.pop(module).dequantize(torch.float32)


def _fold_outliers(ckpt: Checkpoint, target: str, allow: bool, result: ConvertResult) -> None:
    """Put each outlier side matrix where the target can hold it (see the module docstring)."""

    if not ckpt.outliers or target == "native":
        return
    if target != "hf":
        module = next(iter(ckpt.outliers))
        count = len(ckpt.outliers)
        more = f" (and {count - 1} more layers)" if count > 1 else ""
        refuse_unless_allowed(_TARGET_NAMES[target], [(module, f"it keeps {ckpt.outliers[module]['indices'].numel()} outlier "
                              f"weights in a bf16 side matrix, which {_TARGET_NAMES[target]} has no place for{more}")], allow)
    for module, side in ckpt.outliers.items():
        qt = ckpt.qtensors[module]
        w = qt.dequantize(torch.float32) + unpack_outliers(side, tuple(qt.shape))
        if target == "hf":
            del ckpt.qtensors[module]
            ckpt.dense[f"{module}.weight"] = w
            continue
        folded = requantized(module, w, qt.spec)
        ckpt.qtensors[module] = folded
        result.changes.append(LayerChange(module, f"{qt.spec.label} + {side['indices'].numel()} outliers", qt.spec.label,
                                          "outliers folded into the weight", tensor_relative_error(w, folded.dequantize())))
    if target == "hf":
        result.notes.append(f"added the outlier side matrices of {len(ckpt.outliers)} layers into their weights")
    ckpt.outliers = {}



def _place_tied_head(ckpt: Checkpoint, target: str, result: ConvertResult) -> None:
    """A quantized head tied to the embeddings (`quantize --quantize-head` on a tied model) is stored
    once, as lm_head. GGUF keeps it once too, the way llama.cpp ties: a quantized token_embd and no
    output.weight. The other targets' loaders (transformers, vLLM) read a dense embedding table, so
    there it is dequantized into model.embed_tokens.weight: the same values, the file a table larger."""
    if target == "native" or "lm_head" not in ckpt.qtensors or not ckpt.config.get("tie_word_embeddings", False):
        return
    qt = ckpt.qtensors.pop("lm_head")
    if target == "gguf":
        ckpt.qtensors["model.embed_tokens"] = qt
        return
    ckpt.dense["model.embed_tokens.weight"] = qt.dequantize(torch.float32)
    result.notes.append(f"the tied head is quantized ({qt.spec.label}); it was dequantized into the embedding table, "
                        f"which {target} loaders read dense (the same values; {qt.shape[0] * qt.shape[1] * 2 / 1e6:.1f} MB more)")


def _projection_values(ckpt: Checkpoint) -> dict[str, torch.Tensor | QTensor]:
    tensors = ckpt.tensors()
    return {m: tensors[f"{m}.weight"] for m in ckpt.linear_weights()}


def _requantize(module: str, value, spec: FormatSpec, reason: str, result: ConvertResult, fix=None) -> QTensor:
    w = dequantized(value)
    qt = requantized(module, w, spec)
    if fix is not None:
        qt = fix(qt)
    result.changes.append(LayerChange(module, source_label(value), spec.label, reason, tensor_relative_error(w, qt.dequantize())))
    return qt


def _dense_rest(ckpt: Checkpoint, quantized: set[str]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in ckpt.dense.items() if not (n.endswith(".weight") and n[: -len(".weight")] in quantized)}


def _plan(values: dict, check, allow: bool, target: str, ckpt: Checkpoint, keep_dense: bool = True) -> dict[str, str | None]:
    """module → None (write exactly) or the reason it needs requantization; refuses when not allowed."""
    reasons: dict[str, str | None] = {}
    for module, value in values.items():
        if module in ckpt.unexpressed:
            reasons[module] = ckpt.unexpressed[module][1]
        elif isinstance(value, QTensor):
            reasons[module] = check(value)
        elif not keep_dense:
            reasons[module] = "the weight is not quantized"
    refuse_unless_allowed(target, [(m, r) for m, r in reasons.items() if r], allow)
    return reasons


def _save(tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------ writers


def _write_native(ckpt: Checkpoint, tmp: Path, allow: bool, result: ConvertResult, dtype: str) -> None:

    values = _projection_values(ckpt)
    reasons = _plan(values, lambda qt: None, allow, "a lowbit native checkpoint", ckpt)
    writer = NativeWriter(tmp)
    quantized = set()
    for module, value in values.items():
        if isinstance(value, QTensor):
            writer.add_quantized(module, value)
            quantized.add(module)
        elif module in ckpt.unexpressed:
            spec = _nominal_spec(ckpt.unexpressed[module][0], parse_spec)
            writer.add_quantized(module, _requantize(module, value, spec, reasons[module], result))
            quantized.add(module)
    for module, side in ckpt.outliers.items():
        writer.add_outliers(module, side)
    for name, t in _dense_rest(ckpt, quantized).items():
        writer.add_dense(name, t)
    writer.close(dict(ckpt.config))


def _nominal_spec(label: str, parse_spec) -> FormatSpec:
    """The lowbit spec nearest a foreign layer's own description ("int4 g128 act-order", "Q6_K")."""
    words = label.split()
    if words and words[0].startswith("int"):
        group = next((int(w[1:]) for w in words if w.startswith("g") and w[1:].lstrip("-").isdigit()), 128)
        return parse_spec(words[0] + "-asym", group if group > 0 else -1, scale_dtype="float16")
    if label.upper().startswith(("Q8", "Q6", "Q5")):
        return parse_spec("int8-g32-sfp16")
    if label.startswith("fp8"):
        return parse_spec("fp8-block128")
    return parse_spec("int4-asym-g32-sfp16")


def _write_ct(ckpt: Checkpoint, tmp: Path, allow: bool, result: ConvertResult, dtype: str) -> None:

    values = _projection_values(ckpt)
    reasons = _plan(values, ct.why_not_exact, allow, "compressed-tensors", ckpt)
    out: dict[str, torch.Tensor] = {}
    schemes: dict[str, FormatSpec] = {}
    dense_linears = []
    for module, value in values.items():
        if not isinstance(value, QTensor) and module not in ckpt.unexpressed:
            dense_linears.append(module)
            continue
        qt = value
        if reasons.get(module):
            spec = ct.requant_spec(value.spec if isinstance(value, QTensor) else ct.parse_spec("int4"), tuple(value.shape))
            qt = _requantize(module, value, spec, reasons[module], result)
        out.update(ct.module_tensors(module, qt))
        schemes[module] = qt.spec
    out.update(_dense_rest(ckpt, set(schemes)))
    if "lm_head" not in schemes:
        dense_linears.append("lm_head")  # a Linear even when tied to the embeddings: "Linear" must not match it
    out, schemes, dense_linears = ct.moe_export_layout(ckpt.config, out, schemes, dense_linears)
    _save(tmp, out)
    write_config(tmp, ckpt.config, ct.quantization_config(schemes, dense_linears) if schemes else None)


def _write_packed(ckpt: Checkpoint, tmp: Path, allow: bool, result: ConvertResult, fmt, scheme_of, label: str, fix=None):
    """The int32-packed layouts (GPTQ, AWQ): one scheme for the whole model, each projection written
    exactly or (with --allow-requant) requantized, the other tensors dense. Returns the scheme for the config.
    `fmt` is formats/gptq.py or formats/awq.py: why_not_exact, requant_spec and module_tensors."""
    values = _projection_values(ckpt)
    scheme = scheme_of([v.spec for v in values.values() if isinstance(v, QTensor)])
    reasons = _plan(values, lambda qt: fmt.why_not_exact(qt, scheme), allow, label, ckpt, keep_dense=False)
    out: dict[str, torch.Tensor] = {}
    for module, value in values.items():
        qt = value
        if reasons.get(module):
            qt = _requantize(module, value, fmt.requant_spec(scheme), reasons[module], result, fix=fix)
        out.update(fmt.module_tensors(module, qt))
    out.update(_dense_rest(ckpt, set(values)))
    _save(tmp, out)
    return scheme


def _write_gptq(ckpt: Checkpoint, tmp: Path, allow: bool, result: ConvertResult, dtype: str) -> None:
    scheme = _write_packed(ckpt, tmp, allow, result, gptq, gptq.model_scheme, "GPTQ", fix=gptq.fit_v1_zeros)
    qconfig = gptq.quantize_config(scheme)
    write_config(tmp, ckpt.config, qconfig)
    (tmp / "quantize_config.json").write_text(json.dumps(qconfig, indent=2) + "\n")


def _write_awq(ckpt: Checkpoint, tmp: Path, allow: bool, result: ConvertResult, dtype: str) -> None:
    group = _write_packed(ckpt, tmp, allow, result, awq, awq.model_group, "AWQ")
    qconfig = awq.quantization_config(group)
    write_config(tmp, ckpt.config, qconfig)
    (tmp / "quant_config.json").write_text(json.dumps({k: qconfig[k] for k in ("zero_point", "q_group_size", "w_bit", "version")}, indent=2) + "\n")


def _write_hf(ckpt: Checkpoint, tmp: Path, allow: bool, result: ConvertResult, dtype: str) -> None:

    torch_dtype = parse_dtype(dtype)
    out = {}
    for name, value in ckpt.tensors().items():
        out[name] = cast_dense(name, dequantized(value) if isinstance(value, QTensor) else value, torch_dtype, result.rounded)
    _save(tmp, out)
    config = dict(ckpt.config)
    config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    write_config(tmp, config, None)
    if ckpt.qtensors:
        result.notes.append(f"dequantized {len(ckpt.qtensors)} quantized weights to {config['torch_dtype']}")
