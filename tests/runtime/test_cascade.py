"""runtime/cascade.py: a position takes the cheap model's logits when its confidence is strictly
above the threshold, else the full model's; threshold 1.0 is the full model bit for bit (eval and
decode), 0.0 the cheap model; when the full model answers after a run of cheap tokens, it has
caught up on every one of them (its logits equal a from-scratch forward over the whole sequence)."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.errors import UsageError
from lowbit.runtime.cascade import CascadeLM, CascadeSettings, load_cheap_model
from lowbit.runtime.early_exit import confidence_of
from lowbit.runtime.loader import load_model
from lowbit.runtime.tokenizer import load_tokenizer
from tests.runtime.cascade_reference import CascadeDecoder
from tests.runtime.conftest import _llama_config, build_hf, randomize_
from tests.runtime.engine.conftest import save_with_tokenizer

IDS = torch.tensor([[3 + (i * 37) % 200 for i in range(40)]])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    full = tmp_path_factory.mktemp("cascade_full")
    save_with_tokenizer(build_hf(_llama_config(num_hidden_layers=3)), full)
    cheap = tmp_path_factory.mktemp("cascade_cheap")
    model = build_hf(_llama_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    randomize_(model, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked distributions, so confidences spread over (0, 1)
    save_with_tokenizer(model, cheap)
    return full, cheap


@pytest.fixture(scope="module")
def pair(dirs):
    return load_model(dirs[0], torch.float32, "cpu"), load_model(dirs[1], torch.float32, "cpu")


def _median_confidence(cheap) -> float:
    with torch.no_grad():
        return float(confidence_of(cheap(IDS).float(), "top1").median())


def test_eval_rows_take_the_cheap_model_where_it_is_confident(pair):
    full, cheap = pair
    with torch.no_grad():
        f, c = full(IDS).float(), cheap(IDS).float()
    assert torch.equal(CascadeLM(full, cheap, CascadeSettings(1.0))(IDS), f)
    assert torch.equal(CascadeLM(full, cheap, CascadeSettings(0.0))(IDS), c)
    t = _median_confidence(cheap)
    lm = CascadeLM(full, cheap, CascadeSettings(t))
    out = lm(IDS)
    take = confidence_of(c, "top1") > t
    assert 0 < int(take.sum()) < take.numel()
    assert torch.equal(out[take], c[take]) and torch.equal(out[~take], f[~take])
    assert lm.stats.cheap == int(take[0, :-1].sum()) and lm.stats.cheap + lm.stats.full == IDS.shape[1] - 1
    assert torch.equal(lm.last[2], f)  # the KLD base: the same forward's full-model logits


def _decode(full, cheap, threshold, steps=24):
    dec = CascadeDecoder(full, cheap, CascadeSettings(threshold), 64)
    prompt = IDS[0, :9].tolist()
    logits = [dec.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(dec.step(tokens[-1]))
    return dec, tokens, logits


def test_decode_threshold_one_is_the_full_model_and_zero_the_cheap_model(pair):
    full, cheap = pair
    dec, tokens, logits = _decode(full, cheap, 1.0)
    with torch.no_grad():
        ref = full(torch.tensor([tokens])).float()[0, 8:]
    assert [int(x.argmax()) for x in logits] == [int(x.argmax()) for x in ref]
    torch.testing.assert_close(torch.stack(logits), ref, rtol=1e-4, atol=1e-4)
    assert dec.stats.cheap == 0 and dec.stats.full == 24
    dec, tokens, logits = _decode(full, cheap, 0.0)
    with torch.no_grad():
        ref = cheap(torch.tensor([tokens])).float()[0, 9:]
    torch.testing.assert_close(torch.stack(logits[1:]), ref, rtol=1e-4, atol=1e-4)
    assert dec.stats.full == 0 and dec.full_cache.length == 9  # the full model never ran after the prompt


def test_the_full_model_catches_up_on_the_cheap_tokens(pair):
    full, cheap = pair
    dec, tokens, logits = _decode(full, cheap, _median_confidence(cheap))
    assert dec.stats.cheap > 0 and dec.stats.full > 0
    with torch.no_grad():
        f = full(torch.tensor([tokens])).float()[0]
        c = cheap(torch.tensor([tokens])).float()[0]
    from_full = 0
    for i, step_logits in enumerate(logits[1:], start=9):  # the logits after token i
        if torch.allclose(step_logits, f[i], rtol=1e-4, atol=1e-4):
            from_full += 1
        else:
            torch.testing.assert_close(step_logits, c[i], rtol=1e-4, atol=1e-4)
    assert from_full == dec.stats.full
    assert dec.full_cache.length + len(dec.unseen) == len(tokens)


def test_bad_settings_and_cheap_models(dirs, tmp_path):
    with pytest.raises(UsageError, match=r"--cascade-threshold must be in \[0, 1\], got 1.5"):
        CascadeSettings(1.5)
    with pytest.raises(UsageError, match="--exit-confidence must be one of"):
        CascadeSettings(0.5, "entropy")
    tok = load_tokenizer(dirs[0])
    with pytest.raises(UsageError, match="the model's own early layers are --early-exit"):
        load_cheap_model("self:layers=2", dirs[0], tok, torch.float32, "cpu")
    other = tmp_path / "other"
    build_hf(_llama_config(num_hidden_layers=1)).save_pretrained(other)
    spec = json.loads((dirs[0] / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["zz"] = vocab.pop(next(iter(vocab)))  # one token spelled differently
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UsageError, match="--cascade model .* does not share the target's tokenizer"):
        load_cheap_model(str(other), dirs[0], tok, torch.float32, "cpu")
    from lowbit.runtime.engine.engine import Engine

    with pytest.raises(UsageError, match="--cascade model .* does not share the target's tokenizer"):
        Engine(dirs[0], kv_memory=4 << 20, draft=str(other), cascade=CascadeSettings(0.5))  # generate's path
