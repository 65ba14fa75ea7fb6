"""QuantLinear: a Linear whose weight is a QTensor, run through the kernel dispatch.

The weight is prepared once for the device (kernels.prepare picks the path and repacks) and never
dequantized into a stored dense matrix. `attach_quantized` swaps the plain Linears a model was
built with (runtime/linear.py `make_linear`) for QuantLinears by Hugging Face module name.

Outliers (`lowbit quantize --keep-outliers`): an optional sparse [out, in] matrix S of weights kept
in bf16 outside the format, added back as y += x @ Sᵀ; see `set_outliers`. S is held as CSR
(rows = output features): on the CPU, CSR mv / addmm beat COO, `x @ Sᵀ` and an index_add scatter
at 0.5 % density, for one decode token and for a 2048-token prefill alike.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.kernels import prepare, qmatmul
from lowbit.quant.qtensor import QTensor


class QuantLinear(nn.Module):
    def __init__(self, qt: QTensor, bias: torch.Tensor | None = None, device: torch.device | str = "cpu",
                 path: str | None = None):
        super().__init__()
        self.out_features, self.in_features = qt.shape
        self.label = qt.spec.label
        self.prepared = prepare(qt, device, path)  # path: a kernel path by name (kernels.dispatch), else the best
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.outliers: torch.Tensor | None = None  # sparse CSR float32 [out, in], on the weight's device
        self._outliers_as: dict[torch.dtype, torch.Tensor] = {}  # S in another compute dtype, made once

    def set_outliers(self, sparse: torch.Tensor | None) -> None:
        """A sparse (COO or CSR) [out, in] matrix of weights kept outside the quantized format (or None)."""
        if sparse is not None and tuple(sparse.shape) != (self.out_features, self.in_features):
            raise LowbitError(
                f"outlier matrix {tuple(sparse.shape)} does not match the weight ({self.out_features}, {self.in_features})"
            )
        self._outliers_as = {}
        if sparse is None:
            self.outliers = None
            return
        if sparse.layout == torch.sparse_coo:
            sparse = sparse.coalesce()
        with warnings.catch_warnings():  # torch calls CSR "beta" once per process; lowbit relies only on CSR @ dense
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            self.outliers = sparse.to(self.prepared.device).float().to_sparse_csr()

    def _with_side(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + x Sᵀ: one CSR mv for a single token (decode), else (yᵀ + S xᵀ)ᵀ in one CSR addmm with
        xᵀ left strided (for prefill this saves both a contiguous copy of xᵀ and a separate add
        over y, the two slower alternatives). The CPU computes in float32 (float64 for float64 inputs); CUDA in x's dtype."""
        dtype = x.dtype if x.is_cuda or x.dtype == torch.float64 else torch.float32
        s = self.outliers if dtype == torch.float32 else self._outliers_as.get(dtype)
        if s is None:
            s = self._outliers_as[dtype] = self.outliers.to(dtype)
        flat_x = x.reshape(-1, self.in_features)
        if flat_x.dtype != dtype:
            flat_x = flat_x.to(dtype)
        if flat_x.shape[0] == 1:
            return (y + torch.mv(s, flat_x[0]).view(y.shape)).to(y.dtype)
        flat_y = y.reshape(-1, self.out_features).to(dtype)
        out = torch.addmm(flat_y.T, s, flat_x.T).T
        return out.reshape(*x.shape[:-1], self.out_features).to(y.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = qmatmul(x, self.prepared, self.bias)
        if self.outliers is not None:
            y = self._with_side(x, y)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, format={self.label}, "
            f"path={self.prepared.path}, bias={self.bias is not None}"
            + (f", outliers={self.outliers._nnz()}" if self.outliers is not None else "")
        )


def attach_quantized(
    model: nn.Module, names: list[str], load: Callable[[str], QTensor], device: torch.device | str = "cpu"
) -> None:
    """Replace each named Linear of `model` by a QuantLinear around `load(name)`, one at a time so
    only one unprepared QTensor is in memory. A bias is left to the state dict: the new module
    keeps a meta-device bias parameter of the right shape for `load_state_dict(assign=True)`."""
    from lowbit.formats.moe_names import to_lowbit as rename
    from lowbit.runtime.models.moe import Gate

    for name in names:
        target = rename(name)  # Mixtral's hub names (block_sparse_moe.experts.E.w1) -> lowbit's modules
        try:
            old = model.get_submodule(target)
        except AttributeError:
            raise LowbitError(f"quantized module {name} does not exist in {type(model).__name__}") from None
        qt = load(name)
        if isinstance(old, Gate):
            # a router a recipe quantized: it routes with its dequantized weight (exact in float32),
            # computed as a dense router is (runtime/models/moe.py)
            if tuple(qt.shape) != tuple(old.weight.shape):
                raise LowbitError(f"quantized weight {name} has shape {tuple(qt.shape)}, config.json implies {tuple(old.weight.shape)}")
            old.weight = nn.Parameter(qt.dequantize(torch.float32).to(device=device, dtype=old.weight.dtype), requires_grad=False)
            continue
        if not isinstance(old, nn.Linear):
            raise LowbitError(f"quantized module {name} is a {type(old).__name__}, not a Linear")
        if tuple(qt.shape) != (old.out_features, old.in_features):
            raise LowbitError(
                f"quantized weight {name} has shape {tuple(qt.shape)}, config.json implies ({old.out_features}, {old.in_features})"
            )
        bias = torch.empty_like(old.bias, device="meta") if old.bias is not None else None
        new = QuantLinear(qt, bias=bias, device=device)
        parent_name, _, leaf = target.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, new)


def attach_native(model: nn.Module, path, tied_head: bool, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> set[str]:
    """If `path` is a lowbit native checkpoint, swap in a QuantLinear for every quantized module and
    return the safetensors names of their packed parts (the loader skips those); else an empty set.
    A quantized head that config.json ties to the embeddings also becomes the embedding table
    (runtime/quant_embedding.py): the checkpoint stores that matrix once, as lm_head."""
    from lowbit.formats.native import NativeReader, is_native
    from lowbit.quant.outlier_matrix import sparse_outliers
    from lowbit.formats.moe_names import to_lowbit as rename
    from lowbit.runtime.quant_embedding import QuantEmbedding

    if not is_native(path):
        return set()
    reader = NativeReader(path)
    attach_quantized(model, reader.modules, reader.quantized, device)
    if tied_head and "lm_head" in reader.modules:
        if "lm_head" in reader.outlier_meta:
            raise LowbitError(f"{path}: a tied lm_head with kept outliers cannot also be the embedding table")
        model.model.embed_tokens = QuantEmbedding(reader.quantized("lm_head"), dtype, device)
    for module in reader.outlier_meta:
        shape = tuple(reader.module_meta[module]["shape"])
        model.get_submodule(rename(module)).set_outliers(sparse_outliers(reader.outliers(module), shape))
    return reader.packed_names
