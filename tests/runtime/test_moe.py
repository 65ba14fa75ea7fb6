"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers, their three
checkpoint layouts (per expert, Mixtral's w1/w2/w3, transformers' fused tensors), routing that does not
depend on the batch, and every refusal as one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.loader import load_model
from lowbit.runtime.models.moe import SparseMoE
from tests.runtime.moe_models import CASES, save_moe

TOL = 1e-4


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (b, t), generator=gen) for b, t in ((1, 1), (1, 23), (3, 40))]


@pytest.fixture(scope="module", params=CASES)
def moe(request, tmp_path_factory):
    """(case, directory, transformers model, lowbit model)."""
    path, hf = save_moe(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, hf, load_model(path)


def test_logits_match_transformers_fp32(moe):
    case, _, hf, ours = moe
    assert any(isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers)
    for ids in _prompts():
        with torch.no_grad():
            diff = (hf(ids).logits - ours(ids)).abs().max().item()
        assert diff < TOL, f"{case} {tuple(ids.shape)}: max |logit diff| {diff}"


def test_greedy_tokens_match_transformers(moe):
    _, _, hf, ours = moe
    prompt = _prompts()[1]
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(12):  # transformers: the whole sequence every step
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
        cache = ours.new_cache(1, ids.shape[1])
        logits = ours(prompt, cache=cache)[:, -1]
        got = []
        for _ in range(12):  # lowbit: incrementally through its KV cache
            got.append(int(logits.argmax()))
            logits = ours(torch.tensor([[got[-1]]]), cache=cache)[:, -1]
    assert got == ids[0, prompt.shape[1]:].tolist()


def test_routing_is_the_same_whatever_else_is_in_the_batch(moe):
    _, _, _, ours = moe
    block = next(layer.mlp for layer in ours.model.layers if isinstance(layer.mlp, SparseMoE))
    rows = torch.randn(37, ours.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        weights, experts = block.route(rows)
        perm = torch.randperm(37, generator=torch.Generator().manual_seed(6))
        w_perm, e_perm = block.route(rows[perm])
        assert torch.equal(w_perm, weights[perm]) and torch.equal(e_perm, experts[perm])
        out = block(rows)
        for i in (0, 17, 36):
            w1, e1 = block.route(rows[i : i + 1])
            assert torch.equal(w1, weights[i : i + 1]) and torch.equal(e1, experts[i : i + 1])  # bit for bit
            torch.testing.assert_close(block(rows[i : i + 1]), out[i : i + 1], rtol=0, atol=1e-6)


def test_one_token_touches_only_its_routed_experts(moe):
    _, _, _, ours = moe
    block = next(layer.mlp for layer in ours.model.layers if isinstance(layer.mlp, SparseMoE))
    called = []
    hooks = [e.register_forward_pre_hook(lambda m, a, i=i: called.append(i)) for i, e in enumerate(block.experts)]
    try:
        row = torch.randn(1, ours.config.hidden_size)
        with torch.no_grad():
            _, experts = block.route(row)
            block(row)
    finally:
        for h in hooks:
            h.remove()
    assert sorted(called) == sorted(experts[0].tolist()) and len(called) == block.top_k


# ---- checkpoint layouts --------------------------------------------------------------------------

def _fused_state(hf) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory names: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    return {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}


def _per_expert(state: dict[str, torch.Tensor], mixtral: bool) -> dict[str, torch.Tensor]:
    """The hub layout written by hand from fused tensors (Mixtral: block_sparse_moe.experts.E.w1/w3/w2)."""
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, i = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{'w1' if mixtral else 'gate_proj'}.weight"] = t[e, :i].clone()
                out[f"{prefix}.{e}.{'w3' if mixtral else 'up_proj'}.weight"] = t[e, i:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{'w2' if mixtral else 'down_proj'}.weight"] = t[e].clone()
        else:
            out[name] = t
    if mixtral:
        out = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in out.items()}
    return out


def _write(directory, like, tensors):
    directory.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (directory / f).write_bytes((like / f).read_bytes())
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_save_pretrained_writes_per_expert_tensors(moe):
    case, path, _, _ = moe
    names = load_file(str(path / "model.safetensors")).keys()
    expert = "block_sparse_moe.experts.0.w1.weight" if case == "mixtral" else "mlp.experts.0.gate_proj.weight"
    assert any(n.endswith(expert) for n in names) and not any("gate_up_proj" in n for n in names)


def test_fused_and_hand_written_per_expert_layouts_load_alike(moe, tmp_path):
    case, path, hf, ours = moe
    fused = _fused_state(hf)
    ids = _prompts()[2]
    weights = ours.state_dict()
    with torch.no_grad():
        expected = ours(ids)
        for name, tensors in (("fused", fused), ("per-expert", _per_expert(fused, case == "mixtral"))):
            other = load_model(_write(tmp_path / name, path, tensors))
            got = other.state_dict()
            assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in got), name
            # same weights; the logits may differ in the last bit only because MKL's GEMM result
            # depends on the address alignment of the weights (views of a fused tensor vs mmap'd)
            torch.testing.assert_close(other(ids), expected, rtol=0, atol=1e-5)


# ---- refusals, each one line naming what is wrong ------------------------------------------------

def _refused(fn, *words):
    with pytest.raises(LowbitError) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path, hf = save_moe("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_bad"))
    return path, hf


