"""GGUF block layouts that hold a lowbit QTensor bit for bit, both ways.

Facts from ggml (ggml-common.h) and gguf-py's quants.py; every block covers 32 consecutive
weights of one row, rows are independent, and blocks follow each other along the row:
  Q8_0   34 bytes: float16 d, int8 q[32];                  value = d * q
  Q4_0   18 bytes: float16 d, 16 bytes of nibbles;         value = d * (q - 8)
  MXFP4  17 bytes: E8M0 e, 16 bytes of nibbles;            value = E2M1(q) * 2^(e - 127)
         (ggml keeps the E2M1 values doubled and halves the scale: the same numbers)
In Q4_0 and MXFP4 byte j holds element j in its LOW nibble and element j + 16 in its high
nibble; lowbit's rows hold element 2i and 2i + 1 in byte i, so export and import reorder.
Equivalences: lowbit int8-g32-sfp16 = Q8_0, int4-g32 (symmetric, float16 scales) = Q4_0,
mxfp4 = MXFP4, whenever K is a multiple of 32. A group of 64, 128, … (any multiple of 32) is held
exactly too: each of its 32-blocks repeats the group's scale (a Q4_0 file of an int4-g128 model
costs 0.125 bit/weight more than the checkpoint; its decoded weights are the same numbers).
"""

from __future__ import annotations

import numpy as np
import torch

from lowbit.quant.dtypes import fits_float16
from lowbit.quant.packing import pack_bits, unpack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec, parse_spec

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "MXFP4": 17, "Q5_0": 22}
# A Q5_0 block is d × (q − 16), q in 0..31: an 8-bit code with Q8_0's float16 scale, so lowbit
# holds it exactly as int8-g32 (8.5 bits a weight in memory where the file has 5.5; the int8 kernel
# runs it, where a float32 copy read 32), and writes it back as Q5_0 (Checkpoint.stored_as,
# fits_read_as)
READ_AS = {"Q5_0": "Q8_0"}


def fits_read_as(qt, stored: str | None) -> bool:
    """Whether `qt`, read from a `stored` block type (READ_AS), still fits that type: a Q5_0 weight's
    int8-g32 codes in -16..15 with float16 scales (training its scales keeps them so)."""
    if stored != "Q5_0" or not isinstance(qt, QTensor) or exact_gguf_type(qt.spec, qt.shape[1], qt.scales) != "Q8_0":
        return False
    return qt.spec.group_size == BLOCK and int(qt.qweight.min()) >= -16 and int(qt.qweight.max()) <= 15


def exact_gguf_type(spec: FormatSpec, in_features: int, scales: torch.Tensor | None = None) -> str | None:
    """The GGUF block type that holds this spec exactly, or None. Q4_0 and Q8_0 store float16
    scales: a spec with bf16 or float32 ones (llm-compressor's checkpoints keep the model's bf16)
    fits when `scales`, the weight's own, all survive the trip through float16."""
    if in_features % BLOCK:
        return None
    if (spec.family == "int" and spec.granularity == "group" and spec.group_size % BLOCK == 0 and not spec.double_quant
            and (spec.scale_dtype == "float16" or (scales is not None and fits_float16(scales)))):
        if spec.bits == 8 and spec.symmetric:
            return "Q8_0"
        if spec.bits == 4 and spec.symmetric:
            return "Q4_0"
    if spec.family == "mxfp4":
        return "MXFP4"
    return None


def gguf_spec(type_name: str) -> FormatSpec:
    return {"Q8_0": parse_spec("int8-g32-sfp16"), "Q4_0": parse_spec("int4-g32-sfp16"), "MXFP4": parse_spec("mxfp4")}[type_name]


def _nibbles_to_gguf(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] → [N, K/32, 16]: low nibble element j, high nibble element j + 16."""
    c = codes.reshape(codes.shape[0], -1, 2, 16)
    return c[:, :, 0] | (c[:, :, 1] << 4)


def _nibbles_from_gguf(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 16] bytes → codes uint8 [N, B*32]."""
    return torch.stack((qs & 0xF, qs >> 4), dim=2).reshape(qs.shape[0], -1)


