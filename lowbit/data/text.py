"""Load an evaluation or calibration text: a demo name (`wiki-eval`, ...) or a UTF-8 file."""

from __future__ import annotations

from pathlib import Path

from lowbit.errors import LowbitError
from lowbit.paths import DATA_NAMES, data_asset_path


def resolve_text_path(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if text in DATA_NAMES:
        path = data_asset_path(text)
        if not path.is_file():
            raise LowbitError(f"demo text '{text}' is not installed yet; run `lowbit assets` first")
        return path
    path = Path(text).expanduser()
    if not path.exists():
        raise LowbitError(f"text not found: {text} (not a file or a demo name {sorted(DATA_NAMES)})")
    if not path.is_file():
        raise LowbitError(f"text path is not a file: {path}")
    return path


def load_text(name_or_path: str | Path) -> str:
    """The whole text, decoded as UTF-8; empty or undecodable files are errors."""
    path = resolve_text_path(name_or_path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LowbitError(f"cannot read text {path}: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LowbitError(f"text {path} is not valid UTF-8 (byte {exc.start})") from exc
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise LowbitError(f"text {path} is empty")
    return text
