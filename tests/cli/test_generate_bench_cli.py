"""`lowbit generate` and `lowbit bench` on a tiny random model: streamed text equals the engine's,
stdin prompts, JSON shapes, one-line errors."""

from __future__ import annotations

import io
import json
import sys

import pytest

from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from tests.runtime.conftest import _llama_config, build_hf
from tests.runtime.engine.conftest import save_with_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_llama")
    save_with_tokenizer(build_hf(_llama_config()), path)
    return path


def test_generate_streams_the_engines_greedy_text(model_dir, run_cli, monkeypatch):
    expected = Engine(model_dir, kv_memory=1 << 20).generate(
        [list(b"hello")], SamplingParams(temperature=0, max_tokens=12))[0]
    code, out, err = run_cli(["generate", str(model_dir), "hello", "--max-tokens", "12"])
    assert code == 0 and out == expected.text + "\n" and "tok/s" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    code, out, _ = run_cli(["generate", str(model_dir), "-", "--max-tokens", "12", "--json", "--draft", "ngram"])
    result = json.loads(out)
    assert code == 0 and result["token_ids"] == expected.token_ids and result["text"] == expected.text


def test_generate_bad_input_is_one_line(model_dir, run_cli):
    code, _, err = run_cli(["generate", str(model_dir), "hi", "--temperature", "-1"])
    assert code == 2 and err.count("\n") == 1 and "temperature" in err
    code, _, err = run_cli(["generate", str(model_dir / "missing"), "hi"])
    assert code == 1 and "not found" in err
    code, _, err = run_cli(["generate", str(model_dir), "hi", "--draft", "self:int8", "--draft-vocab", "-5"])
    assert code == 2 and err.count("\n") == 1 and "--draft-vocab -5" in err


def test_bench_json(model_dir, run_cli):
    code, out, _ = run_cli(["bench", str(model_dir), "--batches", "1,2", "--gen-tokens", "6", "--prefill-tokens", "20",
                            "--draft", "ngram", "--kv-memory", "2MiB", "--json"])
    r = json.loads(out)
    assert code == 0 and [d["batch"] for d in r["decode"]] == [1, 2]
    assert r["prefill_tok_s"] > 0 and r["prefill_first_tok_s"] > 0 and r["stream_bandwidth_gbs"] > 0 and r["weight_bytes"] > 0
    # the roofline's bandwidth: the mean of the reads just before and just after the batch-1 decode
    before, after = r["stream_bandwidth_around_gbs"]
    assert r["stream_bandwidth_gbs"] == pytest.approx((before + after) / 2)
    assert r["speculative"]["identical_output"] is True and r["speculative"]["draft_vocab"] is None  # n-gram: no head
    if sys.platform == "linux":  # the process's memory: at least what it holds in KV cache, peak not below now
        assert r["kv_cache_bytes"] < r["resident_bytes_loaded"] <= r["resident_bytes_peak"]


def test_bench_default_prefill_fits_a_short_model(model_dir, run_cli):
    # the tiny model has 512 positions: the default 512-token prefill (+ 2 generated) used to be refused
    code, out, err = run_cli(["bench", str(model_dir), "--batches", "1", "--gen-tokens", "2", "--kv-memory", "2MiB",
                              "--json"])
    assert code == 0, err
    assert json.loads(out)["prefill_tokens"] == 510
