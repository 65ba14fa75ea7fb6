"""The one-call decode step (native/decode_layers.c through runtime/engine/decode_chain.py): every
step it takes gives hidden states bit for bit equal to the model's own forward over the same cache,
for dense float32 models (float32 and bf16-stored weights), int4 models, batched decode rows,
speculative verifies and the self:layers draft; models it cannot run say why and keep their path."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import cpu_f32, cpu_int4dot, cpu_int8, decode_chain as kernel_chain
from lowbit.runtime.engine import decode_chain
from lowbit.runtime.engine.draft_models import quantize_linears_
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from tests.runtime.engine.test_engine import prompts

pytestmark = pytest.mark.skipif(not (kernel_chain.available() and cpu_f32.available()),
                                reason="the C kernels of the one-call step are not built here")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _checked(runner) -> list[int]:
    """Make every chained step of `runner` also run the model's forward over the same cache and
    compare bit for bit; returns a list that collects each checked step's row count."""
    chained = runner.chained
    real = chained.forward
    rows: list[int] = []

    def both(ids, positions, max_position, meta):
        got = real(ids, positions, max_position, meta).clone()
        # the Python path writes the same K/V at the same slots, so running it second is harmless
        want = runner.model.model(torch.tensor([ids]), positions, max_position, runner.cache)[0]
        assert torch.equal(got, want), f"chained step of {len(ids)} rows differs from the model's forward"
        rows.append(len(ids))
        return got

    chained.forward = both
    return rows


def _engine(path, quantize: str | None = None, **kw) -> Engine:
    # one step a call unless asked (the checks below wrap the runner's one-step forward)
    engine = Engine(path, kv_memory=4 << 20, **{"decode_steps": 1, **kw})
    if quantize:
        quantize_linears_(engine.model, quantize, engine.device)
    return engine


def _setup(tiny_float_model, family: str, weights: str, monkeypatch):
    """A 3-layer tiny model for one `weights` case (skipped where its kernel is missing)."""
    if weights == "int4" and not cpu_int4dot.available() or weights.startswith("int8") and not cpu_int8.available():
        pytest.skip(f"no {weights} kernel on this machine")
    if weights == "int8-w8a8":  # 8-bit codes with int8 activations (Q8_0's arithmetic; the default on VNNI CPUs)
        if not cpu_int4dot.vnni_int8_available():
            pytest.skip("no AVX512-VNNI here: 8-bit codes have no int8-activation kernel")
        monkeypatch.setenv("LOWBIT_INT8_ACTIVATIONS", "int8")
    if weights == "bf16-a16":  # --dense-activations bf16: x rounded to bf16 for every bf16 Linear, chain and path alike
        if not cpu_f32.bf16_available():
            pytest.skip("no AVX512-BF16 here")
        monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "bf16")
    return tiny_float_model(family=family, dtype=torch.float32 if weights == "float32" else torch.bfloat16, layers=3)


QUANTIZED = {"int4": "int4-g32", "int8": "int8", "int8-g32": "int8-g32", "int8-w8a8": "int8-g32"}
KINDS = {"int4": 1, "bf16-stored": 2, "float32": 2, "int8": 3, "int8-g32": 3, "int8-w8a8": 1, "bf16-a16": 2, "kv-f32": 2}


@pytest.mark.parametrize("family, weights", [("llama", "bf16-stored"), ("llama", "float32"), ("llama", "int4"),
                                             ("llama", "int8"), ("llama", "int8-g32"), ("llama", "int8-w8a8"),
                                             ("llama", "bf16-a16"), ("gemma3", "bf16-stored"), ("gemma3", "int4"),
                                             ("gemma3", "bf16-a16"), ("llama", "kv-f32"), ("gemma3", "kv-f32")])
