"""Token ids of a calibration text, cached on disk by the text's and the tokenizer's hashes.

Tokenizing the 400 KB wiki-calib slice is a noticeable part of start-up, each time a calibrated
`quantize` or `calibrate` starts; the ids depend only on the text and tokenizer.json, so they are
kept under $LOWBIT_HOME/cache/tokens/<sha256 of both>.npy. A cache that cannot be written (read-only
home) is skipped; a damaged file is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from lowbit.paths import lowbit_home


def cache_path(tokenizer_file: Path, text: str) -> Path:
    digest = hashlib.sha256(Path(tokenizer_file).read_bytes())
    digest.update(b"\0")
    digest.update(text.encode())
    return lowbit_home() / "cache" / "tokens" / f"{digest.hexdigest()[:32]}.npy"


def encode_cached(tokenizer, tokenizer_file: Path, text: str) -> list[int]:
    """tokenizer.encode(text, add_bos=False), from the cache when this text met this tokenizer before."""
    path = cache_path(tokenizer_file, text)
    try:
        return np.load(path, allow_pickle=False).tolist()
    except (OSError, ValueError):
        pass
    ids = tokenizer.encode(text, add_bos=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(ids, dtype=np.int32), allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass
    return ids
