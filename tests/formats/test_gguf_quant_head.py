"""A GGUF head in a block type lowbit runs (Q8_0, Q4_0, MXFP4) is read as the quantized lm_head
`quantize --quantize-head` writes: its exact blocks, run by the kernels, and where token_embd is
tied, the embedding's rows read from them instead of a float32 table (Gemma-3's 262k x 640: 671 MB
against 178 MB)."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from lowbit.formats.convert import convert
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.gguf_import import convert_gguf
from lowbit.runtime.loader import load_model
from lowbit.runtime.quant_embedding import QuantEmbedding
from tests.formats.test_gguf_tiny import _reference, write_tiny

IDS = torch.tensor([[5, 17, 200, 256, 258, 3, 99]])


def _logits(path, monkeypatch):
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")  # float32 dequantize-then-matmul everywhere
    with torch.no_grad():
        return load_model(path)(IDS)


def test_tied_q8_0_token_embd_is_the_quantized_head(tmp_path, monkeypatch):
    record = write_tiny(tmp_path / "tied.gguf", tied=True)  # token_embd Q8_0, no output.weight
    ckpt = read_checkpoint(tmp_path / "tied.gguf")
    assert "model.embed_tokens.weight" not in ckpt.dense and ckpt.qtensors["lm_head"].spec.label.startswith("int8-g32")
    want = _reference(record["expected"]["model.embed_tokens.weight"], T.Q8_0)
    assert np.array_equal(ckpt.qtensors["lm_head"].dequantize().numpy(), want)  # the file's values exactly
    model = load_model(tmp_path / "tied.gguf")
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert torch.equal(model.model.embed_tokens(IDS)[0], torch.from_numpy(want)[IDS[0]])
    # the same logits as the file converted to a float32 directory (its head and embedding dense)
    convert_gguf(tmp_path / "tied.gguf", tmp_path / "hf", dtype="f32")
    torch.testing.assert_close(_logits(tmp_path / "tied.gguf", monkeypatch), _logits(tmp_path / "hf", monkeypatch),
                               rtol=1e-5, atol=1e-5)


def test_untied_q8_0_output_is_the_head_and_the_embedding_stays_dense(tmp_path, monkeypatch):
    record = write_tiny(tmp_path / "untied.gguf", tied=False, output_type=T.Q8_0)
    ckpt = read_checkpoint(tmp_path / "untied.gguf")
    head = ckpt.qtensors["lm_head"]
    assert np.array_equal(head.dequantize().numpy(), _reference(record["expected"]["lm_head.weight"], T.Q8_0))
    assert ckpt.dense["model.embed_tokens.weight"].shape == head.shape
    convert_gguf(tmp_path / "untied.gguf", tmp_path / "hf", dtype="f32")
    torch.testing.assert_close(_logits(tmp_path / "untied.gguf", monkeypatch), _logits(tmp_path / "hf", monkeypatch),
                               rtol=1e-5, atol=1e-5)


def test_a_head_in_another_block_type_stays_dense(tmp_path):
    write_tiny(tmp_path / "q41.gguf", tied=False)  # output.weight Q4_1: no lowbit format holds it
    ckpt = read_checkpoint(tmp_path / "q41.gguf")
    assert "lm_head" not in ckpt.qtensors and "lm_head.weight" in ckpt.dense


def test_reexport_writes_the_tied_head_blocks_back(tmp_path):
    write_tiny(tmp_path / "tied.gguf", tied=True)
    out = tmp_path / "again.gguf"
    result = convert(tmp_path / "tied.gguf", out, "gguf", allow_requant=True)  # Q4_1/Q5_x layers requantize
    assert not any(c.module in ("lm_head", "model.embed_tokens") for c in result.changes)
    source = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "tied.gguf")).tensors}
    again = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert "output.weight" not in again and again["token_embd.weight"].tensor_type == T.Q8_0
    assert np.array_equal(np.asarray(again["token_embd.weight"].data), np.asarray(source["token_embd.weight"].data))


def test_q5_0_blocks_are_read_exactly_as_int8_codes(tmp_path, monkeypatch):
    """Q5_0 is d x (q - 16): an 8-bit code with Q8_0's float16 scale, so it runs on the int8 kernel
    from its exact values; inspect still reports the file's Q5_0 bytes."""
    from lowbit.compress.checkpoint_report import inspect_checkpoint

    record = write_tiny(tmp_path / "q.gguf", arch="qwen2", tied=False, output_type=T.Q5_0)
    ckpt = read_checkpoint(tmp_path / "q.gguf")
    for module, hf in (("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj.weight"),
                       ("lm_head", "lm_head.weight")):
        qt = ckpt.qtensors[module]
        assert qt.spec.label.startswith("int8-g32") and ckpt.stored_as[module] == "Q5_0"
        assert np.array_equal(qt.dequantize().numpy(), _reference(record["expected"][hf], T.Q5_0)), module
    rows = {r.name: r for r in inspect_checkpoint(tmp_path / "q.gguf").rows}
    q = rows["model.layers.0.self_attn.q_proj"]
    assert (q.format, q.bits_per_weight) == ("Q5_0", 5.5) and q.bytes == 64 * 64 * 22 // 32
    convert_gguf(tmp_path / "q.gguf", tmp_path / "hf", dtype="f32")
    torch.testing.assert_close(_logits(tmp_path / "q.gguf", monkeypatch), _logits(tmp_path / "hf", monkeypatch),
                               rtol=1e-5, atol=1e-5)


