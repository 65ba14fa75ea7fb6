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


def test_an_int4_engine_places_each_weight_once(tiny_float_model, monkeypatch):
    # joined q/k/v and gate/up are copied once into the engine's chunks, by their join: the separate
    # projections read its rows, and the chunks the load placed them in are given back (with
    # quantize_to, the copy's own join too: the engine joins again in its new chunks)
    import gc

    from lowbit.kernels import cpu_int4dot
    from lowbit.kernels.cpu_f32 import InvariantLinear
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.models.fusion import JoinedLinear

    if not cpu_int4dot.available():
        pytest.skip("no int4 kernel on this machine")
    monkeypatch.setattr(hugepages, "_enabled", True)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    taken = []
    real_take = hugepages._take
    monkeypatch.setattr(hugepages, "_take", lambda nbytes: taken.append((hugepages._generation, nbytes)) or real_take(nbytes))
    before = set(hugepages._chunks)
    engine = Engine(tiny_float_model(hidden=64, intermediate=192), quantize_to="int4-g32", max_model_len=64)
    gc.collect()
    final = hugepages._generation
    assert {b: g for b, g in hugepages._chunks.items() if b not in before and g != final} == {}  # the load's chunks are gone
    spans = []  # every array a decode reads: (address, bytes)
    for module in engine.model.modules():
        prepared = [getattr(module, "prepared", None)] + [
            j.prepared for j in (module.__dict__.get("fused_qkv"), module.__dict__.get("fused_gate_up")) if isinstance(j, JoinedLinear)]
        for pw in prepared:
            for name, t in (pw.tensors.items() if pw is not None else ()):
                if name in cpu_int4dot.STREAMED:
                    assert hugepages.placed(t), name
                    spans.append((t.data_ptr(), t.numel() * t.element_size()))
    unique, end = 0, 0  # the bytes they cover, views counted once
    for address, nbytes in sorted(spans):
        unique += max(0, address + nbytes - max(address, end))
        end = max(end, address + nbytes)
    mlp = engine.model.model.layers[0].mlp
    codes, joined = mlp.up_proj.prepared.tensors["codes"], mlp.fused_gate_up.prepared.tensors["codes"]
    assert joined.data_ptr() < codes.data_ptr() < joined.data_ptr() + joined.numel()  # up's rows inside the join
    dense = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size() for m in engine.model.modules()
             if type(m) is InvariantLinear}  # the head
    assert sum(n for g, n in taken if g == final) <= 1.02 * (unique + sum(dense.values()))


def test_lazy_zeros_are_zeros_that_take_memory_only_where_written():
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("resident memory is read from /proc")
    from lowbit.runtime.process_memory import resident_bytes

    before = resident_bytes()[0]
    t = hugepages.lazy_zeros((256, 1024, 256), torch.float32)  # 256 MiB
    assert t.shape == (256, 1024, 256) and t.dtype is torch.float32 and t.is_contiguous()
    assert resident_bytes()[0] - before < 32 << 20  # nothing touched yet
    t[3].fill_(2.5)  # one MiB written
    assert t[3].eq(2.5).all() and t[2].eq(0).all() and t[4].eq(0).all()
    assert resident_bytes()[0] - before < 64 << 20
    assert float(t[100:110].sum()) == 0.0 and float(t.sum()) == 2.5 * 1024 * 256  # reads see zeros
    assert hugepages.lazy_zeros((3, 5), torch.int8).eq(0).all()


def test_an_engine_kv_cache_is_resident_only_where_used(smollm2_dir):
    # the default cache is sized from free memory (up to 4 GiB); loading must not touch it all
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.process_memory import resident_bytes

    before = resident_bytes()[0]
    engine = Engine(smollm2_dir, kv_memory=2 << 30)
    assert engine.cache.nbytes > 1.9 * (1 << 30)
    # the model adds ~0.5 GB; zeros written in full would add the cache's 2 GiB as well
    assert resident_bytes()[0] - before < 1 << 30
