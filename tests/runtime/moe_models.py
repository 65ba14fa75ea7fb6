"""Tiny random mixture-of-experts checkpoints for runtime and engine tests.

`moe_config(case)` is a transformers config of one of CASES (Mixtral, Qwen2-MoE with its shared
expert and a dense layer by decoder_sparse_step, Qwen3-MoE with norm_topk_prob and a dense layer by
mlp_only_layers, OLMoE); `save_moe(case, directory)` builds it with weights ~N(0, 0.1)
(tests/runtime/conftest.py's randomize_, so routing is far from uniform), saves it with
save_pretrained (transformers 5 writes the per-expert layout: `mlp.experts.E.gate_proj`, Mixtral's
`block_sparse_moe.experts.E.w1`) and the byte tokenizer of tests/conftest.py (vocab 258, BOS 256,
EOS 257), and returns the transformers model (eager attention) beside it.
"""

from __future__ import annotations

from tests.conftest import _byte_tokenizer
from tests.runtime.conftest import build_hf

VOCAB = 258
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
               max_position_embeddings=512, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)

CASES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def moe_config(case: str, **overrides):
    import transformers as tf

    kw = dict(_COMMON)
    if case == "mixtral":
        kw.update(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16)
        kw.update(overrides)
        return tf.MixtralConfig(**kw)
    if case == "qwen2_moe":
        # layer 0 dense by decoder_sparse_step 2 (only layers 1, 3, ... are sparse)
        kw.update(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                  num_experts_per_tok=3, decoder_sparse_step=2)
        kw.update(overrides)
        return tf.Qwen2MoeConfig(**kw)
    if case == "qwen3_moe":
        kw.update(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, mlp_only_layers=[1])
        kw.update(overrides)
        return tf.Qwen3MoeConfig(**kw)
    if case == "olmoe":
        kw.update(intermediate_size=32, num_experts=8, num_experts_per_tok=2)
        kw.update(overrides)
        return tf.OlmoeConfig(**kw)
    raise ValueError(case)


def save_moe(case: str, directory, **overrides):
    """(directory, transformers model): a tiny random `case` checkpoint with a byte tokenizer."""
    model = build_hf(moe_config(case, **overrides))
    model.save_pretrained(directory)
    _byte_tokenizer(directory)
    return directory, model
