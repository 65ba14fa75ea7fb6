"""Structured output: a JSON Schema the generated text must match, enforced by masking logits.

The grammar library is llguidance (see docs/serve.md, "Structured output", for why). Per request:
the schema becomes a grammar and is compiled ONCE into a pristine matcher, cached by schema text
(an LRU of COMPILED_CACHE entries), and each sequence gets a copy of it. Per step, the masks of
all the guided rows of the batch are computed together (llguidance's executor, GIL released),
unpacked from its bitmask into one bool[rows, V] tensor, and applied by the sampler in one op;
unguided rows are untouched. Each accepted token advances the sequence's matcher; when the
grammar can take nothing more (the JSON value closed), the sequence finishes with "stop".

Guided sequences are not drafted by the speculative drafter (the engine skips them), so every
token they emit is drawn from the masked distribution.

llguidance's tokenizer is built from the token byte strings of lowbit's own tokenizer
(`token_bytes`): byte-level BPE (GPT-2's byte alphabet) and SentencePiece-style vocabularies
('▁' for space, <0xNN> byte fallback) are both read from tokenizer.json.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from lowbit.errors import UsageError

COMPILED_CACHE = 64  # distinct schemas kept compiled
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object
# Whitespace between JSON tokens is allowed (models write `{"a": 1}` or indented JSON), but at most
# a few characters of it per gap: an unbounded run would let a weak model loop on spaces forever.
JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,8}"}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise UsageError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


def schema_text(schema: Any) -> str:
    """A JSON Schema (dict or JSON text) as the JSON text that keys the compiled-grammar cache."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise UsageError(f"the JSON schema is not valid JSON: {exc}") from None
        except RecursionError:
            raise UsageError("the JSON schema is nested too deeply") from None
    if schema is True:
        schema = {}  # the schema that every value matches
    if schema is False:
        raise UsageError("the JSON schema false matches no value")
    if not isinstance(schema, dict):
        raise UsageError("a JSON schema must be an object (or true)")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        raise UsageError("the JSON schema is nested too deeply") from None


def _grammar(schema: str) -> str:
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise UsageError(f"invalid JSON schema: {_first_line(exc)}") from None


def check_schema(schema: str) -> None:
    """UsageError naming the problem when llguidance cannot compile the schema (no tokenizer needed)."""
    error = _llguidance().LLMatcher.validate_grammar(_grammar(schema))
    if error:
        raise UsageError(f"unsupported or invalid JSON schema: {_first_line(error)}")


def _first_line(error) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 200 else text[:197] + "..."


# -- tokenizer adapter --------------------------------------------------------------------------
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _uses_byte_level(backend) -> bool:
    """Whether tokenizer.json's decoder or pre-tokenizer is (or contains) ByteLevel."""
    def has(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    # each component's own JSON: parsing the whole tokenizer.json would cost ~0.5 s on a 49k vocabulary
    parts = [json.loads(c.__getstate__()) for c in (backend.decoder, backend.pre_tokenizer) if c is not None]
    return has(parts)


def token_bytes(tokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """(the bytes of each token id below vocab_size, the ids of special tokens) from a lowbit
    Tokenizer. Ids the tokenizer lacks (padded embedding rows) are empty, so never allowed."""
    backend = tokenizer.backend
    byte_level = _uses_byte_level(backend)
    alphabet = _byte_level_alphabet()
    to_latin1 = str.maketrans({ch: chr(b) for ch, b in alphabet.items()})  # then byte b = latin-1 char b
    tokens = [b""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size:
            continue
        if byte_level and all(ch in alphabet for ch in text):
            tokens[i] = text.translate(to_latin1).encode("latin-1")
        elif not byte_level and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            tokens[i] = bytes([int(text[3:5], 16)])  # SentencePiece byte fallback
        else:
            tokens[i] = text.replace("▁", " ").encode("utf-8") if not byte_level else text.encode("utf-8")
    special = []
    for i, added in backend.get_added_tokens_decoder().items():
        if i < vocab_size:
            tokens[i] = added.content.encode("utf-8")  # added tokens are literal text, not byte-mapped
            if added.special:
                special.append(i)
    return tokens, sorted(special)


class _Wrapper:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads (tokens as bytes, an encoder)."""

    def __init__(self, tokenizer, tokens: list[bytes], special: list[int], eos: int):
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokens
        self.special_token_ids = special
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False)


# -- per-request state --------------------------------------------------------------------------
class GuidedDecoding:
    """The engine's structured-output state: compiled grammars by schema, a matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        llg = _llguidance()
        self.vocab_size = vocab_size
        tokens, special = token_bytes(tokenizer, vocab_size)
        eos = sorted(i for i in eos_ids if i < vocab_size)
        if not eos:
            raise UsageError("structured output needs an end-of-sequence token, and this tokenizer has none")
        self.eos_ids = eos
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper(tokenizer, tokens, special, eos[0])),
                                         n_vocab=vocab_size, eos_token=eos)
        self.executor = llg.LLExecutor(num_threads=1)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.matchers: dict[str, Any] = {}  # request id -> LLMatcher

    def _compile(self, schema: str):
        matcher = self._compiled.get(schema)
        if matcher is not None:
            self._compiled.move_to_end(schema)
            return matcher
        matcher = _llguidance().LLMatcher(self.tokenizer, _grammar(schema), log_level=0)
        if matcher.is_error():
            raise UsageError(f"unsupported or invalid JSON schema: {_first_line(matcher.get_error())}")
        self._compiled[schema] = matcher
        if len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return matcher

    def start(self, schema: str):
        """A fresh matcher for one sequence (the schema compiled once, then copied)."""
        return self._compile(schema_text(schema)).deep_copy()

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def advance(self, request_id: str, token_id: int) -> bool:
        """Feed one accepted token; True when the output is complete: the grammar can take
        nothing more (the JSON value closed), or it refused the token."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        # A refusal cannot follow a masked draw; ending the sequence beats stopping the engine.
        return not matcher.consume_token(token_id) or matcher.is_stopped()

    def allowed(self, seqs, width: int) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bool[len(rows), width]) for the guided sequences among seqs; None when none is."""
        rows = [i for i, s in enumerate(seqs) if s.request_id in self.matchers]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr(
            [(self.matchers[seqs[i].request_id], j) for j, i in enumerate(rows)],
            bitmask.data_ptr(), words * 4, len(rows))
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        mask = bits.reshape(len(rows), words * 32)[:, : self.vocab_size].bool()
        if width > self.vocab_size:  # logits wider than the vocabulary: the extra ids are never allowed
            mask = torch.nn.functional.pad(mask, (0, width - self.vocab_size))
        mask = mask[:, :width]
        empty = ~mask.any(dim=-1)
        if bool(empty.any()):  # a matcher in an error state allows nothing: let it end instead of NaN
            mask[empty, self.eos_ids[0]] = True
        return rows, mask
