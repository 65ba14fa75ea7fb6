"""A smaller student cut from the teacher: decoder layers removed by a measured importance.

Importance (train.py `teacher_pass`): 1 − mean cos(input, output) of each layer on the
calibration windows, i.e. how much the layer turns the hidden state. `--student-layers N` keeps the
N most important layers (in their order); `--drop-layers LIST` names the ones to drop. The cut
student is an ordinary Hugging Face directory (config.json with the new num_hidden_layers and
per-layer lists cut alike, the kept layers' tensors renumbered, the tokenizer files), written into
the work folder so that a resumed run starts from the very same weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors.torch import save_file

from lowbit.errors import UsageError
from lowbit.formats.checkpoint import copy_side_files
from lowbit.formats.hf_files import read_config, weight_files
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.loader import iter_tensors

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# config.json lists with one entry per decoder layer, cut like the layers
_PER_LAYER_KEYS = ("layer_types",)


def parse_layer_list(text: str, layers: int) -> list[int]:
    """'3,5,7-9' → [3, 5, 7, 8, 9]; every index inside 0..layers-1, at least one layer left."""
    chosen: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match:
            raise UsageError(f"--drop-layers: {item!r} is not a layer index or range such as 3 or 7-9")
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if hi < lo or hi >= layers:
            raise UsageError(f"--drop-layers: {item} is outside the teacher's layers 0-{layers - 1}")
        chosen.update(range(lo, hi + 1))
    if len(chosen) >= layers:
        raise UsageError(f"--drop-layers would drop all {layers} layers")
    return sorted(chosen)


def layers_to_drop(importance: list[float], keep: int) -> list[int]:
    """The len(importance) − keep least important layers (ties: the later layer goes first)."""
    layers = len(importance)
    if not 1 <= keep < layers:
        raise UsageError(f"--student-layers must be between 1 and {layers - 1} (the teacher has {layers}), got {keep}")
    order = sorted(range(layers), key=lambda i: (importance[i], -i))
    return sorted(order[: layers - keep])


def cut_teacher(teacher_dir: Path, drop: list[int], out: Path) -> Path:
    """Write the teacher without the `drop` layers as a Hugging Face directory at `out`."""
    config = read_config(teacher_dir)
    config.pop("quantization_config", None)
    n = int(config["num_hidden_layers"])
    kept = [i for i in range(n) if i not in set(drop)]
    new_index = {old: new for new, old in enumerate(kept)}
    tensors = {}
    for name, tensor in iter_tensors(weight_files(teacher_dir)):
        match = _LAYER.match(name)
        if match is None:
            tensors[name] = tensor
        elif int(match.group(1)) in new_index:
            tensors[f"model.layers.{new_index[int(match.group(1))]}.{match.group(2)}"] = tensor
    parsed = ModelConfig.from_dict(config)
    config["num_hidden_layers"] = len(kept)
    for key in _PER_LAYER_KEYS:
        if isinstance(config.get(key), list) and len(config[key]) == n:
            config[key] = [config[key][i] for i in kept]
        elif key == "layer_types" and len(set(parsed.layer_types)) > 1:
            # a pattern-made list (Gemma-3's sliding_window_pattern) no longer lines up: spell it out
            config[key] = [parsed.layer_types[i] for i in kept]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(teacher_dir, out)
    return out
