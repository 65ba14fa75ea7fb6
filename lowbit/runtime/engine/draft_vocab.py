"""A draft's vocabulary: the tokens its head scores (the frequency-ranked head of FR-Spec).

A draft head is read whole at every draft step. On a large vocabulary that read is most of the
step: Gemma-3's 262144 × 640 head is 84 MB in int4 beside about 100 MB of int8 layers. Text uses
few of those tokens: the 32768 seen most often in lowbit's calibration text cover 94 % of the
tokens of the (distinct) evaluation text. So a draft of a large-vocabulary model scores only its
N most frequent tokens (the rest get -inf), and its head reads N/V of the bytes. The target verifies
every draft token, so the output is the same bits; a token outside the set is a draft the target
corrects, as any other rejected one (Gemma-3-270M, self:int8, k = 4: 2.07x plain decoding against
1.74x with the whole head, the same number of verifies; 16384 tokens verified 14 % more often).

Token cascades keep the whole head: their sure tokens stand unverified, and `lowbit eval --cascade`
prices the cheap model's full distribution.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
from pathlib import Path

import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.paths import lowbit_home

# By default a draft head is restricted where the vocabulary is larger than AUTO_ABOVE, to
# AUTO_SIZE tokens (measured on Gemma-3: 16384 lost acceptance, 65536 read twice the bytes for the
# acceptance of 32768).
AUTO_ABOVE = 65536
AUTO_SIZE = 32768
# The text the frequencies are counted over (a demo name or a file): lowbit's calibration text.
FREQUENCY_TEXT = "wiki-calib"


def check_draft_vocab(setting: int | None) -> None:
    """A one-line UsageError for a setting no vocabulary can take (a negative count)."""
    if setting is not None and setting < 0:
        raise UsageError(f"--draft-vocab {setting}: give a token count (0 = the whole vocabulary)")


def draft_vocab_size(setting: int | None, vocab_size: int) -> int | None:
    """The number of tokens a draft head scores, or None for all of them. setting: None = auto
    (AUTO_SIZE where the vocabulary is larger than AUTO_ABOVE), 0 = all, N = the N most frequent."""
    check_draft_vocab(setting)
    if setting is None:
        return AUTO_SIZE if vocab_size > AUTO_ABOVE else None
    if setting == 0 or setting >= vocab_size:
        return None
    return setting


def _file_key(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _tokenizer_key(tokenizer, model_path: str | Path | None) -> list:
    """What names the tokenizer in the cache key: its tokenizer.json file (path, size, time; cheap),
    else its whole vocabulary (~0.5 s for Gemma-3's 262144 tokens)."""
    if model_path is not None:
        file = Path(model_path) / "tokenizer.json"
        if file.is_file():
            return _file_key(file)
    return sorted(tokenizer.backend.get_vocab().items())


def frequent_tokens(tokenizer, size: int, vocab_size: int, text: str | Path | None = None,
                    model_path: str | Path | None = None) -> torch.Tensor:
    """The `size` token ids most frequent in `text` (FREQUENCY_TEXT by default), the tokenizer's
    end-of-sequence ids always among them, filled up in id order where the text saw fewer; sorted,
    int64. Cached under $LOWBIT_HOME/draft_vocab by tokenizer (model_path's tokenizer.json where
    given), text and size."""
    from lowbit.data.text import load_text, resolve_text_path

    path = resolve_text_path(text or FREQUENCY_TEXT)
    key = hashlib.sha256(json.dumps([_tokenizer_key(tokenizer, model_path), _file_key(path), size,
                                     vocab_size]).encode()).hexdigest()[:24]
    cached = lowbit_home() / "draft_vocab" / f"{key}.json"
    try:
        ids = json.loads(cached.read_text())
        if isinstance(ids, list) and len(ids) == size:
            return torch.tensor(ids, dtype=torch.long)
    except (OSError, ValueError):
        pass  # not cached yet (or a damaged file): count again
    counts = collections.Counter(tokenizer.encode(load_text(path), add_bos=False))
    chosen = [i for i in sorted(tokenizer.eos_ids) if i < vocab_size][:size]
    seen = set(chosen)
    # by count, then (a short text) the lowest ids the text did not use
    for token in itertools.chain((t for t, _ in counts.most_common()), range(vocab_size)):
        if len(chosen) == size:
            break
        if token < vocab_size and token not in seen:
            chosen.append(token)
            seen.add(token)
    ids = sorted(chosen)
    _write_atomic(cached, json.dumps(ids))
    return torch.tensor(ids, dtype=torch.long)


def draft_vocabulary(tokenizer, setting: int | None, vocab_size: int,
                     model_path: str | Path | None = None) -> torch.Tensor | None:
    """The ids a draft head scores (None: all): `setting` as draft_vocab_size reads it. Without the
    frequency text (`lowbit assets` not run) an automatic setting keeps the whole head; one asked
    for by number is an error."""
    size = draft_vocab_size(setting, vocab_size)
    if size is None:
        return None
    try:
        return frequent_tokens(tokenizer, size, vocab_size, model_path=model_path)
    except LowbitError as e:
        if setting is None:
            return None
        raise UsageError(f"--draft-vocab {setting}: {e}") from None


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: count again next time
