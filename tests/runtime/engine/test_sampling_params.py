"""SamplingParams refuses what would overflow torch's int64 ops inside the engine loop (a top_k of
2**63 once killed the server's engine thread for good)."""

from __future__ import annotations

import pytest

from lowbit.errors import UsageError
from lowbit.runtime.engine.sequence import SamplingParams


@pytest.mark.parametrize("field, value, message", [
    ("top_k", 2**63, "top_k must be an integer in"), ("top_k", -1, "top_k"), ("max_tokens", 2**40, "max_tokens"),
    ("max_tokens", 0, "max_tokens"), ("stop_token_ids", (2**63,), "stop token ids"), ("seed", 2**63, "seed"),
])
def test_out_of_range_values_are_usage_errors(field, value, message):
    with pytest.raises(UsageError, match=message):
        SamplingParams(**{field: value})


def test_the_largest_accepted_values_are_accepted():
    p = SamplingParams(top_k=2**31 - 1, max_tokens=2**31 - 1, stop_token_ids=(2**31 - 1,), seed=2**63 - 1)
    assert p.top_k == 2**31 - 1
