"""Tiny random checkpoints WITH a byte-level tokenizer, so the engine (which detokenizes) can run them.

Token id i is byte i (GPT-2's byte-to-unicode alphabet, no merges), so any text encodes and
stop strings work; ids 1 and 2 are BOS and EOS as in the tiny configs.
"""

from __future__ import annotations

import json

import pytest

from tests.runtime.conftest import _gemma3_config, _llama_config, build_hf, randomize_


def byte_tokenizer_json() -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    order = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(order)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return json.loads(tok.to_str())


def _byte_of(ch: str) -> int:
    # GPT-2's map: printable latin-1 bytes map to themselves, the rest to 256 + n in order.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


def save_with_tokenizer(model, path) -> None:
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "ā", "eos_token": "Ă", "add_bos_token": False}))


@pytest.fixture(scope="session")
def engine_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_llama")
    save_with_tokenizer(build_hf(_llama_config()), path)
    return path


@pytest.fixture(scope="session")
def engine_llama_draft_dir(tmp_path_factory):
    """A different, smaller model with the same tokenizer: a draft that often disagrees."""
    path = tmp_path_factory.mktemp("engine_llama_draft")
    model = build_hf(_llama_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    randomize_(model, seed=1)
    save_with_tokenizer(model, path)
    return path


@pytest.fixture(scope="session")
def engine_gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_gemma3")
    save_with_tokenizer(build_hf(_gemma3_config()), path)
    return path


CHI2_3DOF_P001 = 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def assert_speculative_sampling_keeps_distribution(engine, prompt: list[int], top_k: int, requests: int) -> list:
    """Many seeded top-k requests through the engine's draft: the rank of each token a verify pass
    emitted (tokens 2 and 3 of each) under the exact target distribution (recomputed without
    cache) must follow that distribution (chi-square, 3 degrees of freedom, p = 0.001)."""
    import torch

    from lowbit.runtime.engine.sampler import process_logits
    from lowbit.runtime.engine.sequence import SamplingParams

    params = [SamplingParams(temperature=1.0, top_k=top_k, seed=i, max_tokens=3, ignore_eos=True) for i in range(requests)]
    completions = engine.generate([prompt] * len(params), params)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # both accept and reject paths ran
    observed = torch.zeros(top_k)
    expected = torch.zeros(top_k, dtype=torch.float64)
    with torch.inference_mode():
        for c in completions:
            ids = prompt + c.token_ids
            logits = engine.model(torch.tensor([ids]))[0]
            for pos in (len(prompt) + 1, len(prompt) + 2):  # tokens 2 and 3 come from verify passes
                probs = process_logits(logits[pos - 1 : pos], [params[0]], [[]]).softmax(-1)[0].double()
                ranked = probs.argsort(descending=True)
                rank = int((ranked == ids[pos]).nonzero())
                assert rank < top_k  # never a token the target gives zero probability
                observed[rank] += 1
                expected += probs[ranked[:top_k]]
    chi2 = float(((observed.double() - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_3DOF_P001, (observed.tolist(), expected.tolist(), chi2)
    return completions
