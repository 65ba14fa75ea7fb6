"""kernels/hugepages.py: weights copied onto 2 MB pages only inside an engine's arena, unchanged in
value, and the engine's decode weights really on huge pages where the kernel offers them."""

import pytest
import torch

from lowbit.kernels import hugepages


def test_outside_an_arena_nothing_moves():
    t = torch.randn(1024, 1024)
    assert hugepages.place(t) is t


def test_inside_an_arena_big_tensors_move_and_keep_their_values(monkeypatch):
    monkeypatch.setattr(hugepages, "_enabled", True)
    big = torch.randn(300, 1000)
    small = torch.randn(10)
    strided = torch.randn(1000, 300).t()
    with hugepages.arena():
        placed = hugepages.place(big)
        again = hugepages.place(strided)
        assert hugepages.place(small) is small
    assert placed is not big and placed.data_ptr() != big.data_ptr()
    assert torch.equal(placed, big) and placed.dtype is big.dtype and placed.is_contiguous()
    assert torch.equal(again, strided) and again.is_contiguous()
    assert placed.data_ptr() % hugepages.ALIGN == 0 and again.data_ptr() % hugepages.ALIGN == 0
    # one chunk, filled front to back
    assert again.data_ptr() >= placed.data_ptr() + big.numel() * 4
    huge = torch.randn(hugepages.CHUNK_BYTES // 4 + 5)  # its own chunk
    with hugepages.arena():
        alone = hugepages.place(huge)
    assert torch.equal(alone, huge) and alone.data_ptr() % hugepages.HUGE_PAGE == 0


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LOWBIT_HUGEPAGES", "0")
    t = torch.randn(1024, 1024)
    with hugepages.arena():
        assert hugepages.place(t) is t


def _huge_kb_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(v, 16) for v in first.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.demo
def test_an_engine_streams_its_head_and_linears_from_huge_pages(smollm2_dir, monkeypatch):
    if not hugepages.enabled():
        pytest.skip("the kernel offers no transparent huge pages here")
    from lowbit.runtime.engine.engine import Engine

    taken = []
    real_take = hugepages._take
    monkeypatch.setattr(hugepages, "_take", lambda nbytes: taken.append(nbytes) or real_take(nbytes))
    engine = Engine(smollm2_dir, max_model_len=64)
    # every weight copied once: joined q/k/v and gate/up are placed by the join, not before it too
    params = {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}
    assert sum(taken) <= 1.02 * sum(params.values())
    head = engine.model.lm_head.weight  # the tied embedding, compacted to bf16: 57 MB
    assert _huge_kb_at(head.data_ptr()) >= 2048
    down = engine.model.model.layers[3].mlp.down_proj.weight
    assert _huge_kb_at(down.data_ptr()) >= 2048


@pytest.mark.demo
def test_engine_maps_no_chunk_when_switched_off(smollm2_dir, monkeypatch):
    monkeypatch.setenv("LOWBIT_HUGEPAGES", "0")
    monkeypatch.setattr(hugepages, "_new_chunk", lambda size: pytest.fail("a huge-page chunk was mapped"))
    from lowbit.runtime.engine.engine import Engine

    engine = Engine(smollm2_dir, max_model_len=64)
    assert engine.model.lm_head.weight.dtype is torch.bfloat16  # loaded and compacted all the same