def to_gguf_bytes(qt: QTensor, type_name: str) -> np.ndarray:
    """uint8 [N, K/32 * block bytes] rows of GGUF blocks for a QTensor of the matching spec."""
    n, k = qt.shape
    nb = k // BLOCK
    if type_name in ("Q8_0", "Q4_0") and qt.spec.group_size != BLOCK:
        # block b lies in group (32 b) // g: it carries that group's scale (a last, shorter group too)
        qt = _with_scales(qt, qt.scales[:, (torch.arange(nb) * BLOCK) // qt.spec.group_size])
    if type_name == "Q8_0":
        d = qt.scales.to(torch.float16).contiguous().view(torch.uint8).reshape(n, nb, 2)
        q = qt.qweight.contiguous().view(torch.uint8).reshape(n, nb, 32)
        blocks = torch.cat([d, q], dim=2)
    elif type_name == "Q4_0":
        d = qt.scales.to(torch.float16).contiguous().view(torch.uint8).reshape(n, nb, 2)
        blocks = torch.cat([d, _nibbles_to_gguf(unpack_bits(qt.qweight, 4, k))], dim=2)
    elif type_name == "Q5_0":  # int8-g32 codes in -16..15 (fits_read_as): q = code + 16, its fifth bit in qh
        d = qt.scales.to(torch.float16).contiguous().view(torch.uint8).reshape(n, nb, 2)
        q = (qt.qweight.to(torch.int32) + 16).reshape(n, nb, 32)
        qh = ((q.long() >> 4) << torch.arange(32)).sum(dim=2)  # 0 .. 2^32 - 1
        qh = torch.where(qh >= 1 << 31, qh - (1 << 32), qh).to(torch.int32)  # the same 32 bits, as int32
        qh = qh.reshape(n, nb, 1).contiguous().view(torch.uint8).reshape(n, nb, 4)
        low = _nibbles_to_gguf((q & 0xF).to(torch.uint8).reshape(n, k))
        blocks = torch.cat([d, qh, low], dim=2)
    elif type_name == "MXFP4":
        e = qt.scales.reshape(n, nb, 1)
        blocks = torch.cat([e, _nibbles_to_gguf(unpack_bits(qt.qweight, 4, k))], dim=2)
    else:
        raise ValueError(type_name)
    return blocks.reshape(n, -1).numpy()


def _with_scales(qt: QTensor, scales: torch.Tensor) -> QTensor:
    """The same codes with one scale per 32-block: the g32 QTensor that decodes to the same weights."""
    spec = gguf_spec("Q8_0" if qt.spec.bits == 8 else "Q4_0")
    # float16 scales: exact_gguf_type has checked that bf16 or float32 ones survive the conversion
    return QTensor.from_tensors({"qweight": qt.qweight, "scales": scales.to(torch.float16).contiguous()},
                                {"spec": spec.to_dict(), "shape": list(qt.shape)})


def from_gguf_bytes(raw: np.ndarray | bytes, type_name: str, shape: tuple[int, int]) -> QTensor:
    """The QTensor a Q8_0 / Q4_0 / MXFP4 / Q5_0 tensor of HF shape (N, K) stands for, exactly (Q5_0
    as int8-g32: READ_AS)."""
    n, k = shape
    nb = k // BLOCK
    blocks = torch.from_numpy(np.frombuffer(bytes(raw), dtype=np.uint8).copy()).reshape(n, nb, BLOCK_BYTES[type_name])
    spec = gguf_spec(READ_AS.get(type_name, type_name))
    if type_name == "Q5_0":
        scales = blocks[:, :, :2].contiguous().view(torch.float16).reshape(n, nb)
        high = blocks[:, :, 2:6].contiguous().view(torch.int32).reshape(n, nb, 1)  # bit j: element j's fifth bit
        high = (high >> torch.arange(32, dtype=torch.int32)) & 1
        codes = _nibbles_from_gguf(blocks[:, :, 6:]).reshape(n, nb, 32).to(torch.int32) | (high << 4)
        parts = {"qweight": (codes - 16).to(torch.int8).reshape(n, k), "scales": scales}
    elif type_name == "Q8_0":
        scales = blocks[:, :, :2].contiguous().view(torch.float16).reshape(n, nb)
        qweight = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, k)
        parts = {"qweight": qweight, "scales": scales}
    elif type_name == "Q4_0":
        scales = blocks[:, :, :2].contiguous().view(torch.float16).reshape(n, nb)
        parts = {"qweight": pack_bits(_nibbles_from_gguf(blocks[:, :, 2:]), 4), "scales": scales}
    else:
        parts = {"qweight": pack_bits(_nibbles_from_gguf(blocks[:, :, 1:]), 4), "scales": blocks[:, :, 0].contiguous()}
    return QTensor.from_tensors(parts, {"spec": spec.to_dict(), "shape": [n, k]})


def permute_rows(qt: QTensor, order: torch.Tensor) -> QTensor:
    """The same QTensor with its output rows reordered (every part here is per row)."""
    parts = {name: t[order] for name, t in qt.parts().items() if name in ("qweight", "scales", "zeros")}
    extra = {name: t for name, t in qt.parts().items() if name not in parts}
    return QTensor(spec=qt.spec, shape=qt.shape, **parts, **extra)
