"""Build and load the small C library behind the CPU kernels (native/lut_gemv.c, native/bf16_gemv.c,
native/int4_dot.c, native/paged_decode.c, native/rowops.c, native/f32_dot.c, native/int4_vnni.c,
native/gptq_columns.c, native/scale_search.c).

The library is compiled on first use with the system C compiler for the CPU it runs on
(-march=native), cached under $LOWBIT_HOME/kernels keyed by the source, the compiler flags and
the CPU's flags, and loaded with ctypes (which releases the GIL during calls). Without a C
compiler `load_library()` returns None and dispatch falls back to another path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from lowbit.paths import lowbit_home

SOURCES = tuple(Path(__file__).with_name(name) for name in ("lut_gemv.c", "bf16_gemv.c", "int4_dot.c", "paged_decode.c", "rowops.c", "f32_dot.c", "int4_vnni.c", "gptq_columns.c", "scale_search.c"))
_NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# A build without AVX-512 (tests run it so the scalar code is checked on AVX-512 machines too).
_PORTABLE_FLAGS = ("-O3", "-march=x86-64-v2", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_MATMUL_ARGS = [_INT, _INT, _P, _I64, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _INT]
_BF16_MATMUL_ARGS = [_P, _P, _I64, _I64, _P, _INT, _INT]
_DEQUANT_ARGS = [_INT, _INT, _P, _I64, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _INT]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(portable: bool = False) -> Path | None:
    """Compile the library (once per source/flags/CPU) and return its path, or None if impossible."""
    cc = _compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _PORTABLE_FLAGS if portable else _NATIVE_FLAGS
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES) + " ".join((cc, *flags, _cpu_flags())).encode()).hexdigest()[:16]
    target = lowbit_home() / "kernels" / f"liblowbit_lut_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        result = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            return None
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


@functools.cache
def load_library(portable: bool = False) -> ctypes.CDLL | None:
    if os.environ.get("LOWBIT_NO_NATIVE"):
        return None
    path = build(portable)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.lowbit_lut_matmul.argtypes = _MATMUL_ARGS
    lib.lowbit_lut_matmul.restype = _INT
    lib.lowbit_lut_dequant.argtypes = _DEQUANT_ARGS
    lib.lowbit_lut_dequant.restype = _INT
    lib.lowbit_bf16_matmul.argtypes = _BF16_MATMUL_ARGS
    lib.lowbit_bf16_matmul.restype = _INT
    lib.lowbit_bf16_dequant.argtypes = [_P, _P, _I64, _INT, _INT]
    lib.lowbit_bf16_dequant.restype = _INT
    lib.lowbit_bf16_available.argtypes = []
    lib.lowbit_bf16_available.restype = _INT
    lib.lowbit_i4_available.argtypes = []
    lib.lowbit_i4_available.restype = _INT
    lib.lowbit_i4_matmul.argtypes = [_P, _P, _INT, _I64, _I64, _P, _INT, _I64, _INT]
    lib.lowbit_i4_matmul.restype = _INT
    lib.lowbit_i4v_available.argtypes = []
    lib.lowbit_i4v_available.restype = _INT
    lib.lowbit_i4v_matmul.argtypes = [_P, _P, _INT, _I64, _I64, _P, _INT, _I64, _INT]
    lib.lowbit_i4v_matmul.restype = _INT
    lib.lowbit_paged_decode.argtypes = [_P, _I64, _P, _I64, _P, _I64, _P, _P, _INT, _P, _P, _P, _P, _I64, _P, _P, _P,
                                        _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _INT]
    lib.lowbit_paged_decode.restype = _INT
    lib.lowbit_f32dot_available.argtypes = []
    lib.lowbit_f32dot_available.restype = _INT
    lib.lowbit_f32_matmul.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, _INT]
    lib.lowbit_f32_matmul.restype = _INT
    return lib


def bound_library(signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The library with these functions' argument types set (each returns an int status), or None
    without the library or without one of them."""
    lib = load_library()
    if lib is None or not all(hasattr(lib, name) for name in signatures):
        return None
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _INT
    return lib
