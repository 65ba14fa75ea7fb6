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
    # every residual add rides in a norm call: the first layer's input norm alone, then per layer
    # (previous MLP residual + input norm) and (attention residual + MLP norm); the last MLP
    # residual goes with the final norm. Gemma adds its per-head q and k norms.
    qk = 2 * layers if family == "gemma3" else 0
    assert calls == {"rmsnorm": 1 + qk, "add_rmsnorm": 2 * layers, "act_mul": layers}
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


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_residuals_equal_layer_by_layer_bit_for_bit(family, dtype, tiny_llama_dir, tiny_gemma3_dir, monkeypatch):
    """The C adds of the deferred path round like torch's adds: same logits as calling each layer,
    which the model does when a layer has a forward hook (that must still fire)."""
    model = load_model(tiny_llama_dir if family == "llama" else tiny_gemma3_dir, dtype=dtype)
    ids = _ids()
    with torch.inference_mode():
        deferred = model(ids)
        seen = []
        handle = model.model.layers[1].register_forward_hook(lambda *args: seen.append(1))
        calls = _counting(monkeypatch)
        layered = model(ids)
        handle.remove()
    assert seen == [1] and calls["add_rmsnorm"] == model.config.num_hidden_layers * (2 if family == "gemma3" else 1)
    assert torch.equal(deferred, layered)
