"""load_model: a Hugging Face-style directory (config.json + safetensors) -> a ready CausalLM.

The model is built on the meta device and its parameters are assigned straight from the files,
so no memory is spent on a random initialisation that would be overwritten. Loading is strict:
every parameter must come from the checkpoint and every checkpoint tensor must be used.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lowbit.errors import LowbitError
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.models import CausalLM, build_model
from lowbit.runtime.moe_weights import expert_tensors
from lowbit.runtime.quant_linear import attach_native
from lowbit.formats.native import check_finite_part
from lowbit.formats.hf_files import is_gguf_file, model_dir, one_line, read_config, weight_files

# Tensors some exporters save that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def iter_tensors(files: list[Path], skip: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the files not in `skip`, with any read failure as one LowbitError line."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in skip:
                        continue
                    yield name, f.get_tensor(name)
        except LowbitError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types for bad files
            raise LowbitError(f"corrupt or unreadable safetensors file {file}: {one_line(exc)}") from None


def _layer_count(names) -> int:
    """Decoder layers the tensor names hold (1 + the largest `layers.<i>.` index; 0 without any)."""
    found = [int(m.group(1)) for m in map(_LAYER_INDEX.search, names) if m]
    return max(found) + 1 if found else 0


_LAYER_INDEX = re.compile(r"\blayers\.(\d+)\.")


def check_layer_count(config: ModelConfig, names, where: str | Path) -> None:
    """config.json's num_hidden_layers against the layers the weights hold, before a model of that
    many layers is built (a damaged count of millions would otherwise take minutes to refuse)."""
    count = _layer_count(names)
    if count != config.num_hidden_layers:
        raise LowbitError(f"config.json of {where} says num_hidden_layers {config.num_hidden_layers}, "
                          f"but its weights hold {count} decoder layer(s)")


def check_weights_fit(config: ModelConfig, shapes: dict[str, tuple[int, ...]], directory: str | Path) -> None:
    """The loader's strictness before any work, from the tensors' shapes alone (lowbit's names:
    MoE experts however they were stored): every weight the architecture needs, with the shape
    config.json implies, and nothing else. `lowbit quantize` and `lowbit convert` of a float
    checkpoint run it first; without it a renamed, missing or misshapen tensor is quantized or
    converted "successfully" into a file no tool can load."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in build_model(config).state_dict().items()}
    tied = config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight", None)
    found = {name: tuple(shape) for name, shape in shapes.items()
             if not name.endswith(_IGNORED_SUFFIXES) and not (tied and name == "lm_head.weight")}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise LowbitError(f"checkpoint {directory} lacks {len(missing)} weight(s) {config.architecture} needs, e.g. {missing[0]}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise LowbitError(f"checkpoint {directory} has {len(unexpected)} weight(s) that {config.architecture} does not use, "
                          f"e.g. {unexpected[0]}")
    for name, shape in found.items():
        if shape != expected[name]:
            raise LowbitError(f"weight {name} in {directory} has shape {shape}, config.json implies {expected[name]}")


