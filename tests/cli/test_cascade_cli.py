"""`lowbit generate --cascade` and `lowbit eval --cascade` on the tiny pair of tests/runtime/test_cascade.py:
threshold 1 decodes the model's own greedy tokens, threshold 0 generates runs of cheap tokens and
scores the cheap model everywhere, bad values are one-line errors."""

from __future__ import annotations

import json

from tests.runtime.test_cascade import dirs  # noqa: F401 - the fixture


def test_cli_generate_and_eval(dirs, tmp_path, run_cli):
    run = run_cli
    full, cheap = dirs
    code, out, err = run(["generate", str(full), "hello", "--cascade", str(cheap), "--cascade-threshold", "1",
                          "--max-tokens", "12", "--json", "--threads", "1"])
    assert code == 0, err
    cascaded = json.loads(out)
    code, out, err = run(["generate", str(full), "hello", "--max-tokens", "12", "--json", "--threads", "1"])
    assert code == 0, err
    assert cascaded["token_ids"] == json.loads(out)["token_ids"]  # threshold 1: the full model's greedy tokens
    assert cascaded["cascade"]["full_rate"] == 1.0 and cascaded["cascade"]["positions"] == 11
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    code, out, err = run(["eval", str(full), "--data", str(text), "--ctx", "64", "--chunks", "2", "--cascade",
                          "self:int8", "--cascade-threshold", "0", "--json", "--threads", "1"])
    assert code == 0, err
    r = json.loads(out)
    assert r["cascade"]["cheap_rate"] == 1.0 and 0 < r["kld"]["mean"] < 0.05  # int8 everywhere: close, not equal
    for args, message in [(["--cascade-threshold", "2"], "--cascade-threshold must be in [0, 1], got 2.0"),
                          (["--early-exit", "1"], "--early-exit and --cascade do not combine")]:
        code, _, err = run(["eval", str(full), "--data", str(text), "--ctx", "64", "--cascade", "self:int8", *args])
        assert code == 2 and message in err and "Traceback" not in err, err
    code, _, err = run(["generate", str(full), "hi", "--cascade", str(cheap), "--draft", "ngram"])
    assert code == 2 and "--cascade does not combine with --early-exit or --draft" in err
    code, _, err = run(["generate", str(full), "hi", "--cascade", str(cheap), "--cascade-run", "0"])
    assert code == 2 and "--cascade-run must be >= 1, got 0" in err and "Traceback" not in err
    code, _, err = run(["generate", str(full), "hi", "--cascade", "self:layers=3"])  # the model has 3 layers
    assert code == 2 and "--cascade self:layers=3: the layer count must be between 1 and 2" in err, err


def test_cli_generate_threshold_zero_takes_runs_of_cheap_tokens(dirs, run_cli):
    full, cheap = dirs
    code, out, err = run_cli(["generate", str(full), "hello", "--cascade", str(cheap), "--cascade-threshold", "0",
                              "--cascade-run", "3", "--max-tokens", "13", "--json", "--threads", "1"])
    assert code == 0, err
    # 12 positions after the first token: three runs of 3 cheap tokens + the model's
    assert json.loads(out)["cascade"]["cheap_rate"] == 9 / 12


def test_cli_bench_measures_the_cascade_at_each_batch(dirs, run_cli):
    full, cheap = dirs
    code, out, err = run_cli(["bench", str(full), "--cascade", str(cheap), "--cascade-threshold", "1", "--batches",
                              "1,2", "--gen-tokens", "6", "--prefill-tokens", "20", "--json", "--threads", "1"])
    assert code == 0, err
    r = json.loads(out)
    assert r["cascade_model"] == str(cheap) and [c["batch"] for c in r["cascade"]] == [1, 2]
    for c in r["cascade"]:  # threshold 1: the model's own tokens, none from the cheap model
        assert c["greedy_agreement_pct"] == 100.0 and c["cheap_rate"] == 0.0 and c["tok_s"] > 0
    code, _, err = run_cli(["bench", str(full), "--cascade", str(cheap), "--cascade-threshold", "-0.1"])
    assert code == 2 and "--cascade-threshold must be in [0, 1], got -0.1" in err and "Traceback" not in err
