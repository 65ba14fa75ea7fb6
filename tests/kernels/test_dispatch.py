"""The dispatch table: every path's reasons, forced paths, settings, validation before any path,
and describe_paths / summarize."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.kernels import cpu_bf16, cpu_int4dot, dispatch
from lowbit.kernels.dispatch import (
    BY_NAME, PATHS, TABLE, KernelSettings, choose_path, current_settings, describe_paths, prepare, qmatmul, summarize,
    use_settings,
)
from tests.kernels.cases import SPECS, quantized

needs_int4dot = pytest.mark.skipif(not cpu_int4dot.available(), reason="no int4 decode kernel on this machine")
needs_both_routes = pytest.mark.skipif(not (cpu_int4dot.bf16_available() and cpu_int4dot.vnni_available()),
                                       reason="needs AVX512-BF16 and AVX512-VNNI")


def test_table_is_best_first_and_names_every_path():
    names = [p.name for p in TABLE]
    assert names == ["triton", "cpu-int4dot", "cpu-int8dot", "cpu-int4", "cpu-int8f", "cpu-int8", "cpu-bf16", "cpu-lut", "reference"]
    assert set(PATHS) == set(names) | {"cpu"}  # "cpu" is the alias for the best CPU path
    assert all(p.automatic for p in TABLE)
    with pytest.raises(AttributeError):
        TABLE[0].name = "other"  # frozen


@pytest.mark.parametrize("label", SPECS)
def test_supports_agrees_with_the_kernels_own_checks(label):
    # supports() gives a reason exactly when the kernel module's boolean says no
    for n, k in [(96, 192), (33, 200)]:
        qt = quantized(label, n, k)
        for p in TABLE:
            reason = p.supports(qt)
            assert (reason is None) == p.runs(qt), (p.name, label, n, k, reason)
            assert reason is None or (reason and "\n" not in reason)


# (path, weight, words the reason must contain)
REASONS = [
    ("cpu-int4dot", ("nf4", 16, 64), "integer 4-bit"),
    ("cpu-int4dot", ("int4-g16", 16, 128), "groups of 16"),
    ("cpu-int4", ("nf4", 16, 64), "integer 4-bit"),
    ("cpu-int4", ("int4", 16, 200), "divides both"),
    ("cpu-int4", ("int4", 33, 192), "N=33 output rows"),
    ("cpu-int8", ("int4", 16, 64), "per-channel integer 8-bit"),
    ("cpu-int8", ("int8", 16, 200), "not a multiple of 32"),
    ("cpu-bf16", ("int8", 16, 64), "4-bit"),
    ("cpu-lut", ("int3-asym-g32", 16, 64), "4- or 8-bit"),
    ("cpu-int8dot", ("int4", 16, 64), "integer 8-bit"),
]


@pytest.mark.parametrize(("name", "weight", "words"), REASONS)
def test_each_path_says_why_it_cannot_run_a_weight(name, weight, words):
    reason = BY_NAME[name].supports(quantized(*weight))
    assert reason is not None and words in reason, reason


def test_paths_that_run_a_weight_have_no_reason():
    assert BY_NAME["reference"].supports(quantized("int3-asym-g32", 16, 64)) is None
    assert BY_NAME["triton"].supports(quantized("nf4", 16, 64)) is None  # every format (on CUDA)
    assert BY_NAME["cpu-lut"].supports(quantized("fp8", 16, 64)) is None
    assert BY_NAME["cpu-int8"].supports(quantized("int8", 16, 64)) is None


def test_machine_reasons(monkeypatch):
    qt = quantized("int4", 16, 64)
    monkeypatch.setattr(cpu_int4dot, "available", lambda: False)
    monkeypatch.setattr(cpu_int4dot, "supports", lambda qt: False)
    reason = BY_NAME["cpu-int4dot"].supports(qt)
    assert reason is not None and ("C kernel" in reason or "CPU has no" in reason or "LOWBIT_NO_NATIVE" in reason)
    monkeypatch.setenv("LOWBIT_NO_NATIVE", "1")
    assert BY_NAME["cpu-int4dot"].supports(qt) == "LOWBIT_NO_NATIVE is set (no C kernels)"
    monkeypatch.setattr(cpu_bf16, "available", lambda: False)
    assert "LOWBIT_NO_NATIVE" in BY_NAME["cpu-bf16"].unavailable()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        assert "CUDA" in BY_NAME["triton"].unavailable()


def test_forced_paths_are_one_line_errors_with_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qt = quantized("nf4", 16, 64)
    with pytest.raises(LowbitError, match="cannot run nf4 16x64 on this machine: needs integer 4-bit codes") as info:
        prepare(qt, "cpu", "cpu-int4")
    assert "\n" not in str(info.value)
    with pytest.raises(LowbitError, match="needs a CUDA device"):
        choose_path(qt, "cpu", "triton")
    with pytest.raises(LowbitError, match="runs on CPU, but the weight is on cuda"):
        choose_path(qt, "cuda", "cpu-lut")  # decided from the device type alone: no GPU needed
    assert choose_path(qt, "cuda") == "triton" and choose_path(qt, "cuda", "reference") == "reference"
    with pytest.raises(UsageError, match="unknown kernel path 'fast'"):
        choose_path(qt, "cpu", "fast")
    monkeypatch.setenv("LOWBIT_KERNEL", "fast")
    with pytest.raises(UsageError, match="set by LOWBIT_KERNEL"):
        choose_path(qt, "cpu")


@pytest.mark.parametrize("label", ["int4", "nf4", "int8", "fp8", "int3-asym-g32"])
def test_cpu_alias_is_the_automatic_choice(label):
    qt = quantized(label, 33, 192)
    auto = choose_path(qt, "cpu")
    assert choose_path(qt, "cpu", "cpu") == auto
    first = next((p.name for p in TABLE if p.device == "cpu" and p.automatic and p.picks(qt)), "reference")
    assert auto == first


def test_settings_force_a_path_between_the_argument_and_the_environment(monkeypatch):
    qt = quantized("int8", 16, 64)
    auto = choose_path(qt, "cpu")
    assert auto != "reference"
    with use_settings(kernel="reference") as s:
        assert s == current_settings() == KernelSettings(kernel="reference")
        assert prepare(qt, "cpu").path == "reference"
        assert prepare(qt, "cpu", "cpu-lut").path == "cpu-lut"  # the argument wins
        monkeypatch.setenv("LOWBIT_KERNEL", "cpu-lut")
        assert choose_path(qt, "cpu") == "reference"  # settings beat the environment
    assert current_settings() == KernelSettings()
    assert choose_path(qt, "cpu") == "cpu-lut"  # the environment is the fallback
    monkeypatch.delenv("LOWBIT_KERNEL")
    with pytest.raises(RuntimeError), use_settings(KernelSettings(kernel="reference")):
        raise RuntimeError("restored even on errors")
    assert choose_path(qt, "cpu") == auto


def test_settings_validate_their_values():
    with pytest.raises(UsageError, match="unknown kernel path"):
        KernelSettings(kernel="fast")
    with pytest.raises(UsageError, match="int8 or bf16"):
        KernelSettings(int4_activations="int7")


@needs_both_routes
def test_settings_choose_the_int4_activations(monkeypatch):
    qt = quantized("int4", 16, 64)
    monkeypatch.setenv(cpu_int4dot.ACTIVATIONS_ENV, "int8")
    assert prepare(qt, "cpu").params["act"] == "int8"
    with use_settings(int4_activations="bf16"):
        assert prepare(qt, "cpu").params["act"] == "bf16"  # settings beat the environment
        assert dispatch.int4_activations() == "bf16"
    monkeypatch.delenv(cpu_int4dot.ACTIVATIONS_ENV)
    with use_settings(int4_activations="int8"):
        assert prepare(qt, "cpu").params["act"] == "int8"


def test_settings_name_themselves_in_errors(monkeypatch):
    monkeypatch.setattr(cpu_int4dot, "vnni_available", lambda: False)
    with use_settings(int4_activations="int8"), pytest.raises(LowbitError, match="--int4-activations=int8 needs"):
        cpu_int4dot.activations()


@needs_int4dot
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_validation_comes_before_any_path(monkeypatch, dtype, bias):
    pw = prepare(quantized("int4", 32, 64), "cpu")
    assert pw.path == "cpu-int4dot"

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was checked")

    for name in ("decode_matmul", "_fused", "matmul"):
        monkeypatch.setattr(cpu_int4dot, name, no_kernel)
    b = torch.randn(32) if bias else None
    for x in (torch.randn(2, 63), torch.randn(1, 1, 65), torch.randn(16, 128)):
        with pytest.raises(LowbitError, match="features but the int4 weight expects 64"):
            qmatmul(x.to(dtype), pw, b)
    with pytest.raises(LowbitError, match="bf16, fp16 or fp32"):
        qmatmul(torch.randn(2, 64, dtype=torch.float64), pw, b)


@needs_int4dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4dot_decode_fast_path_results_unchanged(dtype):
    # the decode fast path is the one cpu_int4dot.decode_matmul takes: same bits for 1..16 rows,
    # 2-D and 3-D, and the general route (bias, fp16, more rows) as before
    qt = quantized("int4-asym-g64", 40, 192)
    pw = prepare(qt, "cpu")
    assert pw.path == "cpu-int4dot"
    for m in (1, 3, 16):
        x = torch.randn(m, 192).to(dtype)
        y = qmatmul(x, pw)
        assert y.dtype == dtype and torch.equal(y, cpu_int4dot.decode_matmul(x, pw))
        assert torch.equal(qmatmul(x.view(1, m, 192), pw), y.view(1, m, 40))
    x = torch.randn(20, 192).to(dtype)
    out = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    assert torch.equal(qmatmul(x, pw), cpu_int4dot.matmul(x, pw, out).to(dtype))
    bias = torch.randn(40)
    assert torch.equal(qmatmul(x[:3], pw, bias), (cpu_int4dot.matmul(x[:3], pw).float() + bias).to(dtype))
    assert qmatmul(x[:0], pw).shape == (0, 40)


def test_describe_paths_on_this_machine_and_for_a_weight(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    machine = describe_paths(device=None)
    assert [s.name for s in machine] == [p.name for p in TABLE]
    assert all((s.reason is None) == s.usable and not s.chosen for s in machine)
    assert machine[-1].name == "reference" and machine[-1].usable

    qt = quantized("nf4", 33, 192)
    statuses = describe_paths(qt, "cpu")
    assert [s.name for s in statuses if s.chosen] == [choose_path(qt, "cpu")]
    by = {s.name: s for s in statuses}
    assert not by["cpu-int4"].usable and "integer 4-bit" in by["cpu-int4"].reason
    assert not by["triton"].usable and "CUDA" in by["triton"].reason
    assert set(by["reference"].to_dict()) == {"name", "device", "automatic", "usable", "reason", "chosen"}

    on_gpu = {s.name: s for s in describe_paths(qt, "cuda")}
    assert [n for n, s in on_gpu.items() if s.chosen] == ["triton"]
    assert "runs on the CPU" in on_gpu["cpu-lut"].reason

    with use_settings(kernel="cpu-int4"):  # a forced path that cannot run the weight: nothing chosen
        assert not any(s.chosen for s in describe_paths(qt, "cpu"))


def test_summarize_counts_paths_and_activations():
    weights = [prepare(quantized(label, 16, 64), "cpu") for label in ("int8", "int8", "fp8")]
    with use_settings(kernel="reference"):
        weights.append(prepare(quantized("nf4", 16, 64), "cpu"))
        s = summarize(weights)
    assert s["requested"] == "reference"
    assert sum(s["paths"].values()) == 4 and s["paths"]["reference"] == 1
    assert s["int4_activations"] is None  # no layer on the int4 decode kernel
    if cpu_int4dot.available():
        pw = prepare(quantized("int4", 16, 64), "cpu")
        assert summarize([pw])["int4_activations"] == pw.params["act"]


def test_dense_activations_precedence_and_bad_environment(monkeypatch):
    from lowbit.errors import UsageError
    from lowbit.kernels import cpu_f32
    from lowbit.kernels.dispatch import dense_activations, use_settings

    monkeypatch.delenv("LOWBIT_DENSE_ACTIVATIONS", raising=False)
    # the default: bf16 x where the CPU has the bf16 x bf16 kernel (llama.cpp's BF16 arithmetic), else float32
    assert dense_activations() == ("bf16" if cpu_f32.bf16_available() else "f32")
    with monkeypatch.context() as without_bf16:
        without_bf16.setattr(cpu_f32, "bf16_available", lambda: False)
        assert dense_activations() == "f32"
    monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "int4")
    with pytest.raises(UsageError, match="LOWBIT_DENSE_ACTIVATIONS must be f32 or bf16, not 'int4'"):
        dense_activations()
    with use_settings(dense_activations="f32"):  # the setting beats the variable
        assert dense_activations() == "f32"
    if cpu_f32.bf16_available():
        monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "bf16")
        assert dense_activations() == "bf16"
    else:
        with use_settings(dense_activations="bf16"), pytest.raises(UsageError, match="AVX512-BF16"):
            dense_activations()


@pytest.mark.parametrize("label", ["int8", "int8-g32"])
def test_int8_activations_choose_the_path_of_8_bit_weights(monkeypatch, label):
    from lowbit.kernels.dispatch import int8_activations

    qt = quantized(label, 33, 192)
    vnni = cpu_int4dot.vnni_int8_available()
    monkeypatch.delenv("LOWBIT_INT8_ACTIVATIONS", raising=False)
    # the default: int8 x (Q8_0's arithmetic) where the CPU has VNNI, else float32 x
    assert int8_activations() == ("int8" if vnni else "f32")
    assert (choose_path(qt, "cpu") == "cpu-int8dot") == vnni
    with use_settings(int8_activations="f32"):
        assert choose_path(qt, "cpu") not in ("cpu-int8dot", "reference")
    monkeypatch.setenv("LOWBIT_INT8_ACTIVATIONS", "f32")
    assert choose_path(qt, "cpu") not in ("cpu-int8dot", "reference")
    assert choose_path(quantized("int4", 33, 192), "cpu") != "cpu-int8dot"  # only 8-bit codes take it
    monkeypatch.setenv("LOWBIT_INT8_ACTIVATIONS", "int16")
    with pytest.raises(UsageError, match="LOWBIT_INT8_ACTIVATIONS must be int8 or f32, not 'int16'"):
        int8_activations()
    with use_settings(int8_activations="f32"):  # the setting beats the variable
        assert int8_activations() == "f32"
    with pytest.raises(UsageError, match="int8 or f32"):
        KernelSettings(int8_activations="bf16")
    monkeypatch.setattr(cpu_int4dot, "vnni_int8_available", lambda: False)
    monkeypatch.delenv("LOWBIT_INT8_ACTIVATIONS")
    assert int8_activations() == "f32"
    with use_settings(int8_activations="int8"), pytest.raises(UsageError, match="--int8-activations int8 needs"):
        int8_activations()
