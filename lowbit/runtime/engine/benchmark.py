"""What `lowbit bench` measures, as plain functions returning plain dicts.

- prefill: one long prompt, max_tokens 1: prompt tokens / wall time, the median of PREFILL_RUNS
  prompts after one of the same length as a warm-up (as llama-bench repeats pp512 after a warm-up;
  the first long prompt also pays its first forward's allocations, reported apart as
  `prefill_first_tok_s`); TTFT of a short prompt. The KV pages every timed run writes are faulted
  in before any (Engine.touch_kv), as llama.cpp clears its KV buffer up front.
- decode at batch B: B requests of a short prompt, generating `gen_tokens` each with EOS
  ignored; decode tok/s counts tokens after each request's first, over the time after every
  request has produced it (so prefill is excluded); inter-token latency is the median step.
- weight bandwidth: weight bytes read per decode step (every weight once per step) x steps/s
  at batch 1, beside the machine's streaming read bandwidth measured here (a large buffer sum).
- with a draft: batch-1 greedy decode with and without speculation on the same prompt; the
  outputs must be identical, and speedup and mean acceptance length are reported.
- with a token cascade: greedy decode of the same prompts with and without it, alternating, at
  each batch size; speedup, greedy agreement with the model alone (tokens equal position by
  position) and the share of tokens the cheap model answered.
"""

from __future__ import annotations

import statistics
import time

import torch

from lowbit.kernels.cpu_bf16pack import packed_bytes
from lowbit.runtime.engine.sequence import SamplingParams
from lowbit.runtime.process_memory import resident_bytes

BENCH_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from those used to make wine. Within fifty "
    "years presses were working in more than two hundred cities across Europe, and the number of books grew "
    "from thousands to millions. Printing made texts cheaper, more uniform and easier to share, which changed "
    "how people learned, argued and worshipped. "
)


