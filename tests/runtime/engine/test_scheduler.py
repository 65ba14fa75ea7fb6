import random

import pytest

from lowbit.errors import LowbitError, UsageError
from lowbit.runtime.engine.block_manager import BlockManager
from lowbit.runtime.engine.scheduler import Scheduler
from lowbit.runtime.engine.sequence import SamplingParams, Sequence, SequenceStatus

EOS = 0


def next_token(tokens):
    """A deterministic stand-in for a model: the next token depends on the whole history."""
    return 1 + sum((i + 1) * t for i, t in enumerate(tokens)) % 47


class FakeRunner:
    """Executes schedule() plans against a simulated paged KV cache.

    Each computed token is written into its slot (block table entry, offset); a sampling step
    first reads back every earlier position through the block table and checks it holds the
    sequence's own token, so a block shared, evicted or reused wrongly is caught.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.kv = {}
        self.steps = []

    def step(self):
        sched = self.scheduler
        bs = sched.block_manager.block_size
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        tokens = []
        for item in out.items:
            seq = item.seq
            assert item.start == seq.num_computed_tokens and item.num_new_tokens >= 1
            assert len(seq.block_table) * bs >= item.start + item.num_new_tokens
            for p in range(item.start):  # attention reads the cached prefix
                assert self.kv[seq.block_table[p // bs], p % bs] == seq.token_ids[p], f"{seq} pos {p}"
            for p in range(item.start, item.start + item.num_new_tokens):
                self.kv[seq.block_table[p // bs], p % bs] = seq.token_ids[p]
            tokens.append([next_token(seq.token_ids)] if item.samples else [])
        self.steps.append(out)
        sched.postprocess(out, tokens)
        return out

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


def make(num_blocks=64, block_size=4, **kw):
    return Scheduler(BlockManager(num_blocks, block_size), eos_token_ids=[EOS], **kw)


def request(rid, prompt, max_tokens=5, **kw):
    return Sequence(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw))


def reference_output(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def test_fcfs_admission_and_max_num_seqs():
    sched = make(max_num_seqs=2)
    seqs = [request(f"r{i}", [i + 1, 2, 3], max_tokens=2 + i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    runner = FakeRunner(sched)
    out = runner.step()
    assert [it.seq.request_id for it in out.items] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]
    runner.run()
    admitted = []
    for step in runner.steps[1:]:
        admitted += [it.seq.request_id for it in step.items if it.start == 0]
    assert admitted == ["r2", "r3"]  # in arrival order, each as soon as a slot freed
    assert all(s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens for s in seqs)


def test_chunked_prefill_under_token_budget_mixed_with_decodes():
    sched = make(max_num_batched_tokens=8)
    a = request("a", [1, 2, 3], max_tokens=20)
    sched.add(a)
    runner = FakeRunner(sched)
    runner.step()  # a's prefill (3 tokens), samples its first token
    b = request("b", list(range(1, 21)), max_tokens=2)
    sched.add(b)
    plans = [[(it.seq.request_id, it.start, it.num_new_tokens, it.samples) for it in runner.step().items]
             for _ in range(3)]
    # a's decode goes first; b's 20-token prompt fills the rest of the budget, 7 at a time.
    assert plans == [
        [("a", 3, 1, True), ("b", 0, 7, False)],
        [("a", 4, 1, True), ("b", 7, 7, False)],
        [("a", 5, 1, True), ("b", 14, 6, True)],
    ]
    assert b.num_computed_tokens == 20 and b.num_output_tokens == 1
    runner.run()
    assert a.output_token_ids == reference_output([1, 2, 3], 20)
    assert b.output_token_ids == reference_output(list(range(1, 21)), 2)


def test_prefill_cap_one_prompt_after_another_while_others_wait():
    sched = make(num_blocks=128, max_num_batched_tokens=64, max_prefill_tokens=10)
    a, b = request("a", list(range(1, 15)), max_tokens=3), request("b", list(range(2, 10)), max_tokens=3)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched)
    plans = [[(it.seq.request_id, it.start, it.num_new_tokens, it.samples) for it in runner.step().items]
             for _ in range(3)]
    # 10 prompt tokens a step while b waits: a (14) finishes its prompt first and answers, then b
    # goes, a's decode riding along; a lone prompt would have taken the whole budget.
    assert plans == [
        [("a", 0, 10, False)],
        [("a", 10, 4, True), ("b", 0, 6, False)],
        [("a", 14, 1, True), ("b", 6, 2, True)],
    ]
    runner.run()
    assert a.output_token_ids == reference_output(list(range(1, 15)), 3)
    assert b.output_token_ids == reference_output(list(range(2, 10)), 3)


def test_prefill_cap_leaves_a_lone_prompt_whole():
    sched = make(num_blocks=128, max_num_batched_tokens=64, max_prefill_tokens=10)
    a = request("a", list(range(1, 41)), max_tokens=2)
    sched.add(a)
    out = FakeRunner(sched).step()
    assert [(it.seq.request_id, it.num_new_tokens, it.samples) for it in out.items] == [("a", 40, True)]
    with pytest.raises(UsageError, match="max_prefill_tokens"):
        make(max_prefill_tokens=0)


def test_stop_conditions():
    sched = make()
    prompt = [5, 6, 7]
    first = next_token(prompt)
    stopped = request("stop-id", prompt, max_tokens=10, stop_token_ids=[first])
    eos_seq = request("eos", prompt, max_tokens=10)
    ignoring = request("ignore", prompt, max_tokens=3, ignore_eos=True)
    hooked = request("hook", [9, 9], max_tokens=10)
    sched.eos_token_ids = frozenset([first])
    sched.stop_checker = lambda s: s.request_id == "hook" and s.num_output_tokens == 2
    for s in (stopped, eos_seq, ignoring, hooked):
        sched.add(s)
    FakeRunner(sched).run()
    assert stopped.finish_reason == "stop" and stopped.output_token_ids == [first]
    assert eos_seq.finish_reason == "stop" and eos_seq.output_token_ids == [first]
    assert ignoring.finish_reason == "length" and ignoring.num_output_tokens == 3
    assert hooked.finish_reason == "stop" and hooked.num_output_tokens == 2
    assert sched.block_manager.num_used_blocks == 0


def test_abort_frees_blocks_at_next_step():
    sched = make()
    a, b = request("a", [1, 2, 3, 4, 5], max_tokens=50), request("b", [7, 8], max_tokens=50)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched)
    runner.step()
    used = sched.block_manager.num_used_blocks
    sched.abort("a")
    assert a.status is SequenceStatus.RUNNING and sched.block_manager.num_used_blocks == used
    out = runner.step()
    assert out.finished == [a] and a.finish_reason == "abort" and a not in sched.running
    assert [it.seq for it in out.items] == [b]
    assert sched.block_manager.num_used_blocks == len(b.block_table)
    sched.abort("b")
    sched.abort("unknown")  # already gone or never there: ignored
    runner.run()
    assert b.finish_reason == "abort" and sched.block_manager.num_used_blocks == 0


def test_preempt_newest_then_resume_gives_uninterrupted_output():
    # 6 blocks of 4 slots; two sequences that each grow to 12 tokens (3 blocks) fit only just;
    # three cannot, so the newest is preempted and resumes later by recompute.
    sched = make(num_blocks=6)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9, 10], "c": [11, 12, 13, 14, 15]}
    seqs = {rid: request(rid, p, max_tokens=7) for rid, p in prompts.items()}
    for s in seqs.values():
        sched.add(s)
    runner = FakeRunner(sched)
    runner.run()
    preempted = [s.request_id for step in runner.steps for s in step.preempted]
    assert preempted and preempted[0] == "c"
    assert sched.num_preemptions == len(preempted)
    for rid, s in seqs.items():
        assert s.output_token_ids == reference_output(prompts[rid], 7), rid
        assert s.finish_reason == "length"


def test_preempted_goes_to_front_of_waiting_queue():
    sched = make(num_blocks=4, max_num_seqs=2)
    a, b, c = request("a", [1] * 7, max_tokens=20), request("b", [2] * 7, max_tokens=20), request("c", [3], max_tokens=1)
    for s in (a, b, c):
        sched.add(s)
    runner = FakeRunner(sched)
    while not sched.num_preemptions:
        runner.step()
    assert b.status is SequenceStatus.WAITING and list(sched.waiting) == [b, c]
    assert b.block_table == [] and b.num_computed_tokens == 0


def test_resume_reuses_its_own_cached_blocks():
    sched = make(num_blocks=8)
    a = request("a", list(range(1, 14)), max_tokens=3)
    sched.add(a)
    runner = FakeRunner(sched)
    runner.run()
    b = request("b", list(range(1, 14)) + [40, 41], max_tokens=2)
    sched.add(b)
    runner.step()
    assert b.num_cached_tokens == 12 and sched.block_manager.num_hit_tokens == 12
    runner.run()
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)


def test_single_sequence_larger_than_pool_finishes_with_length():
    sched = make(num_blocks=2)
    s = request("a", [1, 2, 3], max_tokens=50)
    sched.add(s)
    FakeRunner(sched).run()
    # 8 slots: 8 tokens computed, plus the token sampled from the last one's logits.
    assert s.finish_reason == "length" and s.num_tokens == 9 and s.num_computed_tokens == 8
    assert sched.block_manager.num_used_blocks == 0


def test_bad_requests():
    sched = make(num_blocks=2)
    with pytest.raises(LowbitError, match="does not fit the KV cache"):
        sched.add(request("big", list(range(1, 10))))
    sched.add(request("x", [1]))
    with pytest.raises(UsageError, match="already in use"):
        sched.add(request("x", [2]))
    with pytest.raises(UsageError):
        Scheduler(BlockManager(4), max_num_seqs=0)


@pytest.mark.parametrize("max_prefill_tokens", [None, 5])
def test_randomized_load_matches_reference(max_prefill_tokens):
    rng = random.Random(3)
    sched = make(num_blocks=20, max_num_seqs=5, max_num_batched_tokens=16, max_prefill_tokens=max_prefill_tokens)
    shared = [rng.randrange(1, 47) for _ in range(9)]
    seqs = []
    runner = FakeRunner(sched)
    for i in range(40):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, 47) for _ in range(rng.randrange(1, 14))]
        seqs.append(request(f"r{i}", prompt, max_tokens=rng.randrange(1, 15)))
        sched.add(seqs[-1])
        for _ in range(rng.randrange(3)):
            runner.step()
    runner.run()
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens), s.request_id
    assert sched.num_preemptions > 0 and sched.block_manager.num_hit_tokens > 0
    assert sched.block_manager.num_used_blocks == 0


def test_speculative_verify_step_bookkeeping():
    from lowbit.runtime.engine.scheduler import ScheduledSeq, SchedulerOutput

    sched = make(num_blocks=8)
    s = request("a", [1, 2, 3], max_tokens=10)
    sched.add(s)
    runner = FakeRunner(sched)
    runner.step()  # prefill; s now has 4 tokens, 3 computed
    bm = sched.block_manager
    k = 3
    assert bm.can_append(s, num_lookahead=k)
    bm.append_slot(s, num_lookahead=k)
    assert len(s.block_table) * bm.block_size >= s.num_tokens + k
    # The target ran the last token + 3 drafts; 2 drafts were accepted, plus its own token.
    verify = SchedulerOutput(items=[ScheduledSeq(s, s.num_computed_tokens, 1 + k, True)])
    sched.postprocess(verify, [[11, 12, 13]])
    assert s.num_tokens == 7 and s.num_computed_tokens == 6  # the last emitted token is not computed
    assert s.num_hashed_blocks == 1  # block 0 (tokens 0..3) is full and computed
    # A stop token among the accepted ones ends the sequence and drops what follows.
    s.params.stop_token_ids = (21,)
    verify = SchedulerOutput(items=[ScheduledSeq(s, s.num_computed_tokens, 1 + k, True)])
    sched.postprocess(verify, [[20, 21, 22]])
    assert s.output_token_ids[-2:] == [20, 21] and s.finish_reason == "stop"
    # 9 tokens, 8 computed: both full blocks were registered before the blocks were freed.
    assert s.num_computed_tokens == 8 and bm.num_used_blocks == 0
    assert len(bm.match_prefix(request("b", s.token_ids[:8] + [99]))) == 2
