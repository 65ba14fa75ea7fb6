"""Where lowbit keeps its demo assets, and the short names that point at them.

Every command that takes a model or a text accepts one of these names, a local path,
or (for models) a Hugging Face hub id.
"""

from __future__ import annotations

import os
from pathlib import Path

MODEL_NAMES = {
    "smollm2-135m": "models/smollm2-135m",
    "gemma3-270m": "models/gemma3-270m",
}

DATA_NAMES = {
    "wiki-calib": "data/wiki-calib.txt",
    "wiki-eval": "data/wiki-eval.txt",
    "shakespeare": "data/shakespeare.txt",
}


def lowbit_home() -> Path:
    """The asset folder: $LOWBIT_HOME, else ~/.cache/lowbit."""
    return Path(os.environ.get("LOWBIT_HOME") or Path.home() / ".cache" / "lowbit")


def model_asset_path(name: str) -> Path:
    return lowbit_home() / MODEL_NAMES[name]


def data_asset_path(name: str) -> Path:
    return lowbit_home() / DATA_NAMES[name]
