"""Quantization methods as the pipeline sees them: one call per part of the model.

The pipeline (compress/pipeline.py) walks a checkpoint part by part — the embeddings, then each
decoder layer in order, then the final norm and lm_head — and hands each part to the method as a
`LayerWork`. The method returns a `LayerResult`: a QTensor for every module in `work.specs`,
plus any dense tensors it changed (AWQ folds its input scales into the preceding norm) and any
outlier side matrices it kept (compress/outliers.py). Anything it does not return is written exactly
as read.

A method is registered by name with a factory `make(context: MethodContext) -> LayerMethod`;
the factory runs once per `quantize_model` call and may keep state across parts (a calibrated
method keeps the calibration activations and feeds each layer the outputs of the already
quantized layers below it). `METHOD_MODULES` names modules that define `make_layer_method` and
are imported only when asked for, so a method still being written is simply "not available".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.compress.options import MethodOptions
from lowbit.errors import UsageError
from lowbit.quant.qtensor import QTensor
from lowbit.quant.rtn import quantize_rtn
from lowbit.quant.spec import FormatSpec


@dataclass(slots=True)
class LayerWork:
    """One part of the model, ready for a method."""

    name: str  # "embeddings", "model.layers.3", "head"
    index: int | None  # decoder layer index; None for the embeddings and head parts
    tensors: dict[str, torch.Tensor]  # every stored tensor of this part by HF name, dtype as stored
    specs: dict[str, FormatSpec]  # module name -> format, for the modules to quantize
    fused: list[tuple[str, ...]]  # modules of `specs` that share an input and run fused (q/k/v, gate/up)
    global_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> shared nvfp4 scale

    def weight(self, module: str) -> torch.Tensor:
        """The module's weight in float32 (what every format's quantize takes)."""
        return self.tensors[f"{module}.weight"].float()


@dataclass(slots=True)
class LayerResult:
    qtensors: dict[str, QTensor]  # exactly the modules of work.specs
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # replaced tensors of work.tensors
    notes: list[str] = field(default_factory=list)  # shown in the summary (e.g. "layer 7: RTN fallback")
    # module -> {'indices' int32, 'values' bf16}: weights kept outside the format (compress/outliers.py)
    outliers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # MoE block -> calibration tokens per expert


@dataclass(slots=True)
class MethodContext:
    method: str  # the name asked for ("awq+gptq" reaches awq's factory with this name)
    model_dir: Path  # the float checkpoint being quantized
    config: dict  # its config.json
    num_layers: int
    options: MethodOptions = field(default_factory=MethodOptions)  # the caller's typed options (compress/options.py)
    formats: dict[str, str] = field(default_factory=dict)  # module -> its format's label, as the run asks for it


LayerMethod = Callable[[LayerWork], LayerResult]
MethodFactory = Callable[[MethodContext], LayerMethod]

_REGISTERED: dict[str, MethodFactory] = {}
# name -> module defining `make_layer_method(context) -> LayerMethod` (imported on demand)
# (compress/sequential.py runs all three; it imports this module, so it is imported by name, late)
METHOD_MODULES = {
    "gptq": "lowbit.compress.sequential",
    "awq": "lowbit.compress.sequential",
    "awq+gptq": "lowbit.compress.sequential",
}


def rtn_layer(work: LayerWork) -> LayerResult:
    """Round-to-nearest with each format's searched scales, one module at a time."""
    out = {}
    for module, spec in work.specs.items():
        out[module] = quantize_rtn(work.weight(module), spec, global_scale=work.global_scales.get(module))
    return LayerResult(qtensors=out)


def _make_rtn(context: MethodContext) -> LayerMethod:
    if context.options.outliers.active:
        # Choosing outliers needs input statistics: the calibrated layer loop, rounding to nearest.
        from lowbit.compress.sequential import make_layer_method  # sequential builds on this module

        return make_layer_method(context)
    return rtn_layer  # MethodOptions refused calibration options without outliers


def register_method(name: str, factory: MethodFactory) -> None:
    _REGISTERED[name] = factory


register_method("rtn", _make_rtn)


def method_names() -> list[str]:
    return sorted(set(_REGISTERED) | set(METHOD_MODULES))


def get_method(name: str) -> MethodFactory:
    """The factory of a method by name; UsageError when unknown or not available in this build."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in METHOD_MODULES:
        raise UsageError(f"unknown method '{name}' (known: {', '.join(method_names())})")
    try:
        module = importlib.import_module(METHOD_MODULES[name])
    except ModuleNotFoundError as exc:
        if exc.name != METHOD_MODULES[name]:
            raise
        raise UsageError(f"method '{name}' is not available in this lowbit yet (use --method rtn)") from None
    factory = getattr(module, "make_layer_method", None)
    if factory is None:
        raise UsageError(f"method '{name}' is not available in this lowbit yet (use --method rtn)")
    return factory
