"""bf16 weights packed in 12 bits (kernels/cpu_bf16pack.py, native/f32_dot.c): packing is lossless,
so the packed matmul gives bit for bit the bf16 kernel's outputs (cpu_f32.matmul with bf16_x) at any
row count, a row's weights that fall outside its table go through the side list exactly, and an
engine packs its bf16 Linears (head and layers) and generates the very tokens (and logits) it did
unpacked."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import cpu_bf16pack, cpu_f32
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_bf16pack.enabled() or not cpu_f32.bf16_available(),
                                reason="no AVX512-BF16 here (the packed kernel is its bf16 x bf16 one)")


def _spread(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """bf16 weights whose magnitudes span ~40 binades, zeros of both signs, subnormals and tiny
    normals: most blocks go through the side list."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-40, 2, (n, k), generator=g).float())
    w = w.bfloat16()
    w[0, :7] = 0
    w[1 % n, 3] = -0.0
    w[2 % n, 5] = 1e-40  # a bf16 subnormal
    w[3 % n, 9] = -1.2e-38  # a tiny normal: exponent field 1, high byte 0x80
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("n, k", [(1000, 576), (77, 64), (33, 640), (5, 32), (1, 96)])
def test_packed_matmul_is_the_bf16_kernel_bit_for_bit(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    w[0, :5] = 0
    w[n // 2, 7] = 1e-30  # far below the row's other weights: its block goes to the side list
    packed = cpu_bf16pack.pack(w)
    assert packed.esc_block.numel() >= 1
    assert packed.nbytes < w.numel() * 2 or n * k < 4096  # 12 bits a weight and 16 bytes a row (+ the side list)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 6, 8, 16, 17):  # the engine reads the packed copy up to cpu_f32.PACKED_MAX_ROWS
        x = torch.randn(m, k, generator=g)
        for b in (None, bias):
            assert torch.equal(_bits(cpu_bf16pack.matmul(x, packed, b)), _bits(cpu_f32.matmul(x, w, b, bf16_x=True))), (m, b is None)


@pytest.mark.parametrize("n, k", [(31, 64), (8, 96)])
def test_every_weight_comes_back_exactly_and_wide_rows_use_the_side_list(n, k):
    w = _spread(n, k)
    packed = cpu_bf16pack.pack(w)
    assert packed.esc_block.numel() > 0 and int(packed.esc_start[-1]) == packed.esc_block.numel()
    # one-hot rows of x read each column back: bf16 x 1 is exact in float32 (a subnormal weight
    # reads as zero, as the bf16 instruction flushes it: the plain kernel does the same)
    for col in range(k):
        x = torch.zeros(1, k)
        x[0, col] = 1.0
        got = cpu_bf16pack.matmul(x, packed)[0]
        assert torch.equal(_bits(got), _bits(cpu_f32.matmul(x, w, None, bf16_x=True)[0])), col
        normal = w[:, col].float().abs() >= 2.0**-126
        assert torch.equal(got[normal], w[:, col].float()[normal]), col


def test_pack_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_bf16pack.pack(torch.zeros(4, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        cpu_bf16pack.pack(torch.zeros(4, 64))


def _generate(path, monkeypatch, pack: str, batch: int = 1):
    monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "bf16")  # the default on AVX512-BF16 CPUs (tests pin f32)
    monkeypatch.setenv("LOWBIT_PACK_BF16", pack)
    engine = Engine(path, kv_memory=4 << 20)
    head = engine.model.lm_head
    x = torch.randn(1, head.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = head(x)
    prompts = [[256, 72 + i, 101, 108, 108, 111] for i in range(batch)]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return engine, logits, [o.token_ids for o in out]


def test_an_engine_packs_its_bf16_linears_and_generates_the_same_tokens(tiny_float_model, monkeypatch):
    path = tiny_float_model(tie=True)  # bf16 checkpoint, tied head: the head weight is the bf16 embedding
    engine, logits, tokens = _generate(path, monkeypatch, "1")
    model = engine.model
    assert model.lm_head.packed is not None and model.lm_head.packed.shape == (258, 64)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    # the Linears the model calls are packed: the joined q/k/v and gate/up, o and down; the separate
    # projections, views of the joined rows, are not (nothing calls them)
    for linear, rows in ((attn.fused_qkv.linear, attn.q_proj.out_features + 2 * attn.k_proj.out_features),
                         (attn.o_proj, attn.o_proj.out_features), (mlp.fused_gate_up.linear, 2 * mlp.gate_proj.out_features),
                         (mlp.down_proj, mlp.down_proj.out_features)):
        assert linear.packed is not None and linear.packed.shape == (rows, linear.in_features)
    assert all(m.packed is None for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    # counted as the checkpoint names them: every Linear of the model is covered (joined ones by their join)
    linears = sum(1 for m in model.modules() if isinstance(m, cpu_f32.InvariantLinear))
    assert cpu_bf16pack.covered_linears(model) == linears == 7 * len(model.model.layers) + 1
    # the decode chain reads the same packed copies at steps of up to PACKED_MAX_ROWS rows
    chained = engine.runner.chained.chain._layers[0]
    assert chained.qkv.packed and chained.qkv.packed_rows == cpu_f32.PACKED_MAX_ROWS and chained.mlp.down.packed
    unpacked, logits0, tokens0 = _generate(path, monkeypatch, "0")
    assert unpacked.model.lm_head.packed is None and unpacked.model.model.layers[0].self_attn.o_proj.packed is None
    assert torch.equal(_bits(logits), _bits(logits0))
    assert tokens == tokens0 and len(tokens[0]) == 16
    # steps of 3 rows read the packed copies, of 6 the bf16 weights: the same tokens as unpacked
    for batch in (3, 6):
        assert _generate(path, monkeypatch, "1", batch)[2] == _generate(path, monkeypatch, "0", batch)[2]
    # a bf16 engine computes in bf16 (no float32 rows to read a packed copy): nothing is packed
    monkeypatch.setenv("LOWBIT_PACK_BF16", "1")
    model = Engine(path, kv_memory=4 << 20, dtype=torch.bfloat16).model
    assert model.lm_head.packed is None and model.model.layers[0].self_attn.o_proj.packed is None
    monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "f32")  # float32 x: nothing is packed
    model = Engine(path, kv_memory=4 << 20).model
    assert model.lm_head.packed is None and model.model.layers[0].self_attn.o_proj.packed is None


def test_a_weight_that_packs_badly_keeps_no_packed_copy():
    # most blocks of a weight spanning ~40 binades go to the side list: more bytes than bf16
    linears = []
    for w in (_spread(64, 256), (torch.randn(64, 256) * 0.02).bfloat16()):
        linear = torch.nn.Linear(256, 64, bias=False)
        linear.weight = torch.nn.Parameter(w, requires_grad=False)
        linear.__class__ = cpu_f32.InvariantLinear
        linear.bf16_x = True
        linears.append(linear)
    model = torch.nn.Sequential(*linears)
    total = cpu_bf16pack.pack_linears(model)
    spread = cpu_bf16pack.pack(linears[0].weight.data)
    assert spread.esc_block.numel() > cpu_bf16pack.WORTH_PACKING * 64 * 8 and spread.nbytes > 64 * 256 * 2
    # pack_linears asks pack to stop once the count is known: nothing packed, nothing allocated
    assert cpu_bf16pack.pack(linears[0].weight.data, max_escapes=spread.esc_block.numel() - 1) is None
    assert cpu_bf16pack.pack(linears[0].weight.data, max_escapes=spread.esc_block.numel()) is not None
    assert linears[0].packed is None and linears[1].packed is not None
    assert total == linears[1].packed.nbytes < 0.8 * 64 * 256 * 2


def test_an_invariant_linear_reads_its_packed_copy_up_to_four_rows(monkeypatch):
    torch.manual_seed(5)
    linear = torch.nn.Linear(64, 40, bias=True)
    linear.weight.data = linear.weight.data.bfloat16()
    linear.weight.requires_grad_(False)
    linear.bias.requires_grad_(False)
    linear.__class__ = cpu_f32.InvariantLinear
    linear.bf16_x = True
    x = torch.randn(3, 8, 64)
    with torch.no_grad():
        plain = {rows: linear(x.reshape(-1, 64)[:rows]) for rows in range(1, 9)}
        linear.packed = cpu_bf16pack.pack(linear.weight.data)
        calls = []
        real = cpu_bf16pack.matmul
        monkeypatch.setattr(cpu_bf16pack, "matmul", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
        for rows in range(1, 9):
            assert torch.equal(_bits(linear(x.reshape(-1, 64)[:rows])), _bits(plain[rows])), rows
        assert calls == [1, 2, 3, 4] == list(range(1, cpu_f32.PACKED_MAX_ROWS + 1))
        assert torch.equal(linear(x[:1, :2]), plain[2].view(1, 2, 40))  # any leading shape


def test_greedy_speculation_with_a_packed_head_gives_the_tokens_of_plain_decoding(tiny_float_model, monkeypatch):
    # verifies of 1 + 3 rows read the packed head (up to PACKED_MAX_ROWS), plain steps one row
    path = tiny_float_model(tie=True)
    monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "bf16")
    prompt = [[256, 72, 101, 108, 108, 111]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(path, kv_memory=4 << 20)
    spec = Engine(path, kv_memory=4 << 20, draft="self:layers=1", num_speculative_tokens=3)
    assert plain.model.lm_head.packed is not None and spec.model.lm_head.packed is not None
    monkeypatch.setenv("LOWBIT_PACK_BF16", "0")
    unpacked = Engine(path, kv_memory=4 << 20)
    want = unpacked.generate(prompt, greedy)[0].token_ids
    assert plain.generate(prompt, greedy)[0].token_ids == want
    assert spec.generate(prompt, greedy)[0].token_ids == want


def test_eval_scores_without_a_packed_copy(tiny_float_model, monkeypatch):
    # eval's windows are many rows (the bf16 weight's tiles), so its scoring model keeps no packed copy
    from lowbit.runtime.evaluate import _scoring_model

    monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "bf16")
    scorer = _scoring_model(tiny_float_model(tie=True), torch.float32, torch.device("cpu"), 64)
    assert scorer.lm.lm_head.bf16_x and scorer.lm.lm_head.packed is None
