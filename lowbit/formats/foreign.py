"""What kind of checkpoint a path is, and reading any supported kind into lowbit's representation.

`detect_checkpoint_kind(path)` → "native" | "gptq" | "awq" | "compressed-tensors" | "gguf" | "hf".
`load_foreign(path)` → (config dict, tensors): the model's config.json without its
quantization_config, and HF parameter names → dense tensors or QTensors (`<module>.weight`
for every quantized projection). Layers a foreign format stores in a way lowbit cannot hold
as a QTensor (GPTQ act-order, GGUF K-quants) arrive as float32 tensors with the exact values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.formats.awq import read_awq
from lowbit.formats.checkpoint import Checkpoint, read_hf, read_native
from lowbit.formats.compressed_tensors import read_compressed_tensors
from lowbit.formats.gguf_arch import arch_spec, expert_names, is_stacked, model_identity, unpermute_qk
from lowbit.formats.gguf_blocks import BLOCK, BLOCK_BYTES, READ_AS, from_gguf_bytes, permute_rows
from lowbit.formats.gguf_import import _embeddings_tied, _plan_tensors, hf_tensors
from lowbit.formats.gguf_reader import check_finite_tensor, open_gguf
from lowbit.formats.gptq import read_gptq
from lowbit.formats.hf_files import is_gguf_file
from lowbit.formats.moe_names import expert_pieces, take_piece, to_lowbit
from lowbit.formats.native import check_finite_part
from lowbit.quant.qtensor import QTensor

KINDS = ("native", "gptq", "awq", "compressed-tensors", "gguf", "hf")


def detect_checkpoint_kind(path: str | os.PathLike) -> str:
    path = Path(path).expanduser()
    if not path.exists():
        raise LowbitError(f"checkpoint not found: {path}")
    if path.is_file():
        if is_gguf_file(path) or path.suffix.lower() == ".gguf":
            return "gguf"  # a damaged *.gguf gets the GGUF reader's precise error
        raise LowbitError(f"{path} is a file but not GGUF; lowbit reads checkpoint directories or *.gguf files")
    config_path = path / "config.json"
    qc = None
    if config_path.is_file():
        try:
            qc = json.loads(config_path.read_text()).get("quantization_config")
        except (json.JSONDecodeError, AttributeError):
            raise LowbitError(f"{config_path} is not a valid JSON object") from None
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    if method == "lowbit":
        return "native"
    if method in ("compressed-tensors", "gptq", "awq"):
        return method
    if method:
        raise LowbitError(f"{path}: quantization method '{method}' is not one lowbit reads (native, gptq, awq, compressed-tensors)")
    if (path / "quantize_config.json").is_file():
        return "gptq"
    if (path / "quant_config.json").is_file():
        return "awq"
    if not config_path.is_file():
        raise LowbitError(f"{path} is not a model directory: it has no config.json")
    return "hf"


def read_checkpoint(path: str | os.PathLike, kind: str | None = None) -> Checkpoint:
    """Any supported checkpoint as a `Checkpoint` (config, QTensors, dense tensors)."""
    path = Path(path).expanduser()
    kind = kind or detect_checkpoint_kind(path)
    reader = _READERS.get(kind)
    if reader is None:
        raise LowbitError(f"unknown checkpoint kind '{kind}' (known: {', '.join(KINDS)})")
    ckpt = reader(path)
    if kind not in ("native", "gguf"):  # those readers check every tensor themselves
        _check_finite(ckpt, path)
    return _lowbit_expert_names(ckpt)


def _check_finite(ckpt: Checkpoint, path: Path) -> None:
    """NaN/inf in a foreign checkpoint's tensors or in the values imported from them (an act-order
    layer's dequantized weights, say) stop every command that reads it, naming the tensor: a
    conversion must not carry them silently into another format."""
    for name, tensor in ckpt.dense.items():
        check_finite_part(tensor, name, path)
    for module, qt in ckpt.qtensors.items():
        for part, tensor in qt.to_tensors().items():
            check_finite_part(tensor, f"{module}.weight.{part}", path)


def _lowbit_expert_names(ckpt: Checkpoint) -> Checkpoint:
    """Every layout's expert and router names in lowbit's spelling (formats/moe_names.py), so the
    writers see one: a hub Mixtral's `block_sparse_moe.experts.E.w1` is `mlp.experts.E.gate_proj`,
    and transformers 5's fused `mlp.experts.gate_up_proj` one view per expert."""
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.dense.items():
        for piece_name, _, piece in expert_pieces(name, tuple(tensor.shape)):
            if piece_name in dense:
                raise LowbitError(f"checkpoint holds weight {piece_name} twice (e.g. fused and per expert)")
            dense[piece_name] = take_piece(tensor, piece)
    ckpt.dense = dense
    for table in (ckpt.qtensors, ckpt.unexpressed, ckpt.outliers, ckpt.stored_as):
        renamed = {to_lowbit(name): value for name, value in table.items()}
        if len(renamed) != len(table):
            raise LowbitError("checkpoint names one expert weight twice (Mixtral's and lowbit's spelling)")
        table.clear()
        table.update(renamed)
    return ckpt