def test_chained_steps_equal_the_model_forward(tiny_float_model, family, weights, monkeypatch):
    # Gemma-3: (1 + w) norms, q/k norms, post-norms, GeGLU, embedding scale, sliding and global layers
    path = _setup(tiny_float_model, family, weights, monkeypatch)
    # a bf16 checkpoint's cache is bf16 by default (keys and values rounded, read against float32
    # queries); kv-f32 asks for the float32 pool
    kw = {"kv_dtype": "f32"} if weights == "kv-f32" else {}
    engine = _engine(path, QUANTIZED.get(weights), **kw)
    assert decode_chain.why_not(engine.model, engine.cache) is None
    assert engine.cache.keys[0].dtype == (torch.float32 if weights in ("float32", "kv-f32") else torch.bfloat16)
    rows = _checked(engine.runner)
    outs = engine.generate(prompts(4), GREEDY)
    # (quantized: rebuilt after the in-place quantization)
    assert engine.runner.chained.chain._keep[0].qkv.struct.kind == KINDS[weights]
    bf16_fn = kernel_chain.entry(kernel_chain.f32_dot.library(), "lowbit_bf16xw_matmul")
    assert (engine.runner.chained.chain._keep[0].qkv.struct.fn == bf16_fn) == (weights == "bf16-a16")
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert rows and max(rows) > 1  # batched decode rows went through the chain, each checked
    # and the tokens equal a run with the chain off
    plain = _engine(path, QUANTIZED.get(weights), **kw)
    plain.runner.chained = None
    assert [o.token_ids for o in plain.generate(prompts(4), GREEDY)] == [o.token_ids for o in outs]


def test_speculative_verifies_and_the_layer_draft_take_the_chain(tiny_float_model):
    path = tiny_float_model(layers=3)
    engine = _engine(path, draft="self:layers=1", num_speculative_tokens=3)
    target_rows = _checked(engine.runner)
    draft_rows = _checked(engine.drafter.runner)
    assert engine.drafter.runner.chained.chain.num_layers == 1
    ps = [p + p for p in prompts(3)]
    got = [o.token_ids for o in engine.generate(ps, GREEDY)]
    assert any(r > 3 for r in target_rows)  # verifies of several rows per sequence
    assert draft_rows
    plain = _engine(path)
    plain.runner.chained = None
    assert got == [o.token_ids for o in plain.generate(ps, GREEDY)]


def test_a_swapped_module_rebuilds_the_chain(tiny_float_model):
    if not cpu_int4dot.available():
        pytest.skip("no int4 kernel on this machine")
    engine = _engine(tiny_float_model())
    before = engine.runner.chained.chain
    quantize_linears_(engine.model, "int4-g32", engine.device)  # after the engine was built (bench/decode.py does)
    rows = _checked(engine.runner)
    engine.generate(prompts(2), GREEDY)
    assert rows and engine.runner.chained.chain is not before
    assert engine.runner.chained.chain._keep[0].qkv.struct.kind == 1


def test_a_leaf_assigned_after_steps_rebuilds_the_chain(tiny_float_model):
    # the full slot check runs only after a module assignment somewhere (runtime/module_swaps.py):
    # one made between steps, deep inside a layer, must still be seen, and its numbers used
    import copy

    engine = _engine(tiny_float_model())
    engine.generate(prompts(1), GREEDY)
    before = engine.runner.chained.chain
    attn = engine.model.model.layers[1].self_attn
    swapped = copy.deepcopy(attn.o_proj)
    swapped.weight.data.mul_(-1)
    attn.o_proj = swapped
    rows = _checked(engine.runner)
    got = [o.token_ids for o in engine.generate(prompts(2), GREEDY)]
    assert rows and engine.runner.chained.chain is not before
    plain = _engine(tiny_float_model())
    plain.runner.chained = None
    plain.model.model.layers[1].self_attn.o_proj.weight.data.mul_(-1)
    assert got == [o.token_ids for o in plain.generate(prompts(2), GREEDY)]


def test_a_hooked_layer_keeps_steps_off_the_chain_until_the_hook_goes(tiny_float_model):
    engine = _engine(tiny_float_model())
    rows = _checked(engine.runner)
    seen = []
    handle = engine.model.model.layers[1].register_forward_hook(lambda module, args, out: seen.append(1))
    engine.generate(prompts(1), GREEDY)
    assert seen and not rows  # every step went through the modules, so the hook saw them
    handle.remove()
    seen.clear()
    engine.generate(prompts(1), GREEDY)
    assert rows and not seen


def test_qk_norm_layers_take_the_chain(tmp_path):
    # Qwen3: per-head q/k RMSNorm in a Llama-family layer
    from tests.runtime.engine.conftest import save_with_tokenizer
    from tests.runtime.conftest import build_hf
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=258, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    save_with_tokenizer(build_hf(config), tmp_path)
    engine = _engine(tmp_path)
    assert engine.runner.chained.chain._keep[0].q_norm is not None
    rows = _checked(engine.runner)
    engine.generate(prompts(3), GREEDY)
    assert rows


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("head", ["int8-g32", "int8-g64-sbf16", "int8-g32-sfp32", "int8-channel", "int4-g32",
                                  "int4-asym-g64", "int4-asym-channel-sbf16"])
