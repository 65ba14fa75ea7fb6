"""runtime/early_exit.py: exit logits are the model's own norm + head on the first L layers'
hidden state, a position takes its first confident exit, threshold 1.0 is the full model bit for
bit (eval and decode), and a decode exit fills the skipped layers' K/V from the exit hidden state."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import UsageError
from lowbit.runtime.early_exit import (
    EarlyExitLM,
    ExitDecoder,
    ExitSettings,
    FullLogits,
    check_threshold,
    confidence_of,
    parse_exit_layers,
)
from lowbit.runtime.engine.draft_models import layer_prefix
from lowbit.runtime.evaluate import chunk_windows, evaluate_tokens
from lowbit.runtime.layers import apply_rotary
from lowbit.runtime.loader import load_model
from tests.runtime.conftest import _gemma3_config, _llama_config, build_hf

LAYERS = 4


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"early_exit_{request.param}")
    config = (_llama_config if request.param == "llama" else _gemma3_config)(num_hidden_layers=LAYERS)
    build_hf(config).save_pretrained(path)
    return load_model(path, torch.float32, "cpu")


IDS = torch.tensor([[3 + (i * 37) % 200 for i in range(48)]])


def test_threshold_one_is_the_full_model_bit_for_bit(model):
    early = EarlyExitLM(model, ExitSettings((1, 2, 3), 1.0))
    with torch.inference_mode():
        assert torch.equal(early(IDS, logits_start=10), model(IDS, logits_start=10).float())
    assert early.stats.full == 48 - 10 - 1 and not early.stats.exits
    tokens = IDS[0].tolist() * 2
    windows = chunk_windows(len(tokens), 32)
    plain = evaluate_tokens(model, tokens, windows)
    early = EarlyExitLM(model, ExitSettings((2,), 1.0))
    mixed = evaluate_tokens(early, tokens, windows, base_model=FullLogits(early))
    assert mixed.ppl == plain.ppl and mixed.kld.mean == 0.0 and mixed.kld.same_top_pct == 100.0


def test_rows_take_their_first_confident_exit(model):
    with torch.inference_mode():
        full = model(IDS).float()[0]
        prefix = {n: layer_prefix(model, n)(IDS).float()[0] for n in (1, 2)}
    conf = {n: confidence_of(logits, "top1") for n, logits in prefix.items()}
    threshold = float(torch.cat(list(conf.values())).median())  # some rows exit, some do not
    early = EarlyExitLM(model, ExitSettings((1, 2), threshold))
    got = early(IDS)[0]
    counts = {1: 0, 2: 0, None: 0}
    for row in range(IDS.shape[1]):
        layer = 1 if conf[1][row] > threshold else 2 if conf[2][row] > threshold else None
        expected = full[row] if layer is None else prefix[layer][row]
        torch.testing.assert_close(got[row], expected, rtol=1e-5, atol=1e-5)
        counts[layer] += row < IDS.shape[1] - 1  # the last row is never scored, never counted
    assert early.stats.exits.get(1, 0) == counts[1] > 0 and early.stats.full == counts[None] > 0
    assert early.stats.exits.get(2, 0) == counts[2]
    # threshold 0: every row at the first exit, a quarter of the layers
    early = EarlyExitLM(model, ExitSettings((1, 2), 0.0))
    torch.testing.assert_close(early(IDS)[0], prefix[1], rtol=1e-5, atol=1e-5)
    assert early.stats.mean_layers == 1.0 and early.stats.rates() == {"1": 1.0, "full": 0.0}


def test_confidences():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [4.0, 4.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]]).log_softmax(-1)
    top1 = confidence_of(logits, "top1")
    margin = confidence_of(logits, "margin")
    p = logits.exp()
    torch.testing.assert_close(top1, p.amax(-1))
    torch.testing.assert_close(margin, torch.tensor([0.0, 0.0, float(p[2, 0] - p[2, 1])]))


def _greedy(step, first_logits, n):
    out, logits = [], first_logits
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = step(out[-1])
    return out


def test_decode_threshold_one_is_plain_decoding_and_zero_the_prefix_model(model):
    prompt = [5, 9, 17, 33, 65, 129]
    with torch.inference_mode():
        cache = model.new_cache(1, 64)
        first = model(torch.tensor([prompt]), cache=cache)[0, -1]
        plain = _greedy(lambda t: model(torch.tensor([[t]]), cache=cache)[0, -1], first, 20)
        view = layer_prefix(model, 2)
        dec0 = ExitDecoder(model, ExitSettings((2,), 0.0), 64)
        lg0 = dec0.prefill(prompt)
    dec = ExitDecoder(model, ExitSettings((1, 2, 3), 1.0), 64)
    assert _greedy(dec.step, dec.prefill(prompt), 20) == plain
    assert dec.stats.full == 20 and not dec.stats.exits
    # threshold 0: each decoded token is the 2-layer model's greedy token after the first
    ids = _greedy(dec0.step, lg0, 12)
    assert dec0.stats.exits == {2: 12}
    with torch.inference_mode():
        for n in range(1, len(ids)):
            logits = view(torch.tensor([prompt + ids[:n]]))[0, -1]
            assert int(logits.argmax()) == ids[n]


def test_decode_exit_fills_the_skipped_layers_kv_from_the_exit_hidden_state(model):
    prompt = [5, 9, 17, 33]
    dec = ExitDecoder(model, ExitSettings((1,), 0.0), 64)
    ids = _greedy(dec.step, dec.prefill(prompt), 6)
    seq = prompt + ids[:-1]  # tokens fed through dec.step: positions len(prompt)..
    decoder = model.model
    with torch.inference_mode():
        # h after layer 1 for every token, without any cache (layer 0 saw the same tokens)
        view = layer_prefix(model, 1)
        h = decoder.embed_tokens(torch.tensor([seq]))
        if decoder.scale_embeddings:
            h = h * torch.tensor(decoder.hidden_size**0.5, dtype=h.dtype).item()
        positions = torch.arange(len(seq))
        for which, layer in zip(decoder.layer_rotary, view.model.layers):
            cos, sin = decoder.rotaries[which].cos_sin(positions, len(seq), h.dtype)
            h = layer(h, cos, sin, _ctx(len(seq)), None)
        for j in range(1, LAYERS):
            layer = decoder.layers[j]
            x = layer.input_layernorm(h)
            k, v = layer.self_attn.k_proj(x), layer.self_attn.v_proj(x)
            if layer.self_attn.k_norm is not None:
                k = layer.self_attn._head_norm(layer.self_attn.k_norm, k)
            cos, sin = decoder.rotaries[decoder.layer_rotary[j]].cos_sin(positions, len(seq), h.dtype)
            d = layer.self_attn.head_dim
            k = apply_rotary(k.view(1, len(seq), -1, d).transpose(1, 2), cos, sin)
            v = v.view(1, len(seq), -1, d).transpose(1, 2)
            new = slice(len(prompt), len(seq))
            torch.testing.assert_close(dec.cache.keys[j][:, :, new], k[:, :, new], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dec.cache.values[j][:, :, new], v[:, :, new], rtol=1e-5, atol=1e-5)


def _ctx(t):
    from lowbit.runtime.attention import AttentionContext

    return AttentionContext(0, t, torch.device("cpu"))


@pytest.mark.parametrize("spec, message", [("0", "between 1 and 3"), ("2,4", "layer 4 is out of range"),
                                           ("a", "comma-separated"), (",", "at least one")])
def test_bad_exit_layers(spec, message):
    with pytest.raises(UsageError, match=message):
        parse_exit_layers(spec, LAYERS)


@pytest.mark.parametrize("t", [-0.1, 1.01, float("nan")])
def test_bad_threshold(t):
    with pytest.raises(UsageError, match=r"in \[0, 1\]"):
        check_threshold(t)


def test_exit_layers_are_sorted_and_unique():
    assert parse_exit_layers("3,1,3", LAYERS) == (1, 3)
