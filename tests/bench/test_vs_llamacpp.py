"""bench/vs_llamacpp.py's cases without llama.cpp: which checkpoint and GGUF each runs, and what
`lowbit bench` is asked for (the peers themselves run outside CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.bench_scripts import load_bench


@pytest.fixture
def vs(monkeypatch):
    module = load_bench("vs_llamacpp")
    calls = []

    def fake_lowbit(*args, capture=True):
        calls.append(args)
        if args[0] == "quantize":
            Path(args[-1]).mkdir()
        elif args[0] == "convert":
            Path(args[3]).write_bytes(b"GGUF")
            return json.dumps({"exact": True})
        elif args[0] == "bench":
            return json.dumps({"prefill_tok_s": 1.0, "decode": [{"batch": 1, "decode_tok_s": 2.0}, {"batch": 16, "decode_tok_s": 3.0}],
                               "decode_weight_bytes": 4, "stream_bandwidth_gbs": 5.0})
        return ""

    monkeypatch.setattr(module, "lowbit", fake_lowbit)
    module.calls = calls
    return module


def test_the_a32_case_runs_the_int8_files_with_float32_activations(vs, tmp_path):
    assert vs.prepare("m", "int8", tmp_path) == vs.prepare("m", "int8-a32", tmp_path) == (str(tmp_path / "int8"), tmp_path / "int8.gguf")
    assert [c[0] for c in vs.calls] == ["quantize", "convert"]  # quantized and exported once for both
    vs.run_lowbit_bench("ckpt", 2, vs.CASES["int8-a32"].bench_args)
    vs.run_lowbit_bench("ckpt", 2, vs.CASES["int8"].bench_args)
    a32, default = vs.calls[-2:]
    assert a32[a32.index("--int8-activations") + 1] == "f32" and "--int8-activations" not in default


def test_the_float_case_runs_the_model_itself(vs, tmp_path):
    ckpt, gguf = vs.prepare("smollm2-135m", "bf16", tmp_path)
    assert ckpt == "smollm2-135m" and gguf == tmp_path / "bf16.gguf"
    assert [c[0] for c in vs.calls] == ["convert"]
    # bf16-a16: the same model and GGUF (exported once), with bf16 activations
    assert vs.prepare("smollm2-135m", "bf16-a16", tmp_path) == (ckpt, gguf)
    vs.run_lowbit_bench("smollm2-135m", 2, vs.CASES["bf16-a16"].bench_args)
    args = vs.calls[-1]
    assert args[args.index("--dense-activations") + 1] == "bf16"
    # bf16-a32: float32 activations named (the default on CPUs without AVX512-BF16)
    assert vs.prepare("smollm2-135m", "bf16-a32", tmp_path) == (ckpt, gguf)
    vs.run_lowbit_bench("smollm2-135m", 2, vs.CASES["bf16-a32"].bench_args)
    args = vs.calls[-1]
    assert args[args.index("--dense-activations") + 1] == "f32"


def test_an_inexact_export_is_refused(vs, tmp_path, monkeypatch):
    monkeypatch.setattr(vs, "lowbit", lambda *a, capture=True: json.dumps({"exact": False}) if a[0] == "convert" else "")
    with pytest.raises(SystemExit, match="not exact"):
        vs.prepare("smollm2-135m", "bf16", tmp_path)


def test_a_case_row_sets_each_tool_against_its_own_bandwidth(vs):
    # 1 GB a token; lowbit 40 tok/s at 50 GB/s (25 ms against a 20 ms roofline), llama.cpp 30 tok/s
    # at 30 GB/s (33.3 ms against 33.3): lowbit is 1.33x faster, 0.8x at equal bandwidth
    ours = {"decode_tok_s": 40.0, "prefill_tok_s": 100.0, "decode16_tok_s": 400.0, "decode_weight_bytes": 10**9,
            "stream_bandwidth_gbs": 50.0}
    theirs = {"decode_tok_s": 30.0, "prefill_tok_s": 50.0, "decode16_tok_s": 200.0, "stream_bandwidth_gbs": 30.0}
    row = vs.summarize_case("int4", [(ours, theirs)] * 3, 123)
    assert row["decode_tok_s"]["ratio"] == pytest.approx(4 / 3)
    assert row["decode_vs_roofline"] == pytest.approx(1.25)
    assert row["llama_cpp_decode_vs_roofline"] == pytest.approx(1.0)
    assert row["decode_ratio_at_equal_bandwidth"] == pytest.approx(0.8)
    assert row["prefill_tok_s"]["ratio"] == 2.0 and row["decode16"]["ratio"] == 2.0 and row["gguf_bytes"] == 123
    # pairs from before llama.cpp's bandwidth was measured: no such fields, the rest the same
    old = vs.summarize_case("int4", [(ours, {k: v for k, v in theirs.items() if k != "stream_bandwidth_gbs"})], 123)
    assert "llama_cpp_decode_vs_roofline" not in old and old["decode_vs_roofline"] == pytest.approx(1.25)


def test_a_packed_head_sets_lowbit_against_the_bytes_it_reads(vs):
    # lowbit reads 0.75 GB a token (its head packed), llama.cpp the same weights unpacked, 1 GB: at
    # 40 GB/s both, 40 tok/s is lowbit at 0.75 GB / 40 GB/s = 18.75 ms against 25 ms (1.33) and
    # 30 tok/s llama.cpp at 25 ms against 33.3 ms (1.33)
    ours = {"decode_tok_s": 40.0, "prefill_tok_s": 100.0, "decode16_tok_s": 400.0, "decode_weight_bytes": 75 * 10**7,
            "decode_weight_bytes_unpacked": 10**9, "stream_bandwidth_gbs": 40.0}
    theirs = {"decode_tok_s": 30.0, "prefill_tok_s": 50.0, "decode16_tok_s": 200.0, "stream_bandwidth_gbs": 40.0}
    row = vs.summarize_case("int4", [(ours, theirs)] * 3, 123)
    assert row["decode_vs_roofline"] == pytest.approx(4 / 3)
    assert row["llama_cpp_decode_vs_roofline"] == pytest.approx(4 / 3)


def test_llama_cpp_runs_from_a_fresh_copy_of_its_build_folder(vs, tmp_path):
    # a stand-in tool that prints where it runs from and where its libraries are looked up first
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "libggml.so.0").write_bytes(b"library bytes\n")
    (bin_dir / "libggml.so").symlink_to("libggml.so.0")
    tool = bin_dir / "llama-bench"
    tool.write_text('#!/bin/sh\necho "$0"\necho "$LD_LIBRARY_PATH"\ncat "$(dirname "$0")/libggml.so"\necho "$@"\n')
    tool.chmod(0o755)
    ran_from, lib_path, lib_bytes, args = vs.run_llama(tool, ["-m", "x.gguf"]).stdout.splitlines()
    copy = Path(ran_from).parent
    assert copy != bin_dir and lib_path.split(":")[0] == str(copy)
    assert lib_bytes == "library bytes" and args == "-m x.gguf"
    assert not copy.exists()  # removed after the run
