"""CPU path for integer 4-bit weights through bf16 dot products (native/int4_dot.c, AVX512-BF16).

Numbers: activations are rounded to bf16, weights are not: the codes' integer values are exact
in bf16, so every product is exact in float32, and the group's scale and zero point are applied
in float32 after the group's dot product (y = sum_j s_j * dot_j - s_j * z_j * sum_j(x)). The result
is the float32 dequantize-then-matmul of bf16-rounded activations up to float32 summation order.

Batch invariance: each row of x is converted, summed and accumulated in the same order whatever
the number of rows in the call, so a row's output is bit-identical whether it runs alone, among
1 + k rows of a speculative verify, or in a prefill chunk of any length. The C kernel takes any M
in passes of PASS_ROWS rows, each pass reading the weight once: a prefill's weights stay in the
cache between passes, so this beat decoding the weight once and running torch's GEMM on it at
every M measured (78 to 1024 rows: 2.2-7.8x on SmolLM2's linears, docs/benchmarks.md, Prefill),
and prefill, decode and verify share one set of numerics.

Layout (native/int4_dot.c): output rows in tiles of 16 (one per vector lane), four tiles
interleaved chunk by chunk, K zero-padded to whole 64s; scales as [tiles, groups, 16].

`concat` joins prepared weights of the same input width along the output dimension (q/k/v,
gate/up), so one call reads all of them.

int8 activations (native/int4_vnni.c, AVX512-VNNI; `LOWBIT_INT4_ACTIVATIONS=int8`, the default
where the CPU has VNNI): each row of x is quantized per weight group (per 32 for a per-channel
weight) to int8 (scale max|x| / 127, round half to even) and multiplied with the codes in exact
integer sums, twice the multiply-adds per instruction of the bf16 route, which is what bounds
16-row decode steps. Same batch
invariance; the cost is the activations' rounding (docs/benchmarks.md, Decode, measures the KLD).
`LOWBIT_INT4_ACTIVATIONS=bf16` keeps the bf16 route; either way prefill takes the same route.
"""

from __future__ import annotations

import ctypes
import os

import torch

from lowbit.errors import LowbitError
from lowbit.kernels import layout
from lowbit.native import int4_dot, int4_vnni
from lowbit.kernels.prepared import PreparedWeight, placed
from lowbit.quant.qtensor import QTensor

PASS_ROWS = 16  # rows of x per pass over the weight in the C kernel (LOWBIT_PASS_ROWS)
TILE_ROWS = 16  # output rows per tile of the C kernel: one per vector lane
PATH = "cpu-int4dot"
INT8_PATH = "cpu-int8dot"  # 8-bit codes, int8 activations (supports_int8)


class I4WeightStruct(ctypes.Structure):
    """The C kernel's `I4Weight` (native/int4_dot.c)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("tile_bytes", ctypes.c_int64), ("table", ctypes.c_void_p),
        ("scales", ctypes.c_void_p), ("szs", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("chunks", ctypes.c_int64), ("groups", ctypes.c_int64),
        ("cpg", ctypes.c_int32),
    ]


class I4VWeightStruct(ctypes.Structure):
    """The C kernel's `I4VWeight` (native/int4_vnni.c)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("tile_bytes", ctypes.c_int64), ("scales", ctypes.c_void_p), ("zeros", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("chunks", ctypes.c_int64), ("groups", ctypes.c_int64),
        ("cpg", ctypes.c_int32), ("offset", ctypes.c_int32), ("bits", ctypes.c_int32), ("scales16", ctypes.c_void_p),
        ("gps", ctypes.c_int32),
    ]


ACTIVATIONS_ENV = "LOWBIT_INT4_ACTIVATIONS"
_I4 = _I4V = None  # the two libraries, once available() has found them (the fused call reads these)


def bf16_available() -> bool:
    """The bf16-activation kernel (native/int4_dot.c, AVX512-BF16) is built for this CPU."""
    lib = int4_dot.library()
    return lib is not None and lib.lowbit_i4_available() == 1


def vnni_available() -> bool:
    """The int8-activation kernel (native/int4_vnni.c) is built for this CPU: AVX512-VNNI, or
    AVX2 for 4-bit codes (the same numbers, see the C file)."""
    lib = int4_vnni.library()
    return lib is not None and lib.lowbit_i4v_available() in (1, 2)


def vnni_int8_available() -> bool:
    """The int8-activation kernel takes 8-bit codes too (AVX512-VNNI only: AVX2's int16 pair sums
    would saturate on 8-bit codes)."""
    lib = int4_vnni.library()
    return lib is not None and lib.lowbit_i4v_available() == 1


