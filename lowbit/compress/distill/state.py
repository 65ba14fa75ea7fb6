"""The resumable state of a distillation, in the work folder beside the output.

  manifest.json            the job's fingerprint (compress/workdir.py): another job starts afresh
  state.safetensors        every trained tensor, the optimizer's moments and step counts, and in
                           its metadata where the run stands: {"stage": "block", "done": layers}
                           or {"stage": "e2e", "done": steps, "losses": [...]}; written to a
                           temporary name and renamed, so a kill mid-write leaves the last one
  teacher.bin + .json      the teacher's last hidden states on the training windows (the
                           end-to-end stage's targets come from them through the teacher's head)

Everything is stored exactly (float32 as float32), so a resumed run continues with the very
numbers an uninterrupted one had and writes the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

STATE_NAME = "state.safetensors"


def save_state(directory: Path, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
               meta: dict) -> None:
    # copies on the CPU (a run on a GPU saves the same file)
    tensors = {f"param/{name}": p.detach().to("cpu", copy=True).contiguous() for name, p in params.items()}
    if optimizer is not None:
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                tensors[f"opt/{index}/{key}"] = torch.as_tensor(value).detach().to("cpu", copy=True).contiguous()
    path = directory / STATE_NAME
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)


def load_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]], dict] | None:
    """(params by name, optimizer state by parameter index, meta) or None when no state is saved."""
    path = directory / STATE_NAME
    if not path.is_file():
        return None
    params: dict[str, torch.Tensor] = {}
    opt: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["meta"])
        for key in f.keys():
            kind, _, rest = key.partition("/")
            if kind == "param":
                params[rest] = f.get_tensor(key)
            else:
                index, _, field = rest.partition("/")
                opt.setdefault(int(index), {})[field] = f.get_tensor(key)
    return params, opt, meta


def restore(params: dict[str, torch.nn.Parameter], saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[int, dict[str, torch.Tensor]]) -> None:
    state = optimizer.state_dict()
    state["state"] = {i: dict(v) for i, v in saved.items()}
    optimizer.load_state_dict(state)
