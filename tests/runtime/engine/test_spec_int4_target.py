"""Speculation against an int4 target in bf16: the cpu-int4dot kernel and the fused CPU decode
attention compute every verify row as a one-token step does, so n-gram speculation must give
plain greedy decoding token for token, and the draft length stays within num_speculative_tokens."""

import pytest

from lowbit.kernels import cpu_int4dot
from lowbit.runtime.engine.draft_models import quantize_linears_
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from tests.runtime.engine.test_engine import prompts

pytestmark = pytest.mark.skipif(not cpu_int4dot.available(), reason="no AVX512-BF16 build on this machine")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _int4_engine(path, **kw):
    engine = Engine(path, dtype="bfloat16", kv_memory=4 << 20, **kw)
    quantize_linears_(engine.model, "int4", engine.device)
    prepared = [m.prepared for m in engine.model.modules() if getattr(m, "prepared", None) is not None]
    assert prepared and all(p.path == "cpu-int4dot" for p in prepared)
    return engine


@pytest.mark.parametrize("k", [1, 3, 5])  # 5: verifies of 6 rows, two passes of the kernel's 4-row tiles
def test_ngram_speculation_on_int4_target_equals_plain_greedy(engine_llama_dir, k):
    ps = [p + p for p in prompts()]  # repetition, so the n-gram drafter proposes
    plain = _int4_engine(engine_llama_dir)
    expected = [c.token_ids for c in plain.generate(ps, GREEDY)]
    spec = _int4_engine(engine_llama_dir, draft="ngram", num_speculative_tokens=k)
    got = [c.token_ids for c in spec.generate(ps, GREEDY)]
    assert got == expected
    s = spec.spec_stats
    assert s.num_drafted > 0
    assert s.num_drafted <= k * s.num_passes  # adaptive k never exceeds the requested k
    if k > 1:
        assert s.num_drafted > s.num_passes  # and drafts longer than 1 happen