def test_a_quantized_tied_head_embeds_in_the_step(tiny_float_model, tmp_path, family, head):
    # `quantize --quantize-head` on a tied model: the embedding reads its rows from the int8 / int4 head
    # (QuantEmbedding); the C step dequantizes them itself, bit for bit as QuantEmbedding does
    # (_checked compares every step with the model's forward, whose embedding is QuantEmbedding's),
    # Gemma's sqrt(96) scale included; float16, bf16 and float32 scales, a part group (96 = 64 + 32), one per row,
    # symmetric and asymmetric 4-bit codes
    from lowbit.compress.pipeline import quantize_model
    from lowbit.compress.recipe import parse_recipe
    from lowbit.runtime.quant_embedding import QuantEmbedding

    recipe = parse_recipe([{"pattern": "lm_head", "format": head}, {"pattern": "*", "format": "int4-g32"}])
    out = tmp_path / "q"
    quantize_model(tiny_float_model(family=family, tie=True, hidden=96, layers=2), recipe, out_dir=out, quantize_head=True)
    engine = _engine(out)
    assert type(engine.model.model.embed_tokens) is QuantEmbedding
    made = []
    real = kernel_chain.Embedding

    def spy(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    import lowbit.runtime.engine.decode_chain as runtime_chain
    runtime_chain.decode_chain.Embedding = spy
    try:
        rows = _checked(engine.runner)
        outs = engine.generate(prompts(3), GREEDY)
    finally:
        runtime_chain.decode_chain.Embedding = real
    assert rows and made and all(e.scales is not None for e in made)  # the C step embedded every step
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    # several greedy steps a call: the quantized head's own kernel and the embedding from its codes
    multi = _engine(out, decode_steps=8)
    assert [o.token_ids for o in multi.generate(prompts(3), GREEDY)] == [o.token_ids for o in outs]
    assert multi.num_multi_steps > 0


@pytest.mark.parametrize("case, reason", [
    ("bf16", "float32 model over the paged float32 cache"),
    ("kv-int8", "float32 model over the paged float32 cache"),
])
def test_models_it_cannot_run_say_why_and_keep_their_path(tiny_float_model, case, reason):
    path = tiny_float_model()
    kw = {"dtype": "bfloat16"} if case == "bf16" else {"kv_dtype": "int8"}
    engine = _engine(path, **kw)
    assert reason in decode_chain.why_not(engine.model, engine.cache)
    assert engine.runner.chained is None
    assert len(engine.generate(prompts(1), GREEDY)[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("case, weights", [("mixtral", "bf16-stored"), ("mixtral", "int4"), ("qwen2_moe", "bf16-stored"),
                                           ("qwen3_moe", "bf16-stored"), ("olmoe", "int4")])
def test_moe_layers_take_the_chain_and_route_alike(tmp_path, case, weights):
    # Mixtral; Qwen2-MoE's shared expert and dense layer; Qwen3-MoE's renormalized top-k, q/k norms and
    # dense layer; OLMoE's whole-projection q/k norms: every chained step equals the model's forward
    from tests.runtime.moe_models import save_moe

    if weights == "int4" and not cpu_int4dot.available():
        pytest.skip("no int4 kernel on this machine")
    save_moe(case, tmp_path)
    engine = _engine(tmp_path, QUANTIZED.get(weights))
    rows = _checked(engine.runner)
    outs = engine.generate(prompts(4), GREEDY)
    assert any(isinstance(spec.mlp, kernel_chain.MoESpec) for spec in engine.runner.chained.chain._keep)
    assert rows and max(rows) > 1
    plain = _engine(tmp_path, QUANTIZED.get(weights))
    plain.runner.chained = None
    assert [o.token_ids for o in plain.generate(prompts(4), GREEDY)] == [o.token_ids for o in outs]


def test_a_step_mixing_decodes_and_prefill_chunks_runs_whole_on_the_chain(tiny_float_model):
    # decodes already running when longer prompts arrive: with the fused CPU attention every item
    # of those steps (prefill chunks included) goes through the chain in one forward, with the
    # outputs of the layer-by-layer forward; without it (torch's SDPA, no chain) the step is one
    # layer-by-layer forward too, with the same tokens
    if not cpu_int4dot.available():
        pytest.skip("no int4 kernel on this machine")
    path = tiny_float_model(family="llama", dtype=torch.bfloat16, layers=3)
    late = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)

    def run(engine):
        for i, p in enumerate(prompts(2)):
            engine.add_request(f"early{i}", p, GREEDY)
        for _ in range(3):
            engine.step()  # the early ones are decoding now
        for i, p in enumerate(prompts(5, seed=1)[2:]):  # 40, 9 and 33 tokens: prefill chunks
            engine.add_request(f"late{i}", p, late)
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                got = outs.setdefault(o.request_id, {"tokens": [], "prompt": None})
                got["tokens"] += o.new_token_ids
                if o.prompt_logprobs is not None:
                    got["prompt"] = [None if e is None else (e.token_id, e.logprob, e.rank, e.top) for e in o.prompt_logprobs]
        return outs

    def traced(engine):
        runner, calls = engine.runner, []
        real = runner._forward
        runner._forward = lambda works, argmax=False: calls.append([len(w.token_ids) for w in works]) or real(works, argmax)
        return calls, _checked(runner)

    engine = _engine(path, "int4-g32")
    assert engine.cache.fused_decode
    calls, rows = traced(engine)
    whole = run(engine)
    assert any(min(c) <= 8 < max(c) for c in calls)  # mixed steps, each one forward
    assert max(rows) > 8  # ... through the chain, prefill rows and all
    plain = _engine(path, "int4-g32")
    plain.runner.chained = None  # one forward a step, layer by layer
    assert run(plain) == whole  # the same tokens and prompt log-probs, bit for bit
    unfused = _engine(path, "int4-g32")
    unfused.cache.fused_decode = False  # torch's SDPA, layer by layer (the chain needs the fused attention)
    calls, rows = traced(unfused)
    unfused_out = run(unfused)
    assert any(min(c) <= 8 < max(c) for c in calls) and not rows  # mixed steps, each one forward, none chained
    assert {k: v["tokens"] for k, v in unfused_out.items()} == {k: v["tokens"] for k, v in whole.items()}
    for k, v in unfused_out.items():  # another attention's arithmetic for the chunks: close, not equal
        if v["prompt"] is not None:
            for a, b in zip(v["prompt"], whole[k]["prompt"]):
                assert (a is None) == (b is None) and (a is None or abs(a[1] - b[1]) < 1e-3), (k, a, b)


@pytest.fixture
def two_threads():
    # the one-region step needs two threads (OpenMP runs them on one core too)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _team_checked(chained) -> list[int]:
    """Make every chained step run twice, with a region per kernel (team off) and then in one
    region, and compare bit for bit; returns a list that collects each checked step's row count."""
    real = chained.forward
    rows: list[int] = []

    def both(ids, positions, max_position, meta):
        struct = chained.chain._chain
        assert struct.team == 1 and struct.paged_write and struct.paged_attend
        struct.team = 0
        alone = real(ids, positions, max_position, meta).clone()  # K/V written twice: the same values
        struct.team = 1
        got = real(ids, positions, max_position, meta)
        assert torch.equal(got, alone), f"the one-region step of {len(ids)} rows differs"
        rows.append(len(ids))
        return got

    chained.forward = both
    return rows


@pytest.mark.parametrize("family, weights", [("llama", "int4"), ("llama", "bf16-a16"), ("llama", "int8-g32"),
                                             ("llama", "float32"), ("gemma3", "int4"), ("gemma3", "kv-f32")])
def test_the_one_region_step_equals_a_region_per_kernel(tiny_float_model, family, weights, monkeypatch, two_threads):
    # native/decode_layers.c run_layers: on 2+ threads a step runs in one OpenMP region, every
    # kernel called as a part (lowbit_native.h); each step, decodes, batched rows and prefill
    # chunks, gives the very bits of the same step with a region per kernel (team off)
    if weights == "int4" and not cpu_int4dot.available() or weights.startswith("int8") and not cpu_int8.available():
        pytest.skip(f"no {weights} kernel on this machine")
    if weights == "bf16-a16":
        if not cpu_f32.bf16_available():
            pytest.skip("no AVX512-BF16 here")
        monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "bf16")
    path = tiny_float_model(family=family, dtype=torch.float32 if weights == "float32" else torch.bfloat16, layers=3)
    kw = {"kv_dtype": "f32"} if weights == "kv-f32" else {}  # (a bf16 checkpoint's default pool is bf16)
    engine = _engine(path, QUANTIZED.get(weights), **kw)
    rows = _team_checked(engine.runner.chained)
    engine.generate([p * 3 for p in prompts(4)], GREEDY)  # prefill chunks, then 4 rows a step
    engine.generate(prompts(1, seed=2), GREEDY)  # one row a step
    # (grouped int8 weights send steps past their kernel's rows, prefill chunks, another way)
    assert 4 in rows and 1 in rows and (max(rows) > 4 or engine.runner.chained.chain.max_rows is not None)


@pytest.mark.parametrize("weights", ["int4", "bf16-a16"])
def test_steps_of_fewer_rows_than_threads_norm_on_every_thread_alike(tiny_float_model, weights, monkeypatch):
    # run_layers' solo steps (rows < threads): each thread norms the rows whole, helpers into their
    # own buffers, the residual alternating between two; three threads make steps of one and two
    # rows solo (two helpers), four rows not: every step equals the region-per-kernel step
    if weights == "int4" and not cpu_int4dot.available() or weights == "bf16-a16" and not cpu_f32.bf16_available():
        pytest.skip(f"no {weights} kernel on this machine")
    if weights == "bf16-a16":
        monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "bf16")
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        engine = _engine(tiny_float_model(family="gemma3", dtype=torch.bfloat16, layers=3), QUANTIZED.get(weights))
        rows = _team_checked(engine.runner.chained)
        for batch in (1, 2, 4):
            engine.generate(prompts(batch, seed=batch), GREEDY)
    finally:
        torch.set_num_threads(threads)
    assert {1, 2, 4} <= set(rows)


