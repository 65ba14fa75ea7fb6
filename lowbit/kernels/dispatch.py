"""The one entry point for quantized matmul: `prepare` at load time, `qmatmul` in forward.

The paths are a table, `TABLE`, best first; each is a `KernelPath` that says why it cannot run a
weight (`supports(qt) -> reason | None`), repacks it (`prepare`) and multiplies (`matmul`):

  triton       CUDA device, every format                          (kernels/triton_qmm.py)
  cpu-int4dot  CPU with AVX512-BF16, -VNNI or AVX2, integer 4-bit
               codes, groups of 32k or one per row                (kernels/cpu_int4dot.py, batch-invariant)
  cpu-int8dot  CPU with AVX512-VNNI, 8-bit integer codes, int8
               activations (W8A8; unless int8_activations="f32")  (kernels/cpu_int4dot.py, batch-invariant)
  cpu-int4     CPU, int4 with a group torch's op accepts          (kernels/cpu.py, torch's int4 op)
  cpu-int8f    CPU with AVX-512 or AVX2, symmetric int8 (per channel, or
               groups of 16k), float32 activations                (kernels/cpu_int8.py, batch-invariant)
  cpu-int8     CPU, per-channel int8, K % 32 == 0                 (kernels/cpu.py, torch's int8 op)
  cpu-bf16     CPU with AVX512-BF16, other 4-bit formats          (kernels/cpu_bf16.py, bf16 dot products)
  cpu-lut      CPU, any 4-bit or 8-bit format                     (kernels/cpu_lut.py, compiled C kernel)
  reference    anything (int2/3/5/6 on CPU, no compiler)          (kernels/reference.py)

On a CUDA device the choice is triton; on a CPU the first CPU path that `picks` the weight (it
runs it and no activation setting turns it away), else reference. A path can be forced by name, in this order of precedence:
`prepare(..., path=)`, the `KernelSettings` in effect (`use_settings`, which the CLI's `--kernel`
sets), then `LOWBIT_KERNEL`: reference | cpu | cpu-int4dot | cpu-int4 | cpu-int8f | cpu-int8 | cpu-bf16 |
cpu-lut | cpu-int8dot | triton ("cpu" means the best CPU path). A forced path that cannot run the
weight raises a one-line LowbitError with the reason instead of silently running another.

The int4 decode kernel's activations (`int8` where the CPU has AVX512-VNNI or AVX2, else `bf16`; see
kernels/cpu_int4dot.py) follow the same precedence: `KernelSettings.int4_activations`
(`--int4-activations`), then `LOWBIT_INT4_ACTIVATIONS`. So do 8-bit weights' activations
(`int8_activations`, `--int8-activations`, `LOWBIT_INT8_ACTIVATIONS`): `int8` (the default where
the CPU has AVX512-VNNI) picks cpu-int8dot, llama.cpp's Q8_0 arithmetic; `f32` keeps them on the
float32-activation paths (cpu-int8f, cpu-int8, cpu-lut). All are read when a weight is prepared,
so settings must be in effect while the model loads.

`describe_paths()` lists every path with whether it can run here (for a weight, or on this
machine at all) and why not; `lowbit doctor` prints it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.kernels import cpu, cpu_bf16, cpu_int4dot, cpu_int8, cpu_lut, layout
from lowbit.kernels.prepared import PreparedWeight, placed
from lowbit.kernels.reference import reference_matmul
from lowbit.quant.qtensor import QTensor

PATHS = ("reference", "cpu", "cpu-int4dot", "cpu-int4", "cpu-int8f", "cpu-int8", "cpu-bf16", "cpu-lut", "cpu-int8dot", "triton")
ENV = "LOWBIT_KERNEL"
ACTIVATIONS_ENV = cpu_int4dot.ACTIVATIONS_ENV
INT4_ACTIVATIONS = ("int8", "bf16")
INT8_ACTIVATIONS = ("int8", "f32")
INT8_ACTIVATIONS_ENV = "LOWBIT_INT8_ACTIVATIONS"
DENSE_ACTIVATIONS = ("f32", "bf16")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# -- settings ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelSettings:
    """Kernel choices made explicitly (the CLI's --kernel / --int4-activations, or an API caller).

    None leaves a choice to its environment variable, and without one to the default:
    kernel            a name of PATHS (LOWBIT_KERNEL; default: the best path for each weight)
    int4_activations  "int8" or "bf16" for the cpu-int4dot decode kernel (LOWBIT_INT4_ACTIVATIONS;
                      default: int8 where the CPU has AVX512-VNNI or AVX2, else bf16)
    dense_activations "f32" or "bf16" for bf16-stored dense Linears of a float32 model on the CPU
                      (LOWBIT_DENSE_ACTIVATIONS; default: bf16 where the CPU has AVX512-BF16, else
                      f32): bf16 rounds x to bf16 for bf16 x bf16 products, as llama.cpp's BF16
                      does; f32 keeps x float32 (exact products)
    int8_activations  "int8" or "f32" for 8-bit integer weights on the CPU (LOWBIT_INT8_ACTIVATIONS;
                      default: int8 where the CPU has AVX512-VNNI, else f32): int8 quantizes each
                      row of x per weight group to int8 for exact integer sums (cpu-int8dot, as
                      llama.cpp's Q8_0 does); f32 keeps x float32 (cpu-int8f)
    """

    kernel: str | None = None
    int4_activations: str | None = None
    dense_activations: str | None = None
    int8_activations: str | None = None

    def __post_init__(self):
        if self.kernel is not None and self.kernel not in PATHS:
            raise UsageError(f"unknown kernel path '{self.kernel}' for --kernel (choose from {', '.join(PATHS)})")
        if self.int4_activations is not None and self.int4_activations not in INT4_ACTIVATIONS:
            raise UsageError(f"unknown int4 activations '{self.int4_activations}' for --int4-activations "
                             f"(choose {' or '.join(INT4_ACTIVATIONS)})")
        if self.dense_activations is not None and self.dense_activations not in DENSE_ACTIVATIONS:
            raise UsageError(f"unknown dense activations '{self.dense_activations}' for --dense-activations "
                             f"(choose {' or '.join(DENSE_ACTIVATIONS)})")
        if self.int8_activations is not None and self.int8_activations not in INT8_ACTIVATIONS:
            raise UsageError(f"unknown int8 activations '{self.int8_activations}' for --int8-activations "
                             f"(choose {' or '.join(INT8_ACTIVATIONS)})")


_settings = KernelSettings()


def current_settings() -> KernelSettings:
    """The KernelSettings in effect (all None unless `use_settings` set some)."""
    return _settings


@contextlib.contextmanager
def use_settings(settings: KernelSettings | None = None, **fields) -> Iterator[KernelSettings]:
    """Make `settings` (or KernelSettings(**fields)) the ones `prepare` reads, until the block ends.

    Process-wide (not per thread): a model loaded in another thread inside the block sees them
    too. Weights keep what they were prepared with after the block."""
    global _settings
    chosen = settings if settings is not None else KernelSettings(**fields)
    saved, _settings = _settings, chosen
    try:
        yield chosen
    finally:
        _settings = saved


def requested_path(path: str | None = None) -> str | None:
    """The forced path name, if any: `path`, else the settings', else LOWBIT_KERNEL."""
    if path:
        source = "the path argument"
    elif _settings.kernel is not None:
        return _settings.kernel  # validated when the settings were made
    else:
        path, source = os.environ.get(ENV) or None, ENV
    if path is not None and path not in PATHS:
        raise UsageError(f"unknown kernel path '{path}' (choose from {', '.join(PATHS)}; set by {source})")
    return path


# -- machine facts ----------------------------------------------------------------------------
CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


@functools.cache
def _cpu_flag_set() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_bf16_matmuls() -> bool:
    """Whether torch's bf16 matmuls are faster than its float32 ones on this CPU: AVX512-BF16 or AMX
    (oneDNN's native bf16). Without them bf16 is emulated: 2-4x slower than float32 on an AVX2
    machine. Unknown flags (not Linux) count as yes, the old default."""
    flags = _cpu_flag_set()
    return not flags or bool({"avx512_bf16", "amx_bf16"} & flags)


def cpu_features() -> dict[str, bool] | None:
    """The CPU flags the kernels care about (None where /proc/cpuinfo cannot tell)."""
    flags = _cpu_flag_set()
    return {name: name in flags for name in CPU_FLAGS} if flags else None


def _native_reason(kernel: str, any_flag: tuple[str, ...] = ()) -> str:
    """Why a C kernel is not available: the switch, the CPU, or the build."""
    if os.environ.get("LOWBIT_NO_NATIVE"):
        return "LOWBIT_NO_NATIVE is set (no C kernels)"
    flags = _cpu_flag_set()
    if any_flag and flags and not any(f in flags for f in any_flag):
        return f"this CPU has no {' or '.join(f.upper().replace('_', '-') for f in any_flag)}"
    return f"the C kernel {kernel} is not built or loaded (see `lowbit doctor`)"


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _group(qt: QTensor) -> int:
    return layout.group_scales(qt).group_size


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A path's y plus bias (in float32), in the input's dtype."""
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(dtype)


# -- the paths --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelPath:
    """One row of the dispatch table. Subclasses override the four methods.

    name       the name `prepare(path=)`, --kernel and LOWBIT_KERNEL use
    device     "cpu" or "cuda": where it runs
    automatic  chosen without being named (when `picks` agrees)
    """

    name: str
    device: str
    automatic: bool = True

    def unavailable(self) -> str | None:
        """Why this path cannot run anything on this machine, or None. Cheap enough for diagnostics."""
        return None

    def supports(self, qt: QTensor) -> str | None:
        """Why this path cannot run `qt` here (machine facts included), or None when it can."""
        return None

    def runs(self, qt: QTensor) -> bool:
        """`supports(qt) is None`, computed the cheap way (the kernel module's own check)."""
        return self.supports(qt) is None

    def picks(self, qt: QTensor) -> bool:
        """Whether `choose_path` takes this path for `qt` unasked: it runs it, and no setting
        turns it away (cpu-int8dot's int8 activations can be)."""
        return self.runs(qt)

    def prepare(self, qt: QTensor, device: torch.device) -> PreparedWeight:
        raise NotImplementedError

    def matmul(self, x2: torch.Tensor, pw: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """y [M, N] in x2's dtype for a validated 2-D x2 [M, K] (bf16, fp16 or fp32)."""
        raise NotImplementedError

    def place(self, pw: PreparedWeight) -> PreparedWeight:
        """pw with what its matmul streams on huge pages inside an engine's arena (kernels/hugepages.py);
        pw itself where the path keeps its arrays where they are."""
        return pw

    def rows(self, pw: PreparedWeight, start: int, n: int) -> PreparedWeight | None:
        """Output rows start..start+n-1 of pw as a weight of their own sharing pw's memory, or None
        where the path's layout cannot give them without a copy."""
        return None


@dataclass(frozen=True, slots=True)
class ReferencePath(KernelPath):
    """Dequantize to float32 and matmul: every format, every device; the tests' oracle."""

    def prepare(self, qt, device):
        return PreparedWeight(path=self.name, shape=qt.shape, label=qt.spec.label, device=device, qt=qt.to(device))

    def matmul(self, x2, pw, bias):
        return _finish(reference_matmul(x2, pw.qt), bias, x2.dtype)


@dataclass(frozen=True, slots=True)
class TritonPath(KernelPath):
    """Every format on a CUDA device (or the interpreter, TRITON_INTERPRET=1, for tests)."""

    def unavailable(self):
        if not _triton_installed():
            return "triton is not installed"
        if not torch.cuda.is_available() and not _interpreting():
            return "needs a CUDA device (torch.cuda.is_available() is False; TRITON_INTERPRET=1 runs it interpreted, for tests)"
        return None

    def prepare(self, qt, device):
        from lowbit.kernels import triton_qmm  # imported late: TRITON_INTERPRET is read at import

        return triton_qmm.prepare(qt, device)

    def matmul(self, x2, pw, bias):
        from lowbit.kernels import triton_qmm

        return _finish(triton_qmm.matmul(x2, pw), bias, x2.dtype)


@dataclass(frozen=True, slots=True)
class Int4DotPath(KernelPath):
    """cpu-int4dot (integer 4-bit codes) and cpu-int8dot (8-bit codes, W8A8): native/int4_dot.c,
    native/int4_vnni.c. Batch-invariant at any number of rows; bf16 or float32 y straight from C."""

    bits: int = 4

    def unavailable(self):
        if self.bits == 8:
            return None if cpu_int4dot.vnni_int8_available() else _native_reason("int4_vnni.c", ("avx512_vnni",))
        if cpu_int4dot.available():
            return None
        return _native_reason("int4_dot.c / int4_vnni.c", ("avx512_bf16", "avx512_vnni", "avx2"))

    def runs(self, qt):
        return cpu_int4dot.supports(qt) if self.bits == 4 else cpu_int4dot.supports_int8(qt)

    def picks(self, qt):
        if self.bits == 8 and (qt.spec.bits != 8 or int8_activations() != "int8"):
            return False
        return self.runs(qt)

    def supports(self, qt):
        if self.runs(qt):
            return None
        spec, k = qt.spec, qt.shape[1]
        if spec.bits != self.bits or spec.element != "int":
            return f"needs integer {self.bits}-bit codes, not {spec.label}"
        machine = self.unavailable()
        if machine is not None:
            return machine
        g = _group(qt)
        if not (g >= k or g % 32 == 0):
            return f"groups of {g} columns (needs a multiple of 32, or one group per row)"
        if self.bits == 8 and k >= 1 << 16:
            return f"K={k} is too wide for the int32 group sums (at most 65535)"
        table = layout.code_table(qt)
        if not torch.equal(table, table.round()) or table.abs().max() > 256:
            return "its code values are not integers"
        return "its code table is not code - offset, which the int8-activation kernel needs"

    def prepare(self, qt, device):
        return cpu_int4dot.prepare(qt)

    def place(self, pw):
        return cpu_int4dot.place(pw)

    def rows(self, pw, start, n):
        return cpu_int4dot.rows(pw, start, n)

    def matmul(self, x2, pw, bias):
        dtype = x2.dtype
        if bias is None and (dtype is torch.bfloat16 or dtype is torch.float32):
            # the fast path (cpu_int4dot.decode_matmul without its checks, made above):
            # contiguous rows straight into the C kernel, y in x's dtype
            if x2.shape[0] > 0 and x2.stride(-1) == 1:
                return cpu_int4dot._fused(x2, pw, dtype is torch.bfloat16)
        if x2.shape[0] == 0:
            return _finish(x2.new_zeros(0, pw.shape[0]), bias, x2.dtype)
        if bias is None:
            # float32 or bf16 y straight from C (bf16 rounded once); fp16 inputs come back as float32
            out = torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float32
            return cpu_int4dot.matmul(x2, pw, out).to(x2.dtype)
        return _finish(cpu_int4dot.matmul(x2, pw), bias, x2.dtype)


@dataclass(frozen=True, slots=True)
class TorchInt4Path(KernelPath):
    """torch's `_weight_int4pack_mm_for_cpu` in bf16 (kernels/cpu.py)."""

    def unavailable(self):
        ok = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        return None if ok else f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"

    def runs(self, qt):
        return cpu.int4_group(qt) is not None

    def supports(self, qt):
        if self.runs(qt):
            return None
        spec = qt.spec
        if spec.bits != 4 or spec.element != "int":
            return f"needs integer 4-bit codes, not {spec.label}"
        machine = self.unavailable()
        if machine is not None:
            return machine
        if qt.shape[0] % cpu.INT4_ROW_MULTIPLE:
            return f"N={qt.shape[0]} output rows (torch's op packs them in {cpu.INT4_ROW_MULTIPLE}s)"
        sizes = "/".join(map(str, cpu.INT4_GROUPS))
        return f"no group size torch's op takes ({sizes}) divides both the group of {_group(qt)} and K={qt.shape[1]}"

    def prepare(self, qt, device):
        return cpu.prepare_int4(qt)

    def matmul(self, x2, pw, bias):
        if x2.shape[0] == 0:
            return _finish(x2.new_zeros(0, pw.shape[0]), bias, x2.dtype)
        return _finish(cpu.matmul_int4(x2, pw), bias, x2.dtype)


@dataclass(frozen=True, slots=True)
class Int8FloatPath(KernelPath):
    """Symmetric int8 codes times float32 activations (kernels/cpu_int8.py, native/int8_gemv.c)."""

    def unavailable(self):
        return None if cpu_int8.available() else _native_reason("int8_gemv.c", ("avx512f", "avx2"))

    def runs(self, qt):
        return cpu_int8.supports(qt)

    def supports(self, qt):
        return cpu_int8.why_not(qt) or self.unavailable()

    def prepare(self, qt, device):
        return cpu_int8.prepare(qt)

    def place(self, pw):
        return placed(pw)

    def rows(self, pw, start, n):
        return cpu_int8.rows(pw, start, n)

    def matmul(self, x2, pw, bias):
        return _finish(cpu_int8.matmul(x2, pw), bias, x2.dtype)


@dataclass(frozen=True, slots=True)
class TorchInt8Path(KernelPath):
    """torch's `_weight_int8pack_mm` in bf16, per-channel int8 (kernels/cpu.py)."""

    def unavailable(self):
        ok = hasattr(torch.ops.aten, "_weight_int8pack_mm")
        return None if ok else f"torch {torch.__version__} has no _weight_int8pack_mm"

    def runs(self, qt):
        return cpu.int8_channel(qt)

    def supports(self, qt):
        if self.runs(qt):
            return None
        spec = qt.spec
        if spec.bits != 8 or spec.element != "int" or spec.granularity != "channel":
            return f"needs per-channel integer 8-bit codes, not {spec.label}"
        machine = self.unavailable()
        if machine is not None:
            return machine
        return f"K={qt.shape[1]} is not a multiple of 32 (torch's int8 op is wrong or crashes there)"

    def prepare(self, qt, device):
        return cpu.prepare_int8(qt)

    def matmul(self, x2, pw, bias):
        if x2.shape[0] == 0:
            return _finish(x2.new_zeros(0, pw.shape[0]), bias, x2.dtype)
        return _finish(cpu.matmul_int8(x2, pw), bias, x2.dtype)


@dataclass(frozen=True, slots=True)
class Bf16Path(KernelPath):
    """4-bit formats through bf16 dot products, weights exact (kernels/cpu_bf16.py, native/bf16_gemv.c)."""

    def unavailable(self):
        return None if cpu_bf16.available() else _native_reason("bf16_gemv.c", ("avx512_bf16",))

    def runs(self, qt):
        return cpu_bf16.supports(qt)

    def supports(self, qt):
        if self.runs(qt):
            return None
        if qt.spec.bits != 4:
            return f"needs a 4-bit format, not {qt.spec.label}"
        machine = self.unavailable()
        if machine is not None:
            return machine
        g, k = _group(qt), qt.shape[1]
        if g < k and (g < 16 or g & (g - 1)):
            return f"groups of {g} columns (needs a power of two >= 16, or one group per row)"
        return ("some of its weights cannot be formed exactly in bf16 (tiny or non-finite values, "
                "or a hi+lo pair in 16-column groups)")

    def prepare(self, qt, device):
        return cpu_bf16.prepare(qt)

    def matmul(self, x2, pw, bias):
        if x2.shape[0] == 0:
            return _finish(x2.new_zeros(0, pw.shape[0]), bias, x2.dtype)
        if bias is None and x2.dtype == torch.bfloat16:
            return cpu_bf16.matmul(x2, pw, torch.bfloat16)  # rounded once, in C
        return _finish(cpu_bf16.matmul(x2, pw), bias, x2.dtype)


def _lut_probe() -> QTensor:
    from lowbit.quant.registry import get_format, parse_spec

    spec = parse_spec("int4-g16")
    return get_format(spec).quantize(torch.ones(16, 32), spec)


@dataclass(frozen=True, slots=True)
class LutPath(KernelPath):
    """Every 4-bit and 8-bit format in float32 through the compiled LUT kernel (kernels/cpu_lut.py)."""

    def unavailable(self):
        return None if cpu_lut.supports(_lut_probe()) else _native_reason("lut_gemv.c")

    def runs(self, qt):
        return cpu_lut.supports(qt)

    def supports(self, qt):
        if self.runs(qt):
            return None
        spec = qt.spec
        if spec.bits not in (4, 8):
            return f"needs 4- or 8-bit codes, not {spec.label}"
        if spec.bits == 8 and (spec.element not in ("int", "e4m3", "e5m2") or
                               (spec.element == "int" and qt.qweight.dtype != torch.int8)):
            return f"8-bit {spec.element} codes stored as {qt.qweight.dtype} are not a kind the kernel reads"
        g, k = _group(qt), qt.shape[1]
        if g < k and (g < 16 or g & (g - 1)):
            return f"groups of {g} columns (needs a power of two >= 16, or one group per row)"
        return _native_reason("lut_gemv.c")

    def prepare(self, qt, device):
        return cpu_lut.prepare(qt)

    def place(self, pw):
        return placed(pw)

    def matmul(self, x2, pw, bias):
        if x2.shape[0] == 0:
            return _finish(x2.new_zeros(0, pw.shape[0]), bias, x2.dtype)
        return _finish(cpu_lut.matmul(x2, pw), bias, x2.dtype)


# Best first. `choose_path` takes the first automatic CPU path that picks the weight.
TABLE: tuple[KernelPath, ...] = (
    TritonPath("triton", "cuda"),
    Int4DotPath("cpu-int4dot", "cpu"),
    Int4DotPath("cpu-int8dot", "cpu", bits=8),  # 8-bit codes unless int8_activations() is "f32"
    TorchInt4Path("cpu-int4", "cpu"),
    Int8FloatPath("cpu-int8f", "cpu"),
    TorchInt8Path("cpu-int8", "cpu"),
    Bf16Path("cpu-bf16", "cpu"),
    LutPath("cpu-lut", "cpu"),
    ReferencePath("reference", "any"),
)
BY_NAME: dict[str, KernelPath] = {p.name: p for p in TABLE}
_AUTO_CPU = tuple(p for p in TABLE if p.device == "cpu" and p.automatic)
_MATMUL = {p.name: p.matmul for p in TABLE}  # qmatmul's lookup: one dict access per call


# -- choosing, preparing, multiplying ---------------------------------------------------------
def choose_path(qt: QTensor, device: torch.device | str, path: str | None = None) -> str:
    """Which path `prepare` will use for this weight on this device."""
    device = torch.device(device)
    want = requested_path(path)
    if want == "reference":
        return "reference"
    if device.type == "cuda":
        if want not in (None, "triton"):
            raise LowbitError(f"kernel path '{want}' runs on CPU, but the weight is on {device}")
        return "triton"
    if want == "triton":
        if not _interpreting():
            raise LowbitError("kernel path 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
        return "triton"
    if want in (None, "cpu"):
        for p in _AUTO_CPU:  # the checks decode scales, so stop at the first that picks it
            if p.picks(qt):
                return p.name
        return "reference"
    reason = BY_NAME[want].supports(qt)
    if reason is not None:
        raise LowbitError(f"kernel path '{want}' cannot run {qt.spec.label} {qt.shape[0]}x{qt.shape[1]} on this machine: {reason}")
    return want


def prepare(qt: QTensor, device: torch.device | str = "cpu", path: str | None = None) -> PreparedWeight:
    """Repack a loaded QTensor once for the matmul path chosen on `device` (never saved to disk)."""
    device = torch.device(device)
    return BY_NAME[choose_path(qt, device, path)].prepare(qt, device)


def place_prepared(pw: PreparedWeight) -> PreparedWeight:
    """pw's arrays on huge pages inside an engine's arena, as its path places them."""
    return BY_NAME[pw.path].place(pw)


def prepared_rows(pw: PreparedWeight, start: int, n: int) -> PreparedWeight | None:
    """Output rows start..start+n-1 of pw sharing its memory, or None where its path cannot."""
    return BY_NAME[pw.path].rows(pw, start, n)


def qmatmul(x: torch.Tensor, prepared: PreparedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K] in bf16/fp16/fp32; y has x's dtype."""
    # Validated once, before any path: a decode step makes ~120 of these calls, so this stays a
    # few attribute reads ahead of the path's own work.
    shape, k = x.shape, prepared.shape[1]
    if shape[-1] != k:
        raise LowbitError(f"matmul input has {shape[-1]} features but the {prepared.label} weight expects {k}")
    if x.dtype not in _DTYPES:
        raise LowbitError(f"quantized matmul takes bf16, fp16 or fp32 inputs, not {x.dtype}")
    if len(shape) == 2:  # the engine's rows and most callers: no reshapes
        return _MATMUL[prepared.path](x, prepared, bias)
    y = _MATMUL[prepared.path](x.reshape(-1, k), prepared, bias)
    return y.reshape(*shape[:-1], prepared.shape[0])


# -- diagnostics ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PathStatus:
    """One path of the table as `describe_paths` sees it."""

    name: str
    device: str  # "cpu", "cuda" or "any"
    automatic: bool  # chosen without being named
    usable: bool  # can run (this weight, or anything at all on this machine when no weight was given)
    reason: str | None  # why not, when not usable
    chosen: bool = False  # the path `choose_path` picks for the weight (always False without one)

    def to_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "automatic": self.automatic, "usable": self.usable,
                "reason": self.reason, "chosen": self.chosen}


def _device_reason(p: KernelPath, device: torch.device | None) -> str | None:
    if device is None:  # each path on its own kind of device: `unavailable` says the rest
        return None
    if p.device == "cuda" and device.type != "cuda":
        return None if _interpreting() else f"runs on CUDA devices, not {device.type}"
    if p.device == "cpu" and device.type == "cuda":
        return f"runs on the CPU, not {device.type}"
    return None


def describe_paths(qt: QTensor | None = None, device: torch.device | str | None = "cpu") -> list[PathStatus]:
    """Every path of the table, best first: can it run `qt` on `device` (without `qt`: anything
    there), and if not, why. device=None judges each path on its own kind of device, i.e. "on this
    machine" (`lowbit doctor`). With `qt` and a device, `chosen` marks the path `choose_path` picks."""
    device = None if device is None else torch.device(device)
    chosen = None
    if qt is not None and device is not None:
        try:
            chosen = choose_path(qt, device)
        except LowbitError:
            chosen = None  # a forced path that cannot run it: nothing is chosen
    out = []
    for p in TABLE:
        reason = _device_reason(p, device) or p.unavailable()
        if reason is None and qt is not None:
            reason = p.supports(qt)
        out.append(PathStatus(p.name, p.device, p.automatic, reason is None, reason, p.name == chosen))
    return out


def dense_activations() -> str:
    """"f32" or "bf16": what the settings in effect, else LOWBIT_DENSE_ACTIVATIONS, ask of bf16
    dense weights; without either, "bf16" where the CPU has AVX512-BF16 (llama.cpp's BF16
    arithmetic, 1.2-1.5x faster from 4 rows on, KLD ~1e-4: the same trade as int8 activations for
    int4) and "f32" elsewhere. "bf16" asked for without AVX512-BF16 is a usage error."""
    from lowbit.kernels import cpu_f32

    choice = _settings.dense_activations or os.environ.get("LOWBIT_DENSE_ACTIVATIONS")
    if choice is None:
        return "bf16" if cpu_f32.bf16_available() else "f32"
    if choice not in DENSE_ACTIVATIONS:
        raise UsageError(f"LOWBIT_DENSE_ACTIVATIONS must be {' or '.join(DENSE_ACTIVATIONS)}, not '{choice}'")
    if choice == "bf16":
        if not cpu_f32.bf16_available():
            raise UsageError("--dense-activations bf16 needs a CPU with AVX512-BF16 (the bf16 x bf16 kernel); "
                             "this one runs f32")
    return choice


def int8_activations() -> str:
    """"int8" or "f32": what the settings in effect, else LOWBIT_INT8_ACTIVATIONS, ask of 8-bit
    integer weights; without either, "int8" where the CPU has AVX512-VNNI (cpu-int8dot: measured
    1.4-2x faster than float32 activations at prefill and 16 rows on SmolLM2 int8, +0.002 KLD;
    docs/benchmarks.md) and "f32" elsewhere. "int8" asked for without VNNI is a usage error."""
    choice = _settings.int8_activations
    source = "--int8-activations"
    if choice is None:
        choice, source = os.environ.get(INT8_ACTIVATIONS_ENV, "").strip().lower() or None, INT8_ACTIVATIONS_ENV
    vnni = cpu_int4dot.vnni_int8_available()
    if choice is None:
        return "int8" if vnni else "f32"
    if choice not in INT8_ACTIVATIONS:
        raise UsageError(f"{INT8_ACTIVATIONS_ENV} must be {' or '.join(INT8_ACTIVATIONS)}, not '{choice}'")
    if choice == "int8" and not vnni:
        raise UsageError(f"{source} int8 needs a CPU with AVX512-VNNI (the int8 x int8 kernel); this one runs f32")
    return choice


def int4_activations() -> str | None:
    """The activations the cpu-int4dot kernel would take for a weight prepared now ("int8" or
    "bf16"), or None where it cannot run here (no kernel, or a choice this CPU cannot honour)."""
    if not cpu_int4dot.available():
        return None
    try:
        return cpu_int4dot.activations()
    except LowbitError:
        return None


def summarize(prepared: Iterable[PreparedWeight]) -> dict:
    """What a loaded model's quantized layers run on: {"requested": forced path or None,
    "paths": {path: layers}, "int4_activations": "int8" | "bf16" | "mixed" | None (no layer on
    the int4dot kernel)}. Call it while the settings the model was loaded with are in effect."""
    paths: dict[str, int] = {}
    acts = set()
    for pw in prepared:
        paths[pw.path] = paths.get(pw.path, 0) + 1
        if pw.path == "cpu-int4dot":
            acts.add(pw.params.get("act"))
    act = None if not acts else acts.pop() if len(acts) == 1 else "mixed"
    return {"requested": requested_path(), "paths": dict(sorted(paths.items())), "int4_activations": act}
