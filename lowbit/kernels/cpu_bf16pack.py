"""bf16 weights packed losslessly in 12 bits for the CPU's bf16 x bf16 matmul (native/f32_dot.c,
"bf16 weights packed in 12 bits").

Why: at one row (a decode step) a bf16 weight's matmul runs at the memory's speed, so its time is
its bytes. A bf16's low byte (the exponent's last bit and the mantissa) stays whole; its high byte
(the sign and the exponent's top 7 bits) becomes a 4-bit code into its row's table of 16: the
weights of a trained model's row span a few binades below its largest (SmolLM2's and Gemma-3's
tied embeddings: every weight but exact zeros within 14 binades, and zeros have a code of their
own). A 32-weight block with a high byte outside its row's table stays whole in a side list. So a
packed weight decodes to the very same bf16 values, and `matmul` gives bit for bit what
cpu_f32.matmul(x, weight, bf16_x=True) gives, from 12 bits a weight plus 16 bytes a row.

The engine packs every bf16 Linear of a float32 model that rounds its activations to bf16
(`--dense-activations bf16`, the default on AVX512-BF16 CPUs; `pack_linears`): the tied embedding
of every int4 model, read whole every token (Gemma-3-270M's: 335 MB of its int4 model's 392 MB a
token), and a bf16 model's layers. Calls of up to cpu_f32.PACKED_MAX_ROWS rows read the packed copy
(1.3-1.5x faster from memory at 1-4 rows), in Python and in the decode chain alike; more rows are
compute-bound and decoding costs more than it saves there (0.85x at 6 rows, 0.8x at 16), so they
read the bf16 weight, which stays (the embedding rows are read from it too).
LOWBIT_PACK_BF16=0 turns packing off.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from lowbit.kernels import hugepages
from lowbit.native import f32_dot

BLOCK_BYTES = 48  # 32 weights: 32 low bytes and 32 4-bit codes


class _Packed(ctypes.Structure):  # native/f32_dot.c Bf16Packed
    _fields_ = [("blocks", ctypes.c_void_p), ("tables", ctypes.c_void_p), ("esc_start", ctypes.c_void_p),
                ("esc_block", ctypes.c_void_p), ("esc_raw", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


@dataclass(slots=True)
class PackedBf16:
    """A bf16 weight [N, K] packed: blocks [N / 2 rounded up, K / 32 * 96] (pairs of rows, block by
    block) and tables [N, 16] (uint8), the side list
    of whole blocks (esc_start [N + 1], esc_block [E] int32, esc_raw [E, 32] bf16) and the C struct
    over them (valid while this object lives)."""

    blocks: torch.Tensor
    tables: torch.Tensor
    esc_start: torch.Tensor
    esc_block: torch.Tensor
    esc_raw: torch.Tensor
    struct: _Packed

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.struct.n), int(self.struct.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.tables, self.esc_start, self.esc_block, self.esc_raw))


def enabled() -> bool:
    """Packing is on unless LOWBIT_PACK_BF16=0, and the CPU has the bf16 x bf16 kernel."""
    if os.environ.get("LOWBIT_PACK_BF16", "1") == "0":
        return False
    lib = f32_dot.library()
    return lib is not None and lib.lowbit_bf16dot_available() == 1


def packable(weight: torch.Tensor) -> bool:
    """A 2-D contiguous bf16 CPU weight whose rows are whole multiples of 32."""
    return (weight.dtype is torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.shape[1] % 32 == 0 and weight.shape[1] > 0 and not weight.requires_grad)


def pack(weight: torch.Tensor, max_escapes: int | None = None) -> PackedBf16 | None:
    """weight [N, K] bf16 (packable) packed; the arrays go on huge pages inside hugepages.arena().
    None, with nothing allocated, when more than max_escapes blocks would go to the side list."""
    if not packable(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} (a contiguous bf16 [N, K], K a multiple of 32)")
    lib = f32_dot.library()
    n, k = weight.shape
    threads = torch.get_num_threads()
    esc_start = torch.empty(n + 1, dtype=torch.int32)
    entries = lib.lowbit_bf16p_escapes(weight.data_ptr(), n, k, k, esc_start.data_ptr(), threads)
    if entries < 0:
        raise RuntimeError(f"lowbit_bf16p_escapes failed with code {entries}")
    if max_escapes is not None and entries > max_escapes:
        return None
    blocks = hugepages.empty(((n + 1) // 2, k // 32 * 2 * BLOCK_BYTES), torch.uint8)  # rows in pairs
    tables = torch.empty(n, 16, dtype=torch.uint8)
    esc_block = torch.empty(max(entries, 1), dtype=torch.int32)
    esc_raw = torch.empty(max(entries, 1), 32, dtype=torch.bfloat16)
    rc = lib.lowbit_bf16p_pack(weight.data_ptr(), n, k, k, blocks.data_ptr(), tables.data_ptr(), esc_start.data_ptr(),
                               esc_block.data_ptr(), esc_raw.data_ptr(), threads)
    if rc != 0:
        raise RuntimeError(f"lowbit_bf16p_pack failed with code {rc}")
    struct = _Packed(blocks.data_ptr(), tables.data_ptr(), esc_start.data_ptr(), esc_block.data_ptr(), esc_raw.data_ptr(), n, k)
    return PackedBf16(blocks, tables, esc_start, esc_block[:entries], esc_raw[:entries], struct)


def matmul(x: torch.Tensor, packed: PackedBf16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] float32 = bf16(x) [M, K] · weightᵀ (+ bias float32): cpu_f32.matmul(x, weight, bias,
    bf16_x=True)'s outputs bit for bit; x float32 with contiguous rows."""
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = f32_dot.library().lowbit_bf16pxw_matmul(
        ctypes.addressof(packed.struct), n, k, k, None if bias is None else bias.data_ptr(),
        x.data_ptr(), x.stride(0), m, y.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_bf16pxw_matmul failed with code {rc}")
    return y


# A packed copy is kept where at most this share of its blocks went to the side list: a trained
# model's weights send a few in a thousand there (SmolLM2's layers 0.4 %, Gemma-3's 0.1 %), and
# the packed bytes are ~0.75 of bf16's; a weight whose rows span many binades sends most, read on
# top of the blocks (up to 1.75x bf16's bytes, and a branch a block).
WORTH_PACKING = 0.1


def pack_linears(model: torch.nn.Module) -> int:
    """Give every bf16 Linear of an engine's model its packed copy for decode steps (`packed`):
    each InvariantLinear rounding x to bf16 with a packable weight, packing enabled, the head (a
    tied embedding) included. A projection whose weight lies within another's (fusion.py's separate
    q/k/v and gate/up, views of the joined weight's rows) packs nothing: the joined one, which the
    model calls, covers its rows; one that sends too many blocks to the side list (WORTH_PACKING)
    keeps none. The engine calls this once its weights are placed. Returns the packed bytes (0: nothing
    packed)."""
    from lowbit.kernels.cpu_f32 import InvariantLinear

    linears = [m for m in _modules(model) if type(m) is InvariantLinear and m.bf16_x and packable(m.weight)] if enabled() else []
    covered: list[tuple[int, int]] = []  # the byte ranges packed so far
    total = 0
    for m in sorted(linears, key=lambda m: -m.weight.numel()):  # a joined weight before its views
        w = m.weight.data
        start, end = _span(w)
        if not any(a <= start and end <= b for a, b in covered):
            covered.append((start, end))
            m.packed = pack(w, max_escapes=int(WORTH_PACKING * (w.numel() // 32)))
            total += m.packed.nbytes if m.packed is not None else 0
    return total


def packed_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Linears with a packed copy (pack_linears), joined projections among them."""
    from lowbit.kernels.cpu_f32 import InvariantLinear

    return [m for m in _modules(model) if isinstance(m, InvariantLinear) and m.packed is not None]


def covered_linears(model: torch.nn.Module) -> int:
    """How many of the model's own Linears (its modules, as named in the checkpoint) a packed copy
    covers: a joined q/k/v or gate/up counts as its separate projections."""
    from lowbit.kernels.cpu_f32 import InvariantLinear

    ranges = [_span(m.weight) for m in packed_linears(model)]
    return sum(1 for m in model.modules() if isinstance(m, InvariantLinear)
               and any(a <= m.weight.data_ptr() < b for a, b in ranges))


def packed_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(packed bytes, the bf16 bytes they stand for) over the model's packed Linears."""
    packed = packed_linears(model)
    return sum(m.packed.nbytes for m in packed), sum(m.weight.numel() * m.weight.element_size() for m in packed)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses of a contiguous tensor's first byte and one past its last."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _modules(model: torch.nn.Module):
    """Every module of `model`, those held as plain attributes included (the joined q/k/v and
    gate/up of runtime/models/fusion.py are not child modules), each once."""
    seen = set()
    for module in model.modules():
        for top in (module, *(v for v in vars(module).values() if isinstance(v, torch.nn.Module))):
            for m in top.modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    yield m
