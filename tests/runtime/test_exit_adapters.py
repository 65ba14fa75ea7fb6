"""Exit adapters (runtime/exit_adapters.py): an untrained one is the identity; the file round-trips
and bad files are refused in one line naming the tensor; `--draft self:layers=N` drafts through the
model's adapter for exit N and still decodes exactly what plain decoding does."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from lowbit.runtime.exit_adapters import ADAPTERS_FILE, ExitAdapter, load_adapters, new_adapters, save_adapters
from tests.runtime.conftest import _llama_config, build_hf
from tests.runtime.engine.conftest import save_with_tokenizer

LAYERS = 4


class _Config:
    hidden_size, num_hidden_layers = 64, LAYERS


def _trained(layers=(1, 2), rank=8, seed=0) -> dict[int, ExitAdapter]:
    adapters = new_adapters(layers, 64, rank, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for a in adapters.values():
            a.up.weight.copy_(0.5 * torch.randn(a.up.weight.shape, generator=gen))
    return adapters


def test_an_untrained_adapter_is_the_identity():
    x = torch.randn(3, 5, 64)
    assert torch.equal(new_adapters((2,), 64, 8, 0)[2](x), x)
    assert torch.equal(new_adapters((2,), 64, 8, 0)[2](x.bfloat16()), x.bfloat16())


def test_the_file_round_trips(tmp_path):
    adapters = _trained()
    save_adapters(adapters, tmp_path / ADAPTERS_FILE, 64, LAYERS)
    loaded = load_adapters(tmp_path, _Config)
    assert sorted(loaded) == [1, 2]
    x = torch.randn(7, 64)
    for layer in (1, 2):
        assert torch.equal(loaded[layer](x), adapters[layer](x))
        assert not torch.equal(loaded[layer](x), x)
    (tmp_path / "model.gguf").write_bytes(b"")
    assert load_adapters(tmp_path / "model.gguf", _Config).keys() == loaded.keys()  # a model file in the directory
    (tmp_path / "elsewhere").mkdir()
    assert load_adapters(tmp_path / "elsewhere", _Config) == {}
    assert load_adapters(tmp_path / "missing", _Config) == {}
    assert load_adapters(None, _Config) == {}


def _broken(tmp_path, edit):
    save_adapters(_trained(), tmp_path / ADAPTERS_FILE, 64, LAYERS)
    tensors = load_file(str(tmp_path / ADAPTERS_FILE))
    from safetensors import safe_open

    with safe_open(str(tmp_path / ADAPTERS_FILE), framework="pt") as f:
        meta = f.metadata()
    meta = edit(tensors, meta) or meta
    save_file(tensors, str(tmp_path / ADAPTERS_FILE), metadata=meta)


def _nan(t, m):
    t["exit.2.down"][1, 1] = float("inf")


def _missing(t, m):
    del t["exit.1.up"]


def _shape(t, m):
    t["exit.2.up"] = torch.zeros(64, 9)


def _range(t, m):
    t["exit.4.down"], t["exit.4.up"] = t["exit.1.down"].clone(), t["exit.1.up"].clone()


def _other_model(t, m):
    return {"lowbit": m["lowbit"].replace('"num_layers": 4', '"num_layers": 30')}


def _no_meta(t, m):
    return {"format": "pt"}


@pytest.mark.parametrize("edit, message", [
    (_nan, "exit.2 holds NaN/inf"),
    (_missing, "exit.1 needs both 'down' and 'up' tensors"),
    (_shape, "exit.2 has down (8, 64) and up (64, 9)"),
    (_range, "exit.4 is outside the model's layers 1..3"),
    (_other_model, "trained for a model of hidden size 64 and 30 layers; this one has 64 and 4"),
    (_no_meta, "not a lowbit exit adapters file"),
])
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path, edit, message):
    _broken(tmp_path, edit)
    with pytest.raises(LowbitError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_adapters(tmp_path, _Config)


def test_saving_a_nan_adapter_writes_nothing(tmp_path):
    adapters = _trained()
    with torch.no_grad():
        adapters[1].up.weight[0, 0] = float("nan")
    with pytest.raises(LowbitError, match="exit adapter exit.1.up holds NaN/inf"):
        save_adapters(adapters, tmp_path / ADAPTERS_FILE, 64, LAYERS)
    assert not (tmp_path / ADAPTERS_FILE).exists()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    plain = tmp_path_factory.mktemp("exit_plain")
    save_with_tokenizer(build_hf(_llama_config(num_hidden_layers=LAYERS)), plain)
    adapted = tmp_path_factory.mktemp("exit_adapted")
    shutil.copytree(plain, adapted, dirs_exist_ok=True)
    save_adapters(_trained(layers=(2,)), adapted / ADAPTERS_FILE, 64, LAYERS)
    return plain, adapted


def test_self_layers_drafts_through_the_adapter_and_decodes_exactly(model_dirs):
    plain_dir, adapted_dir = model_dirs
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[40 + i for i in range(9)], [70, 71, 72]]
    expected = [c.token_ids for c in Engine(plain_dir, kv_memory=4 << 20).generate(prompts, greedy)]
    spec = Engine(adapted_dir, kv_memory=4 << 20, draft="self:layers=2", num_speculative_tokens=3)
    assert [c.token_ids for c in spec.generate(prompts, greedy)] == expected
    # the view's head is the adapter, then the model's head: the draft's logits are head(adapter(norm(h_2)))
    view = spec.drafter.model
    adapter, head = view.lm_head
    assert isinstance(adapter, ExitAdapter) and head is spec.model.lm_head
    x = torch.randn(3, 64)
    assert torch.equal(view.lm_head(x), spec.model.lm_head(adapter(x)))
    assert not torch.equal(view.lm_head(x), spec.model.lm_head(x))
    # an exit with no adapter in the file drafts through the plain head
    other = Engine(adapted_dir, kv_memory=4 << 20, draft="self:layers=1", num_speculative_tokens=3)
    assert other.drafter.model.lm_head is other.model.lm_head
