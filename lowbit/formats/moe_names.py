"""Expert and router names of the mixture-of-experts checkpoint layouts, in lowbit's one spelling.

lowbit names expert E of layer L `model.layers.L.mlp.experts.E.{gate,up,down}_proj` and the layer's
router `model.layers.L.mlp.gate`, as the hub checkpoints of Qwen2/3-MoE and OLMoE do. Mixtral's hub
files say `block_sparse_moe.experts.E.w1 / w3 / w2` (gate / up / down) and `block_sparse_moe.gate`;
llm-compressor's Mixtral exports (transformers 5) say `block_sparse_moe.experts.E.gate_proj / up_proj
/ down_proj`. `to_lowbit` maps either onto lowbit's names (tensor or module names; others unchanged)
and `to_mixtral` writes Mixtral's hub names back, the names vLLM's Mixtral loader reads.
"""

from __future__ import annotations

import re

_FROM_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TO_MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}
_MIXTRAL_EXPERT = re.compile(r"(\.mlp\.experts\.\d+\.)(w[123])(?=\.|$)")
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.(gate|shared_expert_gate)$")
_LOWBIT_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.(experts\.\d+\.(gate|up|down)_proj|gate)(?=\.|$)")


def to_lowbit(name: str) -> str:
    """A checkpoint tensor or module name in lowbit's per-expert spelling."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: m.group(1) + _FROM_MIXTRAL[m.group(2)], name)


_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$")


def expert_pieces(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], tuple[int, int, int] | None]]:
    """The per-expert tensors a stored tensor holds, in lowbit's spelling: [(name, shape, piece)],
    piece None for the whole tensor, or (expert, first row, end row) of transformers 5's fused
    layout (`mlp.experts.gate_up_proj` [E, 2I, H]: gate rows then up rows; `mlp.experts.down_proj`
    [E, H, I]), so readers can take each expert's slice without loading the rest."""
    name = to_lowbit(name)
    fused = _FUSED.match(name)
    if fused is None:
        return [(name, tuple(shape), None)]
    prefix, kind = fused.groups()
    if len(shape) != 3 or (kind == "gate_up_proj" and shape[1] % 2):
        return [(name, tuple(shape), None)]  # not the fused layout: the shape check names it
    e, rows, cols = shape
    if kind == "down_proj":
        return [(f"{prefix}.{x}.down_proj.weight", (rows, cols), (x, 0, rows)) for x in range(e)]
    i = rows // 2
    return [piece for x in range(e) for piece in ((f"{prefix}.{x}.gate_proj.weight", (i, cols), (x, 0, i)),
                                                   (f"{prefix}.{x}.up_proj.weight", (i, cols), (x, i, rows)))]


def fused_kind(name: str) -> str | None:
    """"gate_up_proj" or "down_proj" for a tensor of transformers 5's fused expert layout, else None."""
    fused = _FUSED.match(to_lowbit(name))
    return None if fused is None else fused.group(2)


def take_piece(tensor, piece: tuple[int, int, int] | None):
    """An expert_pieces piece of an in-memory tensor: itself, or a view of one expert's rows."""
    return tensor if piece is None else tensor[piece[0], piece[1]:piece[2]]


def read_piece(handle, stored: str, piece: tuple[int, int, int] | None):
    """An expert_pieces piece read from an open safetensors handle: one expert's rows of a fused
    tensor come alone, without reading the other experts'."""
    if piece is None:
        return handle.get_tensor(stored)
    expert, first, end = piece
    return handle.get_slice(stored)[expert:expert + 1, first:end][0]


def is_router(module: str) -> bool:
    """An MoE layer's router (or Qwen2-MoE's shared-expert gate), in either spelling."""
    return _ROUTER.search(module) is not None


def to_mixtral(name: str) -> str:
    """A lowbit expert or router name in Mixtral's hub spelling (other names unchanged)."""
    def sub(m: re.Match) -> str:
        if m.group(2) == "gate":
            return f"{m.group(1)}.block_sparse_moe.gate"
        return f"{m.group(1)}.block_sparse_moe.{m.group(2).rsplit('.', 1)[0]}.{_TO_MIXTRAL[m.group(3)]}"
    return _LOWBIT_EXPERT.sub(sub, name)
