"""native/build.py: every C source is its own library under its own cache key; a source that does
not build (compile error, no compiler, not x86-64) turns off only the paths that need it, with one
warning line per process; `report()` says why; and `lowbit eval` runs without a compiler."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit.native import build, lut_gemv, rowops, scale_search

REPO = Path(__file__).resolve().parents[2]
SMALL = ("scale_search", "gptq_columns", "f32_dot")  # the quickest to compile
WARNING = "lowbit: warning:"
needs_compiler = pytest.mark.skipif(build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
                                    reason="no C compiler for x86-64 here")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty LOWBIT_HOME, a copy of the C sources to edit, and no build state of this process:
    (the sources' folder, the cache folder)."""
    sources = tmp_path / "native"
    sources.mkdir()
    for path in [*build.SOURCE_DIR.glob("*.c"), build.SOURCE_DIR / build.HEADER]:
        shutil.copy(path, sources)
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(build.NO_NATIVE_ENV, raising=False)
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    monkeypatch.setattr(build, "_outcomes", {})
    monkeypatch.setattr(build, "_bound", {})
    monkeypatch.setattr(build, "_warned", set())
    return sources, tmp_path / "home" / "kernels"


def _compiles(monkeypatch) -> list[str]:
    """The sources compiled from now on (names of the .c files handed to the compiler)."""
    seen, run = [], subprocess.run

    def counting(command, *args, **kwargs):
        seen.extend(Path(a).name for a in command if a.endswith(".c"))
        return run(command, *args, **kwargs)

    monkeypatch.setattr(build.subprocess, "run", counting)
    return seen


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(WARNING)]


@needs_compiler
def test_each_source_is_its_own_library_under_its_own_key(fresh, monkeypatch):
    sources, cache = fresh
    compiled = _compiles(monkeypatch)
    paths = {name: build.build(name) for name in SMALL}
    assert sorted(compiled) == sorted(f"{name}.c" for name in SMALL)
    keys = {name: build.cache_key(name) for name in SMALL}
    assert len(set(keys.values())) == len(SMALL)
    assert sorted(p.name for p in cache.glob("*.so")) == sorted(f"lib{name}_{keys[name]}.so" for name in SMALL)
    lib = ctypes.CDLL(str(paths["scale_search"]))  # one source's functions only
    assert hasattr(lib, "lowbit_int_scale_errors") and not hasattr(lib, "lowbit_gptq_int_block")
    stamps = {name: paths[name].stat().st_mtime_ns for name in SMALL}

    # Editing one source changes its key alone, and the next build compiles it alone.
    edited = sources / "scale_search.c"
    edited.write_text(edited.read_text() + "\n/* edited */\n")
    compiled.clear()
    again = {name: build.build(name) for name in SMALL}
    assert compiled == ["scale_search.c"]
    assert build.cache_key("scale_search") != keys["scale_search"]
    for name in ("gptq_columns", "f32_dot"):
        assert build.cache_key(name) == keys[name]
        assert again[name] == paths[name] and again[name].stat().st_mtime_ns == stamps[name]
    assert again["scale_search"].name == f"libscale_search_{build.cache_key('scale_search')}.so"
    assert len(list(cache.glob("*.so"))) == len(SMALL) + 1
    compiled.clear()
    assert {name: build.build(name) for name in SMALL} == again and compiled == []  # all cached now

    # The shared header, the flags and the compiler are in every key.
    before = {name: build.cache_key(name) for name in build.SOURCES}
    assert all(build.cache_key(name, portable=True) != key for name, key in before.items())
    monkeypatch.setenv("CC", f"{shlex.quote(build.compiler()[0])} -g0")
    assert all(build.cache_key(name) != key for name, key in before.items())
    monkeypatch.delenv("CC")
    header = sources / build.HEADER
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert all(build.cache_key(name) != key for name, key in before.items())


def _mapped_from(lib_name: str) -> set[str]:
    """What this process maps the library `lib_name` (lib<name>_<key>.so) from."""
    return {" ".join(line.split()[5:]) for line in Path("/proc/self/maps").read_text().splitlines() if lib_name in line}


@needs_compiler
@pytest.mark.skipif(not hasattr(os, "memfd_create") or not Path("/proc/self/maps").exists(), reason="Linux only")
def test_a_library_runs_from_a_private_copy_unless_asked_for_the_file(fresh, monkeypatch):
    _, cache = fresh
    monkeypatch.delenv(build.SHARED_ENV, raising=False)
    lib = build.library("scale_search", scale_search.SIGNATURES)
    name = build.library_path("scale_search").name
    # the bytes of the cached file, mapped from an anonymous copy (a memfd), not from the file
    mapped = _mapped_from(name)
    assert f"/memfd:{name} (deleted)" in mapped and str(cache / name) not in mapped
    assert Path(lib._name).read_bytes() == (cache / name).read_bytes()
    # a second library gets its own copy, not the first one's (the loader knows each by its path)
    other = build.library("gptq_columns", {})
    assert hasattr(other, "lowbit_gptq_int_block") and not hasattr(other, "lowbit_int_scale_errors")
    assert lib._name != other._name
    # LOWBIT_NATIVE_SHARED=1 loads the cached file itself
    monkeypatch.setattr(build, "_outcomes", {})
    monkeypatch.setattr(build, "_bound", {})
    monkeypatch.setenv(build.SHARED_ENV, "1")
    shared = build.library("f32_dot", {})
    assert shared._name == str(build.library_path("f32_dot"))
    assert str(build.library_path("f32_dot")) in _mapped_from(build.library_path("f32_dot").name)