@pytest.mark.parametrize("case, weights", [("mixtral", "int4"), ("qwen2_moe", "bf16-stored"), ("qwen3_moe", "bf16-stored")])
def test_the_one_region_step_routes_moe_layers_alike(tmp_path, case, weights, two_threads):
    # team_moe: routing, gathers and scatter-adds on part 0, each routed expert's and the shared
    # expert's MLP as parts: every step's bits equal the region-per-kernel step's
    from tests.runtime.moe_models import save_moe

    if weights == "int4" and not cpu_int4dot.available():
        pytest.skip("no int4 kernel on this machine")
    save_moe(case, tmp_path)
    engine = _engine(tmp_path, QUANTIZED.get(weights))
    assert any(isinstance(spec.mlp, kernel_chain.MoESpec) for spec in engine.runner.chained.chain._keep)
    rows = _team_checked(engine.runner.chained)
    engine.generate(prompts(4), GREEDY)
    engine.generate(prompts(1, seed=2), GREEDY)
    assert 4 in rows and 1 in rows


def test_a_moe_step_with_more_routed_rows_than_one_batch_routes_alike(tmp_path):
    # The routed experts of a step run in batches whose rows fit the step's scratch (decode_layers.c
    # team_moe): all of them at once while rows x top-k <= 256, else batches of up to `rows` rows.
    # A prefill of 170 tokens through the chain (340 routed rows) takes several batches: still the
    # model's forward bit for bit, and the same tokens as the layer-by-layer path.
    from tests.runtime.moe_models import save_moe

    if not cpu_int4dot.available():
        pytest.skip("no int4 kernel on this machine")
    save_moe("mixtral", tmp_path)
    engine = _engine(tmp_path, QUANTIZED.get("int4"), max_prefill_tokens=512)
    rows = _checked(engine.runner)
    long = [[3 + (i * 7) % 250 for i in range(90)], [5 + (i * 11) % 250 for i in range(80)]]
    outs = engine.generate(long, GREEDY)
    assert max(rows) * 2 > 256
    plain = _engine(tmp_path, QUANTIZED.get("int4"), max_prefill_tokens=512)
    plain.runner.chained = None
    assert [o.token_ids for o in plain.generate(long, GREEDY)] == [o.token_ids for o in outs]