def _tensor_names(files: list[Path]) -> list[str]:
    names: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names.extend(f.keys())
        except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types for bad files
            raise LowbitError(f"corrupt or unreadable safetensors file {file}: {one_line(exc)}") from None
    return names


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *,
               bf16_linears: bool = False) -> CausalLM:
    """bf16_linears: with a float32 `dtype`, a weight stored as bf16 of a plain nn.Linear (and the
    embedding table a tied head shares) stays bf16 instead of being widened: the engine's dense
    kernel reads such weights as they are (kernels/cpu_f32.py keeps every bf16-exact weight so),
    and widening them first held twice their bytes while loading."""
    if _foreign_kind(path) is not None:
        return _load_foreign(path, dtype, device)
    path = model_dir(path)
    config = ModelConfig.from_dict(read_config(path))
    files = weight_files(path)
    check_layer_count(config, _tensor_names(files), path)
    with torch.device("meta"):
        model = build_model(config)
    # A lowbit quantized checkpoint: its Linears become QuantLinears (runtime/quant_linear.py).
    quantized_parts = attach_native(model, path, config.tie_word_embeddings, device, dtype)
    expected = dict(model.state_dict(keep_vars=True))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    # what attach_native already filled (a router a recipe quantized, dequantized): not in the files
    state: dict[str, torch.Tensor] = {n: t.data for n, t in expected.items() if not t.is_meta}
    unexpected: list[str] = []
    narrow = _bf16_names(model, config) if bf16_linears and dtype is torch.float32 else set()
    tensors = iter_tensors(files, skip=quantized_parts)
    if config.moe is not None:
        tensors = expert_tensors(tensors, config, path)  # fused and Mixtral layouts onto per-expert names
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise LowbitError(
                f"weight {name} in {path} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected[name].shape)}"
            )
        if not tensor.is_floating_point():
            raise LowbitError(f"weight {name} in {path} is {str(tensor.dtype).removeprefix('torch.')}, not a float tensor")
        check_finite_part(tensor, name, path)
        keep = tensor.dtype is torch.bfloat16 and name in narrow
        state[name] = tensor.to(device=device) if keep else tensor.to(device=device, dtype=dtype)

    missing = sorted(set(expected) - set(state))
    if missing:
        raise LowbitError(f"checkpoint {path} lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]}")
    if unexpected:
        raise LowbitError(
            f"checkpoint {path} has {len(unexpected)} weight(s) that {config.architecture} does not use, "
            f"e.g. {sorted(unexpected)[0]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.requires_grad_(False)
    return model.eval()


def _bf16_names(model, config: ModelConfig) -> set[str]:
    """The weights load_model(bf16_linears=True) keeps in bf16: plain nn.Linear ones, and the
    embedding table when the head tied to it is one."""
    names = {f"{name}.weight" for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    if config.tie_word_embeddings and type(getattr(model, "lm_head", None)) is torch.nn.Linear:
        names.add("model.embed_tokens.weight")
    return names


# Checkpoints of other tools, read through lowbit.formats.foreign (GPTQ, AWQ, compressed-tensors, GGUF).
_FOREIGN_KINDS = ("gptq", "awq", "compressed-tensors", "gguf")


def _foreign_kind(path: str | Path) -> str | None:
    from lowbit.formats.foreign import detect_checkpoint_kind

    path = Path(path).expanduser()
    if path.is_file():
        if not is_gguf_file(path):
            return None  # model_dir() gives the precise error
    elif not (path / "config.json").is_file():
        return None
    try:
        kind = detect_checkpoint_kind(path)
    except LowbitError:
        return None  # e.g. an unreadable config.json: the native path reports it
    return kind if kind in _FOREIGN_KINDS else None


def _load_foreign(path: str | Path, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """Quantized projections become QuantLinears around the imported QTensors; everything else
    (including layers the foreign format keeps in a way no QTensor holds, e.g. GPTQ act-order,
    which arrive with their exact dense values) is loaded as a plain tensor."""
    from lowbit.formats.foreign import read_checkpoint
    from lowbit.runtime.quant_linear import attach_quantized

    ckpt = read_checkpoint(Path(path).expanduser())
    config = ModelConfig.from_dict(ckpt.config)
    check_layer_count(config, [*ckpt.dense, *(f"{m}.weight" for m in ckpt.qtensors)], path)
    with torch.device("meta"):
        model = build_model(config)
    attach_quantized(model, list(ckpt.qtensors), ckpt.qtensors.__getitem__, device)
    if config.tie_word_embeddings and "lm_head" in ckpt.qtensors:  # a GGUF's quantized tied token_embd
        from lowbit.runtime.quant_embedding import QuantEmbedding

        model.model.embed_tokens = QuantEmbedding(ckpt.qtensors["lm_head"], dtype, device)
    expected = dict(model.state_dict(keep_vars=True))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state = {}
    for name, tensor in ckpt.dense.items():
        if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if name not in expected or tuple(tensor.shape) != tuple(expected[name].shape):
            raise LowbitError(f"checkpoint {path}: weight {name} {tuple(tensor.shape)} does not fit {config.architecture}")
        check_finite_part(tensor, name, path)
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise LowbitError(f"checkpoint {path} lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.requires_grad_(False)
    return model.eval()
