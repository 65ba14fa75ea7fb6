"""Tokenizer: tokenizer.json (the `tokenizers` library) plus the facts of tokenizer_config.json.

BOS is added by lowbit, not by the tokenizer's post-processor, so `encode(text, add_bos=...)` means
exactly one BOS or none, as llama.cpp does. Chat templates render with jinja2 in the sandboxed,
trim_blocks/lstrip_blocks environment Hugging Face uses, so prompts match transformers' text.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from lowbit.errors import LowbitError
from lowbit.formats.hf_files import is_gguf_file, read_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    # Rows of the model's embedding (config.json's vocab_size beside tokenizer.json), when known: an
    # id at or past it is a tokenizer that does not belong to the model (or a damaged one), and is
    # refused by `encode` in one line instead of an IndexError inside the embedding lookup.
    model_vocab: int | None = None

    def __init__(self, backend, config: dict[str, Any], chat_template: str | None, extra_eos_ids: list[int]):
        self.backend = backend
        self.special_tokens = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        self.special_tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
        self.bos_id = self._id_of(self.special_tokens.get("bos_token"))
        eos_id = self._id_of(self.special_tokens.get("eos_token"))
        self.eos_ids: set[int] = {i for i in [eos_id, *extra_eos_ids] if i is not None}
        add_bos = config.get("add_bos_token")
        self.add_bos: bool = self.bos_id is not None and (
            bool(add_bos) if add_bos is not None else self._post_processor_adds_bos()
        )
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _post_processor_adds_bos(self) -> bool:
        # No add_bos_token in tokenizer_config: follow what tokenizer.json's post-processor would do.
        with_special = self.backend.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == self.bos_id

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.model_vocab is not None and ids and max(ids) >= self.model_vocab:
            raise LowbitError(f"the tokenizer gives token id {max(ids)} ({self.backend.id_to_token(max(ids))!r}), but the "
                              f"model has only {self.model_vocab} embeddings (config.json vocab_size): tokenizer.json "
                              "does not belong to this model or is damaged")
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise LowbitError("this tokenizer has no chat template (tokenizer_config.json / chat_template.jinja)")
        import jinja2

        variables = {**self.special_tokens, **kwargs}
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise LowbitError(f"chat template failed: {exc}") from None


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change prompts
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialised AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is the chat template
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        template = read_json(path / "chat_template.json", missing={}).get("chat_template")
    return template if isinstance(template, str) else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    path = Path(path).expanduser()
    if path.is_file() and is_gguf_file(path):
        return _gguf_tokenizer(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise LowbitError(f"no tokenizer.json in {path}")
    try:
        backend = Backend.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for bad files
        raise LowbitError(f"cannot read {file}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    config = read_json(path / "tokenizer_config.json", missing={})
    # special_tokens_map.json is the older home of bos/eos; tokenizer_config.json wins where both say.
    for key, value in read_json(path / "special_tokens_map.json", missing={}).items():
        config.setdefault(key, value)
    eos = read_json(path / "generation_config.json", missing={}).get("eos_token_id")
    extra_eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in extra_eos):
        raise LowbitError(f"{path / 'generation_config.json'}: eos_token_id must be a token id or a list of them")
    tokenizer = Tokenizer(backend, config, _chat_template(path, config), extra_eos)
    vocab = read_json(path / "config.json", missing={}).get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        tokenizer.model_vocab = vocab
        if tokenizer.add_bos and tokenizer.bos_id >= vocab:  # callers that build windows insert it themselves
            raise LowbitError(f"{file}: the BOS token has id {tokenizer.bos_id}, but the model has only {vocab} "
                              "embeddings (config.json vocab_size)")
    return tokenizer


def _gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer a GGUF file carries in its metadata, built the way `lowbit convert` writes it, so
    `eval`/`generate`/`serve` take a .gguf directly and tokenize exactly as its converted directory."""
    import tempfile

    from lowbit.formats.gguf_reader import open_gguf
    from lowbit.formats.gguf_tokenizer import end_of_generation_ids, write_tokenizer_files

    gguf = open_gguf(path)
    with tempfile.TemporaryDirectory(prefix="lowbit-gguf-tokenizer-") as tmp:
        write_tokenizer_files(gguf, Path(tmp))
        eos = end_of_generation_ids(gguf)
        (Path(tmp) / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        return load_tokenizer(tmp)
