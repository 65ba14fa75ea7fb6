"""Structured output in the engine: the tokenizer adapter's bytes, masks only on guided rows, and
random tiny models that emit text which always parses and validates against the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lowbit.errors import UsageError
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.guided import (
    GuidedDecoding,
    check_schema,
    schema_text,
    token_bytes,
)
from lowbit.runtime.engine.sequence import SamplingParams, Sequence

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(engine_llama_dir):
    return Engine(engine_llama_dir, kv_memory=4 << 20)


def test_token_bytes_round_trip_byte_level(engine):
    tokens, _ = token_bytes(engine.tokenizer, engine.config.vocab_size)
    text = 'Grüße {"a": [1, 2]}\n\t€'
    ids = engine.tokenizer.encode(text, add_bos=False)
    assert b"".join(tokens[i] for i in ids) == text.encode("utf-8")


def test_token_bytes_round_trip_sentencepiece_style(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    from lowbit.runtime.tokenizer import load_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "▁a", "{", "}", '"', ":"]:
        vocab.setdefault(piece, len(vocab))
    tok = Backend(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    lowbit_tok = load_tokenizer(tmp_path)
    tokens, special = token_bytes(lowbit_tok, len(vocab) + 5)  # padded embedding rows stay empty
    text = ' a{"b": é}'
    ids = lowbit_tok.encode(text, add_bos=False)
    assert any(3 <= i < 259 for i in ids)  # é went through byte fallback
    assert b"".join(tokens[i] for i in ids) == text.encode("utf-8")
    assert special == [1, 2] and tokens[-1] == b""


def test_masks_only_guided_rows(engine):
    guided = GuidedDecoding(engine.tokenizer, engine.config.vocab_size, {2})
    seqs = [Sequence("plain", [40]), Sequence("json", [40]), Sequence("plain2", [41])]
    guided.matchers["json"] = guided.start(schema_text(SCHEMA))
    rows, mask = guided.allowed(seqs, engine.config.vocab_size)
    assert rows == [1] and mask.shape == (1, engine.config.vocab_size)
    allowed = [engine.tokenizer.decode([i]) for i in mask[0].nonzero().flatten().tolist()]
    assert "{" in allowed and "a" not in allowed and len(allowed) < 10  # a JSON object starts with { or space
    # the compiled grammar is cached by schema: a second request copies it
    assert guided.start(schema_text(SCHEMA)) is not guided.start(schema_text(SCHEMA))
    assert len(guided._compiled) == 1


def test_random_model_output_validates(engine, engine_llama_dir):
    prompts = [[40, 41, 42], [70, 71, 72, 73], [100, 101], [5, 6, 7, 8, 9]]
    # A random model loves whitespace: the grammar allows at most 8 characters of it per gap, so the
    # greedy row still closes (in ~210 tokens); the others push whitespace down with logit_bias.
    fewer_spaces = {9: -4.0, 10: -4.0, 13: -4.0, 32: -4.0}  # byte tokenizer: id = byte
    params = [
        SamplingParams(temperature=0, max_tokens=300, guided_json=json.dumps(SCHEMA)),
        SamplingParams(temperature=1.0, seed=7, max_tokens=160, guided_json=json.dumps(SCHEMA), logit_bias=fewer_spaces),
        SamplingParams(temperature=0, max_tokens=12),  # an unguided neighbour in the same batches
        SamplingParams(temperature=0.7, seed=3, max_tokens=160, guided_json='{"type": "object"}',
                       logit_bias=fewer_spaces, frequency_penalty=0.5),
    ]
    out = engine.generate(prompts, params)
    for c, p in zip(out, params):
        if p.guided_json is None:
            continue
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        jsonschema.validate(value, json.loads(p.guided_json))
    alone = engine.generate([prompts[2]], params[2])[0]
    assert out[2].token_ids == alone.token_ids  # the unguided row is untouched by its guided neighbours
    # a speculative engine does not draft guided sequences, and gives the same greedy output
    spec = Engine(engine_llama_dir, kv_memory=4 << 20, draft="ngram")
    again = spec.generate(prompts[:1], params[:1])[0]
    assert again.token_ids == out[0].token_ids and spec.stats().spec_draft_tokens == 0


def test_cut_by_max_tokens_is_length(engine):
    c = engine.generate([[40, 41]], SamplingParams(temperature=0, max_tokens=3, guided_json=json.dumps(SCHEMA)))[0]
    assert c.finish_reason == "length" and c.text.startswith("{")


@pytest.mark.parametrize("schema, message", [
    ({"type": "frobnicate"}, "Invalid type"),
    ({"type": "object", "if": {}}, "Unimplemented keys"),
    ({"type": "string", "pattern": "("}, "regex"),
    ({"$ref": "#/nowhere"}, "does not exist"),
    (False, "matches no value"),
])
def test_bad_schemas_are_refused(engine, schema, message):
    with pytest.raises(UsageError, match=message):
        check_schema(schema_text(schema))
    with pytest.raises(UsageError, match=message):
        engine.add_request("bad", [40], SamplingParams(guided_json=json.dumps(schema)))
    assert not engine.has_unfinished_requests()


def test_matcher_is_forgotten_when_finished_or_aborted(engine):
    engine.add_request("a", [40, 41], SamplingParams(max_tokens=50, guided_json=json.dumps(SCHEMA)))
    engine.add_request("b", [40, 42], SamplingParams(max_tokens=50, guided_json=json.dumps(SCHEMA)))
    engine.step()
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.guided.matchers == {}
