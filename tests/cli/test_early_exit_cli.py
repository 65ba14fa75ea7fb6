"""`lowbit eval --early-exit` / `lowbit generate --early-exit` and `--draft self:layers=N` end to end
on a tiny 4-layer checkpoint: threshold 1.0 is the full model, exit rates are reported, bad input
is a one-line error with exit code 2."""

from __future__ import annotations

import json

import pytest

from tests.runtime.conftest import _llama_config, build_hf
from tests.runtime.engine.conftest import save_with_tokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
        "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. ") * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("early_exit_cli")
    save_with_tokenizer(build_hf(_llama_config(num_hidden_layers=4)), path / "model")
    (path / "text.txt").write_text(TEXT)
    return path / "model", path / "text.txt"


def _eval(run_cli, model, text, *extra):
    code, out, err = run_cli(["eval", str(model), "--data", str(text), "--ctx", "64", "--json", "--threads", "1",
                              *extra])
    assert code == 0, err
    return json.loads(out)


def test_eval_threshold_one_is_the_full_model_and_zero_exits_everywhere(run_cli, tiny):
    model, text = tiny
    plain = _eval(run_cli, model, text)
    same = _eval(run_cli, model, text, "--early-exit", "1,3", "--exit-threshold", "1.0")
    # exactly the full model's own forward (KLD 0 against it); plain eval scores on the engine's path
    # (runtime/engine/window_scorer.py), which rounds differently in the last bits
    assert same["kld"]["mean"] == 0.0 and same["kld"]["base_ppl"] == same["ppl"]
    assert same["ppl"] == pytest.approx(plain["ppl"], rel=1e-6)
    assert same["early_exit"]["exit_rate"] == {"full": 1.0} and same["early_exit"]["mean_layers"] == 4.0
    assert same["early_exit"]["positions"] == plain["tokens_scored"]
    low = _eval(run_cli, model, text, "--early-exit", "1,3", "--exit-threshold", "0", "--exit-confidence", "margin")
    assert low["kld"]["base_ppl"] == same["ppl"]  # against the full model itself
    assert low["kld"]["mean"] > 0 and low["early_exit"]["exit_rate"]["full"] < 1.0


def test_generate_threshold_one_is_plain_greedy(run_cli, tiny):
    model, _ = tiny
    code, out, err = run_cli(["generate", str(model), "hello there", "--max-tokens", "16", "--json"])
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = run_cli(["generate", str(model), "hello there", "--max-tokens", "16", "--json",
                              "--early-exit", "2", "--exit-threshold", "1"])
    assert code == 0, err
    early = json.loads(out)
    assert early["token_ids"] == plain["token_ids"] and early["early_exit"]["exit_rate"] == {"full": 1.0}
    code, out, err = run_cli(["generate", str(model), "hello there", "--max-tokens", "16", "--json",
                              "--draft", "self:layers=2"])
    assert code == 0, err
    assert json.loads(out)["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize("args, message", [
    (["eval", "{model}", "--data", "{text}", "--ctx", "64", "--early-exit", "4"], "layer 4 is out of range"),
    (["eval", "{model}", "--data", "{text}", "--ctx", "64", "--early-exit", "1", "--exit-threshold", "2"], "[0, 1]"),
    (["eval", "{model}", "--data", "{text}", "--early-exit", "1", "--exit-confidence", "entropy"], "top1, margin"),
    (["generate", "{model}", "hi", "--early-exit", "0"], "between 1 and 3"),
    (["generate", "{model}", "hi", "--early-exit", "1", "--exit-threshold", "-1"], "[0, 1]"),
    (["generate", "{model}", "hi", "--early-exit", "1", "--draft", "ngram"], "do not combine"),
    (["generate", "{model}", "hi", "--early-exit", "1", "--kv-dtype", "int8"], "does not combine"),
    (["generate", "{model}", "hi", "--draft", "self:layers=4"], "between 1 and 3"),
    (["generate", "{model}", "hi", "--draft", "self:layers=two"], "integer"),
])
def test_bad_input_is_one_line(run_cli, tiny, args, message):
    model, text = tiny
    code, out, err = run_cli([a.format(model=model, text=text) for a in args])
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
