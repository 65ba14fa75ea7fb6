"""Build a `tokenizers` tokenizer.json from a GGUF vocabulary that tokenizes exactly as llama.cpp.

Two vocabulary kinds are handled:
- `gpt2`: byte-level BPE with the merges stored in the file, split first by the regexes
  llama.cpp applies for the file's `tokenizer.ggml.pre` (e.g. `smollm` isolates every digit);
- `llama`: SentencePiece-style BPE with scores. llama.cpp repeatedly merges the adjacent pair
  whose concatenation is the highest-scoring vocabulary entry; ranking every (left, right)
  pair of vocabulary pieces by that score gives a BPE merge list that does the same.
Control and user-defined tokens become added tokens matched in the raw text, as llama.cpp's
special-token partition does before its tokenizer runs.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from lowbit.errors import LowbitError
from lowbit.formats.gguf_reader import GGUFFile, printable

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre → (regexes applied in order, ignore_merges), as in llama.cpp's llama-vocab.cpp.
_PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False),
    "gpt2": ([_GPT2], False),
    "mpt": ([_GPT2], False),
    "olmo": ([_GPT2], False),
    "smollm": ([r"\p{N}", _GPT2], False),
    "starcoder": ([r"\p{N}", _GPT2], False),
    "refact": ([r"\p{N}", _GPT2], False),
    "codeshell": ([r"\p{N}", _GPT2], False),
    "llama3": ([_LLAMA3], True),
    "llama-v3": ([_LLAMA3], True),
    "llama-bpe": ([_LLAMA3], True),
    "dbrx": ([_LLAMA3], False),
    "smaug-bpe": ([_LLAMA3], False),
    "qwen2": ([_QWEN2], False),
    "stablelm2": ([_QWEN2], False),
}

# Token texts llama.cpp treats as end of generation besides the declared EOS.
_END_OF_TURN = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "_<EOT>",
}


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.string_array("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise LowbitError(f"{gguf.path.name} has no tokenizer in its metadata")
    types = _token_types(gguf, len(tokens))
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        _special_id(gguf, key, len(tokens))
    try:
        if kind == "gpt2":
            tokenizer = _byte_level_bpe(gguf, tokens)
        elif kind == "llama":
            tokenizer = _sentencepiece_bpe(gguf, tokens, types)
        else:
            raise LowbitError(f"{gguf.path.name} uses tokenizer '{printable(str(kind))}'; lowbit imports only 'gpt2' and 'llama' vocabularies")
    except LowbitError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for an inconsistent vocabulary
        raise LowbitError(f"{gguf.path.name}: its vocabulary does not make a tokenizer: "
                          f"{printable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, 200)}") from None
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] != USER_DEFINED, normalized=False)
            for i in range(len(tokens))
            if types[i] in (CONTROL, USER_DEFINED, UNKNOWN)
        ]
    )
    tokenizer.post_processor = _post_processor(gguf, tokens, kind)
    return tokenizer


def _token_types(gguf: GGUFFile, n: int) -> list[int]:
    types = gguf.numeric_array("tokenizer.ggml.token_type")
    if types is not None and len(types) != n:
        raise LowbitError(f"{gguf.path.name}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    return [NORMAL] * n if types is None else [int(t) for t in types]


def _special_id(gguf: GGUFFile, key: str, n: int) -> int | None:
    """A special token id of the metadata, which must name one of the n tokens (None when absent)."""
    value = gguf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < n:
        raise LowbitError(f"{gguf.path.name}: {key} {printable(str(value), 40)} is not a token id (the vocabulary has {n})")
    return value


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZERS:
        raise LowbitError(
            f"{gguf.path.name} uses pre-tokenizer '{printable(str(pre))}', which lowbit does not know "
            f"(known: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    regexes, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in gguf.string_array("tokenizer.ggml.merges")]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise LowbitError(f"{gguf.path.name}: tokenizer.ggml.merges holds {printable(bad[0], 40)!r}, not two tokens split by a space")
    tokenizer = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = gguf.numeric_array("tokenizer.ggml.scores")
    if scores is None:
        raise LowbitError(f"{gguf.path.name} has a 'llama' vocabulary without tokenizer.ggml.scores")
    vocab = _vocab(tokens)
    unk_id = _special_id(gguf, "tokenizer.ggml.unknown_token_id", len(tokens)) or 0
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(tokens, [float(s) for s in scores], vocab),
            unk_token=tokens[unk_id],
            fuse_unk=True,
            byte_fallback=any(t == BYTE for t in types),
        )
    )
    add_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    steps = ([normalizers.Prepend("▁")] if add_prefix else []) + [normalizers.Replace(" ", "▁")]
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a vocabulary piece into two vocabulary pieces, best-scoring result first."""
    ranked = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_bos(gguf: GGUFFile, kind: str) -> bool:
    default = kind == "llama" or gguf.get("tokenizer.ggml.pre") in ("llama3", "llama-v3", "llama-bpe")
    return bool(gguf.get("tokenizer.ggml.add_bos_token", default))


def _add_eos(gguf: GGUFFile) -> bool:
    return bool(gguf.get("tokenizer.ggml.add_eos_token", False))


def _post_processor(gguf: GGUFFile, tokens: list[str], kind: str) -> Any:
    bos_id, eos_id = gguf.get("tokenizer.ggml.bos_token_id"), gguf.get("tokenizer.ggml.eos_token_id")
    add_bos = _add_bos(gguf, kind) and bos_id is not None
    add_eos = _add_eos(gguf) and eos_id is not None
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False) if kind == "gpt2" else None
    bos = f"{tokens[bos_id]}:0 " if add_bos else ""
    eos = f" {tokens[eos_id]}:0" if add_eos else ""
    special = ([(tokens[bos_id], int(bos_id))] if add_bos else []) + ([(tokens[eos_id], int(eos_id))] if add_eos else [])
    return processors.TemplateProcessing(
        single=f"{bos}$A:0{eos}",
        pair=f"{bos}$A:0{eos} {bos.replace(':0', ':1')}$B:1{eos.replace(':0', ':1')}",
        special_tokens=list(dict.fromkeys(special)),
    )


def end_of_generation_ids(gguf: GGUFFile) -> list[int]:
    """EOS first, then the end-of-turn tokens llama.cpp also stops on."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if gguf.has(key):
            ids.append(int(gguf.get(key)))
    tokens = gguf.string_array("tokenizer.ggml.tokens")
    types = _token_types(gguf, len(tokens))
    ids += [i for i, tok in enumerate(tokens) if tok in _END_OF_TURN and types[i] in (CONTROL, USER_DEFINED)]
    return list(dict.fromkeys(ids))


def _token_text(gguf: GGUFFile, tokens: list[str], key: str) -> str | None:
    token_id = gguf.get(key)
    return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None


def write_tokenizer_files(gguf: GGUFFile, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, add_bos_token, chat template)."""
    tokenizer = build_tokenizer(gguf)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokens = gguf.string_array("tokenizer.ggml.tokens")
    kind = gguf.get("tokenizer.ggml.model")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos(gguf, kind),
        "add_eos_token": _add_eos(gguf),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.arch_get("context_length", 2048)),
    }
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        text = _token_text(gguf, tokens, key)
        if text is not None:
            config[name] = text
    template = gguf.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
