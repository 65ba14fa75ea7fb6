"""One in-memory picture of a checkpoint that every converter reads from and writes to.

`Checkpoint` holds the model's config.json (without any quantization_config), the quantized
Linear weights as QTensors by module name, and every other tensor dense by its Hugging Face
name. A weight a reader could decode but not express as a lowbit QTensor (GPTQ act-order,
a GPTQ v1 zero point of 16, a GGUF Q6_K block) is kept dense with the reason in `unexpressed`,
so exact callers (eval) still see the true values and converters know it needs requantization.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from lowbit.errors import LowbitError
from lowbit.formats.hf_files import read_config, read_json, weight_files
from lowbit.formats.native import load_native
from lowbit.quant.qtensor import QTensor

# Files a model directory carries besides its weights; copied verbatim between directory formats.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "exit_adapters.safetensors",  # trained early-exit adapters (runtime/exit_adapters.py) travel with the model
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


@dataclass(slots=True)
class Checkpoint:
    config: dict
    qtensors: dict[str, QTensor] = field(default_factory=dict)  # module name -> QTensor
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # HF tensor name -> tensor
    # module name -> (nominal lowbit format label, why it could not stay quantized)
    unexpressed: dict[str, tuple[str, str]] = field(default_factory=dict)
    # module name -> bf16 side matrix {'indices', 'values'} added to its QTensor (native only; quant/outlier_matrix.py)
    outliers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    source_dir: Path | None = None  # where tokenizer files come from (None: see `gguf`)
    gguf: object | None = None  # the GGUFFile a GGUF source was read from
    # module name -> the GGUF block type a QTensor was read from where it holds it in a wider
    # lowbit format (Q5_0 as int8-g32: gguf_blocks.READ_AS); inspect reports the file's type
    stored_as: dict[str, str] = field(default_factory=dict)
    kind: str = "hf"

    def tensors(self) -> dict[str, torch.Tensor | QTensor]:
        """HF parameter names → dense tensors or QTensors (`<module>.weight` for quantized ones)."""
        out: dict[str, torch.Tensor | QTensor] = dict(self.dense)
        for module, qt in self.qtensors.items():
            out[f"{module}.weight"] = qt
        return out

    def linear_weights(self) -> list[str]:
        """Module names of every 2-D projection weight (quantized or dense), in a stable order."""
        names = set(self.qtensors)
        for name, t in self.dense.items():
            if name.endswith(".weight") and t.dim() == 2 and _is_projection(name):
                names.add(name[: -len(".weight")])
        return sorted(names, key=natural_key)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_projection(name: str) -> bool:
    return name.split(".")[-2] in _PROJECTIONS


def natural_key(name: str) -> list:
    """Sort key of a dotted name with its numbers compared as numbers (layers.2 before layers.10);
    a number sorts before a word at the same place."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types
            raise LowbitError(f"cannot read {file}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return out


def read_hf(directory: Path) -> Checkpoint:
    config = read_config(directory)
    config.pop("quantization_config", None)
    return Checkpoint(config=config, dense=read_safetensors(directory), source_dir=directory, kind="hf")


def read_native(directory: Path) -> Checkpoint:
    ckpt = load_native(directory)
    config = dict(ckpt.config)
    config.pop("quantization_config", None)
    return Checkpoint(config=config, qtensors=ckpt.qtensors, dense=ckpt.dense, source_dir=directory, kind="native",
                      outliers=ckpt.outliers)


def copy_side_files(source: Path | None, out: Path) -> list[str]:
    """Copy tokenizer/generation files that exist in `source` into `out`; returns their names."""
    copied = []
    if source is None:
        return copied
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


def write_config(out: Path, config: dict, quantization_config: dict | None) -> None:
    full = dict(config)
    if quantization_config is not None:
        full["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(full, indent=2) + "\n")


def packed_settings(directory: Path, method: str, side_file: str, marker_keys: tuple[str, ...]) -> dict | None:
    """An int32-packed checkpoint's settings: config.json's quantization_config when its quant_method
    is `method`, else the tool's own side file (quantize_config.json, quant_config.json) when it
    holds one of `marker_keys`; None when neither says so."""
    qc = read_config(directory).get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == method:
        return qc
    qc = read_json(directory / side_file, missing=None)
    if isinstance(qc, dict) and any(key in qc for key in marker_keys):
        return qc
    return None


def packed_config(directory: Path, method: str, side_file: str, marker_keys: tuple[str, ...], name: str) -> tuple[dict, dict]:
    """(config.json without its quantization_config, the settings `packed_settings` finds) of an
    int32-packed checkpoint; one LowbitError line when neither file says it is `name` (GPTQ, AWQ)."""
    config = read_config(directory)
    settings = packed_settings(directory, method, side_file, marker_keys)
    if settings is None:
        raise LowbitError(f"{directory}: no {name} quantization_config or {side_file}")
    config.pop("quantization_config", None)
    return config, settings


def packed_modules(directory: Path, tensors: dict[str, torch.Tensor], parts: tuple[str, ...], used: set[str]):
    """(module, {part: tensor}) for every module with a `.qweight`, sorted; qzeros and scales must be
    there (other parts may be None). The names taken are added to `used`."""
    for module in sorted(n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")):
        found = {p: tensors.get(f"{module}.{p}") for p in parts}
        if found["qzeros"] is None or found["scales"] is None:
            raise LowbitError(f"{directory}: {module} has a qweight but no qzeros/scales")
        used.update(f"{module}.{p}" for p in parts)
        yield module, found


def keep_the_rest_dense(ckpt: Checkpoint, tensors: dict[str, torch.Tensor], used: set[str]) -> Checkpoint:
    """Every tensor no module took goes into the checkpoint as it is."""
    for name, t in tensors.items():
        if name not in used:
            ckpt.dense[name] = t
    return ckpt