def load_foreign(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor | QTensor]]:
    """(config dict, HF parameter name → Tensor or QTensor) for any supported checkpoint."""
    ckpt = read_checkpoint(path)
    return ckpt.config, ckpt.tensors()


def gguf_config(gguf) -> dict:
    """The config.json a GGUF file's metadata describes (architecture, sizes, tied head, and the
    dtype its float tensors show it was saved in): what the runtime builds, and `lowbit plan` reads."""
    spec = arch_spec(gguf)
    config = spec.build_config(gguf)
    config["tie_word_embeddings"] = _embeddings_tied(gguf)
    model_type, hf_class = model_identity(spec, gguf)
    config = {"architectures": [hf_class], "model_type": model_type, **config}
    saved = _saved_dtype(gguf)
    if saved is not None and "torch_dtype" not in config:
        config["torch_dtype"] = saved
    return config


def read_gguf(path: Path) -> Checkpoint:
    """A GGUF file: Q4_0 / Q8_0 / MXFP4 projections become QTensors, and so does a head in those
    types (a tied token_embd is then the quantized lm_head, as `quantize --quantize-head` stores it);
    BF16 and F16 tensors stay in their dtype (where the values allow), everything else float32.

    A stacked expert tensor (`blk.L.ffn_up_exps` [experts, rows, columns]) splits into one
    projection per expert (`model.layers.L.mlp.experts.E.up_proj`): expert E's blocks are the E-th
    run of rows × blocks, so each expert's QTensor holds its exact codes and scales."""
    gguf = open_gguf(path)
    spec = arch_spec(gguf)
    config = gguf_config(gguf)
    tied = config["tie_word_embeddings"]
    ckpt = Checkpoint(config=config, gguf=gguf, kind="gguf")
    for name, hf_name in _plan_tensors(gguf, spec, tied, config):
        info = gguf.info(name)
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        stacked = is_stacked(hf_name)
        is_projection = stacked or (hf_name.endswith("_proj.weight") and len(info.shape) == 2)
        # the head (output.weight, or token_embd where it is tied) in a block type lowbit runs is the
        # quantized lm_head `quantize --quantize-head` writes: the kernels read its blocks, and a tied
        # embedding reads its rows from them (runtime/quant_embedding.py), not a float32 table
        is_head = hf_name == "lm_head.weight" or (tied and hf_name == "model.embed_tokens.weight")
        if (is_projection or is_head) and info.type_name in BLOCK_BYTES and info.shape[-1] % BLOCK == 0:
            raw = gguf.raw_bytes(name)
            if stacked:
                rows, cols = info.shape[1:]
                size = rows * cols // BLOCK * BLOCK_BYTES[info.type_name]
                pieces = [(e_name, raw[e * size:(e + 1) * size]) for e, e_name in enumerate(expert_names(hf_name, info.shape[0]))]
            else:
                rows, cols = info.shape
                pieces = [("lm_head.weight" if is_head else hf_name, raw)]
            for piece_name, piece in pieces:
                qt = from_gguf_bytes(piece, info.type_name, (rows, cols))
                for part_name, part_tensor in qt.to_tensors().items():
                    if part_tensor.is_floating_point():  # the blocks' scales: NaN/inf only in a damaged file
                        check_finite_tensor(part_tensor, f"{name} ({part_name})", gguf.path.name)
                if spec.permute_qk and part in ("attn_q", "attn_k"):
                    heads = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
                    qt = permute_rows(qt, unpermute_qk(torch.arange(rows), heads))
                ckpt.qtensors[piece_name[: -len(".weight")]] = qt
                if info.type_name in READ_AS:
                    ckpt.stored_as[piece_name[: -len(".weight")]] = info.type_name
            continue
        for piece_name, tensor in hf_tensors(gguf, spec, config, name, hf_name):
            ckpt.dense[piece_name] = _in_stored_dtype(tensor, info.type_name)
            if is_projection and info.type_name not in ("F32", "F16", "BF16", "F64"):
                ckpt.unexpressed[piece_name[: -len(".weight")]] = (info.type_name, f"GGUF {info.type_name} blocks have no lowbit format")
    return ckpt


_STORED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16}


def _saved_dtype(gguf) -> str | None:
    """The dtype the model was saved in, as config.json's torch_dtype says it, where the file's
    float tensors tell (a BF16 or F16 embedding): the same weights then run the same way from a GGUF
    as from a Hugging Face directory (`--kv-dtype auto` keeps a bf16 model's cache in bf16)."""
    types = {gguf.info(name).type_name for name in gguf.tensor_names()}
    if "BF16" in types:
        return "bfloat16"
    return "float16" if "F16" in types else None


def _in_stored_dtype(tensor: torch.Tensor, type_name: str) -> torch.Tensor:
    """A BF16 or F16 tensor back in its own dtype where its values allow (a Gemma norm less its
    offset may not): a re-export then writes the file's bytes, not twice as many in float32."""
    dtype = _STORED_DTYPES.get(type_name)
    if dtype is None:
        return tensor
    narrow = tensor.to(dtype)
    return narrow if torch.equal(narrow.float(), tensor.float()) else tensor


_READERS = {"native": read_native, "hf": read_hf, "compressed-tensors": read_compressed_tensors, "gptq": read_gptq,
            "awq": read_awq, "gguf": read_gguf}