def stream_bandwidth_gbs(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Attainable read bandwidth: the best time to sum a buffer much larger than the caches."""
    buf = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=device)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        buf.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer, quantized weights (their prepared parts) and
    packed copies (kernels/cpu_bf16pack.py) included."""
    seen, total = set(), packed_bytes(model)[0]
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        prepared = getattr(module, "prepared", None)
        if prepared is not None:
            tensors += list(prepared.tensors.values())
            if prepared.qt is not None:
                tensors += list(prepared.qt.parts().values())
    for t in tensors:
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_weight_bytes(model: torch.nn.Module, unpacked: bool = False, screen=None) -> int:
    """Bytes a one-token decode step streams: all weights except the embedding table (only rows are
    read), unless the lm_head shares it; of a mixture-of-experts block only its top_k experts'
    (runtime/models/moe.py reads no other expert's weights for a token); a packed Linear
    (kernels/cpu_bf16pack.py) by its packed arrays, or with `unpacked` by its bf16 weight (what a
    tool reading the same weights unpacked streams). screen: the head's int8 copy a greedy step
    reads instead of the head (kernels/screened_head.py), counted by its bytes unless `unpacked`
    (the few head rows it rescores, ~0.5 % of the head on SmolLM2, are left out)."""
    from lowbit.runtime.models.moe import SparseMoE

    packed, bf16 = packed_bytes(model)
    total = weight_bytes(model) - (packed if unpacked else bf16)
    if screen is not None and not unpacked:
        head = model.lm_head
        total += screen.nbytes - (head.packed.nbytes if getattr(head, "packed", None) is not None
                                  else head.weight.numel() * head.weight.element_size())
    for module in model.modules():
        if isinstance(module, SparseMoE):
            experts = weight_bytes(module.experts)
            total -= round(experts * (1 - module.top_k / len(module.experts)))
    embed = getattr(model.model.embed_tokens, "weight", None)
    if embed is None:
        return total  # a quantized tied head (runtime/quant_embedding.py): counted once, as the head
    head = getattr(model.lm_head, "weight", None)
    if head is None or head.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total



def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_prompt(tokenizer, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(BENCH_TEXT * (1 + num_tokens // 40))
    return ids[:num_tokens]


def run_requests(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Run prompts together; time to first token per request, step times after all have one."""
    engine.reset_prefix_cache()
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    start = time.perf_counter()
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    step_times, decode_start = [], None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        _sync(engine.device)
        t1 = time.perf_counter()
        if decode_start is not None:
            # per token: a step of several greedy tokens a sequence (multi_step.py) counts as that many
            step_times.append((t1 - t0) / max([len(out.new_token_ids) for out in outs], default=1))
        for out in outs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = t1 - start
            tokens[out.request_id] += out.new_token_ids
        if decode_start is None and len(first) == len(ids):
            decode_start = t1
    end = time.perf_counter()
    decode_tokens = sum(len(t) - 1 for t in tokens.values())
    decode_time = end - (decode_start or end)
    return {
        "tokens": [tokens[rid] for rid in ids],
        "ttft_s": statistics.median(first.values()),
        "decode_tok_s": decode_tokens / decode_time if decode_time > 0 else 0.0,
        "inter_token_latency_ms": 1000 * statistics.median(step_times) if step_times else 0.0,
        "steps": len(step_times),
        "total_s": end - start,
    }


PREFILL_RUNS = 3


def run_bench(engine, batches=(1, 4, 16, 64), prompt_tokens: int = 32, gen_tokens: int = 64,
              prefill_tokens: int = 512, spec_engine=None, cascade_engine=None) -> dict:
    """All of `lowbit bench`'s figures for one engine (no draft). `spec_engine`: the same model
    with a draft, measured against `engine` at batch 1 (None: no speculation figures).
    `cascade_engine`: the same model under a token cascade, against `engine` at each batch size."""
    tok = engine.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    loaded, _ = resident_bytes()  # the engine(s) loaded, nothing run yet
    # warm up: first forwards allocate and pick kernels
    run_requests(engine, [bench_prompt(tok, 16)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    prefill_len = min(prefill_tokens, engine.max_model_len - 2)
    # the pages every timed run below will write, faulted in first (llama.cpp clears its KV buffer
    # when it makes it; a serving pool is written once and reused)
    for e in (engine, spec_engine, cascade_engine):
        if e is not None:
            e.touch_kv(max(batches), prompt_tokens + gen_tokens)
            e.touch_kv(1, prefill_len + 1)
            e.make_head_copies()
    long_prompt = bench_prompt(tok, prefill_len)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    prefill_times = []
    for i in range(1 + PREFILL_RUNS):  # a different first token each: no prefix-cache hits
        t0 = time.perf_counter()
        run_requests(engine, [[(long_prompt[0] + i) % engine.config.vocab_size] + long_prompt[1:]], one_token)
        prefill_times.append(time.perf_counter() - t0)
    prefill_s = statistics.median(prefill_times[1:])
    result = {
        "model": str(engine.model_path),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "device": str(engine.device),
        "threads": torch.get_num_threads(),
        "prefill_tokens": prefill_len,
        "prefill_tok_s": prefill_len / prefill_s,
        "prefill_first_tok_s": prefill_len / prefill_times[0],
        "weight_bytes": weight_bytes(engine.model),
        "packed_bytes": packed_bytes(engine.model)[0],  # of weight_bytes: packed copies (kernels/cpu_bf16pack.py)
        "kv_cache_bytes": engine.cache.nbytes,
        "kv_dtype": str(engine.cache.store_dtype).replace("torch.", "") if engine.cache.kv_dtype != "fp8" else "fp8",
        "kv_blocks": engine.cache.num_blocks,
        "decode": [],
    }
    prompt = bench_prompt(tok, prompt_tokens)
    # distinct prompts (a different first token) so the prefix cache does not share them
    distinct = [[(prompt[0] + i) % engine.config.vocab_size] + prompt[1:] for i in range(max(batches))]
    # The streaming read just before and just after the first decode run, which the roofline
    # compares against: a VM's memory bandwidth can move by half within a minute (33-60 GB/s
    # measured here), so one reading taken at another moment made the ratio swing with it.
    around = [stream_bandwidth_gbs(engine.device)]
    for b in batches:
        if b > engine.scheduler.max_num_seqs:
            continue
        r = run_requests(engine, distinct[:b], greedy)
        result["decode"].append({"batch": b, "decode_tok_s": r["decode_tok_s"], "ttft_s": r["ttft_s"],
                                 "inter_token_latency_ms": r["inter_token_latency_ms"]})
        if len(around) == 1:
            around.append(stream_bandwidth_gbs(engine.device))
    result["stream_bandwidth_gbs"] = statistics.mean(around)
    result["stream_bandwidth_around_gbs"] = around
    one = result["decode"][0]
    # a greedy step of one row takes the head's argmax through its int8 copy where it has one
    chained = engine.runner.chained
    screen = chained.head_screen(now=True) if chained is not None and engine.num_multi_steps else None
    per_step_bytes = decode_weight_bytes(engine.model, screen=screen)
    steps_per_s = 1000 / one["inter_token_latency_ms"] if one["inter_token_latency_ms"] else 0.0
    result["decode_weight_bytes"] = per_step_bytes
    result["head_screen_bytes"] = 0 if screen is None else screen.nbytes  # made at the first greedy call: not in weight_bytes
    result["decode_weight_bytes_unpacked"] = decode_weight_bytes(engine.model, unpacked=True)
    result["weight_bandwidth_gbs"] = per_step_bytes * steps_per_s / 1e9
    result["ttft_s"] = one["ttft_s"]
    if spec_engine is not None:
        run_requests(spec_engine, [bench_prompt(tok, 16)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        result["speculative"] = speculation(spec_engine, engine, prompt, gen_tokens)
    if cascade_engine is not None:
        run_requests(cascade_engine, [bench_prompt(tok, 16)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        result["cascade"] = [token_cascade(cascade_engine, engine, distinct[:b], gen_tokens, b) for b in batches
                             if b <= engine.scheduler.max_num_seqs]
    # the process's memory (the KV cache allocated up front included): what a machine must hold
    result["resident_bytes_loaded"] = loaded
    result["resident_bytes_peak"] = resident_bytes()[1]
    return result


def token_cascade(engine, baseline, prompts: list[list[int]], gen_tokens: int, batch: int) -> dict:
    """`engine` (a token cascade) against `baseline` (the model alone): the same prompts, `batch` at
    a time, the two alternating; decode tok/s over all of them, greedy agreement, cheap share."""
    greedy = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    before = engine.stats()
    time_of = {"cascade": 0.0, "plain": 0.0}
    same = total = 0
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        plain = run_requests(baseline, group, greedy)
        cascade = run_requests(engine, group, greedy)
        decoded = len(group) * (gen_tokens - 1)
        time_of["plain"] += decoded / plain["decode_tok_s"]
        time_of["cascade"] += decoded / cascade["decode_tok_s"]
        for ours, theirs in zip(cascade["tokens"], plain["tokens"]):
            same += sum(x == y for x, y in zip(ours, theirs))
            total += len(theirs)
    after = engine.stats()
    cheap = after.cascade_cheap_tokens - before.cascade_cheap_tokens
    full = after.cascade_full_tokens - before.cascade_full_tokens
    decoded = len(prompts) * (gen_tokens - 1)
    return {
        "batch": batch,
        "threshold": engine.cascade.threshold,
        "tok_s": decoded / time_of["cascade"],
        "plain_tok_s": decoded / time_of["plain"],
        "speedup": time_of["plain"] / time_of["cascade"],
        "greedy_agreement_pct": 100 * same / total,
        "cheap_rate": cheap / (cheap + full) if cheap + full else 0.0,
    }


def speculation(engine, baseline, prompt: list[int], gen_tokens: int) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    before = engine.stats()
    passes_before = engine.spec_stats.num_passes
    spec = run_requests(engine, [prompt], greedy)
    after = engine.stats()
    plain = run_requests(baseline, [prompt], greedy)
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    passes = engine.spec_stats.num_passes - passes_before
    spec_tok_s = gen_tokens / spec["total_s"]
    plain_tok_s = gen_tokens / plain["total_s"]
    return {
        "draft": engine.draft_kind,
        "draft_vocab": engine.draft_head_vocab,  # tokens the draft's head scores (None: all)
        "identical_output": spec["tokens"] == plain["tokens"],
        "tok_s": spec_tok_s,
        "plain_tok_s": plain_tok_s,
        "speedup": spec_tok_s / plain_tok_s,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + passes) / passes if passes else 0.0,
    }


def kv_cache_kld(engine_model, tokens: list[int], kv_dtype: str, block_size: int = 16) -> dict:
    """Mean KL(full-precision KV || quantized KV) of next-token distributions over one window of
    `tokens`, both through the paged path (what `lowbit eval --base` computes, with the KV cache
    as the only difference)."""
    from lowbit.runtime.engine.model_runner import ModelRunner, Work
    from lowbit.runtime.engine.paged_cache import PagedKVCache

    model = engine_model
    w = model.model.norm.weight  # the compute dtype and device
    blocks = -(-len(tokens) // block_size)
    logp = {}
    for kind in (None, kv_dtype):
        cache = PagedKVCache(model.config, blocks, block_size, w.dtype, w.device, kind)
        logits = ModelRunner(model, cache).run([Work(list(range(blocks)), 0, tokens, len(tokens))])
        logp[kind] = logits.float().log_softmax(-1)
    p, q = logp[None], logp[kv_dtype]
    kld = (p.exp() * (p - q)).sum(-1)
    same = (p.argmax(-1) == q.argmax(-1)).float().mean()
    return {"kv_dtype": kv_dtype, "tokens": len(tokens), "mean_kld": float(kld.mean()), "top1_agreement": float(same)}
