"""Per-layer progress of a long layer-by-layer job, so a killed run resumes where it stopped.

The work folder sits beside the output (`.<out-name>.lowbit-work`) and holds
  manifest.json             the job's fingerprint (model, data, settings); another job starts afresh
  layer-00007.safetensors   layer 7's result (stats, or quantized tensors), written atomically
  hidden.bin + hidden.json  a snapshot of the hidden states entering layer `next_layer`
  reference.bin + .json     the float model's hidden states beside them (GPTQ with float targets)

Writing the hidden states (hundreds of MB) after every layer would cost more than the layer, so
they are snapshotted at most every `snapshot_every_s` seconds; a resumed run reloads the snapshot
and replays the finished layers after it from their saved results, through the same code an
uninterrupted run uses, so both produce the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import sys
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def work_dir_for(output: str | os.PathLike) -> Path:
    out = Path(output)
    return out.with_name(f".{out.name}.lowbit-work")


class WorkDir:
    def __init__(self, path: str | os.PathLike, fingerprint: dict):
        self.path = Path(path)
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))
        manifest = self.path / "manifest.json"
        if self.path.exists():
            try:
                same = json.loads(manifest.read_text()) == self.fingerprint
            except (OSError, json.JSONDecodeError):
                same = False
            if not same:
                shutil.rmtree(self.path)
        self.resumed = self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.resumed:
            _write_text(manifest, json.dumps(self.fingerprint, sort_keys=True, indent=1))
        elif self.finished_layers():
            # Said at the start, so a log shows why this run is quicker than the last (and from where).
            print(f"lowbit: resuming from {self.path}: {self.finished_layers()} layer(s) already done",
                  file=sys.stderr, flush=True)

    def _layer_path(self, index: int) -> Path:
        return self.path / f"layer-{index:05d}.safetensors"

    def has_layer(self, index: int) -> bool:
        return self._layer_path(index).is_file()

    def finished_layers(self) -> int:
        """How many layers from 0 on have a saved result."""
        n = 0
        while self.has_layer(n):
            n += 1
        return n

    def save_layer(self, index: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        path = self._layer_path(index)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta, sort_keys=True)})
        os.replace(tmp, path)

    def load_layer(self, index: int) -> tuple[dict[str, torch.Tensor], dict]:
        with safe_open(str(self._layer_path(index)), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            return {k: f.get_tensor(k) for k in f.keys()}, meta

    def save_hidden(self, hidden: torch.Tensor, next_layer: int, stream: str = "hidden") -> None:
        """Snapshot one stream of hidden states (`stream`: "hidden", or "reference" for the float
        model's beside it); a reader checks that all the streams it needs name the same layer."""
        data, info = self.path / f"{stream}.bin", self.path / f"{stream}.json"
        # The old snapshot stays valid until the new one is complete.
        with contextlib.suppress(FileNotFoundError):
            info.unlink()
        tmp = data.with_name(data.name + ".tmp")
        raw = hidden.contiguous()
        if raw.dtype == torch.bfloat16:  # numpy has no bfloat16: write the same bytes as int16
            raw = raw.view(torch.int16)
        with open(tmp, "wb") as f:
            f.write(memoryview(raw.numpy()).cast("B"))
        os.replace(tmp, data)
        dtype = str(hidden.dtype).removeprefix("torch.")
        _write_text(info, json.dumps({"next_layer": next_layer, "shape": list(hidden.shape), "dtype": dtype}))

    def load_hidden(self, stream: str = "hidden") -> tuple[torch.Tensor, int] | None:
        info = self.path / f"{stream}.json"
        if not info.is_file():
            return None
        meta = json.loads(info.read_text())
        shape = meta["shape"]
        count = 1
        for d in shape:
            count *= d
        dtype = getattr(torch, meta.get("dtype", "float32"))
        data = torch.from_file(str(self.path / f"{stream}.bin"), shared=False, size=count, dtype=dtype)
        return data.view(*shape), int(meta["next_layer"])

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
