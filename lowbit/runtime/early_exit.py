"""Early exit: the model's own final norm and head applied to an intermediate hidden state.

An exit layer L (1 <= L < num_layers) means "after the first L decoder layers". At an exit the
logits are head(norm(h_L)) (softcapped like the final ones); a position takes the FIRST exit whose
confidence is strictly above the threshold, else the full model's logits. Strictly above: with
threshold 1.0 nothing ever exits (a float32 softmax can round a top-1 probability to exactly 1.0),
so 1.0 is the full model bit for bit; with 0.0 (top-1) every position exits at the first exit.

Confidence: "top1" = the top-1 probability, "margin" = top-1 minus top-2 probability. Both are
in [0, 1]; bench/early_exit.py and docs/early_exit.md compare them.

- `EarlyExitLM` wraps a CausalLM for `lowbit eval`: the same `model(ids, logits_start=)` call,
  mixed logits out, exits counted (`ExitStats`); `FullLogits` hands the same forward's full-model
  logits to the evaluator as the KLD base, so "against itself" costs no second forward.
- `ExitDecoder` decodes one sequence over a contiguous KVCache: a token whose exit clears the
  threshold is emitted from that layer and the later layers are skipped for it; their K/V at that
  position are computed from the exit hidden state (CALM's state propagation: each skipped layer's
  input norm, k/v projections, k norm, RoPE), so later tokens attend to something at every layer.

The layer loop mirrors DecoderModel.forward (runtime/models/base.py) statement for statement,
deferred residuals included, so the final logits are the model's own bit for bit (tests check it).
Adapters: `ExitHead(model, adapters)` applies a trained exit adapter (runtime/exit_adapters.py,
`lowbit distill --exit-layers`) to the normed hidden state before the head where the model's
directory has one for that exit; other exits use the head as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.errors import UsageError
from lowbit.runtime.attention import AttentionContext
from lowbit.runtime.layers import add_pending, apply_rotary

CONFIDENCES = ("top1", "margin")


@dataclass(slots=True)
class ExitSettings:
    layers: tuple[int, ...]  # ascending, each in [1, num_layers)
    threshold: float
    confidence: str = "top1"


def check_threshold(threshold: float, flag: str = "--exit-threshold") -> float:
    if not 0.0 <= threshold <= 1.0:  # NaN fails too
        raise UsageError(f"{flag} must be in [0, 1], got {threshold}")
    return float(threshold)


def check_confidence(kind: str) -> str:
    if kind not in CONFIDENCES:
        raise UsageError(f"--exit-confidence must be one of {', '.join(CONFIDENCES)}, got '{kind}'")
    return kind


def parse_exit_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """'12,20' -> (12, 20); each layer must leave at least one layer to skip."""
    try:
        layers = sorted({int(part) for part in str(spec).split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--early-exit '{spec}': give comma-separated layer numbers, e.g. 12,20") from None
    if not layers:
        raise UsageError(f"--early-exit '{spec}': give at least one exit layer, e.g. 12,20")
    bad = [n for n in layers if not 1 <= n < num_layers]
    if bad:
        raise UsageError(f"--early-exit layer {bad[0]} is out of range: exit layers must be between 1 and "
                         f"{num_layers - 1} (the model has {num_layers} layers)")
    return tuple(layers)


def settings_for(model, layers: str, threshold: float, confidence: str = "top1") -> ExitSettings:
    return ExitSettings(parse_exit_layers(layers, model.config.num_hidden_layers), check_threshold(threshold),
                        check_confidence(confidence))


def confidence_of(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """[..., V] logits -> [...] confidence in [0, 1]."""
    probs = logits.float().softmax(dim=-1)
    if kind == "top1":
        return probs.amax(dim=-1)
    top = probs.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


class ExitHead:
    """head(norm(h)) at an exit, softcapped like the model's final logits; float32 out."""

    def __init__(self, model, adapters: dict[int, nn.Module] | None = None):
        self.model = model
        self.adapters = adapters or {}
        self.softcap = model.config.final_logit_softcapping

    def __call__(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        x = self.model.model.norm(h)
        adapter = self.adapters.get(layer)
        if adapter is not None:
            x = adapter(x)
        return self._head(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(x).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def final(self, h_normed: torch.Tensor) -> torch.Tensor:
        # as CausalLM.forward: the head in the model dtype, softcap, then float32
        logits = self.model.lm_head(h_normed)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


@dataclass(slots=True)
class ExitStats:
    """Positions that took each exit (and the full model), over every scored/decoded position."""

    num_layers: int
    exits: dict[int, int] = field(default_factory=dict)
    full: int = 0

    def record(self, layer: int | None) -> None:
        if layer is None:
            self.full += 1
        else:
            self.exits[layer] = self.exits.get(layer, 0) + 1

    @property
    def total(self) -> int:
        return self.full + sum(self.exits.values())

    def rates(self) -> dict[str, float]:
        n = max(self.total, 1)
        out = {str(layer): count / n for layer, count in sorted(self.exits.items())}
        out["full"] = self.full / n
        return out

    @property
    def mean_layers(self) -> float:
        """Decoder layers run per position on average (the compute that early exit keeps)."""
        n = self.total
        run = sum(layer * count for layer, count in self.exits.items()) + self.full * self.num_layers
        return run / n if n else float(self.num_layers)

    def as_dict(self) -> dict:
        return {"positions": self.total, "exit_rate": self.rates(), "mean_layers": self.mean_layers,
                "num_layers": self.num_layers}


# ---------------------------------------------------------------------------------------------
# the layer loop (DecoderModel.forward's, with taps and a stop)


def _embed(decoder, input_ids: torch.Tensor) -> torch.Tensor:
    h = decoder.embed_tokens(input_ids)
    if h.dtype != decoder.norm.weight.dtype:
        h = h.to(decoder.norm.weight.dtype)
    if decoder.scale_embeddings:
        h = h * torch.tensor(decoder.hidden_size**0.5, dtype=h.dtype).item()
    return h


class _LayerLoop:
    """One forward of DecoderModel over input_ids [1, T], layer by layer: `hidden()` is the current
    hidden state (a fresh tensor), `finish()` the final-normed one."""

    def __init__(self, decoder, input_ids: torch.Tensor, positions: torch.Tensor, cache):
        self.decoder = decoder
        self.cache = cache
        self.h = _embed(decoder, input_ids)
        self.ctx = AttentionContext(cache.length if cache is not None else 0, input_ids.shape[1], self.h.device)
        self.rotations = [r.cos_sin(positions, int(positions.max()), self.h.dtype) for r in decoder.rotaries]
        self.deferred = decoder._defer_residuals(self.h)
        self.pending = None
        self.done = 0  # layers run

    def step(self) -> None:
        i = self.done
        layer = self.decoder.layers[i]
        cos, sin = self.rotations[self.decoder.layer_rotary[i]]
        if self.deferred:
            self.h, self.pending = layer.forward_deferred(self.h, self.pending, cos, sin, self.ctx, self.cache)
        else:
            self.h = layer(self.h, cos, sin, self.ctx, self.cache)
        self.done += 1

    def hidden(self) -> torch.Tensor:
        # a copy: the deferred path updates h in place in the next layer
        return add_pending(self.h, self.pending).clone() if self.pending is not None else self.h.clone()

    def finish(self) -> torch.Tensor:
        while self.done < len(self.decoder.layers):
            self.step()
        if self.deferred:
            return self.decoder._final_norm(self.h, self.pending)
        return self.decoder.norm(self.h)


# ---------------------------------------------------------------------------------------------
# eval: mixed logits over whole windows


class EarlyExitLM:
    """`model(ids, logits_start=)` -> [1, R, V] logits where each row comes from its first exit
    whose confidence clears the threshold, else from the full model. All rows but the last (which
    predicts the token after an eval window, never scored) are counted in `stats`."""

    def __init__(self, model, settings: ExitSettings, adapters: dict[int, nn.Module] | None = None):
        self.model = model
        self.config = model.config
        self.settings = settings
        self.head = ExitHead(model, adapters)
        self.stats = ExitStats(model.config.num_hidden_layers)
        self.last: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (ids, logits_start, full logits)

    def parameters(self):
        return self.model.parameters()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, logits_start: int = 0) -> torch.Tensor:
        t = input_ids.shape[1]
        loop = _LayerLoop(self.model.model, input_ids, torch.arange(t, device=input_ids.device), None)
        taps = {}
        for layer in self.settings.layers:
            while loop.done < layer:
                loop.step()
            taps[layer] = loop.hidden()[:, logits_start:]
        full = self.head.final(loop.finish()[:, logits_start:])
        self.last = (input_ids, logits_start, full)
        out = full.clone()
        taken = torch.zeros(full.shape[:-1], dtype=torch.bool, device=full.device)
        chosen = torch.full(full.shape[:-1], -1, dtype=torch.long, device=full.device)
        for layer in self.settings.layers:
            logits = self.head(taps[layer], layer)
            take = ~taken & (confidence_of(logits, self.settings.confidence) > self.settings.threshold)
            out[take] = logits[take]
            chosen[take] = layer
            taken |= take
        for layer in chosen[0, :-1].tolist():
            self.stats.record(None if layer < 0 else layer)
        return out


class FullLogits:
    """The KLD base for "early exit against the model itself": the full-model logits of the
    EarlyExitLM forward that just ran on the same ids (else a forward of the model)."""

    def __init__(self, early: EarlyExitLM):
        self.early = early
        self.config = early.config

    def parameters(self):
        return self.early.model.parameters()

    def __call__(self, input_ids: torch.Tensor, logits_start: int = 0) -> torch.Tensor:
        last = self.early.last
        if last is not None and last[1] == logits_start and torch.equal(last[0], input_ids):
            return last[2]
        with torch.inference_mode():
            return self.early.model(input_ids, logits_start=logits_start)


def wrap_eval_job(job, layers: str, threshold: float, confidence: str = "top1") -> EarlyExitLM:
    """Make an eval job (runtime/evaluate.EvalJob) score the early-exit model; without a --base,
    KLD is against the full model itself."""
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.exit_adapters import load_adapters

    lm = job.causal_lm()
    adapters = load_adapters(resolve_model(job.model_name), lm.config)
    early = EarlyExitLM(lm, settings_for(lm, layers, threshold, confidence), adapters)
    if job.base_model is None:
        job.base_model = FullLogits(early)
        job.base_name = f"{job.model_name} (all {early.stats.num_layers} layers)"
    job.model = early
    return early


# ---------------------------------------------------------------------------------------------
# decode: skip the layers after a confident exit


def fill_skipped_kv(model, hidden: torch.Tensor, first: int, rotations, cache) -> None:
    """K/V of layers first.. at the new position, from the exit hidden state [1, 1, hidden]
    (CALM): each layer's input norm, k/v projection, k norm and RoPE, written into the cache."""
    decoder = model.model
    for j in range(first, len(decoder.layers)):
        layer = decoder.layers[j]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        if attn.fused_qkv is not None:
            _, k, v = attn.fused_qkv.forward(x).split(attn.fused_qkv.sizes, dim=-1)
        else:
            k, v = attn.k_proj(x), attn.v_proj(x)
        if attn.k_norm is not None:
            k = attn._head_norm(attn.k_norm, k)
        d = attn.head_dim
        cos, sin = rotations[decoder.layer_rotary[j]]
        k = apply_rotary(k.view(1, 1, -1, d).transpose(1, 2), cos, sin)
        v = v.view(1, 1, -1, d).transpose(1, 2)
        cache.update(j, k.to(cache.keys[j].dtype), v.to(cache.values[j].dtype))


class ExitDecoder:
    """Early-exit decoding of one sequence over a contiguous KVCache (model.new_cache)."""

    def __init__(self, model, settings: ExitSettings, max_len: int, adapters: dict[int, nn.Module] | None = None):
        self.model = model
        self.settings = settings
        self.head = ExitHead(model, adapters)
        self.cache = model.new_cache(1, max_len)
        self.stats = ExitStats(model.config.num_hidden_layers)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """The full model over the prompt; the last position's logits [V] (float32)."""
        device = self.model.model.norm.weight.device
        logits = self.model(torch.tensor([prompt_ids], device=device), cache=self.cache, logits_start=len(prompt_ids) - 1)
        return logits[0, -1].float()

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token; its next-token logits [V] from the first confident exit or the full model."""
        cache = self.cache
        cache.check_room(1)
        device = self.model.model.norm.weight.device
        pos = torch.tensor([cache.length], device=device)
        loop = _LayerLoop(self.model.model, torch.tensor([[token]], device=device), pos, cache)
        s = self.settings
        for layer in s.layers:
            while loop.done < layer:
                loop.step()
            hidden = loop.hidden()
            logits = self.head(hidden, layer)[0, -1]
            if float(confidence_of(logits, s.confidence)) > s.threshold:
                fill_skipped_kv(self.model, hidden, layer, loop.rotations, cache)
                cache.advance(1)
                self.stats.record(layer)
                return logits
        logits = self.head.final(loop.finish())[0, -1]
        cache.advance(1)
        self.stats.record(None)
        return logits


@dataclass(slots=True)
class ExitGeneration:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: ExitStats  # or cascade.CascadeStats
    ttft_s: float
    decode_s: float


def generate_with_exits(model, tokenizer, prompt_ids: list[int], params, settings: ExitSettings,
                        on_text=None, adapters: dict[int, nn.Module] | None = None) -> ExitGeneration:
    """`lowbit generate --early-exit`: one sequence, the prompt through the full model, each new
    token through ExitDecoder.step."""
    decoder = ExitDecoder(model, settings, len(prompt_ids) + params.max_tokens, adapters)
    return generate_with(decoder, model, tokenizer, prompt_ids, params, on_text)


def generate_with(decoder, model, tokenizer, prompt_ids: list[int], params, on_text=None) -> ExitGeneration:
    """One sequence through a decoder with `prefill(ids) -> logits`, `step(token) -> logits` and
    `stats` (ExitDecoder). Greedy or sampled (the engine's logit
    processing: temperature, top-k/p, min-p, penalties); stop strings and EOS end it.
    on_text(delta) streams the text."""
    import time

    from lowbit.runtime.engine.detokenizer import IncrementalDetokenizer
    from lowbit.runtime.engine.sampler import process_logits

    eos = set(tokenizer.eos_ids) | set(model.config.eos_token_ids)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop)
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=model.model.norm.weight.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
    started = time.perf_counter()
    logits = decoder.prefill(prompt_ids)
    ttft = None
    out: list[int] = []
    finish = "length"
    while True:
        if params.greedy and not params.changes_logits:
            token = int(logits.argmax())
        else:
            x = process_logits(logits[None], [params], [prompt_ids + out], [out], eos_ids=eos)
            token = int(x.argmax()) if params.greedy else int(torch.multinomial(x.softmax(-1)[0], 1, generator=generator))
        out.append(token)
        if ttft is None:
            ttft = time.perf_counter() - started
        stopped = detok.add(token, len(out) >= params.min_tokens)
        ended = stopped or (token in eos and not params.ignore_eos and len(out) >= params.min_tokens)
        if ended or len(out) >= params.max_tokens:
            finish = "stop" if ended else "length"
            break
        if on_text is not None:
            delta = detok.delta(False)
            if delta:
                on_text(delta)
        logits = decoder.step(token)
    tail = detok.delta(True)
    if on_text is not None and tail:
        on_text(tail)
    elapsed = time.perf_counter() - started
    return ExitGeneration(out, detok.text, finish, decoder.stats, ttft or 0.0, elapsed - (ttft or 0.0))
