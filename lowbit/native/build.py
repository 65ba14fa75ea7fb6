"""Build and load lowbit's C kernels: every source in lowbit/native/ is its own shared library.

Each `<name>.c` (the keys of `SOURCES`) is compiled on its first use, alone, with the system C
compiler for the CPU it runs on (`-march=native`; `portable=True` builds for x86-64-v2, without
AVX-512, which the tests use to check the scalar code), into
`$LOWBIT_HOME/kernels/lib<name>_<key>.so`. The key hashes that source's bytes, the shared header
`lowbit_native.h`, the compiler command, the flags and the CPU's flags (/proc/cpuinfo), so editing
one source rebuilds that library only. Libraries are loaded with ctypes (which releases the GIL
during calls).

`library(name, signatures)` is the one way to get a library: it sets the argument types of the
named functions (each returns an int status) and returns the `ctypes.CDLL`, or None when the
source did not build. Each C file has its binding module beside it (`lut_gemv.py` for
`lut_gemv.c`, ...), which declares its functions' signatures and is what the kernels import.

A source that does not build (no compiler, a compile error, not an x86-64 machine) turns off only
the paths that need it (`SOURCES` says which); lowbit then runs torch or the reference instead, and
says so once per process in one line on stderr. The compiler's full output is kept beside the
cache (`lib<name>_<key>.log`). `LOWBIT_NO_NATIVE=1` turns every C path off, silently. Each process
loads a private copy of the library (`_load`: the cached file's own pages ran slower on a VM).
`report()` says, per source, whether it built and why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lowbit.paths import lowbit_home

SOURCE_DIR = Path(__file__).parent
HEADER = "lowbit_native.h"
NO_NATIVE_ENV = "LOWBIT_NO_NATIVE"
SHARED_ENV = "LOWBIT_NATIVE_SHARED"  # 1: load the cached library file itself (see _load)

# Each C source (without .c) and the fast paths that are off without it.
SOURCES: dict[str, str] = {
    "lut_gemv": "cpu-lut",
    "bf16_gemv": "cpu-bf16",
    "int8_gemv": "cpu-int8f",
    "int4_dot": "cpu-int4dot (bf16 activations)",
    "int4_vnni": "cpu-int4dot (int8 activations), cpu-int8dot",
    "paged_decode": "the C paged decode attention",
    "rowops": "the C RMSNorm/activation row ops",
    "f32_dot": "batch-invariant float32 Linears",
    "decode_layers": "the decoder layers of a decode step in one C call",
    "moe_route": "the C mixture-of-experts routing (and with it MoE layers in the one-call decode step)",
    "gptq_columns": "GPTQ's C column loop",
    "scale_search": "the C integer scale search",
}
_COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
NATIVE_FLAGS = ("-march=native", *_COMMON_FLAGS)
PORTABLE_FLAGS = ("-march=x86-64-v2", *_COMMON_FLAGS)  # no AVX-512: the scalar code, checked on any machine

# ctypes types for the binding modules' signatures.
P = ctypes.c_void_p
I64 = ctypes.c_int64
INT = ctypes.c_int
F32 = ctypes.c_float


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """One C source: `built`, else `reason` why not; `library` the loaded file's path ("" if none)."""

    source: str  # "lut_gemv.c"
    built: bool
    reason: str  # "" when built
    library: str


class BuildError(Exception):
    """A source did not build; the message is the one-line reason."""