@needs_compiler
def test_without_a_private_copy_the_file_itself_loads(fresh, monkeypatch):
    """A system that refuses memfd_create (an old kernel, a seccomp filter) still gets its kernels."""
    monkeypatch.delenv(build.SHARED_ENV, raising=False)

    def refused(name):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(build.os, "memfd_create", refused, raising=False)
    lib = build.library("scale_search", scale_search.SIGNATURES)
    assert lib is not None and lib._name == str(build.library_path("scale_search"))
    assert hasattr(lib, "lowbit_int_scale_errors")


@needs_compiler
def test_a_source_that_does_not_compile_turns_off_its_paths_only(fresh, tmp_path, monkeypatch, capsys):
    _, cache = fresh
    cc = tmp_path / "cc.sh"  # the real compiler, except for lut_gemv.c
    cc.write_text(f"""#!/bin/sh
for a in "$@"; do case "$a" in *lut_gemv.c)
    echo "lut_gemv.c: In function 'row4':" >&2
    echo "lut_gemv.c:1:1: error: simulated failure" >&2
    echo "the rest of the compiler's output" >&2
    exit 1;;
esac; done
exec {shlex.quote(build.compiler()[0])} "$@"
""")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    capsys.readouterr()
    # The portable variant: the same build logic, and quicker to compile.
    assert lut_gemv.library(portable=True) is None
    assert lut_gemv.library(portable=True) is None
    err = capsys.readouterr().err
    assert _warnings(err) == err.strip().splitlines()
    (line,) = _warnings(err)
    assert "native/lut_gemv.c did not build (lut_gemv.c:1:1: error: simulated failure" in line
    assert "cpu-lut are off" in line and "torch/reference" in line
    assert "scale_search" not in line and "cpu-bf16" not in line
    log = next(cache.glob("liblut_gemv_*.log"))
    assert "the rest of the compiler's output" in log.read_text() and str(log) in line

    statuses = {s.source: s for s in build.report(portable=True)}
    assert list(statuses) == [f"{name}.c" for name in build.SOURCES]
    assert not statuses["lut_gemv.c"].built and statuses["lut_gemv.c"].library == ""
    assert statuses["lut_gemv.c"].reason.startswith("lut_gemv.c:1:1: error: simulated failure")
    for name, s in statuses.items():
        if name != "lut_gemv.c":
            assert s.built and s.reason == "" and Path(s.library).is_file(), s
    lib = rowops.library(portable=True)  # another source's path still works
    x = torch.tensor([[3.0, 4.0]])
    out = torch.empty_like(x)
    assert lib.lowbit_rmsnorm(x.data_ptr(), 2, 1, 1, 2, torch.ones(2).data_ptr(), 0.0, 0, 0, out.data_ptr(), 2, 1) == 0
    assert torch.allclose(out, x / 12.5**0.5)
    assert rowops.library(portable=True) is lib and scale_search.library(portable=True) is not None
    assert capsys.readouterr().err == ""  # report() and the later calls print nothing


def test_not_x86_says_so_once_and_fails_nothing(fresh, monkeypatch, capsys):
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    capsys.readouterr()
    assert lut_gemv.library() is None and rowops.library() is None and scale_search.library() is None
    assert not scale_search.available()
    (line,) = _warnings(capsys.readouterr().err)
    assert "not an x86-64 machine (aarch64)" in line
    assert all(not s.built and s.reason == "not an x86-64 machine (aarch64)" and s.library == ""
               for s in build.report())
    assert capsys.readouterr().err == ""


def test_lowbit_no_native_turns_every_path_off_silently(fresh, monkeypatch, capsys):
    monkeypatch.setenv(build.NO_NATIVE_ENV, "1")
    compiled = _compiles(monkeypatch)
    capsys.readouterr()
    assert lut_gemv.library() is None and rowops.library() is None
    statuses = build.report()
    assert all(not s.built and s.reason == "LOWBIT_NO_NATIVE is set" for s in statuses)
    assert build.warning_line(statuses) is None  # asked for: nothing to warn about
    assert compiled == [] and capsys.readouterr().err == ""


