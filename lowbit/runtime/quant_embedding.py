"""QuantEmbedding: the token embedding of a model whose tied head is quantized.

With `lowbit quantize --quantize-head` on a model that ties lm_head to embed_tokens, the one
matrix is stored once, quantized, as lm_head (a QuantLinear computes the logits through the
kernels). The embedding reads its rows from that same QTensor: a step looks up a handful of
tokens (a prefill at most a few thousand), so decoding just those rows costs far less than
keeping a second, dense copy of a vocabulary-sized table. Formats whose parts span rows (fp8 2-D
blocks, nf4 with double-quantized scales) cannot be cut by row; those are decoded once into a
dense table of the compute dtype instead.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.quant.qtensor import QTensor


class QuantEmbedding(nn.Module):
    def __init__(self, qt: QTensor, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qt.shape
        self.label = qt.spec.label
        self.dtype = dtype
        # plain attributes, not buffers: the checkpoint's lm_head holds these tensors, and the
        # loader's state_dict must not expect an embed_tokens.weight
        self.qt = qt.to(device) if qt.row_aligned else None
        self.table = None if self.qt is not None else qt.dequantize(torch.float32).to(device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return nn.functional.embedding(ids, self.table)
        flat = ids.reshape(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)  # a repeated token is decoded once
        rows = self.qt.rows(unique).dequantize(torch.float32).to(self.dtype)
        return rows[inverse].reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.label}, rows read from the quantized lm_head"