def test_bad_expert_tensors_are_refused(qwen3, tmp_path):
    path, hf = qwen3
    fused = _fused_state(hf)
    per = _per_expert(fused, mixtral=False)
    name = "model.layers.0.mlp.experts.3.up_proj.weight"

    missing = {k: v for k, v in per.items() if k != name}
    _refused(lambda: load_model(_write(tmp_path / "missing", path, missing)), "lacks", name)

    misshapen = dict(per, **{name: per[name][:-1].clone()})
    _refused(lambda: load_model(_write(tmp_path / "misshapen", path, misshapen)), name, "shape")

    fused_name = "model.layers.2.mlp.experts.gate_up_proj"
    bad_fused = dict(fused, **{fused_name: fused[fused_name][:, :-2].clone()})
    _refused(lambda: load_model(_write(tmp_path / "bad_fused", path, bad_fused)), fused_name, "shape")

    router = "model.layers.0.mlp.gate.weight"
    narrow = dict(per, **{router: per[router][:-1].clone()})
    _refused(lambda: load_model(_write(tmp_path / "router", path, narrow)), router, "shape")

    twice = dict(per, **{"model.layers.0.mlp.experts.gate_up_proj": fused["model.layers.0.mlp.experts.gate_up_proj"]})
    _refused(lambda: load_model(_write(tmp_path / "twice", path, twice)), "twice", "experts.0.gate_proj")


def _config(path, **changes):
    d = json.loads((path / "config.json").read_text())
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, words", [
    ({"num_experts_per_tok": 9}, ("num_experts_per_tok 9", "8 experts")),
    ({"num_experts_per_tok": 0}, ("num_experts_per_tok",)),
    ({"num_experts": None, "num_local_experts": None}, ("num_experts",)),
    ({"decoder_sparse_step": 0}, ("decoder_sparse_step",)),
    ({"mlp_only_layers": [3]}, ("mlp_only_layers",)),
    ({"mlp_only_layers": "1"}, ("mlp_only_layers",)),
    ({"use_sliding_window": True}, ("use_sliding_window",)),
    ({"moe_intermediate_size": None}, ("moe_intermediate_size",)),
    ({"num_experts": 1 << 20}, ("experts", "out of range")),
])
def test_bad_qwen3_moe_configs_are_refused(qwen3, changes, words):
    _refused(lambda: ModelConfig.from_dict(_config(qwen3[0], **changes)), *words)


def test_bad_mixtral_olmoe_qwen2_configs_are_refused(tmp_path):
    mixtral, _ = save_moe("mixtral", tmp_path / "mixtral")
    _refused(lambda: ModelConfig.from_dict(_config(mixtral, num_local_experts=None)), "num_local_experts")
    _refused(lambda: ModelConfig.from_dict(_config(mixtral, num_experts_per_tok=9)), "num_experts_per_tok")
    olmoe, _ = save_moe("olmoe", tmp_path / "olmoe")
    _refused(lambda: ModelConfig.from_dict(_config(olmoe, clip_qkv=8.0)), "clip_qkv")
    _refused(lambda: ModelConfig.from_dict(_config(olmoe, head_dim=32)), "head_dim")
    qwen2, _ = save_moe("qwen2_moe", tmp_path / "qwen2")
    _refused(lambda: ModelConfig.from_dict(_config(qwen2, shared_expert_intermediate_size=None)),
             "shared_expert_intermediate_size")


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_rtn_int4_quantized_moe_loads_per_expert_and_generates(case, tmp_path):
    """`lowbit quantize --format int4 -g 32`: the routers stay dense by themselves (they were quantized,
    and the result refused to load, before), every expert projection becomes a QuantLinear, Mixtral's
    hub names included."""
    from lowbit.compress.pipeline import quantize_model
    from lowbit.quant.spec import parse_spec
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sequence import SamplingParams
    from lowbit.runtime.quant_linear import QuantLinear

    path, _ = save_moe(case, tmp_path / case)
    quantize_model(path, parse_spec("int4-g32"), out_dir=tmp_path / "int4", skip=[])
    engine = Engine(tmp_path / "int4", kv_memory=2 << 20)
    block = next(layer.mlp for layer in engine.model.model.layers if isinstance(layer.mlp, SparseMoE))
    assert all(isinstance(p, QuantLinear) for e in block.experts for p in (e.gate_proj, e.up_proj, e.down_proj))
    assert not isinstance(block.gate, QuantLinear)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ps = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 33]]
    batched = [c.token_ids for c in engine.generate(ps, greedy)]
    assert batched == [engine.generate([p], greedy)[0].token_ids for p in ps] and all(len(b) == 8 for b in batched)
