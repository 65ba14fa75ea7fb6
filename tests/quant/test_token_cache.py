"""Calibration token ids cached by text and tokenizer hash (compress/token_cache.py)."""

from __future__ import annotations

from lowbit.compress.token_cache import cache_path, encode_cached


class CountingTokenizer:
    def __init__(self):
        self.calls = 0

    def encode(self, text, add_bos=None):
        assert add_bos is False
        self.calls += 1
        return [ord(c) * 1000 for c in text]  # ids beyond 16 bits survive the cache


def test_second_encode_reads_the_cache_and_keys_change_with_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path / "home"))
    tok_file = tmp_path / "tokenizer.json"
    tok_file.write_text('{"a": 1}')
    tok = CountingTokenizer()
    first = encode_cached(tok, tok_file, "héllo")
    again = encode_cached(tok, tok_file, "héllo")
    assert first == again == tok.encode("héllo", add_bos=False) and tok.calls == 2  # 1 miss + the direct call
    assert cache_path(tok_file, "héllo").is_file()
    assert cache_path(tok_file, "hello") != cache_path(tok_file, "héllo")
    tok_file.write_text('{"a": 2}')
    encode_cached(tok, tok_file, "héllo")
    assert tok.calls == 3  # another tokenizer: a miss


def test_damaged_cache_file_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path / "home"))
    tok_file = tmp_path / "tokenizer.json"
    tok_file.write_text("{}")
    path = cache_path(tok_file, "abc")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not numpy")
    tok = CountingTokenizer()
    assert encode_cached(tok, tok_file, "abc") == [97000, 98000, 99000] and tok.calls == 1
    assert encode_cached(tok, tok_file, "abc") == [97000, 98000, 99000] and tok.calls == 1
