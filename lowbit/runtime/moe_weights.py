"""Expert weights of the MoE checkpoint layouts, onto the per-expert names lowbit's model uses.

lowbit keeps one `GatedMLP` per expert (runtime/models/moe.py): `model.layers.L.mlp.experts.E.
{gate,up,down}_proj.weight` and the router `model.layers.L.mlp.gate.weight`, which is also how hub
checkpoints of Qwen2/3-MoE and OLMoE (and transformers 5's save_pretrained) store them. Two other
layouts are mapped onto those names as the tensors stream past the loader:

- Mixtral's hub files: `block_sparse_moe.experts.E.w1/w3/w2.weight` (gate/up/down) and
  `block_sparse_moe.gate.weight`, and llm-compressor's `block_sparse_moe.experts.E.gate_proj`
  (formats/moe_names.py renames them);
- transformers 5's in-memory fused tensors, as some tools write them: `mlp.experts.gate_up_proj`
  [E, 2I, H] (gate rows first, then up) and `mlp.experts.down_proj` [E, H, I], with or without a
  `.weight` suffix; each is split into per-expert views (no copy).

Strict like the loader: a fused tensor of the wrong shape, or an expert weight given twice (fused
and per-expert), is one LowbitError naming the tensor; missing experts are the loader's error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.formats.moe_names import expert_pieces, fused_kind, take_piece
from lowbit.runtime.config import ModelConfig


def expert_tensors(items: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                   where: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a checkpoint with the expert layouts above turned into per-expert tensors
    (formats/moe_names.expert_pieces), a fused tensor checked against config.json first."""
    seen: set[str] = set()
    for name, tensor in items:
        kind = fused_kind(name)
        if kind is not None:
            _check_fused(name, kind, tensor, config, where)
        for out_name, _, piece in expert_pieces(name, tuple(tensor.shape)):
            if ".mlp.experts." in out_name:
                if out_name in seen:
                    raise LowbitError(f"checkpoint {where} holds expert weight {out_name} twice (e.g. fused and per expert)")
                seen.add(out_name)
            yield out_name, take_piece(tensor, piece)


def _check_fused(name: str, kind: str, tensor: torch.Tensor, config: ModelConfig, where: str | Path) -> None:
    moe = config.moe
    e, i, h = moe.num_experts, moe.intermediate_size, config.hidden_size
    expected = (e, 2 * i, h) if kind == "gate_up_proj" else (e, h, i)
    if tuple(tensor.shape) != expected:
        raise LowbitError(f"weight {name} in {where} has shape {tuple(tensor.shape)}, config.json implies {expected}")