def test_q5_0_is_written_back_as_the_same_blocks(tmp_path):
    write_tiny(tmp_path / "q.gguf", arch="qwen2", tied=False, output_type=T.Q5_0)
    out = tmp_path / "again.gguf"
    convert(tmp_path / "q.gguf", out, "gguf", allow_requant=True)  # its Q4_1/Q5_1 layers requantize
    source = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    again = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for name in ("blk.0.attn_q.weight", "blk.1.attn_q.weight", "output.weight"):
        assert again[name].tensor_type == T.Q5_0, name
        assert np.array_equal(np.asarray(again[name].data), np.asarray(source[name].data)), name
    # through a native checkpoint (as a distilled student is written) the type travels in stored_as
    convert(tmp_path / "q.gguf", tmp_path / "n", "native", allow_requant=True)
    stored = read_checkpoint(tmp_path / "q.gguf").stored_as
    for keep, want in ((stored, T.Q5_0), (None, T.Q8_0)):
        path = tmp_path / f"n-{want.name}.gguf"
        convert(tmp_path / "n", path, "gguf", allow_requant=True, stored_as=keep)
        tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        assert tensors["blk.0.attn_q.weight"].tensor_type == want


def test_q5_0_blocks_round_trip_every_high_bit():
    """Each element's fifth bit lives in the block's 32-bit qh; element 31's is its sign bit."""
    from gguf.quants import quantize

    from lowbit.formats.gguf_blocks import from_gguf_bytes, to_gguf_bytes

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 128)) * 0.1).astype(np.float32)
    # the block's extreme at element 0 takes code -16 (d = extreme / -16, as Q4_0); -15/16 of it at
    # element 31 takes the top code, 15 (q = 31: its fifth bit is qh's bit 31)
    w[:, 0::32], w[:, 31::32] = 5.0, -4.6875
    w[0, :32] = 0.0  # a zero block (d = 0)
    raw = quantize(w, T.Q5_0)
    qt = from_gguf_bytes(raw.tobytes(), "Q5_0", (8, 128))
    assert (qt.qweight[1:, 31::32] == 15).all() and (qt.qweight[1:, 0::32] == -16).all()
    assert np.array_equal(to_gguf_bytes(qt, "Q5_0").reshape(-1), np.frombuffer(raw.tobytes(), np.uint8))
