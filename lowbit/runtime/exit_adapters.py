"""Trained exit adapters: a small map per exit layer that makes head(norm(h_L)) speak like the
full model's last layer.

Without one, the final norm and head applied to an intermediate hidden state are confident and
wrong (docs/early_exit.md). `lowbit distill TEACHER --exit-layers 12,20` trains one adapter per
exit on KL(full model || exit) and stores them beside the model as `exit_adapters.safetensors`;
every early-exit path (`eval --early-exit`, `generate --early-exit`, `--draft self:layers=N`)
picks them up from the model's directory, and `quantize`/`convert` carry the file along.

An adapter is x + up(down(x)) on the final-normed hidden state, low rank, in float32; `up`
starts at zero, so an untrained adapter is the identity and the exit is the plain head.

File layout: tensors `exit.{L}.down` [rank, hidden] and `exit.{L}.up` [hidden, rank] for each
exit layer L; metadata `{"format": "lowbit-exit-adapters", "hidden_size": ..., "num_layers": ...}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from lowbit.errors import LowbitError

ADAPTERS_FILE = "exit_adapters.safetensors"
FORMAT = "lowbit-exit-adapters"


class ExitAdapter(nn.Module):
    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.down.weight
        return x + self.up(self.down(x.to(w.dtype))).to(x.dtype)


def new_adapters(layers: tuple[int, ...], hidden_size: int, rank: int, seed: int) -> dict[int, ExitAdapter]:
    """Fresh adapters (identity maps), their `down` drawn from the seed alone."""
    torch.manual_seed(seed)
    return {layer: ExitAdapter(hidden_size, rank) for layer in layers}


def save_adapters(adapters: dict[int, ExitAdapter], path: Path, hidden_size: int, num_layers: int) -> None:
    tensors = {}
    for layer, adapter in sorted(adapters.items()):
        for part in ("down", "up"):
            weight = getattr(adapter, part).weight.detach().float().contiguous()
            if not torch.isfinite(weight).all():
                raise LowbitError(f"exit adapter exit.{layer}.{part} holds NaN/inf; nothing written")
            tensors[f"exit.{layer}.{part}"] = weight.clone()
    meta = {"format": FORMAT, "hidden_size": hidden_size, "num_layers": num_layers}
    save_file(tensors, str(path), metadata={"lowbit": json.dumps(meta)})


def load_adapters(source: str | Path | None, config) -> dict[int, ExitAdapter]:
    """The adapters stored beside a model (`source` its directory or a file in it), checked against
    its config; {} when there is no adapters file."""
    if source is None:
        return {}
    source = Path(source)
    path = (source if source.is_dir() else source.parent) / ADAPTERS_FILE
    if not source.exists() or not path.is_file():
        return {}
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("lowbit", "{}"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is no dict
    except (OSError, ValueError, RuntimeError) as e:
        raise LowbitError(f"{path}: not a readable exit adapters file ({e})") from None
    if meta.get("format") != FORMAT:
        raise LowbitError(f"{path}: not a lowbit exit adapters file (no '{FORMAT}' metadata)")
    if meta.get("hidden_size") != hidden or meta.get("num_layers") != layers:
        raise LowbitError(f"{path} was trained for a model of hidden size {meta.get('hidden_size')} and "
                          f"{meta.get('num_layers')} layers; this one has {hidden} and {layers}")
    adapters: dict[int, ExitAdapter] = {}
    for layer in sorted({int(name.split(".")[1]) for name in tensors if name.startswith("exit.")}):
        down, up = tensors.get(f"exit.{layer}.down"), tensors.get(f"exit.{layer}.up")
        if down is None or up is None:
            raise LowbitError(f"{path}: exit.{layer} needs both 'down' and 'up' tensors")
        if not 1 <= layer < layers:
            raise LowbitError(f"{path}: exit.{layer} is outside the model's layers 1..{layers - 1}")
        rank = down.shape[0]
        if down.shape != (rank, hidden) or up.shape != (hidden, rank):
            raise LowbitError(f"{path}: exit.{layer} has down {tuple(down.shape)} and up {tuple(up.shape)}; "
                              f"expected ({rank}, {hidden}) and ({hidden}, {rank})")
        if not (torch.isfinite(down).all() and torch.isfinite(up).all()):
            raise LowbitError(f"{path}: exit.{layer} holds NaN/inf")
        adapter = ExitAdapter(hidden, rank)
        with torch.no_grad():
            adapter.down.weight.copy_(down)
            adapter.up.weight.copy_(up)
        adapters[layer] = adapter.requires_grad_(False).eval()
    return adapters
