"""`lowbit generate`: stream one completion to stdout (the prompt from the argument or stdin)."""

from __future__ import annotations

import sys
import time
from typing import Optional

import typer

from lowbit.cli.common import CASCADE_RUN_OPTION, DRAFT_VOCAB_OPTION, KV_DTYPE_OPTION, THREADS_OPTION, apply_threads, console, print_json
from lowbit.cli.kernel_options import DENSE_ACTIVATIONS_OPTION, INT4_ACTIVATIONS_OPTION, INT8_ACTIVATIONS_OPTION, KERNEL_OPTION, kernel_settings
from lowbit.cli.main import app
from lowbit.errors import UsageError


def read_prompt(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise UsageError("give a PROMPT, or '-' / a pipe to read it from stdin")
    return sys.stdin.read()


@app.command("generate")
def generate(
    model: str = typer.Argument(..., help="Model: a directory, a demo name (smollm2-135m) or a hub id."),
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; '-' or omitted with a pipe: read stdin."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as one user message in the chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message (with --chat)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate (prompt + this: at most the "
                                   "model's max_position_embeddings)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy (the default); higher samples."),
    top_p: float = typer.Option(1.0, "--top-p", help="Keep the smallest likely set with this mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top probability."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="> 1 discourages repeats."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable); not included in the output."),
    draft: Optional[str] = typer.Option(
        None, "--draft", help="Speculative decoding: 'ngram', 'self:FORMAT' (an RTN copy of the model: "
        "self:int8-g32 drafts best on a CPU), 'self:layers=N' (the model's first N layers + its head, sharing the model's KV cache) or a draft model."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="Draft tokens per step (adapts)."),
    draft_vocab: Optional[int] = DRAFT_VOCAB_OPTION,
    early_exit: Optional[str] = typer.Option(
        None, "--early-exit", help="Exit layers, e.g. 12,20: a token whose exit confidence is above --exit-threshold "
        "is emitted from that layer and the later layers are skipped (approximate; docs/early_exit.md)."),
    exit_threshold: float = typer.Option(1.0, "--exit-threshold", help="Exit confidence threshold in [0, 1] "
                                         "(1 = never exit: the full model)."),
    exit_confidence: str = typer.Option("top1", "--exit-confidence", help="top1 or margin (top-1 minus top-2); for "
                                        "--early-exit and --cascade."),
    cascade: Optional[str] = typer.Option(
        None, "--cascade", help="Token cascade: a cheap model (self:FORMAT such as self:int8-g32, self:layers=N, "
        "or a model with the same tokenizer) generates; where its confidence is not above --cascade-threshold the model takes that token, "
        "catching up on the cheap ones in one pass (approximate; docs/early_exit.md)."),
    cascade_threshold: float = typer.Option(0.9, "--cascade-threshold", help="Cascade confidence threshold in [0, 1] "
                                            "(1 = the model alone)."),
    cascade_run: int = CASCADE_RUN_OPTION,
    dtype: str = typer.Option("f32", "--dtype", help="Compute dtype: f32 (default), bf16 or f16 (float32, bfloat16, float16 mean the same)."),
    kv_dtype: Optional[str] = KV_DTYPE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    kernel: Optional[str] = KERNEL_OPTION,
    int4_activations: Optional[str] = INT4_ACTIVATIONS_OPTION,
    dense_activations: Optional[str] = DENSE_ACTIVATIONS_OPTION,
    int8_activations: Optional[str] = INT8_ACTIVATIONS_OPTION,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate a completion, streaming the text to stdout as it is produced."""

    from lowbit.kernels.dispatch import use_settings
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sequence import SamplingParams

    settings = kernel_settings(kernel, int4_activations, dense_activations, int8_activations)
    apply_threads(threads)
    text = read_prompt(prompt)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed, max_tokens=max_tokens, stop=tuple(stop))
    from lowbit.cli.sizes import check_positions, model_positions

    # before the model loads: with at least one prompt token, a --max-tokens of the whole context cannot fit
    check_positions("--max-tokens", max_tokens + 1, model_positions(model), spelled=f"--max-tokens {max_tokens} + the prompt")
    cascade_settings = None
    if cascade is not None:
        from lowbit.runtime.cascade import CascadeSettings

        if early_exit is not None or draft is not None:
            raise UsageError("--cascade does not combine with --early-exit or --draft")
        cascade_settings = CascadeSettings(cascade_threshold, exit_confidence, cascade_run)  # checked before loading
        draft = cascade
    if early_exit is not None:
        if kv_dtype not in (None, "auto"):
            raise UsageError("--kv-dtype does not combine with --early-exit (it decodes over a float KV cache)")
        return _generate_early_exit(model, text, params, chat, system, dtype, early_exit, exit_threshold,
                                    exit_confidence, draft, json_out, settings)
    with use_settings(settings):
        engine = Engine(model, dtype=dtype, kv_dtype=kv_dtype, draft=draft, num_speculative_tokens=num_speculative_tokens,
                        max_num_seqs=1, kv_memory=None, cascade=cascade_settings, draft_vocab=draft_vocab)
    prompt_ids = encode_prompt(engine.tokenizer, text, chat, system)
    start = time.perf_counter()
    engine.add_request("generate", prompt_ids, params)
    pieces, ids, first, last = [], [], None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
            ids += out.new_token_ids
            pieces.append(out.text_delta)
            if not json_out and out.text_delta:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
            last = out
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    decode_s = elapsed - (first or 0.0)
    decode_tok_s = (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else 0.0
    if json_out:
        result = {"text": "".join(pieces), "token_ids": ids, "finish_reason": last.finish_reason,
                  "num_prompt_tokens": len(prompt_ids), "num_generated_tokens": len(ids),
                  "ttft_s": first, "decode_tok_s": decode_tok_s}
        if cascade_settings is not None:
            result["cascade"] = cascade_info(cascade, cascade_settings, stats)
        elif draft:
            result.update(draft=draft, draft_vocab=engine.draft_head_vocab, spec_draft_tokens=stats.spec_draft_tokens,
                          spec_accepted_tokens=stats.spec_accepted_tokens,
                          mean_accepted_length=stats.spec_mean_accepted_length)
        print_json(result)
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    note = f"{len(ids)} tokens, {decode_tok_s:.1f} tok/s, finish: {last.finish_reason}"
    if cascade_settings is not None:
        note += f", {100 * cascade_info(cascade, cascade_settings, stats)['cheap_rate']:.1f} % of tokens from {cascade}"
    elif draft:
        note += f", mean accepted length {stats.spec_mean_accepted_length:.2f}"
    console.print(f"[dim]{note}[/dim]")


def cascade_info(cheap: str, settings, stats) -> dict:
    from lowbit.runtime.cascade import CascadeStats

    counts = CascadeStats(stats.cascade_cheap_tokens, stats.cascade_full_tokens).as_dict()
    return {"cheap": cheap, "threshold": settings.threshold, "confidence": settings.confidence, **counts}


def _report(g, prompt_ids: list[int], json_out: bool, key: str, info: dict, note: str) -> None:
    """The end of a single-sequence decode outside the engine (early exit, cascade): the JSON
    object, or a newline after the streamed text and one dim line of figures."""
    decode_tok_s = (len(g.token_ids) - 1) / g.decode_s if len(g.token_ids) > 1 and g.decode_s > 0 else 0.0
    if json_out:
        print_json({"text": g.text, "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                    "num_prompt_tokens": len(prompt_ids), "num_generated_tokens": len(g.token_ids),
                    "ttft_s": g.ttft_s, "decode_tok_s": decode_tok_s, key: info})
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    console.print(f"[dim]{len(g.token_ids)} tokens, {decode_tok_s:.1f} tok/s, finish: {g.finish_reason}, {note}[/dim]")


def encode_prompt(tok, text: str, chat: bool, system: str | None) -> list[int]:
    if not chat:
        return tok.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    bos = tok.special_tokens.get("bos_token")
    return tok.encode(rendered, add_bos=not (bos and rendered.startswith(bos)))


def _generate_early_exit(model, text, params, chat, system, dtype, layers, threshold, confidence, draft,
                         json_out, settings) -> None:
    from lowbit.formats.resolve import resolve_model
    from lowbit.kernels.dispatch import use_settings
    from lowbit.quant.dtypes import parse_dtype
    from lowbit.runtime.early_exit import check_confidence, check_threshold, generate_with_exits, settings_for
    from lowbit.runtime.exit_adapters import load_adapters
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    check_threshold(threshold)
    check_confidence(confidence)
    if draft is not None:
        raise UsageError("--early-exit and --draft do not combine (for exact self-speculation use --draft self:layers=N)")
    path = resolve_model(model)
    tok = load_tokenizer(path)
    with use_settings(settings):
        import torch

        lm = load_model(path, parse_dtype(dtype), "cuda" if torch.cuda.is_available() else "cpu")
        exits = settings_for(lm, layers, threshold, confidence)
        adapters = load_adapters(path, lm.config)
        prompt_ids = encode_prompt(tok, text, chat, system)

        def stream(delta: str) -> None:
            sys.stdout.write(delta)
            sys.stdout.flush()

        g = generate_with_exits(lm, tok, prompt_ids, params, exits, None if json_out else stream, adapters)
    info = {"layers": list(exits.layers), "threshold": exits.threshold, "confidence": exits.confidence,
            "adapted_layers": sorted(adapters), **g.stats.as_dict()}
    _report(g, prompt_ids, json_out, "early_exit", info, f"{info['mean_layers']:.2f} of {info['num_layers']} layers per token")
