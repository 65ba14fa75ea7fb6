"""load_model: strict, one-line errors for every way a checkpoint can be wrong; shards and dtypes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError
from lowbit.runtime.loader import load_model


@pytest.fixture
def ckpt(tiny_llama_dir, tmp_path):
    """A private copy of the tiny Llama that a test may damage."""
    path = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, path)
    return path


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_named(ckpt):
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(LowbitError) as excinfo:
        load_model(ckpt)
    assert "model.layers.1.mlp.up_proj.weight" in _one_line_error(excinfo)


def test_unexpected_weight_is_named(ckpt):
    _rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(LowbitError) as excinfo:
        load_model(ckpt)
    assert "model.layers.0.extra.weight" in _one_line_error(excinfo)


def test_wrong_shape_is_named(ckpt):
    _rewrite_weights(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(LowbitError, match=r"model\.norm\.weight.*\(65,\)"):
        load_model(ckpt)


def test_rotary_inv_freq_buffers_are_ignored(ckpt):
    _rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_is_one_line(ckpt, damage):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(LowbitError) as excinfo:
        load_model(ckpt)
    assert "model.safetensors" in _one_line_error(excinfo)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(LowbitError, match="not found"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "file.txt").write_text("hi")
    with pytest.raises(LowbitError, match="not a model directory"):
        load_model(tmp_path / "file.txt")
    with pytest.raises(LowbitError, match="no config.json"):
        load_model(tmp_path)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(LowbitError, match="no \\*.safetensors"):
        load_model(ckpt)


def test_unsupported_architecture_in_directory(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(model_type="falcon", architectures=["FalconForCausalLM"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LowbitError, match="FalconForCausalLM"):
        load_model(ckpt)


def test_bad_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(LowbitError, match="config.json"):
        load_model(ckpt)


def test_sharded_checkpoint_equals_single_file(hf_checkpoint, llama_config, tiny_llama_dir):
    path, hf = hf_checkpoint(llama_config(), max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert (load_model(path)(ids) - hf(ids).logits).abs().max() < 1e-4


def test_missing_shard_is_named(hf_checkpoint, llama_config):
    path, _ = hf_checkpoint(llama_config(), max_shard_size="100KB")
    shard = sorted(path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(LowbitError, match=shard.name):
        load_model(path)


def test_dtype_and_inference_mode(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert not model.training
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_bf16_linears_load_narrow_and_the_engine_gives_the_compacted_numbers(tiny_float_model):
    # A bf16 checkpoint in the float32 engine: its Linear weights (and a tied table) stay bf16 as they
    # load, as the compaction left them before when loaded float32 first: the same logits
    from lowbit.kernels import cpu_f32

    if not cpu_f32.available():
        pytest.skip("no dense kernel on this machine")
    for tie in (False, True):
        src = tiny_float_model(tie=tie, name=f"narrow-{tie}")
        wide = load_model(src, torch.float32)
        cpu_f32.use_invariant_linears(wide)
        narrow = load_model(src, torch.float32, bf16_linears=True)
        attn = narrow.model.layers[0].self_attn
        assert attn.q_proj.weight.dtype is torch.bfloat16 and narrow.lm_head.weight.dtype is torch.bfloat16
        assert narrow.model.layers[0].input_layernorm.weight.dtype is torch.float32  # norms stay float32
        assert (narrow.model.embed_tokens.weight.dtype is torch.bfloat16) == tie  # an untied table is widened
        linears = sum(type(m) is torch.nn.Linear for m in narrow.modules())
        assert cpu_f32.use_invariant_linears(narrow, bf16_weights=True) == linears  # on any CPU with the kernel
        assert type(attn.q_proj) is cpu_f32.InvariantLinear
        ids = torch.tensor([[256, 104, 101, 108, 108, 111]])
        with torch.no_grad():
            assert torch.equal(narrow(ids), wide(ids))
