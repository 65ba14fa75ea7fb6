"""Turn a model argument (demo name, local path, or hub id) into a local directory or file."""

from __future__ import annotations

import re
from pathlib import Path

from lowbit.errors import LowbitError
from lowbit.paths import MODEL_NAMES, model_asset_path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(arg: str | Path) -> Path:
    text = str(arg)
    if text in MODEL_NAMES:
        path = model_asset_path(text)
        if not (path / "config.json").exists():
            raise LowbitError(f"demo model '{text}' is not installed yet; run `lowbit assets` first")
        return path
    path = Path(text).expanduser()
    if path.exists():
        return path
    if _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        return _download_from_hub(text)
    raise LowbitError(f"model not found: {text} (not a path, a demo name {sorted(MODEL_NAMES)}, or a hub id)")


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"],
        )
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one line for the user
        raise LowbitError(f"could not fetch '{repo_id}' from the Hugging Face hub: {type(exc).__name__}: {exc}") from exc
    return Path(local)
