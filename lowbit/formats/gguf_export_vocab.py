"""A checkpoint's tokenizer.json written as a GGUF vocabulary llama.cpp tokenizes the same way.

Two kinds, the two llama.cpp reads most:
- byte-level BPE (SmolLM2, Llama-3, Qwen) → `gpt2`: tokens, types and the merges as they are, plus
  the name of the pre-tokenizer whose regexes match (`default` with a note when none does);
- SentencePiece-style BPE with byte fallback (Gemma, Llama-2, Mistral) → `llama`: tokens, types and
  a score per piece. llama.cpp merges the adjacent pair whose result scores highest, so a piece's
  score is minus the rank of the first merge that makes it: the same order as the merge list
  (lowbit's GGUF import rebuilds exactly that merge list from these scores).
A GGUF source's vocabulary is copied key by key instead (gguf_export._copy_gguf_tokenizer).
"""

from __future__ import annotations

import json
import re

from lowbit.errors import LowbitError
from lowbit.formats.checkpoint import Checkpoint
from lowbit.formats.gguf_tokenizer import _PRE_TOKENIZERS
from lowbit.formats.hf_files import read_json

# llama.cpp pre-tokenizer names lowbit can recognise from a tokenizer.json, in preference order
_PRE_ORDER = ("smollm", "gpt2", "llama-bpe", "qwen2", "default")
_BYTE_PIECE = re.compile(r"^<0x[0-9A-F]{2}>$")
# a piece made by no merge (single characters, bytes, specials) scores below every merged piece
_UNMERGED_SCORE = -1e9


def write_vocabulary(writer, ckpt: Checkpoint, vocab_size: int) -> list[str]:
    """Write the tokenizer keys; returns notes for what could not be carried over."""
    src = ckpt.source_dir
    path = src / "tokenizer.json" if src else None
    if path is None or not path.is_file():
        return ["no tokenizer.json next to the weights: the GGUF has no vocabulary (llama.cpp will refuse it)"]
    tok = json.loads(path.read_text(encoding="utf-8"))
    model = tok.get("model", {})
    if model.get("type") == "BPE" and any(p.get("type") == "ByteLevel" for p in _flat_pre(tok)):
        tokens, notes = _byte_level(writer, tok, vocab_size)
    elif model.get("type") == "BPE" and model.get("byte_fallback"):
        tokens, notes = _sentencepiece(writer, tok, vocab_size)
    else:
        raise LowbitError(f"{path}: GGUF export writes byte-level BPE and SentencePiece-style BPE (byte fallback) "
                          f"vocabularies, not {model.get('type')}")
    return notes + _write_special(writer, ckpt, tokens)


def _pieces(tok: dict, vocab_size: int, byte_pieces: bool) -> tuple[list[str], list[int]]:
    """Tokens by id (holes filled as [PADn]) and their llama.cpp token types; with `byte_pieces`,
    SentencePiece's <0xNN> byte-fallback pieces are typed BYTE."""
    from gguf import TokenType as T

    tokens: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    types = {i: (T.BYTE if byte_pieces and _BYTE_PIECE.match(t) else T.NORMAL) for i, t in tokens.items()}
    for added in tok.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = T.CONTROL if added.get("special") else T.USER_DEFINED
    size = max(vocab_size, max(tokens) + 1)
    return [tokens.get(i, f"[PAD{i}]") for i in range(size)], [int(types.get(i, T.UNUSED)) for i in range(size)]


def _byte_level(writer, tok: dict, vocab_size: int) -> tuple[list[str], list[str]]:
    token_list, type_list = _pieces(tok, vocab_size, byte_pieces=False)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    pre, note = _detect_pre(tok)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(token_list)
    writer.add_token_types(type_list)
    writer.add_token_merges(merges)
    return token_list, [note] if note else []


def _sentencepiece(writer, tok: dict, vocab_size: int) -> tuple[list[str], list[str]]:
    token_list, type_list = _pieces(tok, vocab_size, byte_pieces=True)
    ids = {t: i for i, t in enumerate(token_list)}
    scores = [_UNMERGED_SCORE] * len(token_list)
    for rank, merge in enumerate(tok["model"].get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        piece = ids.get(left + right)
        if piece is not None and scores[piece] == _UNMERGED_SCORE:
            scores[piece] = -float(rank)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(token_list)
    writer.add_token_scores(scores)
    writer.add_token_types(type_list)
    # llama.cpp prepends "▁" to the text unless told not to; the tokenizer.json says by its normalizer
    normalizer = tok.get("normalizer") or {}
    steps = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    writer.add_add_space_prefix(any(s.get("type") == "Prepend" for s in steps))
    return token_list, []


def _write_special(writer, ckpt: Checkpoint, tokens: list[str]) -> list[str]:
    """bos/eos/unk/pad ids, add_bos/add_eos and the chat template, from the tokenizer's config files."""
    src = ckpt.source_dir
    tconf = read_json(src / "tokenizer_config.json", missing={})
    gen = read_json(src / "generation_config.json", missing={})
    ids = {t: i for i, t in enumerate(tokens)}
    for key, adder in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                       ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        text = tconf.get(key)
        if isinstance(text, dict):
            text = text.get("content")
        token_id = ids.get(text) if text is not None else None
        if token_id is None and key == "bos_token":
            token_id = ckpt.config.get("bos_token_id", gen.get("bos_token_id"))
        if token_id is None and key == "eos_token":
            eos = ckpt.config.get("eos_token_id", gen.get("eos_token_id"))
            token_id = eos[0] if isinstance(eos, list) else eos
        if token_id is not None:
            adder(int(token_id))
    writer.add_add_bos_token(bool(tconf.get("add_bos_token", False)))
    writer.add_add_eos_token(bool(tconf.get("add_eos_token", False)))
    template = tconf.get("chat_template")
    if template is None and src is not None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)
        return []
    return ["no chat template found: the GGUF has none"]


def _detect_pre(tokenizer: dict) -> tuple[str, str | None]:
    items = _flat_pre(tokenizer)
    regexes = [p["pattern"]["Regex"] for p in items if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]
    byte_level = [p for p in items if p.get("type") == "ByteLevel"]
    digits = [p for p in items if p.get("type") == "Digits"]
    if byte_level and byte_level[0].get("use_regex", True) and not regexes:
        regexes = ([r"\p{N}"] if digits and digits[0].get("individual_digits") else []) + [_PRE_TOKENIZERS["gpt2"][0][0]]
    for name in _PRE_ORDER:
        if _PRE_TOKENIZERS[name][0] == regexes:
            return name, None
    return "default", "the tokenizer's pre-tokenizer matches none llama.cpp names; wrote 'default'"


def _flat_pre(tok: dict) -> list[dict]:
    pre = tok.get("pre_tokenizer") or {}
    return pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
