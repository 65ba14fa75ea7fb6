"""bench/dense_to_moe.py: a dense Llama as an equivalent Mixtral reproduces the dense logits, in lowbit
and in transformers (the converted checkpoint is a valid Mixtral for both)."""

from __future__ import annotations

import pytest
import torch

from bench.dense_to_moe import dense_to_moe, moe_config
from lowbit.runtime.loader import load_model
from lowbit.runtime.models.moe import SparseMoE


@pytest.mark.parametrize("experts", [1, 4])
def test_moe_from_dense_reproduces_dense_logits(experts, llama_config, hf_checkpoint, tmp_path):
    dense_dir, hf_dense = hf_checkpoint(llama_config(tie_word_embeddings=True))
    moe_dir = dense_to_moe(dense_dir, tmp_path / "moe", experts)
    dense, moe = load_model(dense_dir), load_model(moe_dir)
    assert all(isinstance(layer.mlp, SparseMoE) and len(layer.mlp.experts) == experts for layer in moe.model.layers)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = dense(ids)
        assert (moe(ids) - expected).abs().max().item() < 1e-5

        from transformers import AutoModelForCausalLM

        hf_moe = AutoModelForCausalLM.from_pretrained(moe_dir, attn_implementation="eager").eval()
        assert (hf_moe(ids).logits - hf_dense(ids).logits).abs().max().item() < 1e-5


def test_moe_from_dense_refuses_what_it_cannot_split(llama_config):
    dense = llama_config().to_dict()
    for bad in (dict(experts=3), dict(experts=256)):
        with pytest.raises(ValueError, match="power of two dividing"):
            moe_config(dense, **bad)
    with pytest.raises(ValueError, match="biases"):
        moe_config(dict(dense, mlp_bias=True), 4)
