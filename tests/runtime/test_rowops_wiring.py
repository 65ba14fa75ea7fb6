"""The model code's use of the C row ops (kernels/cpu_rowops.py): taken on CPU without autograd,
equal to the torch path up to the float32 sum of squares, and never taken when autograd needs
torch's ops (training, calibration with gradients)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import cpu_rowops
from lowbit.runtime.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_rowops.available(), reason="no C compiler")


def _ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


def _counting(monkeypatch):
    calls = {"rmsnorm": 0, "add_rmsnorm": 0, "act_mul": 0}
    for name in calls:
        real = getattr(cpu_rowops, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cpu_rowops, name, counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_row_ops_run_under_inference_and_match_the_torch_path(family, dtype, tiny_llama_dir, tiny_gemma3_dir, monkeypatch):
    model = load_model(tiny_llama_dir if family == "llama" else tiny_gemma3_dir, dtype=dtype)
    ids = _ids()
    calls = _counting(monkeypatch)
    with torch.inference_mode():
        fast = model(ids)
    layers = model.config.num_hidden_layers
    if family == "llama":  # input norm + final norm; post-attention norm fused with the residual add
        assert calls == {"rmsnorm": layers + 1, "add_rmsnorm": layers, "act_mul": layers}
    else:  # + per-head q and k norms; both sandwich residuals fused
        assert calls == {"rmsnorm": 3 * layers + 1, "add_rmsnorm": 2 * layers, "act_mul": layers}
    monkeypatch.setattr(cpu_rowops, "usable", lambda *args: False)
    with torch.inference_mode():
        slow = model(ids)
    if dtype == torch.float32:
        assert (fast - slow).abs().max() < 1e-4
    else:  # a last-bit change of a norm can move a bf16 value by one step, and that propagates a little
        assert (fast.float() - slow.float()).abs().max() < 0.25
        assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_autograd_keeps_the_torch_path_and_its_gradients(family, tiny_llama_dir, tiny_gemma3_dir, monkeypatch):
    model = load_model(tiny_llama_dir if family == "llama" else tiny_gemma3_dir, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(True)
    calls = _counting(monkeypatch)
    logits = model(_ids())
    logits.logsumexp(-1).mean().backward()
    assert calls == {"rmsnorm": 0, "add_rmsnorm": 0, "act_mul": 0}
    norm = model.model.layers[0].post_attention_layernorm.weight
    assert norm.grad is not None and norm.grad.abs().sum() > 0
    monkeypatch.setattr(cpu_rowops, "usable", lambda *args: False)
    with torch.no_grad():
        assert torch.equal(logits, model(_ids()))  # the torch path, bit for bit
