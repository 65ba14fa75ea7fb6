"""Engine: the step loop that ties scheduler, paged KV cache, model runner, sampler and drafter.

    engine = Engine("smollm2-135m")
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.text_delta, end="")

Each `step()` is one scheduler plan run as ONE model forward (prefill chunks and decodes mixed,
flattened); with a drafter, the decodes first get k draft tokens and the forward verifies them.
Outputs carry the new token ids and the new text (incremental detokenization, stop strings cut
and never streamed). With `SamplingParams.prompt_logprobs`, the prompt's log-probs come from the
same forwards as its prefill chunks (the sequence skips the prefix cache: they are recomputed, not
stored) and ride on the request's first output. See docs/engine.md.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.quant.dtypes import parse_dtype
from lowbit.kernels import hugepages, screened_head
from lowbit.kernels.cpu_f32 import bf16_available
from lowbit.runtime.cascade import CascadeSettings, CascadeStats
from lowbit.runtime.engine.block_manager import BlockManager
from lowbit.runtime.engine.detokenizer import IncrementalDetokenizer
from lowbit.runtime.engine.engine_model import load_engine_model
from lowbit.runtime.engine.draft_vocab import check_draft_vocab, draft_vocabulary
from lowbit.runtime.engine.drafter import LayerPrefixDrafter, ModelDrafter, NgramDrafter, parse_draft
from lowbit.runtime.engine import multi_step
from lowbit.runtime.engine.model_runner import ModelRunner, PromptLogprob, Work
from lowbit.runtime.engine.paged_cache import PagedKVCache, kv_bytes_per_token, resolve_kv_dtype
from lowbit.runtime.engine.sampler import Sampler, _logprobs, _uses_outputs, greedy, nonfinite, process_logits
from lowbit.runtime.engine.scheduler import Scheduler
from lowbit.runtime.engine.sequence import SamplingParams, Sequence
from lowbit.runtime.engine.speculative import AdaptiveK, SpecStats, rejection_sample

LogprobEntry = tuple[float, list[tuple[int, float]]]  # (chosen token's logprob, top-n (id, logprob))


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[LogprobEntry] | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int
    # With SamplingParams.prompt_logprobs, on the first output only: None for the first prompt
    # token (nothing predicts it), then one PromptLogprob per prompt token.
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(slots=True)
class Completion:
    """One finished request, as `Engine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[LogprobEntry] | None
    num_cached_tokens: int
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_mean_accepted_length: float  # tokens per target pass on drafted sequences (accepted + 1)
    cascade_cheap_tokens: int = 0  # token cascade: decode tokens the cheap model answered
    cascade_full_tokens: int = 0  # and those the model took


def default_kv_memory(device: torch.device) -> int:
    """A fifth of the memory that is free now (CPU: MemAvailable), capped at 4 GiB on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return min(int(available * 0.2), 4 << 30)


# A CPU prefills ~2 ms a token (SmolLM2-135M, 2 cores): several prompts in one step make every
# one of them wait for all, and stall the running decodes as long. 128 tokens a step took
# guidellm's TTFT p50 from 765 to 432 ms at 4 concurrent and from 3.3 to 0.8 s at 16, at -4..+7 %
# output tok/s (docs/engine.md, "Scheduling").
CPU_MAX_PREFILL_TOKENS = 128


class Engine:
    def __init__(self, model: str | Path, *, dtype=torch.float32, device: str | torch.device | None = None,
                 kv_memory: int | None = None, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, kv_dtype: str | None = None, draft: str | None = None,
                 num_speculative_tokens: int = 4, max_prefill_tokens: int | None = None,
                 quantize_to: str | None = None, cascade: CascadeSettings | None = None,
                 draft_vocab: int | None = None, decode_steps: int | None = None):
        """decode_steps: the most greedy decode steps one C call may take (multi_step.py; None:
        LOWBIT_DECODE_STEPS or its default, 1: one at a time). max_prefill_tokens: while other sequences run or wait, a step prefills at most this many
        prompt tokens (a lone prompt takes the whole max_num_batched_tokens); None: CPU_MAX_PREFILL_TOKENS
        on a CPU, no cap elsewhere. quantize_to: a format the model's Linears are RTN-quantized to as
        it loads (the `self:FORMAT` rule of drafts; serve --cascade self:int4 runs such a copy).
        cascade: a token cascade instead of speculation: the draft is the cheap model, its tokens
        stand unverified where its confidence clears the threshold and the others are verified
        (_verify). draft_vocab: the tokens a draft's quantized head scores (draft_vocab.py; None:
        automatic, 0: all, N: the N most frequent); a cascade's cheap model scores all."""
        from lowbit.formats.resolve import resolve_model
        from lowbit.runtime.tokenizer import load_tokenizer

        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # torch's bf16 matmuls on a CPU without AVX512-BF16 measured 3.6x slower at prefill than
        # float32 on an AVX2 machine: say so once, since the user asked for bf16 to go faster
        fast_bf16 = self.device.type != "cpu" or bf16_available()
        if self.dtype is torch.bfloat16 and not fast_bf16:
            print("lowbit: note: this CPU has no AVX512-BF16, so bf16 matmuls run through torch's slower path; "
                  "float32 (--dtype f32, the default) is faster here", file=sys.stderr)
        path = resolve_model(model)
        self.model_path = path
        self.tokenizer = load_tokenizer(path)  # first: a missing or bad tokenizer fails before seconds of loading
        self.model = load_engine_model(path, self.dtype, self.device, quantize_to)
        self.config = self.model.config
        if num_speculative_tokens < 1:
            raise UsageError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens

        draft_kind, draft_arg = parse_draft(draft)
        self.draft_kind = draft_kind
        if cascade is not None and draft_kind not in ("self", "layers", "model"):
            raise UsageError("a token cascade needs a cheap model: self:FORMAT (e.g. self:int4), self:layers=N "
                             "or a model with the same tokenizer")
        self.cascade = cascade
        self.cascade_stats = CascadeStats()
        draft_model = None
        # a draft's head over the frequent tokens only (CPU drafts: the head a draft reads whole)
        check_draft_vocab(draft_vocab)  # refused whatever the draft
        head_vocab = None
        if cascade is None and draft_kind in ("self", "model") and self.device.type == "cpu":
            head_vocab = draft_vocabulary(self.tokenizer, draft_vocab, self.config.vocab_size, path)
        # A draft's precision only moves its acceptance rate, never the output (the target
        # verifies every token), so on a GPU a float32 target drafts in bf16, the fast kernels'
        # dtype. On the CPU the draft keeps the target's dtype: float32 compute is what runs the
        # one-call decode step (bf16-stored and quantized weights alike), where a bf16 draft went
        # layer by layer through Python (SmolLM2, self:int4-g32: speculation 0.62x -> 0.87x of plain
        # decoding, Zen 4). A cascade's cheap tokens are emitted unverified, so its cheap model runs
        # in the dtype asked.
        self.draft_dtype = (torch.bfloat16 if self.dtype is torch.float32 and self.device.type != "cpu"
                            and cascade is None else self.dtype)
        if draft_kind == "layers":
            from lowbit.runtime.engine.draft_models import layer_prefix
            from lowbit.runtime.exit_adapters import load_adapters

            # the target's own first layers over its own KV: no weights, no cache of its own; the
            # exit's trained adapter (lowbit distill --exit-layers) where the model has one
            adapter = load_adapters(path, self.config).get(draft_arg)
            draft_model = layer_prefix(self.model, draft_arg, None if adapter is None else adapter.to(self.device),
                                       "--cascade" if cascade is not None else "--draft")
            self.draft_dtype = self.dtype
        elif draft_kind == "self":
            # the target's weights RTN-quantized as they load, placed as the target's are
            draft_model = load_engine_model(path, self.draft_dtype, self.device, quantize_to=draft_arg,
                                            head_vocab=head_vocab)
        elif draft_kind == "model":
            from lowbit.runtime.engine.draft_models import load_draft_model

            draft_model = load_draft_model(draft_arg, self.tokenizer, self.draft_dtype, self.device,
                                           role="--cascade model" if cascade is not None else "draft model",
                                           head_vocab=head_vocab)

        # what the draft's head scores, as loaded (a draft checkpoint's own quantized head keeps every row)
        scored = getattr(getattr(draft_model, "lm_head", None), "vocab", None)
        self.draft_head_vocab = None if scored is None else len(scored)

        # the cache's storage: a bf16 checkpoint's keys and values in bf16 unless asked otherwise
        self.kv_dtype = kv_dtype = resolve_kv_dtype(kv_dtype, self.dtype, self.device, self.config)
        bytes_per_token = kv_bytes_per_token(self.config, self.dtype, kv_dtype)
        # a draft model's own cache dtype (a layer prefix shares the model's cache), by the same
        # rule whatever --kv-dtype says of the model's (its precision only moves acceptance; a
        # cascade's cheap model is the checkpoint's own copy)
        draft_kv = None
        if draft_model is not None and draft_kind != "layers":
            draft_kv = resolve_kv_dtype(None, self.draft_dtype, self.device, draft_model.config)
            bytes_per_token += kv_bytes_per_token(draft_model.config, self.draft_dtype, draft_kv)
        limit = self.config.max_position_embeddings
        if kv_memory is None:
            # a share of free memory, but no more than max_num_seqs sequences of full length need
            wanted = bytes_per_token * max_num_seqs * min(max_model_len or limit, limit) + bytes_per_token * block_size
            kv_memory = min(default_kv_memory(self.device), wanted)
        self.kv_memory = int(kv_memory)
        num_blocks = self.kv_memory // (bytes_per_token * block_size)
        if num_blocks < 2:
            raise UsageError(f"kv_memory of {self.kv_memory} bytes holds fewer than 2 blocks of {block_size} tokens "
                             f"({bytes_per_token} bytes per token); give the KV cache more memory")
        self.max_model_len = min(max_model_len or limit, limit, num_blocks * block_size)

        self.cache = PagedKVCache(self.config, num_blocks, block_size, self.dtype, self.device, kv_dtype)
        self.runner = ModelRunner(self.model, self.cache)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        eos = set(self.tokenizer.eos_ids) | set(self.config.eos_token_ids)
        if max_prefill_tokens is None:
            max_prefill_tokens = CPU_MAX_PREFILL_TOKENS if self.device.type == "cpu" else max_num_batched_tokens
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, eos, self.max_model_len,
                                   max_prefill_tokens)
        self.scheduler.stop_checker = self._check_stop
        self.scheduler.needs_prompt_logits = self._needs_prompt_logits
        self.sampler = Sampler(eos)
        self.guided = None  # guided.GuidedDecoding, made at the first structured-output request
        if decode_steps is not None and decode_steps < 1:
            raise UsageError(f"decode_steps must be >= 1, got {decode_steps}")
        self.decode_steps = decode_steps or multi_step.steps_from_env()  # greedy steps one C call may take
        screened_head.after_tokens()  # a bad LOWBIT_HEAD_SCREEN_AFTER stops here, not mid-decode
        several = self.decode_steps > 1  # a greedy draft's steps after its first in one C call
        if draft_kind == "ngram":
            self.drafter = NgramDrafter()
        elif draft_kind == "layers":
            self.drafter = LayerPrefixDrafter(draft_model, self.cache, several)
        elif draft_model is not None:
            draft_cache = PagedKVCache(draft_model.config, num_blocks, block_size, self.draft_dtype, self.device, draft_kv)
            self.drafter = ModelDrafter(draft_model, draft_cache, several)
        else:
            self.drafter = None
        self.spec_stats = SpecStats()
        self.num_multi_steps = 0  # calls that took more than one step
        self.step_clock = multi_step.StepClock()  # decode steps' times, for the calls' lengths

        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._reported: dict[str, int] = {}
        self._adaptive: dict[str, AdaptiveK] = {}
        # prompt log-probs being computed: entry i is prompt token i + 1's (filled chunk by chunk)
        self._prompt_lps: dict[str, list[PromptLogprob]] = {}
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # the loaders' freed temporaries (file tensors, re-tiling): ~40 % of the RSS after loading
        hugepages.return_freed_memory()

    # -- public API ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    share_prefix_with: str | None = None) -> None:
        """Queue a request. share_prefix_with: the id of a running request with the same prompt (the
        other sequences of an n > 1 request); this one waits for its prefill and reuses its blocks."""
        params = params if params is not None else SamplingParams()
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise UsageError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"maximum model length {self.max_model_len}")
        if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= self.config.vocab_size):
            raise UsageError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if self.cascade is not None and params.logprobs is not None:
            raise UsageError("logprobs are not reported under a token cascade (its cheap tokens have no model logits)")
        matcher = self._check_logit_extras(params)
        seq = Sequence(request_id, prompt_ids, params)
        self.scheduler.add(seq, share_prefix_with)
        if matcher is not None:
            self.guided.matchers[request_id] = matcher
        if params.prompt_logprobs is not None:
            self._prompt_lps[request_id] = []
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, seq.token_ids, params.stop)
        self._reported[request_id] = 0
        self.prompt_tokens_total += seq.num_prompt_tokens

    def abort_request(self, request_id: str) -> None:
        if request_id in self.scheduler.requests:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def touch_kv(self, sequences: int, tokens: int) -> None:
        """Fault in the KV pages that `sequences` sequences of `tokens` tokens will write (and a
        draft model's), so a timed run does not pay first-touch page faults (PagedKVCache.touch)."""
        size = self.cache.block_size
        blocks = sequences * (-(-(tokens + self.num_speculative_tokens + 1) // size))
        self.cache.touch(blocks)
        draft_cache = getattr(getattr(self.drafter, "runner", None), "cache", None)
        if draft_cache is not None and draft_cache is not self.cache:
            draft_cache.touch(blocks)

    def make_head_copies(self) -> None:
        """Make now the int8 head copies that greedy steps (the model's and a draft's) read once their
        decoder has taken its first tokens (kernels/screened_head.py), so a timed run does not pay
        for them midway, as touch_kv spares it the first touch of its KV pages."""
        for runner in (self.runner, getattr(self.drafter, "runner", None)):
            chained = getattr(runner, "chained", None)
            if chained is not None:
                chained.head_screen(now=True)

    def stats(self) -> EngineStats:
        bm, s = self.block_manager, self.spec_stats
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_usage=bm.usage,
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
            prefix_cache_queries=bm.num_query_tokens, prefix_cache_hits=bm.num_hit_tokens,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            preemptions_total=self.scheduler.num_preemptions, spec_draft_tokens=s.num_drafted,
            spec_accepted_tokens=s.num_accepted, spec_mean_accepted_length=s.mean_accepted_length,
            cascade_cheap_tokens=self.cascade_stats.cheap, cascade_full_tokens=self.cascade_stats.full,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run prompts to completion (batched) and return one Completion each, in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        results = {rid: Completion(rid, list(p), [], "", None, None, 0) for rid, p in zip(ids, prompts)}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        while self.has_unfinished_requests():
            for out in self.step():
                c = results.get(out.request_id)
                if c is None:
                    continue
                c.token_ids += out.new_token_ids
                c.text += out.text_delta
                if out.logprobs is not None:
                    c.logprobs = (c.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in ids]

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        outputs = [self._output(seq, []) for seq in out.finished]
        if out.items:
            tokens, logprobs = self._execute(out)
            self.scheduler.postprocess(out, tokens)
            for item, lps in zip(out.items, logprobs):
                seq = item.seq
                if self.drafter is not None:
                    self.drafter.sync(seq)
                if seq.num_output_tokens > self._reported[seq.request_id] or seq.is_finished:
                    outputs.append(self._output(seq, lps))
        return outputs

    # -- internals ----------------------------------------------------------------------------
    def _check_logit_extras(self, params: SamplingParams):
        """logit_bias ids against the vocabulary; a guided request's matcher (compiling its schema)."""
        vocab = self.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise UsageError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        if params.guided_json is None:
            return None
        if self.guided is None:
            from lowbit.runtime.engine.guided import GuidedDecoding

            self.guided = self.sampler.guided = GuidedDecoding(self.tokenizer, vocab, self.scheduler.eos_token_ids)
        return self.guided.start(params.guided_json)

    def _check_stop(self, seq: Sequence) -> bool:
        # stop strings count only from min_tokens on (vLLM's rule); the grammar ends a guided output
        stopped = self._detok[seq.request_id].add(seq.last_token, seq.num_output_tokens >= seq.params.min_tokens)
        if self.guided is not None and self.guided.advance(seq.request_id, seq.last_token):
            return True
        return stopped

    def _needs_prompt_logits(self, seq: Sequence) -> bool:
        # until its prompt log-probs are delivered (a preempted sequence then uses the cache again)
        return seq.request_id in self._prompt_lps

    def _output(self, seq: Sequence, logprobs: list) -> RequestOutput:
        rid = seq.request_id
        before = self._reported.get(rid, 0)
        new_ids = seq.token_ids[seq.num_prompt_tokens + before :]
        self.generation_tokens_total += len(new_ids)
        finished = seq.is_finished
        det = self._detok.get(rid)
        text = det.delta(finished) if det is not None else ""
        lps = None
        if seq.params.logprobs is not None:
            lps = [(lp.logprob, lp.top) for lp in logprobs[: len(new_ids)] if lp is not None]
        prompt_lps = None
        done = self._prompt_lps.get(rid)
        if done is not None and len(done) == seq.num_prompt_tokens - 1:  # complete: the first output after prefill
            prompt_lps = [None, *done]
            del self._prompt_lps[rid]
        if finished:
            for table in (self._detok, self._reported, self._adaptive, self._prompt_lps):
                table.pop(rid, None)
            if self.guided is not None:
                self.guided.forget(rid)
            if self.drafter is not None:
                self.drafter.forget(rid)
        else:
            self._reported[rid] = before + len(new_ids)
        return RequestOutput(rid, new_ids, text, finished, seq.finish_reason if finished else None, lps,
                             seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens, prompt_lps)

    def _draft_len(self, seq: Sequence) -> int:
        # k adapts within [1, num_speculative_tokens]: a verify's cost grows with its rows (on CPU in
        # steps of 4, native/int4_dot.c), so growing past the requested k cost more than it won.
        # A cascade's k is its longest run of cheap tokens (the target decides the unsure ones in
        # its pass over the run, as it verifies drafts).
        k = self.cascade.run if self.cascade is not None else self._adaptive.setdefault(
            seq.request_id, AdaptiveK(self.num_speculative_tokens, 1, self.num_speculative_tokens)).k
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(k, room))

    def _multi_steps(self, out) -> tuple[int, object, bool]:
        """How many greedy steps this step's items take in one C call (multi_step.py), the head the
        call runs (None for a normal step), and whether the step is a plain greedy decode, whose time
        sizes the next calls. The extra KV slots of a call are allocated here."""
        items = out.items
        if self.decode_steps < 2 or self.drafter is not None or self.cascade is not None or self.scheduler.waiting:
            return 1, None, False
        for item in items:
            seq = item.seq
            if not item.samples or item.num_new_tokens != 1 or item.start != seq.num_tokens - 1 \
                    or seq.request_id in self._prompt_lps or not multi_step.plain_greedy(seq.params):
                return 1, None, False
        seqs = [item.seq for item in items]
        steps = min(multi_step.steps_for(seqs, self.decode_steps, self.max_model_len),
                    self.step_clock.steps_within(len(items), self.decode_steps))
        head = self.runner.steps_head(len(items)) if steps > 1 else None
        bm = self.block_manager
        if head is None or sum(bm.blocks_needed(s.num_tokens + steps - 1) - len(s.block_table) for s in seqs) > bm.num_free_blocks:
            return 1, None, True
        for item in items:
            bm.append_slot(item.seq, steps - 1)
            item.num_new_tokens = steps  # the scheduler's count of computed tokens, as for a verify
        return steps, head, True

    def _execute(self, out) -> tuple[list[list[int]], list[list]]:
        started = time.perf_counter()
        steps, head, timed = self._multi_steps(out)
        result = self._execute_steps(out.items, steps, head) if steps > 1 else self._execute_one(out)
        if timed:
            self.step_clock.record(len(out.items), steps, time.perf_counter() - started)
        return result

    def _nonfinite_logits(self) -> LowbitError:
        return LowbitError(f"{self.model_path}: the model's logits hold NaN or inf (corrupt weights, or "
                           f"activations that overflow {str(self.dtype).removeprefix('torch.')})")

    def _execute_steps(self, items, steps: int, head) -> tuple[list[list[int]], list[list]]:
        works = [Work(item.seq.block_table, item.start, [item.seq.token_ids[item.start]], 1) for item in items]
        tokens, done = self.runner.decode_steps(works, steps, head)
        if done < steps:
            raise self._nonfinite_logits()
        self.num_multi_steps += 1
        return tokens, [[] for _ in items]

    def _execute_one(self, out) -> tuple[list[list[int]], list[list]]:
        items = out.items
        drafts: list[list[int]] = [[] for _ in items]
        draft_probs: list[torch.Tensor | None] = [None] * len(items)
        draft_unsure: list[list[bool] | None] = [None] * len(items)  # a cascade's flags
        if self.drafter is not None:
            bm = self.block_manager
            drafting = []
            for i, item in enumerate(items):
                seq = item.seq
                if item.num_new_tokens == 1 and item.samples and seq.params.guided_json is None:  # guided: never drafted
                    k = self._draft_len(seq)
                    if k > 0 and bm.can_append(seq, k):
                        bm.append_slot(seq, k)
                        drafting.append((i, k))
                    elif self.cascade is not None:
                        self.cascade_stats.full += 1  # no room for cheap tokens: the model's alone
            proposals = self.drafter.propose(items, [(items[i].seq, k) for i, k in drafting],
                                             None if self.cascade is None else self.cascade.unsure)
            for (i, _), (tokens, probs, unsure) in zip(drafting, proposals):
                drafts[i], draft_probs[i], draft_unsure[i] = tokens, probs, unsure
                items[i].num_new_tokens = 1 + len(tokens)

        works = []
        for item, d in zip(items, drafts):
            seq = item.seq
            tokens = seq.token_ids[item.start : item.start + item.num_new_tokens - len(d)] + d
            work = Work(seq.block_table, item.start, tokens, 0 if not item.samples else 1 + len(d))
            if seq.request_id in self._prompt_lps and not d:
                # rows start.. predict the prompt tokens after them; the prompt's last row predicts
                # the first generated token, so it is sampled, not scored
                end = min(item.start + item.num_new_tokens + 1, seq.num_prompt_tokens)
                if end > item.start + 1:
                    work.prompt_targets = seq.token_ids[item.start + 1 : end]
                    work.prompt_top = seq.params.prompt_logprobs
            works.append(work)
        # rows that want only their argmax (plain greedy, no prompt log-probs: a token cascade's
        # flags come from its cheap model) may take it through the head's int8 copy (the same
        # tokens, fewer bytes: a verify of 1 + k rows)
        argmax = all(
            not item.samples or multi_step.plain_greedy(item.seq.params) and item.seq.request_id not in self._prompt_lps
            for item in items)
        run = self.runner.forward(works, argmax=argmax)
        logits, chosen = run.logits, None if run.tokens is None else run.tokens.tolist()
        for item, work, got in zip(items, works, run.prompt_logprobs):
            if got is not None:
                done = self._prompt_lps[item.seq.request_id]
                del done[item.start :]  # a prefill restarted after preemption overwrites its entries
                done.extend(got)
        if logits is not None and nonfinite(logits):
            # argmax over NaN is token 0 and sampling is undefined: never emit text from such logits
            raise self._nonfinite_logits()

        result: list[list[int]] = [[] for _ in items]
        logprobs: list[list] = [[] for _ in items]
        plain_rows, plain_items, row = [], [], 0
        for i, item in enumerate(items):
            if not item.samples:
                continue
            if drafts[i]:
                n = 1 + len(drafts[i])
                if chosen is not None:
                    result[i] = self._accept(item.seq, chosen[row : row + n], drafts[i], draft_unsure[i])
                    logprobs[i] = [None] * len(result[i])
                else:
                    result[i], logprobs[i] = self._verify(item.seq, logits[row : row + n], drafts[i], draft_probs[i],
                                                          draft_unsure[i])
                row += n
            else:
                plain_rows.append(row)
                plain_items.append(i)
                row += 1
        if plain_rows and chosen is not None:
            for r, i in zip(plain_rows, plain_items):
                result[i], logprobs[i] = [chosen[r]], [None]
        elif plain_rows:
            rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
            sampled = self.sampler(rows, [items[i].seq for i in plain_items])
            for j, i in enumerate(plain_items):
                result[i] = [sampled.token_ids[j]]
                logprobs[i] = [sampled.logprobs[j]]
        return result, logprobs

    def _verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                unsure: list[bool] | None = None):
        """Target logits [k+1, V] over [last, d0..d(k-1)] -> the emitted tokens and their logprobs.
        A token cascade's drafts (`unsure` given) stand where the cheap model was sure; the target
        decides the unsure ones as it verifies any draft (greedy: its own token wherever they
        differ; sampling: the rejection rule, so the token is the target's draw), and the first
        it changes ends the run. Its tokens are the cascade's rule position by position (sure:
        cheap, unsure: the model's), each unsure draft costing no step of its own."""
        p, k = seq.params, len(drafts)
        histories = ([seq.token_ids + drafts[:j] for j in range(k + 1)] if p.repetition_penalty != 1.0
                     else [[]] * (k + 1))
        # position j sees the drafts before it as generated (penalties, min_tokens), as a plain step would
        outputs = [seq.output_token_ids + drafts[:j] for j in range(k + 1)] if _uses_outputs(p) else None
        eos = self.sampler.eos_token_ids
        if p.greedy:
            if not p.changes_logits:
                target = greedy(logits).tolist()
            else:
                target = process_logits(logits, [p] * (k + 1), histories, outputs, eos_ids=eos).argmax(dim=-1).tolist()
            accepted = _accepted(drafts, target, unsure)
            emitted = drafts[:accepted] + [target[accepted]]
        else:
            target_probs = process_logits(logits, [p] * (k + 1), histories, outputs, eos_ids=eos).softmax(dim=-1)
            for j in range(k) if unsure is not None else ():
                if not unsure[j]:  # the draft's own distribution: accepted whatever u is drawn
                    target_probs[j] = (draft_probs[j] if draft_probs is not None
                                       else torch.zeros_like(target_probs[j]).scatter_(
                                           0, torch.tensor([drafts[j]], device=target_probs.device), 1.0))
            tokens, num_accepted = rejection_sample(
                torch.tensor([drafts], device=logits.device), target_probs[None],
                None if draft_probs is None else draft_probs[None],
                generator=Sampler.generator(seq, logits.device))
            accepted = int(num_accepted[0])
            emitted = tokens[0, : accepted + 1].tolist()
        return self._emit(seq, emitted, accepted, k, unsure, logits)

    def _accept(self, seq: Sequence, target: list[int], drafts: list[int], unsure: list[bool] | None) -> list[int]:
        """A plain greedy verify whose target tokens (one per row over [last, d0..d(k-1)]) came
        without logits (runner.forward(argmax=True)): _verify's greedy rule on them."""
        accepted = _accepted(drafts, target, unsure)
        return self._emit(seq, drafts[:accepted] + [target[accepted]], accepted, len(drafts), unsure, None)[0]

    def _emit(self, seq: Sequence, emitted: list[int], accepted: int, k: int, unsure: list[bool] | None,
              logits: torch.Tensor | None):
        """A verify's emitted tokens counted (speculation's acceptance, or a cascade's cheap and model
        tokens) and their logprobs where asked (from `logits`)."""
        p = seq.params
        n = len(emitted)
        if unsure is not None:  # the sure drafts it kept were the cheap model's; the rest the model's
            cheap = sum(not u for u in unsure[:accepted])
            self.cascade_stats.cheap += cheap
            self.cascade_stats.full += n - cheap
        else:
            self.spec_stats.record(k, accepted)
            self._adaptive[seq.request_id].update(k, accepted)
        logprobs = _logprobs(logits[:n], [p] * n, emitted) if p.logprobs is not None else [None] * n
        return emitted, logprobs


def _accepted(drafts: list[int], target: list[int], unsure: list[bool] | None) -> int:
    """How many drafts a greedy verify keeps: those equal to the target's token at their row, or (a
    token cascade) that the cheap model was sure of, up to the first it is not."""
    accepted = 0
    while accepted < len(drafts) and (drafts[accepted] == target[accepted] or unsure is not None and not unsure[accepted]):
        accepted += 1
    return accepted
