"""FormatSpec: the complete, hashable description of how one weight matrix is quantized.

A spec is what a checkpoint records per tensor, what a recipe line parses into, and what a
kernel reads its layout facts from. `parse_spec("int4-asym-g64")` builds one from text and
`spec.label` prints the text back, so `parse_spec(spec.label) == spec` for every spec.

Text grammar: `<format>[-<option>]...`, options in any order:
  g<N>            group/block size along the input dimension (fp8: 128 means 128x128 blocks)
  channel         one scale per output row (int, fp8)
  tensor          one scale for the whole matrix (fp8)
  block<N>        fp8 N x N blocks
  dq              double quantization: 8-bit codes for the group scales (nf4, int with groups)
  mse|absmax      int/nf4/fp8/nvfp4 scale rule: searched (default) or the plain largest-value rule
  floor|roundup|mse   mxfp4 scale rule (see quant/mxfp4.py)
  s<dtype>        scale dtype: sfp16, sbf16, sfp32 (int, nf4 and fp8 only)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lowbit.errors import UsageError

LAYOUT_VERSION = 1

# name -> (family, bits, symmetric, element); the family is the module that implements it.
_FORMATS: dict[str, tuple[str, int, bool, str]] = {
    "int2": ("int", 2, True, "int"),
    "int2-asym": ("int", 2, False, "int"),
    "int3": ("int", 3, True, "int"),
    "int3-asym": ("int", 3, False, "int"),
    "int4": ("int", 4, True, "int"),
    "int4-asym": ("int", 4, False, "int"),
    # 5 and 6 bits: the mixed-precision step between int4 and int8 (llama.cpp's Q5/Q6 role)
    "int5": ("int", 5, True, "int"),
    "int5-asym": ("int", 5, False, "int"),
    "int6": ("int", 6, True, "int"),
    "int6-asym": ("int", 6, False, "int"),
    "int8": ("int", 8, True, "int"),
    "nf4": ("nf4", 4, True, "nf4"),
    "fp8": ("fp8", 8, True, "e4m3"),
    "fp8-e5m2": ("fp8", 8, True, "e5m2"),
    "mxfp4": ("mxfp4", 4, True, "e2m1"),
    "nvfp4": ("nvfp4", 4, True, "e2m1"),
}
_ALIASES = {"fp8-e4m3": "fp8", "int4-sym": "int4", "int8-sym": "int8", "w4a16": "int4"}

_DEFAULT_GROUP = {"int": 128, "nf4": 64, "fp8": None, "mxfp4": 32, "nvfp4": 16}
_DEFAULT_SCALE_DTYPE = {
    "int": "float16",
    "nf4": "float32",  # bitsandbytes keeps fp32 absmax; `dq` shrinks it to 8 bits
    "fp8": "float32",
    "mxfp4": "e8m0",
    "nvfp4": "float8_e4m3fn",
}
_SCALE_DTYPE_TOKENS = {"sfp16": "float16", "sbf16": "bfloat16", "sfp32": "float32"}
_DTYPE_TOKENS = {v: k for k, v in _SCALE_DTYPE_TOKENS.items()}
_RULES = {
    "int": ("mse", "absmax"),
    "nf4": ("mse", "absmax"),
    "fp8": ("mse", "absmax"),
    "mxfp4": ("mse", "floor", "roundup"),
    "nvfp4": ("mse", "absmax"),
}
_GRANULARITIES = {
    "int": ("group", "channel"),
    "nf4": ("group",),
    "fp8": ("channel", "tensor", "block"),
    "mxfp4": ("group",),
    "nvfp4": ("group",),
}


@dataclass(slots=True, frozen=True)
class FormatSpec:
    """How one matrix [out_features, in_features] is stored. Build with `parse_spec`."""

    name: str  # canonical format name: "int4", "int4-asym", "nf4", "fp8", "mxfp4", ...
    bits: int  # bits per stored element code
    group_size: int | None  # columns sharing a scale; None = one scale per row or per tensor
    symmetric: bool  # False: unsigned codes with a per-group zero point
    scale_dtype: str  # "float16", "bfloat16", "float32", "float8_e4m3fn" or "e8m0"
    granularity: str = "group"  # "group", "channel", "tensor" or "block" (fp8 2-D blocks)
    scale_rule: str = "mse"  # how RTN picks scales; see each format module
    double_quant: bool = False  # nf4, int (group scales): scales stored as 8-bit codes
    layout_version: int = LAYOUT_VERSION

    @property
    def family(self) -> str:
        """The registry key of the module implementing this spec ("int", "nf4", "fp8", ...)."""
        return _FORMATS[self.name][0]

    @property
    def element(self) -> str:
        """The element code: "int", "nf4", "e4m3", "e5m2" or "e2m1"."""
        return _FORMATS[self.name][3]

    @property
    def label(self) -> str:
        """The shortest text `parse_spec` turns back into exactly this spec."""
        parts = [self.name]
        default = _defaults(self.name)
        if self.granularity == "group":
            if self.group_size != default.group_size or default.granularity != "group":
                parts.append(f"g{self.group_size}")
        elif self.granularity == "block":
            parts.append(f"block{self.group_size}")
        elif self.granularity != default.granularity:
            parts.append(self.granularity)
        if self.double_quant:
            parts.append("dq")
        if self.scale_rule != default.scale_rule:
            parts.append(self.scale_rule)
        if self.scale_dtype != default.scale_dtype:
            parts.append(_DTYPE_TOKENS[self.scale_dtype])
        return "-".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FormatSpec:
        try:
            spec = cls(**data)
        except TypeError as exc:
            raise UsageError(f"bad format description {data}: {exc}") from exc
        return _validated(spec)


def list_formats() -> list[str]:
    return list(_FORMATS)


def _defaults(name: str) -> FormatSpec:
    family, bits, symmetric, _ = _FORMATS[name]
    group = _DEFAULT_GROUP[family]
    if family == "int" and bits == 8:
        group = None  # int8 is per-channel unless a group is asked for
    granularity = "group" if group is not None else "channel"
    return FormatSpec(
        name=name,
        bits=bits,
        group_size=group,
        symmetric=symmetric,
        scale_dtype=_DEFAULT_SCALE_DTYPE[family],
        granularity=granularity,
        scale_rule="mse",
    )


def parse_spec(
    text: str,
    group_size: int | None = None,
    *,
    scale_rule: str | None = None,
    scale_dtype: str | None = None,
    double_quant: bool | None = None,
) -> FormatSpec:
    """Parse "int4", "int4-asym-g64", "nf4-dq", "fp8-block128", "mxfp4-floor", ... into a spec.

    `group_size` (e.g. from --group-size) overrides the text; -1 means one scale per row. 0 and the
    other negatives are refused: they used to mean per-row silently, which nobody asks for on purpose.
    """
    tokens = text.strip().lower().split("-")
    name, rest = _split_name(tokens, text)
    spec = _defaults(name)
    fields = dataclasses.asdict(spec)
    for token in rest:
        _apply_token(fields, token, spec.family, text)
    if group_size is not None:
        if isinstance(group_size, bool) or group_size == 0 or group_size < -1:
            raise UsageError(f"group size {group_size!r} is not valid: -1 means one scale per output row, "
                             "otherwise give a positive group size")
        if group_size == -1:
            fields["group_size"], fields["granularity"] = None, "channel"
        elif fields["granularity"] == "block":
            fields["group_size"] = group_size
        else:
            fields["group_size"], fields["granularity"] = group_size, "group"
    if scale_rule is not None:
        fields["scale_rule"] = scale_rule.replace("-", "")
    if scale_dtype is not None:
        fields["scale_dtype"] = _SCALE_DTYPE_TOKENS.get("s" + scale_dtype, scale_dtype)
    if double_quant is not None:
        fields["double_quant"] = double_quant
    return _validated(FormatSpec(**fields))


def _split_name(tokens: list[str], text: str) -> tuple[str, list[str]]:
    # Longest known prefix wins, so "int4-asym-g64" is the name "int4-asym" plus "g64";
    # "sym"/"asym" may also come later ("int4-g64-asym").
    asym = "asym" in tokens[1:]
    tokens = [tokens[0]] + [t for t in tokens[1:] if t not in ("sym", "asym")]
    for n in range(len(tokens), 0, -1):
        candidate = "-".join(tokens[:n])
        candidate = _ALIASES.get(candidate, candidate)
        if asym:
            candidate = f"{candidate}-asym"
        if candidate in _FORMATS:
            return candidate, tokens[n:]
    raise UsageError(f"unknown format '{text}' (known: {', '.join(_FORMATS)})")


def _apply_token(fields: dict, token: str, family: str, text: str) -> None:
    if token.startswith("g") and token[1:].isdigit():
        if int(token[1:]) == 0:
            raise UsageError(f"format '{text}': g0 is not a group size (use '-channel' for one scale per output row)")
        fields["group_size"] = int(token[1:])
        if fields["granularity"] != "block":
            fields["granularity"] = "group"
    elif token.startswith("block") and token[5:].isdigit():
        fields["granularity"], fields["group_size"] = "block", int(token[5:])
    elif token == "block":
        fields["granularity"], fields["group_size"] = "block", 128
    elif token in ("channel", "tensor"):
        fields["granularity"], fields["group_size"] = token, None
    elif token == "dq":
        fields["double_quant"] = True
    elif token in ("mse", "absmax", "floor", "roundup"):
        fields["scale_rule"] = token
    elif token in _SCALE_DTYPE_TOKENS:
        fields["scale_dtype"] = _SCALE_DTYPE_TOKENS[token]
    else:
        raise UsageError(f"unknown option '{token}' in format '{text}'")


def _validated(spec: FormatSpec) -> FormatSpec:
    if spec.name not in _FORMATS:
        raise UsageError(f"unknown format '{spec.name}' (known: {', '.join(_FORMATS)})")
    family, bits, symmetric, _ = _FORMATS[spec.name]
    label = spec.name
    if (spec.bits, spec.symmetric) != (bits, symmetric):
        raise UsageError(f"format {label}: bits/symmetry {spec.bits}/{spec.symmetric} do not match the format")
    if spec.layout_version != LAYOUT_VERSION:
        raise UsageError(f"format {label}: layout version {spec.layout_version} is not supported (this lowbit reads {LAYOUT_VERSION})")
    if spec.granularity not in _GRANULARITIES[family]:
        raise UsageError(f"format {label} cannot use {spec.granularity} scales (allowed: {', '.join(_GRANULARITIES[family])})")
    if spec.scale_rule not in _RULES[family]:
        raise UsageError(f"format {label} has no scale rule '{spec.scale_rule}' (allowed: {', '.join(_RULES[family])})")
    if spec.double_quant and not (family == "nf4" or (family == "int" and spec.granularity == "group")):
        raise UsageError(f"format {label}: double quantization (dq) is an option of nf4 and of grouped int formats")
    _check_scale_dtype(spec, family)
    _check_group(spec, family)
    return spec


def _check_scale_dtype(spec: FormatSpec, family: str) -> None:
    fixed = {"mxfp4": "e8m0", "nvfp4": "float8_e4m3fn"}
    allowed = (fixed[family],) if family in fixed else ("float16", "bfloat16", "float32")
    if spec.scale_dtype not in allowed:
        raise UsageError(f"format {spec.name} cannot store scales as {spec.scale_dtype} (allowed: {', '.join(allowed)})")


def _check_group(spec: FormatSpec, family: str) -> None:
    g = spec.group_size
    if spec.granularity in ("channel", "tensor"):
        if g is not None:
            raise UsageError(f"format {spec.name}: {spec.granularity} scales take no group size")
        return
    if g is None:
        raise UsageError(f"format {spec.name}: {spec.granularity} scales need a group size")
    fixed = {"mxfp4": 32, "nvfp4": 16}
    if family in fixed and g != fixed[family]:
        raise UsageError(f"format {spec.name} uses blocks of exactly {fixed[family]}, not group size {g}")
    if family != "fp8" and not (16 <= g <= 8192 and g & (g - 1) == 0):
        raise UsageError(f"format {spec.name} cannot use group size {g} (a power of two from 16 to 8192, or -1 for per-channel)")
    if family == "fp8" and g not in (32, 64, 128, 256):
        raise UsageError(f"format {spec.name} cannot use {g}x{g} blocks (32, 64, 128 or 256)")