def available() -> bool:
    """Either route: CPUs with VNNI but no BF16 (Cascade Lake, Ice Lake servers) take int8 activations."""
    global _I4, _I4V
    ok = bf16_available() or vnni_available()
    if ok:
        _I4, _I4V = int4_dot.library(), int4_vnni.library()
    return ok


def activations() -> str:
    """"int8" (the VNNI kernel) or "bf16": the `KernelSettings` in effect (kernels/dispatch.py,
    the CLI's --int4-activations), else `LOWBIT_INT4_ACTIVATIONS`, else int8 where the CPU has VNNI."""
    from lowbit.kernels.dispatch import current_settings  # late: dispatch imports this module

    choice, source = current_settings().int4_activations, "--int4-activations"
    if choice is None:
        choice, source = os.environ.get(ACTIVATIONS_ENV, "").strip().lower(), ACTIVATIONS_ENV
    if choice not in ("", "int8", "bf16"):
        raise LowbitError(f"{ACTIVATIONS_ENV} must be int8 or bf16, not {choice!r}")
    vnni = vnni_available()
    if choice == "int8" and not vnni:
        raise LowbitError(f"{source}=int8 needs a CPU with AVX512-VNNI or AVX2")
    if choice == "bf16" and not bf16_available():
        raise LowbitError(f"{source}=bf16 needs a CPU with AVX512-BF16")
    return choice or ("int8" if vnni else "bf16")


def _integer_table(qt: QTensor) -> torch.Tensor | None:
    table = layout.code_table(qt)
    if not torch.equal(table, table.round()) or table.abs().max() > 256:
        return None
    return table


def supports(qt: QTensor) -> bool:
    spec = qt.spec
    if spec.bits != 4 or spec.element != "int" or not available():
        return False
    g = layout.group_scales(qt).group_size
    # a group is whole chunks of the kernels' k-steps (8 for int8 activations, 4 for bf16): any
    # multiple of 32 is; g32 (Q4_0's group) measured 3-4x faster than torch's int4 op at one row
    if not (g >= qt.shape[1] or g % 32 == 0):
        return False
    table = _integer_table(qt)
    return table is not None and (bf16_available() or _zero_offset(table) is not None)


