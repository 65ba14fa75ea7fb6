"""A tiny random Llama checkpoint with a tiny ASCII tokenizer and a chat template, for the server.

The tokenizer is byte-level BPE trained on a fixed English paragraph, so every token decodes to
printable ASCII: streamed deltas can be compared with whole texts without UTF-8 boundary noise.
"""

from __future__ import annotations

import json
from pathlib import Path

TEXT = (
    "The quick brown fox jumps over the lazy dog. A server answers many clients at once; each "
    "client sends a prompt and reads the tokens back as they are made. Hello world, hello there! "
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols: ( ) [ ] { } < > | - + = * / ? , . ' \" ; : # @ & %"
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BOS, EOS = "<s>", "</s>"


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=[BOS, EOS], show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    return tok


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "chat_template": CHAT_TEMPLATE}))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=tok.get_vocab_size(), max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=tok.token_to_id(BOS),
                         eos_token_id=tok.token_to_id(EOS))
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # logits O(1), so greedy text varies with the prompt
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(path)
    return path
