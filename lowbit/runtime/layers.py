"""Building blocks shared by the model families: RMSNorm, rotary embeddings, activations, gated MLP.

The arithmetic follows Hugging Face's reference order (norms in float32, cos/sin cast to the model
dtype) so fp32 logits agree to rounding and bf16 runs round the same way. On CPU without autograd,
norms and the gated activation run as one C call each (kernels/cpu_rowops.py), which rounds where
the torch code below rounds; with autograd (or elsewhere) the torch code runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import LowbitError
from lowbit.kernels import cpu_rowops
from lowbit.runtime.config import RopeConfig
from lowbit.runtime.linear import make_linear


class RMSNorm(nn.Module):
    """Root-mean-square norm; `unit_offset` is Gemma's variant that scales by (1 + weight)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_rowops.usable(x, self.weight):
            return cpu_rowops.rmsnorm(x, self.weight, self.eps, self.unit_offset)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch arithmetic (autograd, GPUs, other dtypes): float32 statistics, HF's rounding."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"


def add_pending(x: torch.Tensor, pending: tuple[torch.Tensor, RMSNorm | None] | None) -> torch.Tensor:
    """x + r, or x + norm(r): a residual add a decoder layer left to its caller (see DecoderModel)."""
    if pending is None:
        return x
    r, norm = pending
    return x + (r if norm is None else norm(r))


def add_pending_and_norm(x: torch.Tensor, pending: tuple[torch.Tensor, RMSNorm | None] | None,
                         norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + pending's residual, norm of that) with the add riding in the C norm call; x is a tensor
    the model made and is updated in place. The caller checked rowops_norms for these norms."""
    if pending is None:
        return x, norm(x)
    r, r_norm = pending
    return cpu_rowops.add_rmsnorm(x, r, norm.weight, norm.eps, norm.unit_offset,
                                  r_weight=None if r_norm is None else r_norm.weight, inplace=True)


def rowops_norms(x: torch.Tensor, *norms: RMSNorm) -> bool:
    """Whether x and these norms can take the fused C row ops together (one eps and offset rule)."""
    first = norms[0]
    for norm in norms:
        if norm.eps != first.eps or norm.unit_offset != first.unit_offset or not cpu_rowops.usable(x, norm.weight):
            return False
    return True


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the config's scaling applied (float32)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class Rotary:
    """cos/sin tables for one RoPE setting, grown on demand and indexed by position.

    Not a module: tables are derived from the config, never loaded, and a model built on the meta
    device gets them on first use on the real device.
    """

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.inv_freq = rope_inv_freq(rope, head_dim)
        self.cos = self.sin = torch.empty(0)
        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _grow(self, needed: int, device: torch.device) -> None:
        size = max(4096, 1 << (needed - 1).bit_length())
        inv_freq = self.inv_freq.to(device)
        freqs = torch.arange(size, device=device, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self._typed = {}

    def tables(self, max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and sin tables [positions, head_dim/2], grown to hold max_position
        (the one-call decode step indexes them itself)."""
        if max_position >= self.cos.shape[0] or self.cos.device != device:
            self._grow(max_position + 1, device)
        return self.cos, self.sin

    def cos_sin(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype):
        """cos, sin of shape [B or 1, 1, T, head_dim/2] for positions [T] or [B, T]."""
        self.tables(max_position, positions.device)
        # tables rounded to the dtype once (rounding commutes with indexing), not every forward
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        if positions.dim() == 1:
            positions = positions[None]
        return typed[0][positions][:, None], typed[1][positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, D] by the half-split convention (first half pairs with second half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise LowbitError(f"unsupported activation '{name}'; lowbit supports {', '.join(ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = make_linear(hidden, intermediate, bias)
        self.up_proj = make_linear(hidden, intermediate, bias)
        self.down_proj = make_linear(intermediate, hidden, bias)
        self.act = activation(act)
        self.act_name = act if act in cpu_rowops.ACTS else None  # computed by the C row op when usable

    fused_gate_up = None  # set by runtime/models/fusion.py (never a registered child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            joined = self.fused_gate_up.forward(x)  # never hooked: not a child module
            if self.act_name is not None and cpu_rowops.usable(joined):
                return self.down_proj(cpu_rowops.act_mul(joined, None, self.act_name))  # reads both halves in place
            gate, up = joined.split(self.fused_gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if self.act_name is not None and up.dtype == gate.dtype and cpu_rowops.usable(gate) and cpu_rowops.usable(up):
                return self.down_proj(cpu_rowops.act_mul(gate, up, self.act_name))
        # act() returns a fresh tensor, so multiplying into it in place saves one allocation
        return self.down_proj(self.act(gate).mul_(up))
