"""Incremental detokenization and stop strings for one request.

Text is decoded over a short window of recent tokens (the last few prompt tokens at first, so
a word-initial space or a byte sequence split across tokens comes out as the full decode
would), and only appended once it no longer ends in a replacement character (an incomplete
UTF-8 sequence). With stop strings, the text is cut where the earliest stop string begins, and
the last `len(longest stop) - 1` characters are held back from the stream until they can no
longer start one, so no part of a stop string is ever sent.
"""

from __future__ import annotations

PROMPT_CONTEXT = 4  # prompt tokens decoded as context for the first generated ones


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix", "read", "text", "sent", "stop", "holdback")

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix = 0  # ids[prefix:read] is already-emitted context
        self.read = len(self.ids)
        self.text = ""  # generated text so far (cut at a stop string)
        self.sent = 0  # characters of text already handed out
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one generated token; True when a stop string has now appeared (looked for only
        when check_stop: min_tokens holds stop strings back)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False
        self.prefix, self.read = self.read, len(self.ids)
        search_from = max(0, len(self.text) - self.holdback)
        self.text += after[len(before) :]
        hits = [at for at in (self.text.find(s, search_from) for s in self.stop) if at >= 0] if check_stop else []
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def delta(self, finished: bool) -> str:
        """Text not yet handed out: all of it when finished, else all but the held-back tail."""
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out