# -- several greedy steps in one C call (runtime/engine/multi_step.py) ------------------------------


@pytest.mark.parametrize("family, weights", [("llama", "int4"), ("llama", "float32"), ("llama", "int8-w8a8"),
                                             ("llama", "bf16-a16"), ("gemma3", "int4"), ("gemma3", "bf16-stored")])
def test_multi_step_decode_gives_the_single_steps_tokens(tiny_float_model, family, weights, monkeypatch):
    # Gemma-3: the embedding scale, q/k norms, sliding and global layers, each step in C in turn
    path = _setup(tiny_float_model, family, weights, monkeypatch)
    multi = _engine(path, QUANTIZED.get(weights), decode_steps=8)
    single = _engine(path, QUANTIZED.get(weights))
    # lengths that end inside a call of 8 steps, and a batch whose rows differ in length
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 13, 21, 30)]
    got = [o.token_ids for o in multi.generate(prompts(4), params)]
    assert multi.num_multi_steps > 0 and single.num_multi_steps == 0
    assert got == [o.token_ids for o in single.generate(prompts(4), params)]
    assert [len(t) for t in got] == [5, 13, 21, 30]


@pytest.fixture
def screened_head(monkeypatch):
    """kernels/screened_head.py, with the head's int8 copy made from the first greedy token; skips
    where the CPU has no AVX512-VNNI (the copy's kernel). Tests turn the copy on or off themselves."""
    from lowbit.kernels import screened_head

    if screened_head.build(torch.zeros(16, 32), False) is None:
        pytest.skip("no AVX512-VNNI here")
    monkeypatch.setenv(screened_head.AFTER_ENV, "0")
    return screened_head