def test_status_is_a_frozen_slotted_dataclass():
    s = build.SourceStatus(source="lut_gemv.c", built=False, reason="no C compiler", library="")
    assert [f.name for f in dataclasses.fields(s)] == ["source", "built", "reason", "library"]
    assert not hasattr(s, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.built = True  # type: ignore[misc]


@needs_compiler
def test_report_here_names_every_library(capsys):
    statuses = build.report()
    assert capsys.readouterr().err == ""
    assert [s.source for s in statuses] == [f"{name}.c" for name in build.SOURCES]
    for s in statuses:
        assert s.built and s.reason == "" and Path(s.library).name.startswith(f"lib{s.source[:-2]}_"), s


def _without_compiler(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != build.NO_NATIVE_ENV}
    env.update(CC="/bin/false", LOWBIT_HOME=str(home), PYTHONPATH=str(REPO))
    return env


MATMUL = """
import json, torch
from lowbit.kernels import prepare, qmatmul
from lowbit.kernels.reference import reference_matmul
from lowbit.native import build
from tests.kernels.cases import quantized
torch.manual_seed(0)
qt = quantized("int4", 33, 200)
x = torch.randn(3, 200)
pw = prepare(qt, "cpu")
y = qmatmul(x, pw)
print(json.dumps({"path": pw.path, "exact": torch.equal(y, reference_matmul(x, qt)), "y": y.tolist(),
                  "report": [[s.source, s.built, s.reason, s.library] for s in build.report()]}))
"""


def test_without_a_compiler_a_matmul_gives_the_reference_numbers(tmp_path):
    run = subprocess.run([sys.executable, "-c", MATMUL], cwd=REPO, env=_without_compiler(tmp_path / "home"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["path"] == "reference" and out["exact"]
    (line,) = _warnings(run.stderr)
    assert run.stderr.strip().splitlines() == [line]  # one line, and nothing else
    assert "/bin/false exited with status 1" in line and "cpu-lut" in line and "cpu-int4dot" in line
    assert [r[0] for r in out["report"]] == [f"{name}.c" for name in build.SOURCES]
    assert all(not built and "/bin/false exited with status 1" in reason and library == ""
               for _, built, reason, library in out["report"])

    torch.manual_seed(0)  # the same weight and x here, where the library builds
    from tests.kernels.cases import quantized
    from lowbit.kernels.reference import reference_matmul

    qt = quantized("int4", 33, 200)
    x = torch.randn(3, 200)
    assert torch.equal(torch.tensor(out["y"], dtype=torch.float32), reference_matmul(x, qt))


TEXT = "The quick brown fox jumps over the lazy dog; sphinx of black quartz, judge my vow. " * 12


@needs_compiler
def test_cli_eval_without_a_compiler_gives_the_same_perplexity(tiny_float_model, tmp_path):
    from lowbit.cli.main import main

    src = tiny_float_model("llama")
    ckpt = tmp_path / "q"
    # int4 in groups of 16: cpu-bf16 (exact weights as a bf16 pair, float32 GEMM at 64 rows) with
    # the library, the float32 reference without it; row ops C or torch.
    with pytest.raises(SystemExit) as done:
        main(["quantize", str(src), "--format", "int4", "--group-size", "16", "-o", str(ckpt)])
        raise SystemExit(0)  # main returns on success, as tests/cli/conftest.py's run_cli expects
    assert not done.value.code
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    command = [sys.executable, "-m", "lowbit", "eval", str(ckpt), "--data", str(text), "--chunks", "1", "--ctx", "64", "--json"]
    env = {k: v for k, v in os.environ.items() if k != build.NO_NATIVE_ENV}
    with_cc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    without = subprocess.run(command, cwd=REPO, env=_without_compiler(tmp_path / "home"), capture_output=True, text=True,
                             timeout=600)
    assert with_cc.returncode == 0 and without.returncode == 0, (with_cc.stderr, without.stderr)
    assert _warnings(with_cc.stderr) == []
    (line,) = _warnings(without.stderr)
    assert "/bin/false" in line
    ppl, ppl_without = json.loads(with_cc.stdout)["ppl"], json.loads(without.stdout)["ppl"]
    assert ppl > 1 and abs(ppl_without - ppl) / ppl < 1e-4


@pytest.mark.parametrize("target", [
    ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),  # the AVX-512 sections (Zen 4, Sapphire Rapids)
    ("-march=x86-64-v3",),  # the AVX2 sections (Zen 2/3, most laptops)
    ("-march=x86-64-v2",),  # the scalar fallbacks
])
def test_every_source_compiles_for_every_isa_section(target):
    # A machine builds only its own ISA's section of each source; this checks the others compile too
    # (a helper used outside its section, say, would otherwise only fail on another CPU).
    import subprocess

    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    for source in sorted(build.SOURCE_DIR.glob("*.c")):
        done = subprocess.run([*cc, *target, "-fsyntax-only", "-std=c11", "-fopenmp", "-Werror=implicit-function-declaration",
                               f"-I{build.SOURCE_DIR}", str(source)], capture_output=True, text=True)
        assert done.returncode == 0, f"{source.name} {' '.join(target)}: {done.stderr[-800:]}"
