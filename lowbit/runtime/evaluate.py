"""Perplexity and KL divergence of a causal LM on a text, computed the way llama.cpp does.

Chunk mode (llama-perplexity): the whole text is tokenized once and cut into consecutive,
non-overlapping windows of `ctx` tokens. When the tokenizer adds a BOS token, the first token of
every window is replaced by BOS. Only the second half of each window is scored: the logits at
positions ctx/2 … ctx-2 predict tokens ctx/2+1 … ctx-1, so a window scores ctx/2 - 1 tokens.

Stride mode (Hugging Face's sliding window): windows of `ctx` tokens start every `stride` tokens;
each window scores only the tokens no earlier window scored, so every token after the first is
scored exactly once, with as much left context as the window allows. The BOS rule is the same.

PPL = exp(mean NLL); its error is PPL · sqrt(var(NLL) / (n - 1)), llama.cpp's estimate.

With a base model, both models run on the same windows; per scored token only scalars are kept
(KL(base‖model), whether the top tokens agree, p_model - p_base of the actual next token), never
the logits of the corpus.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.quant.dtypes import DTYPES, dtype_name

MIN_CTX = 8
# Rows per log-softmax slice: bounds the float64 temporaries for large vocabularies.
SOFTMAX_ROWS = 64


@dataclass(slots=True)
class Window:
    """Tokens [start, end) run through the model; targets score_from … end-1 are scored."""

    start: int
    end: int
    score_from: int

    @property
    def logits_start(self) -> int:
        # The logit at position t predicts token t + 1.
        return self.score_from - 1 - self.start

    @property
    def n_scored(self) -> int:
        return self.end - self.score_from


@dataclass(slots=True)
class KldStats:
    mean: float
    err: float
    p99: float
    p999: float
    median: float
    max: float
    same_top_pct: float
    same_top_err_pct: float
    rms_dp_pct: float
    rms_dp_err_pct: float
    base_ppl: float
    base_ppl_err: float
    ppl_ratio: float


@dataclass(slots=True)
class EvalResult:
    mode: str  # "chunks" or "stride"
    ctx: int
    stride: int | None
    windows: int
    tokens_total: int
    tokens_scored: int
    ppl: float
    ppl_err: float
    nll_mean: float
    kld: KldStats | None
    eval_s: float
    tokens_per_s: float  # tokens run through the evaluated model per second


@dataclass(slots=True)
class _Accumulator:
    """Per-token scalars for the whole run (a few floats per scored token)."""

    nll: list[torch.Tensor] = field(default_factory=list)
    base_nll: list[torch.Tensor] = field(default_factory=list)
    kld: list[torch.Tensor] = field(default_factory=list)
    same_top: list[torch.Tensor] = field(default_factory=list)
    dp: list[torch.Tensor] = field(default_factory=list)
    nll_sum: float = 0.0
    count: int = 0


ProgressCallback = Callable[[int, int, float], None]


# ---------------------------------------------------------------------------------------------
# windows


def check_ctx(ctx: int, max_positions: int | None = None) -> None:
    if ctx < MIN_CTX:
        raise UsageError(f"--ctx {ctx} is too small (at least {MIN_CTX} tokens)")
    if ctx % 2:
        raise UsageError(f"--ctx {ctx} must be even (the second half of each chunk is scored)")
    if max_positions and ctx > max_positions:
        raise UsageError(f"--ctx {ctx} exceeds the model's maximum context of {max_positions} tokens")


def chunk_windows(n_tokens: int, ctx: int, chunks: int | None = None) -> list[Window]:
    """llama-perplexity's windows: consecutive ctx-token chunks, second half scored."""
    check_ctx(ctx)
    if chunks is not None and chunks < 1:
        raise UsageError(f"--chunks must be at least 1, got {chunks}")
    available = n_tokens // ctx
    if available == 0:
        raise UsageError(f"--ctx {ctx} is larger than the text, which has only {n_tokens} tokens")
    count = available if chunks is None else min(chunks, available)
    return [Window(i * ctx, (i + 1) * ctx, i * ctx + ctx // 2 + 1) for i in range(count)]


def stride_windows(n_tokens: int, ctx: int, stride: int, windows: int | None = None) -> list[Window]:
    """Hugging Face's sliding windows: each scores only the tokens not scored before."""
    check_ctx(ctx)
    if stride < 1 or stride > ctx:
        raise UsageError(f"--stride must be between 1 and --ctx ({ctx}), got {stride}")
    if windows is not None and windows < 1:
        raise UsageError(f"--chunks must be at least 1, got {windows}")
    if n_tokens < ctx:
        raise UsageError(f"--ctx {ctx} is larger than the text, which has only {n_tokens} tokens")
    out: list[Window] = []
    scored_until = 1  # token 0 has no left context
    for start in range(0, n_tokens, stride):
        end = min(start + ctx, n_tokens)
        if end > scored_until:
            out.append(Window(start, end, max(scored_until, start + 1)))
            scored_until = end
        if end == n_tokens or (windows is not None and len(out) == windows):
            break
    return out


# ---------------------------------------------------------------------------------------------
# scoring


def _vocab_size(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None)


def _max_positions(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None)


def _window_logits(model, ids: torch.Tensor, window: Window) -> torch.Tensor:
    logits = model(ids, logits_start=window.logits_start)[0]
    # The last row predicts the token after the window: not scored.
    return logits[: window.n_scored]


def _score_window(
    logits: torch.Tensor,
    targets: torch.Tensor,
    base_logits: torch.Tensor | None,
    acc: _Accumulator,
) -> None:
    for lo in range(0, targets.numel(), SOFTMAX_ROWS):
        hi = min(lo + SOFTMAX_ROWS, targets.numel())
        tgt = targets[lo:hi].unsqueeze(1)
        logp = torch.log_softmax(logits[lo:hi].to(torch.float64), dim=-1)
        nll = -logp.gather(1, tgt).squeeze(1)
        acc.nll.append(nll)
        acc.nll_sum += float(nll.sum())
        if base_logits is None:
            continue
        base_logp = torch.log_softmax(base_logits[lo:hi].to(torch.float64), dim=-1)
        base_nll = -base_logp.gather(1, tgt).squeeze(1)
        acc.base_nll.append(base_nll)
        acc.kld.append((base_logp.exp() * (base_logp - logp)).sum(dim=1))
        acc.same_top.append(logp.argmax(dim=1) == base_logp.argmax(dim=1))
        acc.dp.append(torch.exp(-nll) - torch.exp(-base_nll))
    acc.count += targets.numel()


def evaluate_tokens(
    model,
    tokens: Sequence[int] | torch.Tensor,
    windows: list[Window],
    bos_id: int | None = None,
    base_model=None,
    on_window: ProgressCallback | None = None,
) -> EvalResult:
    """Score `windows` of `tokens` with `model` (and `base_model` for KLD).

    bos_id: when not None, the first token of every window is replaced by it (llama-perplexity).
    on_window(done, total, running_ppl) is called after each window.
    """
    if not windows:
        raise UsageError("nothing to evaluate: no windows")
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if base_model is not None:
        _check_same_vocab(model, base_model)
    acc = _Accumulator()
    device = _device_of(model)
    started = time.perf_counter()
    with torch.inference_mode():
        for index, window in enumerate(windows):
            ids = tokens[window.start : window.end].clone()
            if bos_id is not None:
                ids[0] = bos_id
            targets = tokens[window.score_from : window.end]
            logits = _window_logits(model, ids.unsqueeze(0).to(device), window).cpu()
            base_logits = None
            if base_model is not None:
                base_logits = _window_logits(base_model, ids.unsqueeze(0).to(_device_of(base_model)), window).cpu()
                if base_logits.shape[-1] != logits.shape[-1]:
                    raise LowbitError(
                        f"base model has {base_logits.shape[-1]} logits per token, the model {logits.shape[-1]}: "
                        "different vocabularies"
                    )
            _score_window(logits, targets, base_logits, acc)
            del logits, base_logits
            if on_window is not None:
                on_window(index + 1, len(windows), _exp(acc.nll_sum / acc.count))
    elapsed = time.perf_counter() - started
    return _result(acc, windows, tokens.numel(), elapsed)


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _check_same_vocab(model, base_model) -> None:
    ours, theirs = _vocab_size(model), _vocab_size(base_model)
    if ours is not None and theirs is not None and ours != theirs:
        raise LowbitError(f"base model vocabulary has {theirs} tokens, the model's {ours}: KLD needs the same vocabulary")


_MAX_LOG = 709.0  # math.exp overflows a float64 above this


def _exp(x: float) -> float:
    """exp for a running display or a ratio: inf where math.exp would raise OverflowError."""
    return math.exp(x) if x <= _MAX_LOG else math.inf


def ppl_and_error(nll: torch.Tensor) -> tuple[float, float, float]:
    """(ppl, its standard error, mean NLL) from per-token NLLs, as llama-perplexity computes them."""
    nll = nll.to(torch.float64)
    n = nll.numel()
    if not torch.isfinite(nll).all():
        raise LowbitError(f"the model's log-probabilities are NaN or inf at {int((~torch.isfinite(nll)).sum())} of {n} "
                          "scored tokens: its weights or activations overflow (no perplexity to report)")
    mean = float(nll.mean())
    if mean > _MAX_LOG:
        raise LowbitError(f"the model's perplexity overflows (mean negative log-likelihood {mean:.3g} nats per token): "
                          "its logits are out of any sane range (corrupt or overflowing weights)")
    ppl = math.exp(mean)
    variance = float((nll * nll).mean()) - mean * mean
    err = ppl * math.sqrt(variance / (n - 1)) if n > 1 and variance > 0 else 0.0
    return ppl, err, mean


def _mean_and_error(values: torch.Tensor) -> tuple[float, float]:
    values = values.to(torch.float64)
    n = values.numel()
    mean = float(values.mean())
    variance = float((values * values).mean()) - mean * mean
    return mean, (math.sqrt(variance / (n - 1)) if n > 1 and variance > 0 else 0.0)


def kld_stats(nll: torch.Tensor, base_nll: torch.Tensor, kld: torch.Tensor, same_top: torch.Tensor, dp: torch.Tensor) -> KldStats:
    """llama.cpp's KL-divergence summary from per-token scalars."""
    n = kld.numel()
    mean, err = _mean_and_error(kld)
    ordered = kld.to(torch.float64)
    p99, p999, median = (float(torch.quantile(ordered, q)) for q in (0.99, 0.999, 0.5))
    same = float(same_top.to(torch.float64).mean())
    same_err = math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0
    # RMS Δp as llama.cpp reports it: sqrt(mean(Δp²)), its error propagated from that of mean(Δp²).
    dp2_mean, dp2_err = _mean_and_error(dp.to(torch.float64) ** 2)
    rms = math.sqrt(dp2_mean)
    rms_err = 0.5 * dp2_err / rms if rms > 0 else 0.0
    ppl, _, mean_nll = ppl_and_error(nll)
    base_ppl, base_ppl_err, base_mean_nll = ppl_and_error(base_nll)
    return KldStats(
        mean=mean,
        err=err,
        p99=p99,
        p999=p999,
        median=median,
        max=float(ordered.max()),
        same_top_pct=100.0 * same,
        same_top_err_pct=100.0 * same_err,
        rms_dp_pct=100.0 * rms,
        rms_dp_err_pct=100.0 * rms_err,
        base_ppl=base_ppl,
        base_ppl_err=base_ppl_err,
        ppl_ratio=_exp(mean_nll - base_mean_nll),
    )


def _result(acc: _Accumulator, windows: list[Window], n_tokens: int, elapsed: float) -> EvalResult:
    nll = torch.cat(acc.nll)
    ppl, err, mean = ppl_and_error(nll)
    kld = None
    if acc.kld:
        kld = kld_stats(nll, torch.cat(acc.base_nll), torch.cat(acc.kld), torch.cat(acc.same_top), torch.cat(acc.dp))
    tokens_run = sum(w.end - w.start for w in windows)
    return EvalResult(
        mode="chunks",
        ctx=windows[0].end - windows[0].start,
        stride=None,
        windows=len(windows),
        tokens_total=n_tokens,
        tokens_scored=nll.numel(),
        ppl=ppl,
        ppl_err=err,
        nll_mean=mean,
        kld=kld,
        eval_s=elapsed,
        tokens_per_s=tokens_run / elapsed if elapsed > 0 else 0.0,
    )


# ---------------------------------------------------------------------------------------------
# text → result


def tokenize_for_eval(tokenizer, text: str) -> tuple[list[int], int | None]:
    """(tokens of the whole text, BOS id to put first in each window or None).

    Like llama-perplexity, the text is tokenized once with the tokenizer's own BOS rule.
    """
    if not text or not text.strip():
        raise LowbitError("the text is empty")
    tokens = list(tokenizer.encode(text))
    add_bos = bool(getattr(tokenizer, "add_bos", False))
    bos_id = getattr(tokenizer, "bos_id", None) if add_bos else None
    return tokens, bos_id


def plan_windows(
    n_tokens: int, ctx: int, chunks: int | None = None, stride: int | None = None
) -> list[Window]:
    """Chunk windows (llama-perplexity), or sliding windows when `stride` is given."""
    if chunks is not None and chunks < 1:
        raise UsageError(f"--chunks must be at least 1, got {chunks}")
    if stride is None:
        return chunk_windows(n_tokens, ctx, chunks)
    return stride_windows(n_tokens, ctx, stride, chunks)


def evaluate_text(
    model,
    tokenizer,
    text: str,
    ctx: int = 2048,
    chunks: int | None = None,
    stride: int | None = None,
    base_model=None,
    on_window: ProgressCallback | None = None,
) -> EvalResult:
    """Perplexity (and KLD against base_model) of `model` on `text`; see the module docstring."""
    _check_models(model, base_model, ctx)
    tokens, bos_id = tokenize_for_eval(tokenizer, text)
    windows = plan_windows(len(tokens), ctx, chunks, stride)
    return _evaluate_planned(model, tokens, windows, bos_id, base_model, ctx, stride, on_window)


def _check_models(model, base_model, ctx: int) -> None:
    check_ctx(ctx, _max_positions(model))
    if base_model is not None:
        check_ctx(ctx, _max_positions(base_model))
        _check_same_vocab(model, base_model)


def _evaluate_planned(model, tokens, windows, bos_id, base_model, ctx, stride, on_window) -> EvalResult:
    result = evaluate_tokens(model, tokens, windows, bos_id=bos_id, base_model=base_model, on_window=on_window)
    if stride is not None:
        result.mode, result.stride = "stride", stride
    result.ctx = ctx
    return result


# ---------------------------------------------------------------------------------------------
# paths → report (what `lowbit eval` and Python users call)

EVAL_DTYPES = ("f32", "bf16")  # f16 on a CPU is slower than f32 and not more exact
# Text long enough to tell two tokenizers apart, short enough to encode twice for free.
TOKENIZER_PROBE_CHARS = 4000


@dataclass(slots=True)
class EvalReport:
    model: str
    data: str
    base: str | None
    dtype: str
    result: EvalResult
    load_s: float
    device: str = "cpu"


@dataclass(slots=True)
class EvalJob:
    """Everything loaded and checked, ready to run: the slow part left is the forward passes."""

    model_name: str
    data_name: str
    base_name: str | None
    dtype: str
    ctx: int
    stride: int | None
    model: object
    base_model: object | None
    tokens: list[int]
    bos_id: int | None
    windows: list[Window]
    load_s: float
    device: str = "cpu"

    def causal_lm(self):
        """The model itself, for wrappers that run its layers their own way (early exit, cascade):
        on the CPU `model` is the engine path's WindowScorer around it."""
        return getattr(self.model, "lm", self.model)


def prepare(
    model: str,
    data: str,
    ctx: int = 2048,
    chunks: int | None = None,
    stride: int | None = None,
    base: str | None = None,
    dtype: str = "f32",
    device: str = "auto",
) -> EvalJob:
    """Resolve and load `model` (demo name, path or hub id) and `data` (demo name or UTF-8 file),
    tokenize, and plan the windows; every bad input fails here, before any window runs.

    The cheap checks (options, paths, the text) come before loading weights.
    """
    from lowbit.data.text import load_text
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    from lowbit.runtime.device import resolve_device

    dtype = dtype_name(dtype, allowed=EVAL_DTYPES)
    target = resolve_device(device)
    check_ctx(ctx)
    if chunks is not None and chunks < 1:
        raise UsageError(f"--chunks must be at least 1, got {chunks}")
    if stride is not None and not 1 <= stride <= ctx:
        raise UsageError(f"--stride must be between 1 and --ctx ({ctx}), got {stride}")
    model_path = resolve_model(model)
    base_path = resolve_model(base) if base is not None else None
    text = load_text(data)

    started = time.perf_counter()
    tokenizer = load_tokenizer(model_path)
    lm = _scoring_model(model_path, DTYPES[dtype], target, ctx)
    base_lm = None
    if base_path is not None:
        base_lm = load_model(base_path, dtype=DTYPES[dtype], device=target)
        _check_same_vocab(lm, base_lm)
        _check_same_tokenizer(tokenizer, load_tokenizer(base_path), text)
    _check_models(lm, base_lm, ctx)
    tokens, bos_id = tokenize_for_eval(tokenizer, text)
    windows = plan_windows(len(tokens), ctx, chunks, stride)
    return EvalJob(
        model_name=str(model), data_name=str(data), base_name=base, dtype=dtype, ctx=ctx, stride=stride,
        model=lm, base_model=base_lm, tokens=tokens, bos_id=bos_id, windows=windows,
        load_s=time.perf_counter() - started, device=str(target),
    )


def run(job: EvalJob, on_window: ProgressCallback | None = None) -> EvalReport:
    result = _evaluate_planned(job.model, job.tokens, job.windows, job.bos_id, job.base_model, job.ctx, job.stride, on_window)
    return EvalReport(model=job.model_name, data=job.data_name, base=job.base_name, dtype=job.dtype, result=result, load_s=job.load_s, device=job.device)


def evaluate(
    model: str,
    data: str,
    ctx: int = 2048,
    chunks: int | None = None,
    stride: int | None = None,
    base: str | None = None,
    dtype: str = "f32",
    on_window: ProgressCallback | None = None,
    device: str = "auto",
) -> EvalReport:
    """`lowbit eval` as a function: prepare() then run()."""
    return run(prepare(model, data, ctx, chunks, stride, base, dtype, device), on_window)


def _scoring_model(path, dtype: torch.dtype, device: torch.device, ctx: int):
    """The model eval scores with. On the CPU: the engine's model on the engine's path (one window
    a prefill through its runner: runtime/engine/window_scorer.py), so eval's log-probabilities are
    the ones generate and serve compute, bit for bit, in every activation mode; --base stays the
    plain float32 forward, the reference. Elsewhere the model's own forward."""
    if device.type == "cpu":
        from lowbit.kernels import hugepages
        from lowbit.runtime.engine.engine_model import load_engine_model
        from lowbit.runtime.engine.window_scorer import WindowScorer

        # windows of many rows never read a packed head copy: none is made (kernels/cpu_bf16pack.py)
        scorer = WindowScorer(load_engine_model(path, dtype, device, pack=False), ctx)
        hugepages.return_freed_memory()
        return scorer
    from lowbit.runtime.loader import load_model

    return load_model(path, dtype=dtype, device=device)


def _check_same_tokenizer(tokenizer, base_tokenizer, text: str) -> None:
    probe = text[:TOKENIZER_PROBE_CHARS]
    if tokenizer.encode(probe) != base_tokenizer.encode(probe):
        raise LowbitError("the base model's tokenizer splits the text differently from the model's: KLD needs the same tokens")
