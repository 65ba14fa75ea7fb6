"""The base model's logits saved once and played back: a KLD sweep scores many quantized models
against one float model, which then runs once instead of once per row (shared by the bench scripts)."""

from __future__ import annotations

from pathlib import Path

import torch


class RecordingModel:
    """Runs a model and saves each window's logits to disk (the base pass)."""

    def __init__(self, model, directory: Path):
        self.model, self.directory, self.count = model, directory, 0
        self.config = model.config

    def __call__(self, ids, logits_start=0):
        logits = self.model(ids, logits_start=logits_start)
        torch.save(logits.float().cpu().clone(), self.directory / f"base-{self.count}.pt")
        self.count += 1
        return logits


class ReplayModel:
    """Plays the saved base logits back in window order, in place of running the base model."""

    def __init__(self, directory: Path, config):
        self.directory, self.config, self.count = directory, config, 0

    def __call__(self, ids, logits_start=0):
        logits = torch.load(self.directory / f"base-{self.count}.pt")
        self.count += 1
        return logits
