"""The quantized student: any quantized checkpoint as a model whose scales, norms and biases train.

`open_student` reads the checkpoint (lowbit's native format or any foreign one formats/foreign.py
reads), checks that it is a quantization of the teacher (the same identity the STATS file checks:
config hash and every Linear's shape, for a native checkpoint; architecture, sizes and shapes for
a foreign one, whose config.json is rebuilt by its reader), and builds a float32 model with a
`TrainableQuantLinear` for every quantized module. `write_student` writes it back in the
checkpoint's own format: codes and every untrained tensor byte for byte, the trained scales in
their storage dtype, trained norms and biases in float32 (a few KB; the loader casts them).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lowbit.compress.distill.trainable import TrainableQuantLinear
from lowbit.compress.stats import config_hash
from lowbit.errors import LowbitError
from lowbit.formats.atomic import atomic_dir
from lowbit.formats.checkpoint import Checkpoint, copy_side_files
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.native import NativeWriter
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.models import CausalLM, build_model
from lowbit.formats.moe_names import to_lowbit as rename

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class QuantStudent:
    model: CausalLM
    checkpoint: Checkpoint
    linears: dict[str, TrainableQuantLinear]  # checkpoint module name -> its trainable layer
    path: Path


class TiedQuantEmbedding(nn.Module):
    """The token embedding of a quantized tied head: rows of the head's (trainable) weight, so a
    change of the head's scales reaches the embedding too, as it will in the written checkpoint."""

    def __init__(self, head: TrainableQuantLinear):
        super().__init__()
        self._head = (head,)  # not a submodule: its parameters belong to lm_head

    @property
    def weight(self) -> torch.Tensor:
        return self._head[0].weight()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self._head[0].weight())


def is_trained_dense(name: str) -> bool:
    """Dense tensors that train: every norm and every bias (embeddings, head and dense Linears stay)."""
    return name.endswith(".bias") or (name.endswith(".weight") and name.rsplit(".", 2)[-2].endswith("norm"))


def open_student(path: str | Path, teacher_config: dict, teacher_name: str) -> QuantStudent:
    path = Path(path).expanduser()
    ckpt = read_checkpoint(path)
    if not ckpt.qtensors:
        raise LowbitError(f"--student {path} has no quantized layers: give a checkpoint from `lowbit quantize` "
                          "(or a GPTQ/AWQ/compressed-tensors/GGUF one)")
    config = ModelConfig.from_dict(ckpt.config)
    _check_identity(ckpt, config, teacher_config, path, teacher_name)
    with torch.device("meta"):
        model = build_model(config)
    linears: dict[str, TrainableQuantLinear] = {}
    for module, qt in ckpt.qtensors.items():
        target = rename(module)
        try:
            old = model.get_submodule(target)
        except AttributeError:
            raise LowbitError(f"{path}: quantized module {module} does not exist in {config.architecture}") from None
        if not isinstance(old, nn.Linear) or tuple(qt.shape) != (old.out_features, old.in_features):
            raise LowbitError(f"{path}: quantized module {module} {tuple(qt.shape)} does not fit {config.architecture}")
        new = TrainableQuantLinear(qt, bias=old.bias is not None, outliers=ckpt.outliers.get(module))
        parent, _, leaf = target.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        linears[module] = new
    tied_quant = config.tie_word_embeddings and "lm_head" in linears
    if tied_quant:  # `quantize --quantize-head` on a tied model: the embedding reads the quantized head's rows
        model.model.embed_tokens = TiedQuantEmbedding(linears["lm_head"])
    own = {f"{rename(m)}.{p}" for m, lin in linears.items() for p, _ in lin.named_parameters() if p != "bias"}
    expected = {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in own}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state = {}
    for name, tensor in ckpt.dense.items():
        target = rename(name)
        if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and target == "lm_head.weight"):
            continue
        if target not in expected or tuple(tensor.shape) != tuple(expected[target].shape):
            raise LowbitError(f"{path}: tensor {name} {tuple(tensor.shape)} does not fit {config.architecture}")
        state[target] = tensor.float()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise LowbitError(f"{path} lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings and not tied_quant:
        model.tie_weights()
    model.requires_grad_(False)
    for lin in linears.values():
        for name in lin.trained_parts:
            getattr(lin, name).requires_grad_(True)
    for name, p in model.named_parameters():
        if is_trained_dense(name):
            p.requires_grad_(True)
    return QuantStudent(model=model.train(), checkpoint=ckpt, linears=linears, path=path)


def _check_identity(ckpt: Checkpoint, config: ModelConfig, teacher_config: dict, path: Path, teacher_name: str) -> None:
    teacher = ModelConfig.from_dict(teacher_config)
    if ckpt.kind == "native" and config_hash(ckpt.config) == config_hash(teacher_config):
        return
    facts = ("architecture", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
             "num_attention_heads", "num_key_value_heads")
    differ = [f for f in facts if getattr(config, f, None) != getattr(teacher, f, None)]
    if ckpt.kind == "native" and not differ:
        differ = ["config.json"]  # the same sizes but another config: another model of that shape
    if differ:
        what = differ[0]
        raise LowbitError(
            f"--student {path} is not a quantization of {teacher_name}: its {what} "
            f"{getattr(config, what, config_hash(ckpt.config))} differs from the teacher's "
            f"{getattr(teacher, what, config_hash(teacher_config))}; quantize the teacher itself"
        )


def write_student(student: QuantStudent, output: str | Path, overwrite: bool = False) -> Path:
    """The trained student in the format it came in, atomically (a temp sibling renamed into place)."""
    ckpt = student.checkpoint
    output = Path(output)
    if ckpt.kind == "native":
        with atomic_dir(output, overwrite=overwrite) as tmp:
            _write_native(student, tmp)
        return output
    from lowbit.formats.convert import convert

    # Foreign formats: the native checkpoint first (beside the output), then the format's own writer,
    # which is atomic itself and exact for every QTensor that came from that format.
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.native-", dir=output.parent if output.parent.exists() else None) as tmp:
        native = Path(tmp) / "native"
        native.mkdir()
        _write_native(student, native)
        convert(native, output, to=ckpt.kind, overwrite=overwrite, stored_as=ckpt.stored_as)
    return output


def _write_native(student: QuantStudent, directory: Path) -> None:
    ckpt, model = student.checkpoint, student.model
    params = dict(model.named_parameters())
    writer = NativeWriter(directory)
    for module, lin in student.linears.items():
        writer.add_quantized(module, lin.to_qtensor(module))
        if module in ckpt.outliers:
            writer.add_outliers(module, ckpt.outliers[module])
    for name, tensor in ckpt.dense.items():
        trained = params.get(rename(name))
        if trained is not None and trained.requires_grad:
            value = trained.detach().float()
            if not torch.isfinite(value).all():
                raise LowbitError(f"trained tensor {name} holds NaN/inf; nothing written")
            writer.add_dense(name, value.clone())
        else:
            writer.add_dense(name, tensor)
    copy_side_files(ckpt.source_dir, directory)
    if ckpt.gguf is not None:  # a GGUF student's vocabulary lives in its metadata: the GGUF writer reads it back from these
        from lowbit.formats.gguf_tokenizer import write_tokenizer_files

        write_tokenizer_files(ckpt.gguf, directory)
    writer.close(dict(ckpt.config))
