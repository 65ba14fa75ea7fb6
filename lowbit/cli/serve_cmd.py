"""`lowbit serve`: an OpenAI-compatible HTTP server (docs/serve.md)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import typer

from lowbit.cli.common import DRAFT_VOCAB_OPTION, KV_DTYPE_OPTION, console
from lowbit.cli.kernel_options import DENSE_ACTIVATIONS_OPTION, INT4_ACTIVATIONS_OPTION, INT8_ACTIVATIONS_OPTION, KERNEL_OPTION, kernel_settings
from lowbit.cli.main import app
from lowbit.errors import UsageError


@app.command("serve")
def serve_command(
    model: str = typer.Argument(..., help="Model to serve: demo name (smollm2-135m), local directory, or hub id."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind. The default is loopback only; "
                             "use 0.0.0.0 to accept other machines (set --api-key then)."),
    port: int = typer.Option(8000, "--port", help="TCP port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* "
                                          "(default: $LOWBIT_API_KEY; unset = no key). Never logged.",
                                          show_default=False),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="The model id clients send (default: MODEL as given)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Speculative decoding draft: another model, "
                                        "self:FORMAT (a quantized copy of MODEL), self:layers=N (its first N layers + its head) or ngram."),
    draft_vocab: Optional[int] = DRAFT_VOCAB_OPTION,
    cascade: Optional[str] = typer.Option(
        None, "--cascade", help="Query cascade: every request runs on this cheap model first (same tokenizer: a "
        "quantized checkpoint, a distilled student, or self:FORMAT, MODEL's weights RTN-quantized on load) and "
        "again on MODEL when the cheap answer's mean token probability is not above --cascade-threshold. The "
        "answer's 'cascade' field and X-Lowbit-Answered-By header say which model answered (docs/serve.md)."),
    cascade_threshold: float = typer.Option(0.8, "--cascade-threshold", help="Mean token probability in [0, 1] a "
                                            "cheap answer must exceed to stand (1: every request escalates)."),
    max_running: int = typer.Option(64, "--max-running", help="Most requests decoded together in one batch."),
    max_prefill_tokens: Optional[int] = typer.Option(
        None, "--max-prefill-tokens", help="Most prompt tokens prefilled in one step while other requests run or "
        "wait (or 16 per decode in the step, if more; longer prompts go in chunks, one prompt after another; a lone prompt is not capped). Default: 128 on "
        "a CPU, where prefill costs ~2 ms a token and a big step makes every new request and every running stream "
        "wait for all of it; uncapped on a GPU.", show_default=False),
    max_queue: int = typer.Option(256, "--max-queue", help="Most requests waiting beyond --max-running; "
                                  "more get HTTP 429 at once."),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="Memory for the KV cache, e.g. 2GiB, 512MiB "
                                            "or 1.5GB (no unit: bytes; at least 1MiB, at most the memory free; "
                                            "default: the engine's share of free memory)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context length limit in tokens "
                                                "(prompt + output; at most the model's max_position_embeddings, "
                                                "the default)."),
    dtype: str = typer.Option("f32", "--dtype", help="Compute dtype: f32 (default) or bf16 (float32, bfloat16 mean the same)."),
    kv_dtype: Optional[str] = KV_DTYPE_OPTION,
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for the model (default: torch's, "
                                          "one per core; 1 is faster on a machine busy with other work)."),
    kernel: Optional[str] = KERNEL_OPTION,
    int4_activations: Optional[str] = INT4_ACTIVATIONS_OPTION,
    dense_activations: Optional[str] = DENSE_ACTIVATIONS_OPTION,
    int8_activations: Optional[str] = INT8_ACTIVATIONS_OPTION,
    max_body_size: str = typer.Option("4MiB", "--max-body-bytes", help="Largest request body accepted, e.g. 4MiB "
                                      "or 65536 (no unit: bytes); 413 above."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help="Seconds in-flight requests get to "
                                           "finish after SIGTERM before they are aborted."),
) -> None:
    """Serve MODEL over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models,
    /health and /metrics. Stops cleanly on SIGTERM or Ctrl-C."""
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.server.app import ServerConfig, serve
    from lowbit.cli.sizes import MIB, check_memory, check_positions, model_positions, parse_size
    from lowbit.runtime.early_exit import check_threshold
    from lowbit.runtime.engine.paged_cache import check_kv_dtype
    from lowbit.runtime.server.launch import cascade_model, engine_factory

    max_body = parse_size(max_body_size, "--max-body-bytes")
    for name, value in (("--max-running", max_running), ("--port", port), ("--max-body-bytes", max_body),
                        ("--threads", 1 if threads is None else threads),
                        ("--max-prefill-tokens", 1 if max_prefill_tokens is None else max_prefill_tokens)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if port > 65535:
        raise UsageError(f"--port must be a TCP port, 1 to 65535, got {port}")
    if max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {max_queue}")
    if max_model_len is not None and max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2, got {max_model_len}")
    check_threshold(cascade_threshold, "--cascade-threshold")
    check_kv_dtype(kv_dtype)  # before the engine thread loads anything
    settings = kernel_settings(kernel, int4_activations, dense_activations, int8_activations)
    key = api_key if api_key is not None else os.environ.get("LOWBIT_API_KEY") or None
    # the shared size syntax (lowbit/cli/sizes.py); 1MiB at least, so a bare 512 meant as MiB is an error
    kv_bytes = parse_size(kv_memory, "--kv-memory", minimum=MIB) if kv_memory else None
    path = resolve_model(model)
    # before the engine thread loads anything: the engine itself would clamp a too-long limit silently
    if max_model_len is not None:
        check_positions("--max-model-len", max_model_len, model_positions(str(path)))
    if kv_bytes is not None:
        check_memory("--kv-memory", kv_memory, kv_bytes)
    # under --cascade each engine gets half of a given --kv-memory (unset: each its own share of what is free)
    kv_each = kv_bytes // 2 if cascade is not None and kv_bytes is not None else kv_bytes
    common = dict(dtype=dtype, kv_dtype=kv_dtype, kv_memory=kv_each, max_running=max_running, max_model_len=max_model_len,
                  threads=threads, kernel_settings=settings, max_prefill_tokens=max_prefill_tokens)
    from lowbit.runtime.engine.draft_vocab import check_draft_vocab

    check_draft_vocab(draft_vocab)  # before the server starts (the engine loads in its own thread)
    build = engine_factory(path, draft=draft, draft_vocab=draft_vocab, **common)
    build_cheap = None
    if cascade is not None:
        cheap_path, quantize_to = cascade_model(cascade, path)
        build_cheap = engine_factory(cheap_path, quantize_to=quantize_to, **common)
    config = ServerConfig(model_name=served_model_name or model, host=host, port=port, api_key=key,
                          max_running=max_running, max_queue=max_queue, max_body_bytes=max_body,
                          shutdown_timeout=shutdown_timeout)
    cascading = f", cascading from {cascade} (threshold {cascade_threshold:g})" if cascade else ""
    console.print(f"serving [bold]{config.model_name}[/bold] on http://{host}:{port}/v1 "
                  f"({'API key required' if key else 'no API key'}{cascading}); loading the model in the background")
    stopped = serve(config, build, build_cheap, cascade_threshold, cascade or "")
    # Ctrl-C: 130 as every command exits on it, with the line a server's stop deserves (main's own
    # is about outputs not written); SIGTERM: 0
    code = 130 if stopped.interrupted else 0
    if stopped.interrupted:
        when = "while the model was loading" if stopped.loading else "after a graceful shutdown"
        print(f"lowbit: stopped (SIGINT) {when}", file=sys.stderr, flush=True)
    if stopped.loading:  # the loading thread would abort the interpreter's shutdown (serve.Stopped)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    if code:
        sys.exit(code)