@pytest.mark.parametrize("weights", ["bf16-stored", "float32", "bf16-a16"])
def test_multi_step_argmax_through_the_heads_int8_copy_gives_the_same_tokens(tiny_float_model, weights, monkeypatch, screened_head):
    """A dense head's several-step argmax goes through its int8 copy (kernels/screened_head.py) where
    the CPU has AVX512-VNNI: the tokens of one step at a time, and of the copy turned off."""
    path = _setup(tiny_float_model, "llama", weights, monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 19, 26)]
    runs = []
    for screen in ("1", "0"):
        monkeypatch.setenv(screened_head.ENV, screen)
        multi = _engine(path, decode_steps=8)
        runs.append([o.token_ids for o in multi.generate(prompts(3), params)])
        assert multi.num_multi_steps > 0
        assert (multi.runner.chained.head_screen() is not None) == (screen == "1")
    assert runs[0] == runs[1] == [o.token_ids for o in _engine(path).generate(prompts(3), params)]


def test_multi_step_argmax_of_more_rows_than_a_screen_pass_gives_the_same_tokens(tiny_float_model, monkeypatch, screened_head):
    """70 sequences in one several-step call: the head's screen runs a pass of 64 rows and one of 6
    (decode_layers.c screened_argmax), and the tokens are those of the copy turned off and of one
    step at a time."""
    path = _setup(tiny_float_model, "llama", "bf16-stored", monkeypatch)
    gen = torch.Generator().manual_seed(3)
    seventy = [torch.randint(3, 256, (3 + i % 9,), generator=gen).tolist() for i in range(70)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    runs = []
    for screen in ("1", "0"):
        monkeypatch.setenv(screened_head.ENV, screen)
        multi = Engine(path, kv_memory=64 << 20, decode_steps=8, max_num_seqs=80)  # room for all 70 at once
        rows = []
        real = multi.runner.decode_steps

        def decode_steps(works, steps, head, real=real, rows=rows):
            rows.append(len(works))
            return real(works, steps, head)

        multi.runner.decode_steps = decode_steps
        runs.append([o.token_ids for o in multi.generate(seventy, params)])
        assert 70 in rows
        assert (multi.runner.chained.head_screen() is not None) == (screen == "1")
    one_at_a_time = Engine(path, kv_memory=64 << 20, decode_steps=1, max_num_seqs=80)
    assert runs[0] == runs[1] == [o.token_ids for o in one_at_a_time.generate(seventy, params)]
    assert len({tuple(r) for r in runs[0]}) > 60  # rows that differ, so a row given another's x would show


def test_greedy_verifies_and_steps_take_their_tokens_through_the_heads_int8_copy(tiny_float_model, monkeypatch, screened_head):
    """One step a call with n-gram drafts: the verifies' rows and the plain rows want only their
    argmax, which comes through the head's int8 copy (runner.forward(argmax=True)); the tokens are
    those of the whole head, with drafts or without."""
    path = tiny_float_model(family="llama", dtype=torch.bfloat16, layers=3)
    repetitive = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 9]  # the n-gram drafter finds its drafts in these
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for screen in ("1", "0"):
        monkeypatch.setenv(screened_head.ENV, screen)
        engine = _engine(path, draft="ngram")
        kinds = []
        real = engine.runner.forward

        def forward(works, argmax=False, real=real, kinds=kinds):
            out = real(works, argmax)
            kinds.append((max(w.num_logits for w in works), out.tokens is not None))
            return out

        engine.runner.forward = forward
        runs.append([o.token_ids for o in engine.generate(repetitive, params)])
        assert engine.spec_stats.num_drafted > 0
        by_copy = {rows > 1 for rows, copy in kinds if copy}
        assert by_copy == ({True, False} if screen == "1" else set())  # verifies and plain steps alike
    assert runs[0] == runs[1] == [o.token_ids for o in _engine(path).generate(repetitive, params)]


