"""Small floating-point element and scale codes: E2M1 (FP4), E4M3 and E5M2 (FP8), E8M0.

Decode tables are built from the bit fields, not typed in, and every encoder rounds to the
nearest representable value with ties going to the EVEN code (the code whose lowest bit is 0),
the rule IEEE 754 and the OCP MX / NVIDIA conversions use. Magnitudes beyond the largest finite
value saturate to it. The sign is kept even when the magnitude rounds to zero (-0.1 → E2M1 -0),
as hardware conversions do; -0 decodes to 0.

E2M1 (OCP MX v1.0 FP4): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no inf/NaN.
  codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; code | 0x8 is the negative. Ties: 0.25→0, 0.75→1,
  1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4.
E4M3 (fn): bias 7, max 448 (0x7E), no inf, NaN = 0x7F / 0xFF, subnormals down to 2^-9.
E5M2: bias 15, max 57344 (0x7B), inf 0x7C, NaN 0x7D-0x7F.
E8M0 (OCP MX scale): unsigned 8-bit exponent, value 2^(code - 127), 0xFF = NaN, no zero.
"""

from __future__ import annotations

import functools

import torch

from lowbit.quant.element_grid import ElementGrid


def _decode_bits(code: int, exp_bits: int, man_bits: int, bias: int) -> float:
    sign = -1.0 if code >> (exp_bits + man_bits) & 1 else 1.0
    exp = code >> man_bits & ((1 << exp_bits) - 1)
    man = code & ((1 << man_bits) - 1)
    if exp == 0:
        return sign * man / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)


@functools.cache
def e2m1_values() -> torch.Tensor:
    """float32[16]: the value of every E2M1 code."""
    return torch.tensor([_decode_bits(c, 2, 1, 1) for c in range(16)], dtype=torch.float32)


@functools.cache
def e4m3_values() -> torch.Tensor:
    """float32[256]: the value of every E4M3 (fn) code; 0x7F and 0xFF are NaN."""
    vals = [_decode_bits(c, 4, 3, 7) for c in range(256)]
    vals[0x7F] = vals[0xFF] = float("nan")
    return torch.tensor(vals, dtype=torch.float32)


@functools.cache
def e5m2_values() -> torch.Tensor:
    """float32[256]: the value of every E5M2 code (IEEE-style inf and NaN at exponent 31)."""
    vals = []
    for c in range(256):
        exp, man, neg = c >> 2 & 0x1F, c & 0x3, c >> 7
        if exp == 31:
            vals.append(float("nan") if man else (-float("inf") if neg else float("inf")))
        else:
            vals.append(_decode_bits(c, 5, 2, 15))
    return torch.tensor(vals, dtype=torch.float32)


E2M1_MAX = 6.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF


@functools.cache
def _positive_grid(name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(finite non-negative values in code order, midpoints between neighbours, sign bit)."""
    table, sign_bit = {"e2m1": (e2m1_values(), 0x8), "e4m3": (e4m3_values(), 0x80), "e5m2": (e5m2_values(), 0x80)}[name]
    half = table[:sign_bit]
    finite = half[torch.isfinite(half)]
    # Midpoints in float64 so a tie computed from float32 inputs is recognised exactly.
    finite64 = finite.double()
    mids = (finite64[1:] + finite64[:-1]) / 2
    return finite64, mids, sign_bit


@functools.cache
def element_grid(name: str):
    """encode_minifloat(·, name) as an ElementGrid: the finite magnitudes in code order, ties
    going up from an odd code (to the even one)."""

    grid, mids, sign_bit = _positive_grid(name)
    below = torch.arange(mids.numel())
    return ElementGrid(values=grid.float(), codes=torch.arange(grid.numel(), dtype=torch.uint8), mids=mids,
                       tie_up=(below % 2 == 1).to(torch.uint8), sign_bit=sign_bit)


def encode_minifloat(x: torch.Tensor, name: str) -> torch.Tensor:
    """Round float values to codes of `name` ("e2m1", "e4m3", "e5m2"): nearest, ties to even code.

    Returns uint8 codes with the sign bit set for negative inputs. Values beyond the largest
    finite magnitude saturate. NaN inputs are the caller's to reject.
    """
    grid, mids, sign_bit = _positive_grid(name)
    mag = x.detach().double().abs()
    code = torch.bucketize(mag, mids.to(mag.device), right=False)  # a tie lands on the lower code
    at_tie = (code < mids.numel()) & (mag == mids.to(mag.device)[code.clamp(max=mids.numel() - 1)])
    code = torch.where(at_tie & (code % 2 == 1), code + 1, code)
    sign = torch.signbit(x).to(torch.uint8) * sign_bit
    return code.to(torch.uint8) | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return e2m1_values().to(codes.device)[codes.long() & 0xF]


# E2M1 magnitude code by twice its value (0, 0.5, 1, 1.5, 2, 3, 4, 6 → 0..7).
_E2M1_CODE_OF_TWICE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def _e2m1_magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| rounded onto the E2M1 grid. In each binade the grid is uniform and its even codes
    are the even multiples of the step, so round-half-even of |x| / step is ties-to-even-code."""
    mag = x.abs().clamp_(max=E2M1_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.round(mag / step).mul_(step)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Fast E2M1 encoder (float32 arithmetic); the same codes as encode_minifloat(x, "e2m1")."""
    mag = _e2m1_magnitude(x.float())
    code = _E2M1_CODE_OF_TWICE.to(x.device)[(mag * 2).long()]
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x rounded onto the E2M1 grid (saturating at ±6), as float32, sign kept (-0 for small negatives)."""
    x = x.float()
    return _e2m1_magnitude(x).copysign_(x)


_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}


def to_fp8(x: torch.Tensor, name: str = "e4m3") -> torch.Tensor:
    """Saturating round-to-nearest-even cast of float values to a torch fp8 tensor.

    torch's cast rounds to nearest-even (tests check it against `encode_minifloat`); the clamp
    makes out-of-range values saturate on every torch version instead of becoming NaN/inf.
    """
    limit = _FP8_MAX[name]
    return x.float().clamp(-limit, limit).to(_TORCH_FP8[name])


def round_fp8(x: torch.Tensor, name: str = "e4m3") -> torch.Tensor:
    """x rounded onto the fp8 grid, as float32."""
    return to_fp8(x, name).float()


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) as float32 (code 0 is 2^-127, a float32 subnormal); 0xFF gives NaN."""
    exp = codes.to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones_like(exp, dtype=torch.float64), exp).float()
    return torch.where(codes.to(torch.int32) == E8M0_NAN, torch.full_like(value, float("nan")), value)


def float_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents (clamped to the finite range -127..127) as E8M0 codes."""
    return (exponent.to(torch.int32).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
