"""--kernel and --int4-activations on eval, generate, bench and serve: bad values are one-line usage
errors before anything loads, the options reach the loaded layers (eval/bench --json report them),
they beat the environment variables, and nothing stays set after a command."""

from __future__ import annotations

import json

import pytest

from lowbit.kernels import cpu_int4dot
from lowbit.kernels.dispatch import KernelSettings, current_settings

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! " * 6
LAYERS = 14  # 2 layers x (q, k, v, o, gate, up, down)


@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory):
    """A tiny llama quantized to int4 (RTN, groups of 128 = one per row: the int4 decode kernel's
    weights), and a text for eval."""
    from lowbit.cli.main import main
    from tests.runtime.conftest import _llama_config, build_hf
    from tests.runtime.engine.conftest import save_with_tokenizer

    root = tmp_path_factory.mktemp("kernel_options")
    save_with_tokenizer(build_hf(_llama_config()), root / "float")
    main(["quantize", str(root / "float"), "--format", "int4", "-o", str(root / "int4")])  # returns on success
    main(["quantize", str(root / "float"), "--format", "int8-g32", "-o", str(root / "int8")])
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return root


@pytest.mark.parametrize("command", [
    ["eval", "/no/such/model", "--data", "/no/such/text"],
    ["generate", "/no/such/model", "hello"],
    ["bench", "/no/such/model"],
    ["serve", "/no/such/model"],
])
@pytest.mark.parametrize(("option", "value"), [("--kernel", "fast"), ("--int4-activations", "int7"),
                                               ("--dense-activations", "fp8"), ("--int8-activations", "int16")])
def test_bad_values_are_usage_errors_before_loading(run_cli, command, option, value):
    code, out, err = run_cli([*command, option, value])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("lowbit: error:") and option in err and value in err, err


def test_help_explains_the_defaults_numerics(run_cli):
    for command in ("eval", "generate", "bench", "serve"):
        code, _, _ = run_cli([command, "--help"])
        assert code == 0
    from lowbit.cli.kernel_options import DENSE_ACTIVATIONS_HELP, INT4_ACTIVATIONS_HELP, KERNEL_HELP

    assert "AVX512-BF16" in DENSE_ACTIVATIONS_HELP and "llama.cpp" in DENSE_ACTIVATIONS_HELP

    assert "AVX512-VNNI" in INT4_ACTIVATIONS_HELP and "int8" in INT4_ACTIVATIONS_HELP
    assert "LOWBIT_NO_NATIVE" in KERNEL_HELP and "float32" in KERNEL_HELP and "bf16" in KERNEL_HELP


def eval_kernels(run_cli, root, *extra, model="int4"):
    code, out, err = run_cli(["eval", str(root / model), "--data", str(root / "text.txt"), "--ctx", "64",
                              "--chunks", "1", "--json", *extra])
    assert code == 0, err
    assert current_settings() == KernelSettings()  # nothing stays set after the command
    return json.loads(out)["kernels"]


def test_kernel_option_changes_the_paths_eval_reports(run_cli, quantized_model, monkeypatch):
    monkeypatch.delenv("LOWBIT_KERNEL", raising=False)
    default = eval_kernels(run_cli, quantized_model)
    assert default["requested"] is None and sum(default["paths"].values()) == LAYERS
    assert "reference" not in default["paths"]
    if cpu_int4dot.available():
        assert default["paths"] == {"cpu-int4dot": LAYERS} and default["int4_activations"] in ("int8", "bf16")
    forced = eval_kernels(run_cli, quantized_model, "--kernel", "reference")
    assert forced == {"requested": "reference", "paths": {"reference": LAYERS}, "int4_activations": None,
                      "dense_activations": "f32", "dense_bf16_activation_linears": 0, "packed_bf16_linears": 0}
    # the option beats the environment variable, which is the fallback
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")
    assert eval_kernels(run_cli, quantized_model)["paths"] == {"reference": LAYERS}
    assert eval_kernels(run_cli, quantized_model, "--kernel", "cpu")["paths"] == default["paths"]


def test_a_forced_path_that_cannot_run_is_one_line(run_cli, quantized_model):
    code, out, err = run_cli(["eval", str(quantized_model / "int4"), "--data", str(quantized_model / "text.txt"),
                              "--ctx", "64", "--kernel", "cpu-int8"])
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "kernel path 'cpu-int8' cannot run int4" in err


@pytest.mark.skipif(not (cpu_int4dot.bf16_available() and cpu_int4dot.vnni_available()),
                    reason="needs AVX512-BF16 and AVX512-VNNI")
def test_int4_activations_option(run_cli, quantized_model, monkeypatch):
    monkeypatch.setenv(cpu_int4dot.ACTIVATIONS_ENV, "int8")
    assert eval_kernels(run_cli, quantized_model)["int4_activations"] == "int8"
    assert eval_kernels(run_cli, quantized_model, "--int4-activations", "bf16")["int4_activations"] == "bf16"


@pytest.mark.skipif(not cpu_int4dot.vnni_int8_available(), reason="needs AVX512-VNNI")
def test_int8_activations_option(run_cli, quantized_model, monkeypatch):
    # int8 weights: int8 activations (cpu-int8dot) by default on a VNNI CPU, float32 with the option
    monkeypatch.delenv("LOWBIT_INT8_ACTIVATIONS", raising=False)
    assert eval_kernels(run_cli, quantized_model, model="int8")["paths"] == {"cpu-int8dot": LAYERS}
    monkeypatch.setenv("LOWBIT_INT8_ACTIVATIONS", "int8")
    assert eval_kernels(run_cli, quantized_model, "--int8-activations", "f32", model="int8")["paths"] == {"cpu-int8f": LAYERS}


def test_bench_json_reports_kernels(run_cli, quantized_model):
    code, out, err = run_cli(["bench", str(quantized_model / "int4"), "--batches", "1", "--gen-tokens", "3",
                              "--prefill-tokens", "16", "--kv-memory", "2MiB", "--kernel", "reference", "--json"])
    assert code == 0, err
    assert json.loads(out)["kernels"] == {"requested": "reference", "paths": {"reference": LAYERS}, "int4_activations": None,
                                          "dense_activations": "f32", "dense_bf16_activation_linears": 0, "packed_bf16_linears": 0}


def test_generate_with_the_reference_kernel_matches_its_engine(run_cli, quantized_model):
    from lowbit.kernels.dispatch import use_settings
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sequence import SamplingParams

    with use_settings(kernel="reference"):
        engine = Engine(quantized_model / "int4", kv_memory=1 << 20)
    expected = engine.generate([list(b"hello")], SamplingParams(temperature=0, max_tokens=6))[0]
    code, out, err = run_cli(["generate", str(quantized_model / "int4"), "hello", "--max-tokens", "6", "--json",
                              "--kernel", "reference"])
    assert code == 0, err
    assert json.loads(out)["token_ids"] == expected.token_ids


def test_serve_factory_loads_with_the_settings(quantized_model):
    from lowbit.runtime.quant_linear import QuantLinear
    from lowbit.runtime.server.launch import engine_factory

    build = engine_factory(quantized_model / "int4", kv_memory=1 << 20, max_running=2,
                           kernel_settings=KernelSettings(kernel="reference"))
    engine = build()
    paths = {m.prepared.path for m in engine.model.modules() if isinstance(m, QuantLinear)}
    assert paths == {"reference"} and current_settings() == KernelSettings()
