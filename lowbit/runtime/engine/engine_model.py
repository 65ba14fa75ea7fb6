"""The model as the engine runs it on its device: one loader for `Engine` and for `lowbit eval`
(runtime/engine/window_scorer.py), so that eval scores with the very weights, kernels and fused
projections that generate and serve compute with."""

from __future__ import annotations

from pathlib import Path

import torch

from lowbit.kernels import hugepages
from lowbit.kernels.cpu_bf16pack import pack_linears
from lowbit.kernels.cpu_f32 import available as cpu_f32_available, use_invariant_linears
from lowbit.runtime.models.fusion import fuse_projections


def load_engine_model(path: str | Path, dtype: torch.dtype, device: torch.device, quantize_to: str | None = None,
                      draft_head: bool = False, head_vocab: torch.Tensor | None = None, pack: bool = True):
    """Load the checkpoint at `path` for the engine. quantize_to: RTN-quantize its Linears to that
    format as they load (a `self:FORMAT` draft or cascade). draft_head: a draft model's head, read
    in full at every draft step, quantized on the CPU (draft_models.quantize_draft_head_), scoring only
    `head_vocab`'s tokens where given (a draft's, or quantize_to's head: draft_vocab.py). pack: keep a
    bf16 head's packed copy for decode steps (kernels/cpu_bf16pack.py; eval, which scores whole
    windows, does without). The caller
    frees the loaders' temporaries (hugepages.return_freed_memory) once everything it loads is placed."""
    from lowbit.runtime.loader import load_model

    with hugepages.arena():  # the weights decode streams, on 2 MB pages (kernels/hugepages.py)
        # float32 compute on the CPU: bf16-stored Linear weights stay bf16 as they load (the
        # dense kernel reads them so; widening first held twice their bytes)
        narrow = device.type == "cpu" and dtype is torch.float32 and cpu_f32_available()
        if quantize_to is None:
            model = load_model(path, dtype, device, bf16_linears=narrow)
            if draft_head:
                from lowbit.runtime.engine.draft_models import quantize_draft_head_

                quantize_draft_head_(model, device, head_vocab)
        else:
            from lowbit.runtime.engine.draft_models import quantized_copy

            model = quantized_copy(path, quantize_to, dtype, device, fuse=False, head_vocab=head_vocab)  # joined below
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            # batch-invariant float32 (and bf16) Linears: a verify of 1 + k rows computes each row
            # as a plain step does
            use_invariant_linears(model, bf16_weights=narrow)
        # the joins replace the separate q/k/v and gate/up the load placed: join into fresh chunks
        # and move the rest there, so the load's chunks go (kernels/hugepages.py)
        hugepages.new_generation()
        fuse_projections(model)  # q/k/v and gate/up as one matmul where exact (int4dot, invariant dense)
        hugepages.place_weights(model)
        if device.type == "cpu" and pack and dtype is torch.float32:
            # bf16 weights read in 12 bits a weight at decode steps, the same outputs (float32 rows
            # only: a model computing in bf16 would never read the copies)
            pack_linears(model)
    return model
