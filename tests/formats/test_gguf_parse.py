"""lowbit's own GGUF container parser (formats/gguf_reader._parse) against the `gguf` package's
reader: every metadata value and type, every tensor's name, type, shape, bytes and decoded values,
on a file written here with every value type and on the real SmolLM2 package file; and it is the
fast one (Gemma-3's 262144-token vocabulary took the package's reader 16 s)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from lowbit.errors import LowbitError
from lowbit.formats.gguf_reader import open_gguf
from tests.formats.test_gguf_real import smollm2_gguf  # noqa: F401 - the fixture


def _write_every_type(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, -1.25])
    w.add_array("t.arr_str", ["a", "▁b", "<0x0A>", ""])
    w.add_array("t.arr_nested", [[1, 2], [3, 4]])
    w.add_token_list(["<s>", "a", "ab"])
    w.add_token_scores([0.0, -1.0, -2.0])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(32).astype(np.float32))
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.BF16):
        values = rng.standard_normal((4, 256)).astype(np.float32)
        w.add_tensor(qtype.name.lower(), quantize(values, qtype), raw_shape=quantize(values, qtype).shape,
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_same_as_the_package_reader(path) -> None:
    ours = open_gguf(path)
    theirs = gguf.GGUFReader(path)
    real = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its header pseudo-fields
    assert list(ours.fields) == list(real)
    for key, field in real.items():
        mine = ours.fields[key]
        assert mine.types == [int(t) for t in field.types], key
        if key == "t.arr_nested":
            continue  # the package flattens an array of arrays ([1, 2, 3, 4]); checked below as [[1, 2], [3, 4]]
        expected = field.contents()
        got = mine.contents()
        if isinstance(expected, float):
            assert got == pytest.approx(expected, rel=0, abs=0), key
        else:
            assert got == expected, key
    assert ours.tensor_names() == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        info = ours.info(t.name)
        assert info.type_name == t.tensor_type.name
        assert info.shape == tuple(reversed([int(d) for d in t.shape]))
        assert info.n_bytes == int(t.n_bytes)
        assert ours.raw_bytes(t.name) == t.data.tobytes(), t.name


def test_every_value_type_and_tensor_type_equals_the_package_reader(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_type(path)
    _assert_same_as_the_package_reader(path)
    f = open_gguf(path)
    assert f.get("t.u64") == 2**63 + 5 and f.get("t.bool") is True and f.get("t.str") == "héllo ▁world"
    assert f.get("t.arr_nested") == [[1, 2], [3, 4]]
    assert f.string_array("tokenizer.ggml.tokens") == ["<s>", "a", "ab"]
    assert f.numeric_array("tokenizer.ggml.scores").tolist() == [0.0, -1.0, -2.0]
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:  # decoded values: the package's dequantize over the package reader's data
        expected = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        got = f.tensor(t.name).numpy()
        np.testing.assert_array_equal(got.reshape(expected.shape), expected)


def test_the_smollm2_package_file_equals_the_package_reader(smollm2_gguf):
    _assert_same_as_the_package_reader(smollm2_gguf)


def test_a_tensor_past_the_end_and_an_unknown_type_are_named(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_type(path)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(LowbitError, match="truncated or corrupt: tensor bf16 ends at byte"):
        open_gguf(path)
    start = data.index((3).to_bytes(8, "little") + b"f32")  # the first tensor's entry: u64 length, name
    n_dims_at = start + 8 + 3
    qtype_at = n_dims_at + 4 + 8 * 2
    data[qtype_at : qtype_at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(LowbitError, match="tensor f32 has unknown GGUF tensor type 99"):
        open_gguf(path)