def supports_int8(qt: QTensor) -> bool:
    """8-bit integer codes through the int8-activation kernel (path INT8_PATH: W8A8). Chosen for
    8-bit weights unless the int8 activations are turned off (kernels/dispatch.py's
    `int8_activations`, `--int8-activations f32`)."""
    spec = qt.spec
    if spec.bits != 8 or spec.element != "int" or not vnni_int8_available():
        return False
    g = layout.group_scales(qt).group_size
    if not (g >= qt.shape[1] or g % 32 == 0) or qt.shape[1] >= 1 << 16:  # int32 group sums
        return False
    table = _integer_table(qt)
    return table is not None and _zero_offset(table) is not None


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> [ceil(N / 64), 32 * Kp] (Kp: K rounded up to 64; padding is code 0):
    tiles of 16 rows, four interleaved chunk by chunk ([N / 64, Kp / 4, 4, 32]); per tile and
    chunk of 4 k, byte 2i+p = row i's code k+p | code k+2+p << 4."""
    n, k = codes.shape
    quads, kp = -(-n // (4 * TILE_ROWS)), -(-k // 64) * 64
    c = torch.nn.functional.pad(codes, (0, kp - k, 0, quads * 4 * TILE_ROWS - n))
    # [quad, tile, row i, chunk, half h, p]: row 64 quad + 16 tile + i, k = 4 chunk + 2h + p
    c = c.reshape(quads, 4, TILE_ROWS, kp // 4, 2, 2)
    packed = c[..., 0, :] | (c[..., 1, :] << 4)
    return packed.permute(0, 3, 1, 2, 4).reshape(quads, kp * 32).contiguous()


def untile_codes(tiled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `tile_codes`: uint8 codes [n, k]."""
    quads, chunks = tiled.shape[0], tiled.shape[1] // 128
    b = tiled.reshape(quads, chunks, 4, TILE_ROWS, 2).permute(0, 2, 3, 1, 4)
    return torch.stack([b & 15, b >> 4], dim=-2).reshape(quads * 4 * TILE_ROWS, chunks * 4)[:n, :k]


def tile_codes_vnni(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """uint8 codes [N, K] -> [ceil(N / 64), 4 * bits * Kp] for native/int4_vnni.c: tiles of 16
    rows, four interleaved chunk by chunk ([N / 64, Kp / 8, 4, 16 * bits]). Per tile and chunk of
    8 k, 4-bit codes: byte 4i+b = row i's code k+b | code k+4+b << 4; 8-bit codes: byte 4i+b =
    row i's code k+b, then byte 64+4i+b = its code k+4+b."""
    n, k = codes.shape
    quads, kp = -(-n // (4 * TILE_ROWS)), -(-k // 64) * 64
    c = torch.nn.functional.pad(codes, (0, kp - k, 0, quads * 4 * TILE_ROWS - n))
    # [quad, tile, row i, chunk, half h, b]: row 64 quad + 16 tile + i, k = 8 chunk + 4h + b
    c = c.reshape(quads, 4, TILE_ROWS, kp // 8, 2, 4)
    if bits == 8:
        return c.permute(0, 3, 1, 4, 2, 5).reshape(quads, kp * 64).contiguous()
    packed = c[..., 0, :] | (c[..., 1, :] << 4)
    return packed.permute(0, 3, 1, 2, 4).reshape(quads, kp * 32).contiguous()


def untile_codes_vnni(tiled: torch.Tensor, n: int, k: int, bits: int = 4) -> torch.Tensor:
    """The inverse of `tile_codes_vnni`: uint8 codes [n, k]."""
    quads = tiled.shape[0]
    if bits == 8:
        chunks = tiled.shape[1] // 512
        b = tiled.reshape(quads, chunks, 4, 2, TILE_ROWS, 4).permute(0, 2, 4, 1, 3, 5)
        return b.reshape(quads * 4 * TILE_ROWS, chunks * 8)[:n, :k]
    chunks = tiled.shape[1] // 256
    b = tiled.reshape(quads, chunks, 4, TILE_ROWS, 4).permute(0, 2, 3, 1, 4)
    return torch.stack([b & 15, b >> 4], dim=-2).reshape(quads * 4 * TILE_ROWS, chunks * 8)[:n, :k]


def tile_groups(v: torch.Tensor) -> torch.Tensor:
    """float32 per-group values [N, G] -> [ceil(N / 16), G, 16] (padding rows 0)."""
    n, g = v.shape
    tiles = -(-n // TILE_ROWS)
    v = torch.nn.functional.pad(v.float(), (0, 0, 0, tiles * TILE_ROWS - n))
    return v.reshape(tiles, TILE_ROWS, g).permute(0, 2, 1).contiguous()


def untile_groups(v: torch.Tensor, n: int) -> torch.Tensor:
    return v.permute(0, 2, 1).reshape(-1, v.shape[1])[:n]


def _scales16(scales: torch.Tensor, bits: int) -> torch.Tensor | None:
    """The scales as float16 for the int8-route kernel (int4_vnni.c `scales16`, either ISA) where
    every one is exactly a float16; None elsewhere (float32 scales)."""
    lib = _I4V or int4_vnni.library()
    route = 0 if lib is None else lib.lowbit_i4v_available()  # 1: AVX512-VNNI (4- and 8-bit codes), 2: AVX2 (4-bit)
    if route == 0 or bits == 8 and route != 1:
        return None
    half = scales.half()
    return half if torch.equal(half.float(), scales) else None


STREAMED = ("codes", "scales", "zeros", "szs")  # the arrays a matmul reads (place() moves them)


def kernel_params(tensors: dict, n: int, k: int, groups: int, cpg: int, gps: int = 1) -> dict:
    """A PreparedWeight's params for the kernel's arrays in `tensors` (their C struct, which points
    into them). groups: x's quantization groups of cpg chunks each; gps: of those per weight scale
    group."""
    if "offset" in tensors and tensors["scales"].dtype is torch.float32:
        half = _scales16(tensors["scales"], int(tensors["bits"]))
        if half is not None:
            tensors["scales"] = half  # the one copy: 4.5 bits a weight at group 32 instead of 5
    codes = tensors["codes"]
    if "offset" in tensors:  # int8 activations (native/int4_vnni.c)
        zeros = tensors.get("zeros")
        bits = int(tensors["bits"])
        scales = tensors["scales"]
        wide = scales.dtype is torch.float32
        struct = I4VWeightStruct(
            codes.data_ptr(), codes.shape[1] // 4, scales.data_ptr() if wide else None, None if zeros is None else zeros.data_ptr(),
            n, k, codes.shape[1] // (64 * bits), groups, cpg, int(tensors["offset"]), bits,
            None if wide else scales.data_ptr(), gps,
        )
        act = "int8"
    else:
        szs = tensors.get("szs")
        struct = I4WeightStruct(
            codes.data_ptr(), codes.shape[1] // 4, tensors["table"].data_ptr(), tensors["scales"].data_ptr(),
            None if szs is None else szs.data_ptr(), n, k, codes.shape[1] // 128, groups, cpg,
        )
        act = "bf16"
    # The struct holds raw pointers into `tensors`, which the PreparedWeight keeps alive.
    return {"struct": struct, "ref": ctypes.byref(struct), "groups": groups, "cpg": cpg, "act": act, "gps": gps}


def _zero_offset(table: torch.Tensor) -> int | None:
    """o when the table is code - o (symmetric int4: 8; unsigned codes: 0), else None."""
    offset = -int(table[0])
    return offset if torch.equal(table, torch.arange(table.numel(), dtype=table.dtype) - offset) else None


def _tensors(codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, act: str) -> dict:
    """The kernel's arrays for uint8 codes [N, K], per-group scale (and zero point) [N, G]."""
    if act == "int8":
        offset, bits = _zero_offset(table), 8 if table.numel() == 256 else 4
        tensors = {"codes": tile_codes_vnni(codes, bits), "table": table, "scales": tile_groups(scale),
                   "offset": torch.tensor(offset), "bits": torch.tensor(bits)}
        if zero is not None:
            tensors["zeros"] = tile_groups(zero.float() + offset).to(torch.int32)
        return tensors
    table32 = torch.zeros(32, dtype=torch.bfloat16)
    table32[:16] = table.to(torch.bfloat16)
    tensors = {"codes": tile_codes(codes), "table": table32, "scales": tile_groups(scale)}
    if zero is not None:
        tensors["szs"] = tile_groups((scale.double() * zero.double()).float())
    return tensors


def prepare(qt: QTensor, act: str | None = None) -> PreparedWeight:
    """`act`: "int8" or "bf16" activations (default `activations()`; int8 needs a table code - o)."""
    qt = qt.to("cpu")
    n, k = qt.shape
    gs = layout.group_scales(qt)
    table = _integer_table(qt)
    act = "int8" if qt.spec.bits == 8 else act or activations()
    if act == "int8" and _zero_offset(table) is None:
        if not bf16_available():
            raise LowbitError(f"{qt.spec.label}: its code table is not code - offset, which the int8-activation kernel needs")
        act = "bf16"
    tensors = _tensors(layout.codes(qt), table, gs.scale, gs.zero, act)
    groups = gs.scale.shape[1]
    chunk = 8 if act == "int8" else 4
    kp = -(-k // 64) * 64
    cpg = kp // chunk if groups == 1 else gs.group_size // chunk
    gps = 1
    if act == "int8" and groups == 1:
        # A per-channel weight's x rounded per 32 (Q8_0's blocks), not by one scale over the whole
        # row: SmolLM2 per-channel int8 (RTN), KLD to the bf16 model 0.0268 -> 0.0047 (float32 x:
        # 0.0028), same top 89.9 -> 96.0 % (wiki-eval, 4 x 2048); as SmolLM2's self-speculation draft,
        # 3.75 -> 4.36 tokens per verify at k = 4
        cpg = 32 // chunk
        groups = gps = kp // 32  # one scale group: every x group in it
    params = kernel_params(tensors, n, k, groups, cpg, gps)
    # placed at once inside an engine's arena: off the C heap, which long-lived arrays fragment
    return place(PreparedWeight(path=PATH if qt.spec.bits == 4 else INT8_PATH, shape=(n, k), label=qt.spec.label,
                                device=torch.device("cpu"), tensors=tensors, params=params))


def concat(parts: list[PreparedWeight]) -> PreparedWeight:
    """One prepared weight whose output rows are those of `parts`, in order (same K and grouping)."""
    first = parts[0]
    k = first.shape[1]
    if any(p.path != first.path or p.path not in (PATH, INT8_PATH) or p.shape[1] != k or p.params["cpg"] != first.params["cpg"]
           or p.params["groups"] != first.params["groups"] or p.params["act"] != first.params["act"]
           or p.params["gps"] != first.params["gps"]
           or not torch.equal(p.tensors["table"], first.tensors["table"])
           for p in parts):
        raise ValueError("only int4dot (or int8dot) weights with the same input width, grouping, code table and activations "
                         "can be joined")
    n = sum(p.shape[0] for p in parts)
    # Tiles of 16 rows: a part whose rows do not fill its last tile shifts the rest, so re-tile.
    vnni = first.params["act"] == "int8"
    if vnni:
        bits = int(first.tensors["bits"])
        codes = tile_codes_vnni(torch.cat([untile_codes_vnni(p.tensors["codes"], p.shape[0], k, bits) for p in parts]), bits)
    else:
        codes = tile_codes(torch.cat([untile_codes(p.tensors["codes"], p.shape[0], k) for p in parts]))
    tensors = {
        "codes": codes,
        "table": first.tensors["table"],
        "scales": tile_groups(torch.cat([untile_groups(p.tensors["scales"], p.shape[0]) for p in parts])),
    }
    # per-group extras: zero codes (int8 route, default the table's offset) or scale * zero (bf16, default 0)
    name = "zeros" if vnni else "szs"
    if vnni:
        tensors["offset"], tensors["bits"] = first.tensors["offset"], first.tensors["bits"]
    if any(name in p.tensors for p in parts):
        fill = float(first.tensors["offset"]) if vnni else 0.0
        extra = [untile_groups(p.tensors[name], p.shape[0]).float() if name in p.tensors
                 else torch.full((p.shape[0], first.params["groups"] // first.params["gps"]), fill) for p in parts]
        tensors[name] = tile_groups(torch.cat(extra))
        if vnni:
            tensors[name] = tensors[name].to(torch.int32)
    params = kernel_params(tensors, n, k, first.params["groups"], first.params["cpg"], first.params["gps"])
    return place(PreparedWeight(path=first.path, shape=(n, k), label=first.label, device=torch.device("cpu"), tensors=tensors,
                                params=params))


def place(pw: PreparedWeight) -> PreparedWeight:
    """pw with the arrays a matmul streams on huge pages inside an engine's arena (prepared.placed;
    outside one, pw itself), its C struct rebuilt. Arrays that are views into a larger storage
    stay where they are: rows of a joined weight (`rows`), placed with it."""
    moved = placed(pw, STREAMED)
    if moved is not pw:
        moved.params = kernel_params(moved.tensors, pw.shape[0], pw.shape[1], pw.params["groups"], pw.params["cpg"],
                               pw.params["gps"])
    return moved


def rows(pw: PreparedWeight, start: int, n: int) -> PreparedWeight | None:
    """Output rows start..start+n-1 of pw as a weight of their own whose arrays are views of pw's
    (no copy: a joined q/k/v keeps the one copy of q, k and v), or None unless they begin and end
    on a whole group of 64 rows (the codes interleave four tiles of 16)."""
    quad = 4 * TILE_ROWS
    if start % quad or n % quad or n <= 0 or start + n > pw.shape[0]:
        return None
    tensors = dict(pw.tensors)
    tensors["codes"] = pw.tensors["codes"][start // quad : (start + n) // quad]
    for name in ("scales", "zeros", "szs"):
        if name in tensors:
            tensors[name] = pw.tensors[name][start // TILE_ROWS : (start + n) // TILE_ROWS]
    params = kernel_params(tensors, n, pw.shape[1], pw.params["groups"], pw.params["cpg"], pw.params["gps"])
    return PreparedWeight(path=pw.path, shape=(n, pw.shape[1]), label=pw.label, device=pw.device, tensors=tensors, params=params)


def matmul(x: torch.Tensor, pw: PreparedWeight, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, N] in out_dtype (float32 or bf16) for a 2-D x [M, K] (float32 or bf16; others are cast)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _fused(x, pw, out_dtype == torch.bfloat16)


def _fused(x: torch.Tensor, pw: PreparedWeight, out_bf16: bool) -> torch.Tensor:
    # A decode step makes ~120 of these calls, so this stays a few attribute lookups and one
    # ctypes call (Python's fixed cost per call adds up over a step; the old route through
    # dispatch cost several times more).
    n = pw.shape[0]
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if pw.params["act"] == "int8":
        fn = (_I4V or int4_vnni.library()).lowbit_i4v_matmul
    else:
        fn = (_I4 or int4_dot.library()).lowbit_i4_matmul
    rc = fn(pw.params["ref"], x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), m, y.data_ptr(), out_bf16, n,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"int4 matmul kernel failed with code {rc}")
    return y


def decode_matmul(x: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    """qmatmul's fast path for a weight on this path without bias: x [..., K] bf16 or float32,
    y [..., N] in x's dtype (bf16 rounded once in C)."""
    k = pw.shape[1]
    if x.shape[-1] != k:
        raise LowbitError(f"matmul input has {x.shape[-1]} features but the {pw.label} weight expects {k}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.shape[0] == 0 or x2.stride(-1) != 1:
        return None
    y = _fused(x2, pw, x.dtype == torch.bfloat16)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], pw.shape[0])