_lock = threading.RLock()
_outcomes: dict[tuple[str, bool], tuple[ctypes.CDLL | None, str, str]] = {}  # (lib, path, reason)
_bound: dict[tuple[str, bool], ctypes.CDLL | None] = {}
_warned: set[bool] = set()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> list[str] | None:
    """The C compiler command: $CC (may hold arguments), else gcc or cc on PATH; None without one."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    found = shutil.which("gcc") or shutil.which("cc")
    return [found] if found else None


def _flags(portable: bool) -> tuple[str, ...]:
    return PORTABLE_FLAGS if portable else NATIVE_FLAGS


def _source(name: str) -> Path:
    if name not in SOURCES:
        raise ValueError(f"unknown C source {name!r} (one of {', '.join(SOURCES)})")
    return SOURCE_DIR / f"{name}.c"


def cache_key(name: str, portable: bool = False) -> str:
    """The cache key of one source's library: its bytes, the header's, the compiler, flags and CPU."""
    cc = compiler() or []
    digest = hashlib.sha256()
    for part in (_source(name).read_bytes(), (SOURCE_DIR / HEADER).read_bytes(),
                 " ".join((*cc, *_flags(portable), _cpu_flags())).encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def library_path(name: str, portable: bool = False) -> Path:
    """Where the library of `name` is cached (whether it exists or not)."""
    return lowbit_home() / "kernels" / f"lib{name}_{cache_key(name, portable)}.so"


def _not_built_reason() -> str | None:
    """Why nothing can build here, or None."""
    if os.environ.get(NO_NATIVE_ENV):
        return f"{NO_NATIVE_ENV} is set"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 machine ({platform.machine() or 'unknown'})"
    if compiler() is None:
        return "no C compiler (install gcc or set CC)"
    return None


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[0] if lines else ""


def build(name: str, portable: bool = False) -> Path:
    """Compile native/<name>.c alone (once per cache key) and return its library's path.
    Raises BuildError with a one-line reason when it cannot."""
    reason = _not_built_reason()
    if reason:
        raise BuildError(reason)
    cc = compiler()
    target = library_path(name, portable)
    if target.exists():
        return target
    try:
        return _compile(name, portable, cc, target)
    except OSError as e:  # the cache folder cannot be written
        raise BuildError(f"cannot write {target.parent}: {e.strerror or e}") from None


def _compile(name: str, portable: bool, cc: list[str], target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    log = target.with_suffix(".log")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        command = [*cc, *_flags(portable), str(_source(name)), "-o", str(out), "-lm"]
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except OSError as e:  # the compiler is not there or cannot run
            raise BuildError(f"{shlex.join(cc)} did not run: {e.strerror or e}") from None
        if result.stderr:  # warnings of a build that worked, or why it failed: kept, not dropped
            log.write_text(f"$ {shlex.join(command)}\n{result.stderr}")
        if result.returncode != 0 or not out.exists():
            first = _first_error(result.stderr)
            detail = first or f"{shlex.join(cc)} exited with status {result.returncode} and printed nothing"
            raise BuildError(f"{detail}{f'; full output in {log}' if result.stderr else ''}")
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def _load(path: Path) -> ctypes.CDLL:
    """The library at `path`, loaded from a private copy in anonymous memory (a memfd) where Linux
    offers one, else from the file itself (and with LOWBIT_NATIVE_SHARED=1).

    Why a copy: on the 2-core VMs lowbit is benchmarked on, the cached library's own file ran its
    kernels 15-45 % slower than a byte-identical copy of it (Gemma-3-270M int4 decode 61-74 against
    80-108 tok/s, SmolLM2 int4 214-225 against 242-268, processes alternated; Gemma's bf16 head
    after the int4 layers 10.6-13.4 against 5.6-9.7 ms, alternated in one process), and the
    slowness followed the file's pages, not the code: a fresh file written from the same bytes, a
    memfd holding them, or the cached file once its pages were dropped and read back ran fast
    (docs/kernels.md). A copy costs ~100 KB of memory per library and a copy of its bytes per
    process."""
    if os.environ.get(SHARED_ENV) != "1" and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(path.name)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                data = memoryview(path.read_bytes())
                while data:  # a write may take fewer bytes than it was given
                    data = data[os.write(fd, data):]
                lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
            except OSError:  # no /proc, or a loader that refuses it: the file itself below
                os.close(fd)
            else:
                # fd stays open for good: the loader knows a library by its path, and a closed fd's
                # number (so its /proc path) would come back for the next library, which it would
                # then take for this one
                return lib
    return ctypes.CDLL(str(path))


def _outcome(name: str, portable: bool) -> tuple[ctypes.CDLL | None, str, str]:
    """(loaded library or None, its path or "", reason or ""), decided once per process."""
    key = (name, portable)
    with _lock:
        if key not in _outcomes:
            try:
                path = build(name, portable)
                _outcomes[key] = (_load(path), str(path), "")
            except BuildError as e:
                _outcomes[key] = (None, "", str(e))
            except OSError as e:  # built, but the loader refused it
                _outcomes[key] = (None, "", f"built but did not load: {e}")
        return _outcomes[key]


def report(portable: bool = False) -> list[SourceStatus]:
    """Every C source's status (building what was not tried yet); prints nothing."""
    statuses = []
    for name in SOURCES:
        lib, path, reason = _outcome(name, portable)
        statuses.append(SourceStatus(source=f"{name}.c", built=lib is not None, reason=reason, library=path))
    return statuses


def warning_line(statuses: list[SourceStatus]) -> str | None:
    """The one-line warning for the sources that did not build (None when all did, or when
    LOWBIT_NO_NATIVE turned them off on purpose)."""
    failed = [s for s in statuses if not s.built and not s.reason.startswith(NO_NATIVE_ENV)]
    if not failed:
        return None
    by_reason: dict[str, list[str]] = {}
    for s in failed:
        by_reason.setdefault(s.reason, []).append(f"native/{s.source}")
    if len(failed) == len(statuses) and len(by_reason) == 1:
        what = f"no native/*.c built ({failed[0].reason})"
    else:
        what = "; ".join(f"{', '.join(names)} did not build ({reason})" for reason, names in by_reason.items())
    off = ", ".join(SOURCES[s.source.removesuffix(".c")] for s in failed)
    return (f"lowbit: warning: {what}; the fast paths {off} are off, lowbit uses the torch/reference paths "
            f"({NO_NATIVE_ENV}=1 turns them off without this warning)")


def _warn_once(portable: bool) -> None:
    with _lock:
        if portable in _warned:
            return
        _warned.add(portable)
        line = warning_line(report(portable))
    if line:
        print(line, file=sys.stderr, flush=True)


def library(name: str, signatures: dict[str, list], portable: bool = False) -> ctypes.CDLL | None:
    """native/<name>.c's library with these functions' argument types set (each returns an int
    status), or None when it did not build (then, once per process, a warning line on stderr)."""
    key = (name, portable)
    try:
        return _bound[key]
    except KeyError:
        pass
    lib, _, reason = _outcome(name, portable)
    if lib is not None:
        for fn_name, argtypes in signatures.items():
            fn = getattr(lib, fn_name)
            fn.argtypes, fn.restype = argtypes, INT
    elif not reason.startswith(NO_NATIVE_ENV):
        _warn_once(portable)
    with _lock:
        _bound[key] = lib
    return lib


def binding(name: str, signatures: dict[str, list]) -> Callable[..., ctypes.CDLL | None]:
    """A binding module's `library(portable=False)`: `library(name, signatures, portable)`."""

    def bound(portable: bool = False) -> ctypes.CDLL | None:
        return library(name, signatures, portable)

    bound.__name__ = bound.__qualname__ = "library"
    bound.__doc__ = (f"native/{name}.c's library with its SIGNATURES set, or None where it did not build "
                     "(build.report() says why); portable: the x86-64-v2 build (no AVX-512), for tests.")
    return bound
