"""`lowbit generate --cascade` and `lowbit eval --cascade` on the tiny pair of tests/runtime/test_cascade.py:
threshold 1 decodes the model's own greedy tokens, threshold 0 scores the cheap model everywhere, bad
values are one-line errors."""

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
    assert code == 2 and "--cascade does not combine with --early-exit, --draft or --kv-dtype" in err
