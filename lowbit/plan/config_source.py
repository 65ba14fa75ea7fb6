"""Find the config.json a MODEL argument names: bundled, demo, local, or on the hub.

Order: an installed demo model (`smollm2-135m`, `gemma3-270m`, through lowbit.formats.resolve),
a bundled config of a well-known model (so plan works offline and before `lowbit assets`),
a local checkpoint directory, config.json file or GGUF file (its metadata), and last a hub id, for
which only config.json is downloaded.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lowbit.errors import LowbitError
from lowbit.formats.hf_files import is_gguf_file, read_json
from lowbit.paths import MODEL_NAMES

BUNDLED_DIR = Path(__file__).parent / "bundled"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def load_config(arg: str) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from) for a MODEL argument; LowbitError when there is none."""
    text = str(arg).strip()
    if not text:
        raise LowbitError("model name is empty")
    key = text.lower()
    if key in MODEL_NAMES:
        installed = _installed_demo(key)
        if installed is not None:
            return read_json(installed), str(installed)
    bundled = BUNDLED_DIR / f"{key}.json"
    if bundled.exists():
        return read_json(bundled), f"bundled:{key}"
    path = Path(text).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.exists():
            raise LowbitError(f"{path} has no config.json")
        return read_json(config), str(config)
    if path.is_file():
        if is_gguf_file(path):
            from lowbit.formats.foreign import gguf_config  # here: only a GGUF needs torch
            from lowbit.formats.gguf_reader import open_gguf

            return gguf_config(open_gguf(path)), str(path)
        return read_json(path), str(path)
    if _HUB_ID.match(text):
        return read_json(_download_config(text)), f"hub:{text}"
    raise LowbitError(
        f"model not found: {text} (not a bundled name [{', '.join(bundled_names())}], a directory with config.json, or a hub id)"
    )


def _installed_demo(name: str) -> Path | None:
    from lowbit.formats.resolve import resolve_model  # here, not at the top: `lowbit plan` starts without torch

    try:
        path = resolve_model(name)
    except LowbitError:
        return None  # not installed yet: the bundled copy stands in
    config = path / "config.json"
    return config if config.exists() else None


def _download_config(repo_id: str) -> Path:
    from huggingface_hub import constants, hf_hub_download

    # Offline, the hub client retries for half a minute before giving up; a cached copy or a
    # quick "unreachable" is the better answer.
    online = not constants.HF_HUB_OFFLINE and _reachable(constants.ENDPOINT)
    try:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=not online))
    except Exception as exc:  # noqa: BLE001 - offline, gated, missing: all one line for the user
        if not online:
            raise LowbitError(f"cannot fetch config.json of '{repo_id}': the Hugging Face hub is unreachable and it is not cached") from None
        reason = " ".join(str(exc).split())[:160]
        raise LowbitError(f"could not fetch config.json of '{repo_id}' from the Hugging Face hub: {type(exc).__name__}: {reason}") from None


def _reachable(endpoint: str, timeout: float = 3.0) -> bool:
    parsed = urlparse(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False