def test_the_heads_int8_copy_is_made_after_its_first_greedy_tokens(tiny_float_model, monkeypatch, screened_head):
    """A decoder makes the copy once it has taken LOWBIT_HEAD_SCREEN_AFTER greedy tokens through the
    whole head (a short run never pays for it); make_head_copies makes it at once; the tokens stay."""
    path = tiny_float_model(family="llama", dtype=torch.bfloat16, layers=2)
    monkeypatch.setenv(screened_head.AFTER_ENV, "40")
    short = [SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)] * 2
    engine = _engine(path, decode_steps=8)
    first = [o.token_ids for o in engine.generate(prompts(2), short)]
    assert getattr(engine.model.lm_head, "_int8_screen", None) is None and engine.runner.chained.greedy_tokens >= 28
    again = [o.token_ids for o in engine.generate(prompts(2), short)]  # crosses 40 tokens: made midway
    assert engine.model.lm_head._int8_screen[1] is not None and again == first
    fresh = _engine(path, decode_steps=8)
    fresh.make_head_copies()
    assert fresh.model.lm_head._int8_screen[1] is not None and fresh.runner.chained.greedy_tokens == 0
    assert [o.token_ids for o in fresh.generate(prompts(2), short)] == first


def test_multi_step_stops_where_single_steps_stop(tiny_float_model):
    path = tiny_float_model(family="llama", dtype=torch.bfloat16, layers=3)
    single = _engine(path, "int4-g32")
    long = single.generate(prompts(2), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # a stop token first met inside a later call of 8 steps
    out = long[0].token_ids  # (a call's tokens are outputs 1-8, 9-16, ...: index 8k ends one)
    stop = out[next(i for i in range(11, 40) if i % 8 and out[i] not in out[:i])]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    multi = _engine(path, "int4-g32", decode_steps=8)
    got, want = multi.generate(prompts(2), params), single.generate(prompts(2), params)
    assert multi.num_multi_steps > 0
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop and len(got[0].token_ids) % 8 != 1
    # the blocks it cached hold the KV of the tokens it kept: prompts that continue its outputs reuse
    # blocks its several-step calls filled (3 + 40 tokens: positions 3-31 of the first two blocks),
    # and go on as a fresh engine's would
    multi = _engine(path, "int4-g32", decode_steps=8)
    outs = multi.generate(prompts(2), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert multi.num_multi_steps > 0 and [o.token_ids for o in outs] == [o.token_ids for o in long]
    longer = [p + o.token_ids for p, o in zip(prompts(2), outs)]
    more = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    again = multi.generate(longer, more)
    assert [o.token_ids for o in again] == [o.token_ids for o in _engine(path, "int4-g32").generate(longer, more)]
    assert again[0].num_cached_tokens == 32


def test_only_plain_greedy_rows_take_several_steps(tiny_float_model):
    path = tiny_float_model(family="llama", dtype=torch.bfloat16, layers=2)
    for params in (SamplingParams(temperature=0.8, max_tokens=20, seed=3), SamplingParams(temperature=0, max_tokens=20, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3)):
        engine = _engine(path, "int4-g32", decode_steps=8)
        engine.generate(prompts(2), params)
        assert engine.num_multi_steps == 0, params
    engine = _engine(path, "int4-g32", decode_steps=8)
    engine.generate(prompts(2), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert engine.num_multi_steps > 0


def test_multi_step_refuses_nan_logits(tiny_float_model):
    from lowbit.errors import LowbitError

    path = tiny_float_model(family="llama", dtype=torch.bfloat16, layers=2)
    engine = _engine(path, "int4-g32", decode_steps=8)
    engine.add_request("r", prompts(1)[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    engine.model.model.norm.weight.data[0] = float("nan")  # every later step's hidden state, so its logits
    with pytest.raises(LowbitError, match="NaN or inf"):
        engine.step()
    assert engine.num_multi_steps == 0


def test_decode_steps_setting(monkeypatch):
    from lowbit.errors import UsageError
    from lowbit.runtime.engine import multi_step
    from lowbit.runtime.engine.sequence import Sequence

    monkeypatch.delenv(multi_step.STEPS_ENV, raising=False)
    assert multi_step.steps_from_env() == multi_step.DEFAULT_STEPS
    monkeypatch.setenv(multi_step.STEPS_ENV, "3")
    assert multi_step.steps_from_env() == 3
    for bad in ("0", "-2", "eight"):
        monkeypatch.setenv(multi_step.STEPS_ENV, bad)
        with pytest.raises(UsageError, match=multi_step.STEPS_ENV):
            multi_step.steps_from_env()
    # no call runs past a sequence's max_tokens or the model's length
    seqs = [Sequence("a", list(range(10)), SamplingParams(temperature=0, max_tokens=20)),
            Sequence("b", list(range(30)), SamplingParams(temperature=0, max_tokens=5))]
    assert multi_step.steps_for(seqs, 8, 100) == 5
    assert multi_step.steps_for(seqs, 8, 33) == 3
    assert multi_step.steps_for(seqs[:1], 8, 100) == 8


def test_head_screen_after_setting(tiny_float_model, monkeypatch):
    """LOWBIT_HEAD_SCREEN_AFTER takes a whole number >= 0; anything else stops the engine's
    construction with a one-line error (not a silent default, not a failure mid-decode)."""
    from lowbit.errors import UsageError
    from lowbit.kernels import screened_head

    monkeypatch.delenv(screened_head.AFTER_ENV, raising=False)
    assert screened_head.after_tokens() == screened_head.AFTER_TOKENS
    for raw, want in (("0", 0), (" 12 ", 12)):
        monkeypatch.setenv(screened_head.AFTER_ENV, raw)
        assert screened_head.after_tokens() == want
    path = tiny_float_model(family="llama", dtype=torch.bfloat16, layers=1)
    for bad in ("-1", "many", "2.5", "\u00b2"):
        monkeypatch.setenv(screened_head.AFTER_ENV, bad)
        with pytest.raises(UsageError, match=screened_head.AFTER_ENV):
            screened_head.after_tokens()
        with pytest.raises(UsageError, match=screened_head.AFTER_ENV):
            _engine(path)


def test_bench_latency_counts_each_token_of_a_call(tiny_float_model):
    from lowbit.runtime.engine.benchmark import run_requests

    engine = _engine(tiny_float_model(family="llama", dtype=torch.bfloat16, layers=2), "int4-g32", decode_steps=8)
    r = run_requests(engine, prompts(1), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    # the first decode step alone (timed: multi_step.StepClock), then 48 tokens in calls of 8
    assert engine.num_multi_steps == 6 and r["steps"] == 7
    # a call's time over its 8 tokens (it had been the call's whole time: ~8x the per-token figure)
    assert 0.4 < r["inter_token_latency_ms"] / 1000 * r["decode_tok_s"] < 2.5


def test_a_call_takes_the_steps_that_fit_its_time_budget():
    from lowbit.runtime.engine import multi_step

    clock = multi_step.StepClock()
    assert clock.steps_within(16, 8) == 1  # unmeasured: one step, timed
    clock.record(16, 1, 0.012)
    clock.record(1, 8, 0.024)
    assert clock.steps_within(16, 8, budget=0.04) == 3 and clock.steps_within(1, 8, budget=0.04) == 8
    assert clock.steps_within(1, 4, budget=0.04) == 4 and clock.steps_within(16, 8, budget=0.005) == 1
