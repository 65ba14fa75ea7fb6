"""lowbit's forward pass against transformers' on the same saved checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.loader import load_model

TOL = 1e-4
SEQ = 40


def _ids(batch=2, seq=SEQ, vocab=256, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
                       tie_word_embeddings=True)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=256, max_position_embeddings=512, sliding_window=8)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "llama-gqa-untied-bias-llama3": lambda c: c["llama"](attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE),
    "llama-tied-linear-rope": lambda c: c["llama"](
        tie_word_embeddings=True, num_key_value_heads=4, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    ),
    "qwen2": lambda c: _qwen2(),
    "qwen3": lambda c: _qwen3(),
    "mistral-window": lambda c: _mistral(),
    "gemma3": lambda c: c["gemma3"](),
    "gemma3-softcap": lambda c: c["gemma3"](final_logit_softcapping=3.0),
}


@pytest.fixture
def configs(llama_config, gemma3_config):
    return {"llama": llama_config, "gemma3": gemma3_config}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_fp32(case, configs, hf_checkpoint):
    path, hf = hf_checkpoint(CASES[case](configs))
    ours = load_model(path)
    ids = _ids()
    expected = _hf_logits(hf, ids)
    with torch.no_grad():
        got = ours(ids)
    assert got.shape == expected.shape
    assert expected.abs().max() > 0.5  # logits big enough that a wrong layer would show
    assert _max_diff(got, expected) < TOL


def test_tied_embeddings_share_one_tensor(configs, hf_checkpoint):
    path, _ = hf_checkpoint(configs["llama"](tie_word_embeddings=True))
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("case", ["llama-gqa-untied-bias-llama3", "gemma3", "mistral-window"])
def test_incremental_decode_equals_full_forward(case, configs, hf_checkpoint):
    path, _ = hf_checkpoint(CASES[case](configs))
    model = load_model(path)
    ids = _ids(seq=30)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(batch=2, max_len=32)
        # prefill, then a chunk with a past (explicit mask path), then one token at a time
        steps = [model(ids[:, :10], cache=cache), model(ids[:, 10:15], cache=cache)]
        for t in range(15, 30):
            steps.append(model(ids[:, t : t + 1], cache=cache))
    assert cache.length == 30
    assert _max_diff(torch.cat(steps, dim=1), full) < TOL


def test_cache_overflow_is_an_error(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    cache = model.new_cache(batch=1, max_len=4)
    with pytest.raises(LowbitError, match="KV cache full"):
        model(_ids(batch=1, seq=5), cache=cache)


def test_sliding_window_changes_gemma3_logits(tiny_gemma3_dir):
    model = load_model(tiny_gemma3_dir)
    window = model.config.sliding_window
    ids = _ids(seq=4 * window)
    with torch.no_grad():
        windowed = model(ids)
        for layer in model.model.layers:
            layer.self_attn.window = None
        unwindowed = model(ids)
    # identical while the sequence fits in the window, different once it does not
    assert _max_diff(windowed[:, :window], unwindowed[:, :window]) < 1e-6
    assert _max_diff(windowed[:, window:], unwindowed[:, window:]) > 1e-2


def test_gemma3_transformers4_config_spelling(tiny_gemma3_dir, tmp_path):
    """Checkpoints saved before transformers 5 spell RoPE and layer kinds differently."""
    import shutil

    shutil.copytree(tiny_gemma3_dir, tmp_path / "v4", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "v4" / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.update(rope_theta=rope["full_attention"]["rope_theta"], rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
               rope_scaling=None, sliding_window_pattern=3)  # (i + 1) % 3 -> S, S, F, S as in the fixture
    (tmp_path / "v4" / "config.json").write_text(json.dumps(cfg))
    ids = _ids()
    with torch.no_grad():
        assert _max_diff(load_model(tmp_path / "v4")(ids), load_model(tiny_gemma3_dir)(ids)) == 0


def test_logits_start_and_explicit_positions(tiny_gemma3_dir):
    model = load_model(tiny_gemma3_dir)
    ids = _ids()
    with torch.no_grad():
        full = model(ids)
        tail = model(ids, logits_start=25)
        positioned = model(ids, positions=torch.arange(SEQ))
        per_row = model(ids, positions=torch.stack([torch.arange(SEQ), torch.arange(SEQ) * 2]))
        shifted = model(ids, positions=torch.arange(SEQ) + 3)  # RoPE is relative: same logits
        spread = model(ids, positions=torch.arange(SEQ) * 2)
    assert tail.shape == (2, SEQ - 25, 256)
    assert _max_diff(tail, full[:, 25:]) < 1e-6
    assert _max_diff(positioned, full) == 0
    assert _max_diff(shifted, full) < 1e-4
    assert _max_diff(spread, full) > 1e-3  # positions do reach RoPE
    assert _max_diff(per_row[:1], full[:1]) == 0 and _max_diff(per_row[1:], spread[1:]) < 1e-6


@pytest.mark.parametrize("case", ["llama-gqa-untied-bias-llama3", "gemma3"])
def test_bf16_loads_and_runs_close_to_transformers_bf16(case, configs, hf_checkpoint):
    path, hf = hf_checkpoint(CASES[case](configs))
    model = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = _ids()
    with torch.no_grad():
        got = model(ids)
        expected_bf16 = hf.to(torch.bfloat16)(ids).logits
        expected_fp32 = hf.float()(ids).logits
    assert got.dtype == torch.bfloat16
    scale = expected_fp32.abs().max().item()
    assert _max_diff(got, expected_bf16) < 0.05 * scale
    assert _max_diff(got, expected_fp32) < 0.05 * scale


def test_unsupported_architecture_names_it():
    with pytest.raises(LowbitError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64})


def test_unsupported_rope_scaling_names_it(configs):
    cfg = configs["llama"]().to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(LowbitError, match="yarn"):
        ModelConfig.from_dict(cfg)


def test_config_reads_transformers_fields(configs):
    cfg = ModelConfig.from_dict(configs["gemma3"](num_hidden_layers=6, layer_types=None).to_dict())
    assert cfg.family == "gemma3" and cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_types[5] == "full_attention" and cfg.layer_types[:5].count("sliding_attention") == 5
    assert cfg.window(0) == 8 and cfg.window(5) is None
    assert cfg.rope_local.theta == 10_000.0 and cfg.rope.theta == 1_000_000.0
    assert cfg.query_scale == pytest.approx(16**-0.5)


@pytest.mark.demo
@pytest.mark.parametrize("fixture", ["smollm2_dir", "gemma3_dir"])
def test_real_model_logits_match_transformers(fixture, request):
    from transformers import AutoModelForCausalLM

    from lowbit.runtime.tokenizer import load_tokenizer

    path = request.getfixturevalue(fixture)
    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
        "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
    )
    ids = torch.tensor([load_tokenizer(path).encode(text)[:64]])
    ours = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        got = ours(ids)
        expected = hf(ids).logits
    assert ids.shape[1] >= 40
    assert _max_diff(got, expected) < 2e-3
