"""From command-line values to a running server: the engine factory and the config (sizes are parsed in
cli/sizes.py, like every command's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowbit.quant.dtypes import dtype_name

DTYPES = ("f32", "bf16")


def engine_factory(model_path: Path, *, dtype: str = "f32", kv_dtype: str | None = None, kv_memory: int | None = None,
                   max_running: int = 64,
                   max_model_len: int | None = None, draft: str | None = None,
                   threads: int | None = None, kernel_settings=None,
                   max_prefill_tokens: int | None = None, quantize_to: str | None = None,
                   draft_vocab: int | None = None) -> Callable[[], Any]:
    """A zero-argument builder the engine thread calls: loading happens off the event loop.
    kernel_settings: a kernels.dispatch.KernelSettings in effect while the model loads (--kernel,
    --int4-activations, --dense-activations, --int8-activations), else the environment's. quantize_to: RTN-quantize the Linears as they load
    (--cascade self:FORMAT). draft_vocab: --draft-vocab (Engine's draft_vocab)."""
    dtype = dtype_name(dtype, allowed=DTYPES)  # float32/bfloat16 spelled out are the same

    def build():
        import torch

        from lowbit.kernels.dispatch import use_settings
        from lowbit.runtime.engine.engine import Engine

        if threads is not None:
            # The engine thread is the only one doing tensor work, so this is its intra-op pool.
            torch.set_num_threads(threads)
        torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        with use_settings(kernel_settings):  # None: KernelSettings(), the environment's choices
            return Engine(str(model_path), dtype=torch_dtype, kv_dtype=kv_dtype, kv_memory=kv_memory, max_num_seqs=max_running,
                          max_model_len=max_model_len, draft=draft, max_prefill_tokens=max_prefill_tokens,
                          quantize_to=quantize_to, draft_vocab=draft_vocab)

    return build


def cascade_model(spec: str, model_path):
    """--cascade's (model path, format to quantize to on load): self:FORMAT is MODEL's own weights;
    any other model must share MODEL's tokenizer (checked here, before anything loads)."""
    from lowbit.errors import UsageError
    from lowbit.formats.resolve import resolve_model
    from lowbit.quant.registry import get_format
    from lowbit.runtime.engine.draft_models import check_same_tokenizer
    from lowbit.runtime.engine.drafter import parse_draft
    from lowbit.runtime.tokenizer import load_tokenizer

    kind, arg = parse_draft(spec)
    if kind == "self":
        get_format(arg)  # an unknown format is a one-line error now, not a failed load later
        return model_path, arg
    if kind != "model":
        raise UsageError(f"--cascade {spec}: give a model with the same tokenizer or self:FORMAT (e.g. self:int4)")
    cheap_path = resolve_model(arg)
    check_same_tokenizer(cheap_path, load_tokenizer(model_path), f"--cascade {spec}", f"{model_path}'s")
    return cheap_path, None
