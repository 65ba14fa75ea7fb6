"""`lowbit serve smollm2-135m` answers a chat like transformers does with the same checkpoint."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.demo
def test_demo_chat_matches_transformers_greedy(start_server, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    server = start_server(smollm2_dir, "--kv-memory", "64MiB", "--max-model-len", "512", "--threads", "1",
                          "--served-model-name", "smollm2")
    client = server.client()
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)

    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == expected
    assert streamed == expected
    assert "Paris" in expected
