"""load_tokenizer against transformers' PreTrainedTokenizerFast on the same files."""

from __future__ import annotations

import json

import pytest

from lowbit.errors import LowbitError
from lowbit.runtime.tokenizer import load_tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers like 12345 and 2024 appear in text; so does naïve café.",
    "Hello world! How are you today? I am fine, thank you.",
] * 20

# ChatML with the usual template features: namespace, loop.last, raise_exception, tojson, bos_token.
CHATML = (
    "{{ bos_token }}{% set ns = namespace(system=false) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% if message.get('meta') %}{{ message['meta'] | tojson }}{% endif %}"
    "{% if loop.last and ns.system %}{{ '(with system)' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma-style: whitespace control by trim_blocks / lstrip_blocks and an eos_token reference.
GEMMA_LIKE = """{% for message in messages %}
    {% if message['role'] == 'assistant' %}
        {% set role = 'model' %}
    {% else %}
        {% set role = message['role'] %}
    {% endif %}
<start_of_turn>{{ role }}
{{ message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% else %}{{ eos_token }}{% endif %}
"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2+2? Ünïcode ok  "},
    {"role": "assistant", "content": "4", "meta": {"note": "café <b>", "n": [1, 2]}},
    {"role": "user", "content": "And 3+3?"},
]


def _write_tokenizer(path, config: dict, post_bos: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return path


def _hf(path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


@pytest.mark.parametrize("add_bos", [True, False])
def test_encode_decode_and_bos(tmp_path, add_bos):
    path = _write_tokenizer(tmp_path / "tok", {"add_bos_token": add_bos})
    ours, hf = load_tokenizer(path), _hf(path)
    text = "The lazy fox counts 12345 cafés!"
    plain = hf.encode(text, add_special_tokens=False)
    assert ours.bos_id == hf.convert_tokens_to_ids("<s>") and ours.add_bos is add_bos
    assert ours.encode(text) == ([ours.bos_id] if add_bos else []) + plain
    assert ours.encode(text, add_bos=False) == plain
    assert ours.encode(text, add_bos=True) == [ours.bos_id] + plain
    assert ours.decode(plain) == hf.decode(plain) == text
    assert ours.decode(ours.encode(text, add_bos=True), skip_special_tokens=True) == text


def test_add_bos_follows_post_processor_without_config_flag(tmp_path):
    assert load_tokenizer(_write_tokenizer(tmp_path / "a", {}, post_bos=True)).add_bos is True
    assert load_tokenizer(_write_tokenizer(tmp_path / "b", {}, post_bos=False)).add_bos is False


def test_eos_ids_include_generation_config(tmp_path):
    path = _write_tokenizer(tmp_path / "tok", {})
    ours = load_tokenizer(path)
    eos = ours.backend.token_to_id("</s>")
    assert ours.eos_ids == {eos}
    im_end = ours.backend.token_to_id("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, im_end]}))
    assert load_tokenizer(path).eos_ids == {eos, im_end}


@pytest.mark.parametrize("template", [CHATML, GEMMA_LIKE], ids=["chatml", "gemma-like"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(tmp_path, template, generation_prompt):
    path = _write_tokenizer(tmp_path / "tok", {"chat_template": template})
    expected = _hf(path).apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
    got = load_tokenizer(path).apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt)
    assert got == expected
    assert "<|im_start|>" in got or "<start_of_turn>" in got


def test_chat_template_file_as_transformers5_saves_it(tmp_path):
    path = _write_tokenizer(tmp_path / "tok", {})
    (path / "chat_template.jinja").write_text(CHATML)
    got = load_tokenizer(path).apply_chat_template(MESSAGES[:2])
    assert got == _hf(path).apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)


def test_chat_template_raise_exception_is_lowbit_error(tmp_path):
    path = _write_tokenizer(tmp_path / "tok", {"chat_template": CHATML})
    with pytest.raises(LowbitError, match="unknown role tool"):
        load_tokenizer(path).apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_template_and_tokenizer(tmp_path):
    path = _write_tokenizer(tmp_path / "tok", {})
    with pytest.raises(LowbitError, match="no chat template"):
        load_tokenizer(path).apply_chat_template(MESSAGES)
    with pytest.raises(LowbitError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.demo
@pytest.mark.parametrize("fixture,add_bos", [("smollm2_dir", False), ("gemma3_dir", True)])
def test_demo_tokenizers_match_transformers(fixture, add_bos, request):
    from transformers import AutoTokenizer

    path = request.getfixturevalue(fixture)
    ours, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    text = "In 1889, the 300-metre tower opened; it was the world's tallest structure until 1930."
    assert ours.add_bos is add_bos
    assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False)
    if ours.chat_template is None:  # the Gemma-3 GGUF carries no template
        assert not hf.chat_template
        return
    messages = [{"role": "user", "content": "Hello!"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
