"""Damaged files through the CLI: GGUF headers and tensor tables, safetensors headers and data,
config.json, tokenizer.json, STATS files. Each case ends in one `lowbit: error:` line naming the
problem (exit 1 or 2, nothing left at -o), or, where the damage leaves a valid input, in a success
whose output holds no NaN/inf and loads again.

Hypothesis runs derandomized (a fixed sequence of examples, the same in CI and here) with a small
number of examples per test; bench/fuzz_long.py runs the same tests with many more
(LOWBIT_FUZZ_EXAMPLES overrides every count, LOWBIT_FUZZ_SEED switches to a seeded random run).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz.conftest import (
    Blob,
    assert_finite_dir,
    check_outcome,
    get_uint,
    gguf_fields,
    put_uint,
    run_lowbit,
    st_join,
    st_split,
)


def fuzz_settings(examples: int):
    """The suite's settings: `examples` per test unless LOWBIT_FUZZ_EXAMPLES says otherwise."""
    count = int(os.environ.get("LOWBIT_FUZZ_EXAMPLES") or examples)
    seeded = bool(os.environ.get("LOWBIT_FUZZ_SEED"))  # bench/fuzz_long.py --seed passes --hypothesis-seed
    # LOWBIT_FUZZ_NO_SHRINK: report the first failing example as found (shrinking reruns the CLI many times)
    phases = [p for p in Phase if p != Phase.shrink or not os.environ.get("LOWBIT_FUZZ_NO_SHRINK")]
    return settings(derandomize=not seeded, deadline=None, max_examples=count, database=None, phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


EVAL = ["--ctx", "16", "--chunks", "1", "--json"]
QUANT = ["--format", "int4", "-g", "32"]


def load_ok(model: Path, what: str) -> None:
    """A checkpoint that a command accepted must load again (weights and tokenizer), NaN/inf-free.
    (Not evaluated: a bit flip may leave finite weights of 1e38, whose perplexity is not a number.)"""
    from lowbit.errors import LowbitError
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    try:
        load_model(model)
        load_tokenizer(model)
    except LowbitError as exc:
        raise AssertionError(f"{what}: the accepted output does not load: {exc}") from None


def eval_outcome(model: Path, text: Path, what: str) -> None:
    """`lowbit eval` on a damaged model: the contract, and a finite perplexity when it succeeds."""
    code, out, err = run_lowbit(["eval", model, "--data", text, *EVAL])
    if check_outcome(code, err, None, may_succeed=True, what=what):
        ppl = json.loads(out)["ppl"]
        assert math.isfinite(ppl), f"{what}: eval succeeded with PPL {ppl}"


# ---------------------------------------------------------------------------------------------
# GGUF


def _uint_values(size: int, original: int):
    top = (1 << (8 * size)) - 1
    special = [0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 32, 33, 255, original - 1, original + 1, original * 2,
               2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, top]
    return st.sampled_from(sorted({v % (top + 1) for v in special})) | st.integers(0, top)


@st.composite
def gguf_header_mutation(draw, data: bytes):
    """(mutated bytes, description): one header field set to another value, aimed by kind so that
    the 260 token strings do not crowd out the counts, types, dims and offsets."""
    fields, _ = gguf_fields(data)
    kinds = sorted({f.kind for f in fields})
    kind = draw(st.sampled_from(kinds))
    field = draw(st.sampled_from([f for f in fields if f.kind == kind]))
    out = bytearray(data)
    if kind == "magic" or (kind == "value" and draw(st.booleans())):
        raw = draw(st.binary(min_size=field.size, max_size=field.size))
        out[field.offset : field.offset + field.size] = raw
        return Blob(out), f"{kind} {field.label} = {raw!r}"
    value = draw(_uint_values(field.size, get_uint(data, field)))
    put_uint(out, field, value)
    return Blob(out), f"{kind} {field.label} = {value}"


@st.composite
def gguf_flips(draw, data: bytes, header_end: int):
    """Up to 8 bit flips, in the header (where they break structure) or anywhere."""
    out = bytearray(data)
    limit = header_end if draw(st.booleans()) else len(data)
    flips = draw(st.lists(st.tuples(st.integers(0, limit - 1), st.integers(0, 7)), min_size=1, max_size=8))
    for pos, bit in flips:
        out[pos] ^= 1 << bit
    return Blob(out), f"flips {flips}"


def _gguf_case(case_dirs, damaged: bytes) -> tuple[Path, Path]:
    case = case_dirs()
    src = case / "in" / "model.gguf"
    src.parent.mkdir()
    src.write_bytes(damaged)
    out_parent = case / "out"
    out_parent.mkdir()
    return src, out_parent / "converted"


def _convert_gguf_outcome(fuzz_inputs, case_dirs, damaged: bytes, what: str, may_succeed: bool = True) -> None:
    src, out = _gguf_case(case_dirs, damaged)
    code, _, err = run_lowbit(["convert", src, "-o", out])
    if check_outcome(code, err, out, may_succeed=may_succeed, what=what):
        assert_finite_dir(out, what)
        load_ok(out, what)


@functools.cache
def _read(path: Path) -> bytes:
    return path.read_bytes()


@pytest.fixture(scope="module")
def gguf_bytes(fuzz_inputs) -> Blob:
    return Blob(_read(fuzz_inputs.gguf))


@fuzz_settings(120)
@given(data=st.data())
def test_gguf_header_fields(fuzz_inputs, case_dirs, gguf_bytes, data):
    damaged, what = data.draw(gguf_header_mutation(gguf_bytes))
    _convert_gguf_outcome(fuzz_inputs, case_dirs, damaged, what)


@fuzz_settings(60)
@given(data=st.data())
def test_gguf_bit_flips(fuzz_inputs, case_dirs, gguf_bytes, data):
    _, header_end = gguf_fields(gguf_bytes)
    damaged, what = data.draw(gguf_flips(gguf_bytes, header_end))
    _convert_gguf_outcome(fuzz_inputs, case_dirs, damaged, what)


def _gguf_data_end(path: Path) -> int:
    from gguf import GGUFReader

    return max(int(t.data_offset) + int(t.n_bytes) for t in GGUFReader(path).tensors)


@fuzz_settings(40)
@given(data=st.data())
def test_gguf_truncated(fuzz_inputs, case_dirs, gguf_bytes, data):
    _, header_end = gguf_fields(gguf_bytes)
    # cuts inside the header are the interesting ones; the data region is one bounds check
    cut = data.draw(st.integers(0, header_end + 64) | st.integers(0, len(gguf_bytes) - 1))
    # only trailing alignment padding may be cut from a valid file
    _convert_gguf_outcome(fuzz_inputs, case_dirs, gguf_bytes[:cut], f"truncated at {cut}",
                          may_succeed=cut >= _gguf_data_end(fuzz_inputs.gguf))


def test_gguf_huge_array_count(fuzz_inputs, case_dirs, gguf_bytes):
    """Found by bench/fuzz_long.py --atheris gguf: the gguf package trusts a scalar array's count and
    builds a Python list of that many indexes however short the file is (11e9 in the crash: out of
    memory); lowbit must refuse the count before the package parses it. 2^24 here, so that a
    regression costs seconds and a few hundred MB, not the machine."""
    fields, _ = gguf_fields(gguf_bytes)
    damaged = bytearray(gguf_bytes)
    merges = [f for f in fields if f.label == "tokenizer.ggml.merges"]
    put_uint(damaged, next(f for f in merges if f.kind == "array_type"), 0)  # an array of u8
    put_uint(damaged, next(f for f in merges if f.kind == "array_len"), 2**24)
    src, out = _gguf_case(case_dirs, bytes(damaged))
    code, _, err = run_lowbit(["convert", src, "-o", out], timeout_s=30)
    check_outcome(code, err, out, needle="tokenizer.ggml.merges (16777216 elements) runs past the end", what="merges count 2^24")


@fuzz_settings(40)
@given(data=st.data())
def test_gguf_eval(fuzz_inputs, case_dirs, gguf_bytes, data):
    """`lowbit eval X.gguf` reads GGUF through another path (Q4_0/Q8_0 stay quantized)."""
    _, header_end = gguf_fields(gguf_bytes)
    damaged, what = data.draw(gguf_header_mutation(gguf_bytes) | gguf_flips(gguf_bytes, header_end))
    src, _ = _gguf_case(case_dirs, damaged)
    eval_outcome(src, fuzz_inputs.text, what)


# ---------------------------------------------------------------------------------------------
# safetensors

_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "F4", "XYZ", ""]
_JUNK = st.sampled_from([None, True, 0, -1, 2**70, 1.5, "x", "", [], [1, 2], {}, {"a": 1}])


@st.composite
def safetensors_header_mutation(draw, data: bytes, rename: bool = True):
    """(bytes, description): the header length, the JSON text or one tensor's entry damaged.
    rename=False keeps replaced JSON bytes out of the tensor names (see test_quantize_renamed_weight)."""
    header, start = st_split(data)
    body = data[start:]
    names = sorted(k for k in header if k != "__metadata__")
    kind = draw(st.sampled_from(["length", "truncate_json", "dtype", "shape", "offsets", "entry", "drop", "top",
                                 "metadata", "json_bytes"]))
    text = json.dumps(header)
    if kind == "length":
        length = draw(st.sampled_from([0, 1, 7, len(text) - 1, len(text) + 1, len(text) + 8, len(data), 2**31, 2**64 - 1])
                      | st.integers(0, 2**64 - 1))
        return st_join(text, body, length), f"header length {length}"
    if kind == "truncate_json":
        cut = draw(st.integers(0, len(text) - 1))
        keep_length = draw(st.booleans())  # keep the old length (reads into the data) or say the new one
        return st_join(text[:cut], body, len(text) if keep_length else None), f"JSON cut at {cut} (old length: {keep_length})"
    if kind == "json_bytes":
        raw = bytearray(text.encode())
        names_at = set()
        for name in ([] if rename else names):
            at = text.index(json.dumps(name))
            names_at.update(range(at, at + len(json.dumps(name))))
        positions = st.integers(0, len(raw) - 1).filter(lambda p: p not in names_at)
        for pos, value in draw(st.lists(st.tuples(positions, st.integers(0, 255)), min_size=1, max_size=4)):
            raw[pos] = value
        return st_join(bytes(raw), body), "JSON bytes replaced"
    if kind == "top":
        value = draw(st.sampled_from(["[]", "1", "null", '"x"', "{}", '{"a": 1}']))
        return st_join(value, body), f"header {value}"
    name = draw(st.sampled_from(names))
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = draw(st.sampled_from(_DTYPES) | _JUNK)
    elif kind == "shape":
        dims = st.sampled_from([0, 1, 2, 16, 32, 64, 258, -1, 2**31, 2**40, 2**63]) | st.integers(-4, 300)
        entry["shape"] = draw(st.lists(dims, max_size=4) | _JUNK)
    elif kind == "offsets":
        end = len(body)
        bound = st.sampled_from([0, 1, end - 1, end, end + 1, 2**32, 2**63, -1]) | st.integers(0, end + 16)
        entry["data_offsets"] = draw(st.lists(bound, min_size=0, max_size=3) | _JUNK)
    elif kind == "entry":
        header[name] = draw(_JUNK)
    elif kind == "drop":
        del header[name]
    else:
        header["__metadata__"] = draw(_JUNK)
    return st_join(header, body), f"{kind} of {name}: {header.get(name)}"


@st.composite
def data_flips(draw, data: bytes):
    """Bit flips in the data region only (the header stays valid)."""
    _, start = st_split(data)
    out = bytearray(data)
    flips = draw(st.lists(st.tuples(st.integers(start, len(data) - 1), st.integers(0, 7)), min_size=1, max_size=6))
    for pos, bit in flips:
        out[pos] ^= 1 << bit
    return Blob(out), f"data flips {flips}"


@st.composite
def value_damage(draw, data: bytes):
    """Weights changed in place, header intact: low mantissa bits flipped (finite, same magnitude:
    must evaluate) or whole bf16 values set to NaN / inf (must be refused naming the tensor)."""
    header, start = st_split(data)
    out = bytearray(data)
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    lo, hi = header[name]["data_offsets"]
    if draw(st.booleans()):
        for pos in draw(st.lists(st.integers(lo // 2, hi // 2 - 1), min_size=1, max_size=8)):
            out[start + 2 * pos] ^= draw(st.integers(1, 127))  # bf16: the low byte is 7 mantissa bits + 1
        return Blob(out), f"mantissa flips in {name}"
    value = draw(st.sampled_from([b"\xc0\x7f", b"\x80\x7f", b"\x80\xff", b"\xff\xff"]))  # NaN, inf, -inf, NaN
    pos = draw(st.integers(lo // 2, hi // 2 - 1))
    out[start + 2 * pos : start + 2 * pos + 2] = value
    return Blob(out), f"non-finite value in {name}"


def _copy_model(case_dirs, source: Path) -> tuple[Path, Path]:
    """A copy of `source` to damage, and an output path in a folder of its own."""
    case = case_dirs()
    model = case / "in" / source.name
    shutil.copytree(source, model)
    (case / "out").mkdir()
    return model, case / "out" / "result"


def _nonfinite_tensors(file: Path) -> set[str]:
    """Names of the floating tensors that decode to NaN/inf (the file's header must be valid)."""
    from safetensors import safe_open

    bad = set()
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.is_floating_point() and not torch.isfinite(t.float()).all():
                bad.add(name)
    return bad


@pytest.fixture(scope="module")
def hf_weights(fuzz_inputs) -> Blob:
    return Blob(_read(fuzz_inputs.hf / "model.safetensors"))


@pytest.fixture(scope="module")
def quant_weights(fuzz_inputs) -> Blob:
    return Blob(_read(fuzz_inputs.quant / "model.safetensors"))


def _quantize_outcome(fuzz_inputs, model: Path, out: Path, what: str, may_succeed: bool, needle_of=None):
    code, _, err = run_lowbit(["quantize", model, *QUANT, "-o", out])
    if check_outcome(code, err, out, may_succeed=may_succeed, what=what):
        assert_finite_dir(out, what)
        load_ok(out, what)
    return code, err


@fuzz_settings(100)
@given(data=st.data())
def test_safetensors_header_quantize(fuzz_inputs, case_dirs, hf_weights, data):
    damaged, what = data.draw(safetensors_header_mutation(hf_weights, rename=False))
    model, out = _copy_model(case_dirs, fuzz_inputs.hf)
    (model / "model.safetensors").write_bytes(damaged)
    # A reinterpreted dtype of the same width, or a reshaped tensor of the same size, is a valid
    # file; the output must then evaluate like any other.
    _quantize_outcome(fuzz_inputs, model, out, what, may_succeed=True)


def test_quantize_renamed_weight(fuzz_inputs, case_dirs):
    model, out = _copy_model(case_dirs, fuzz_inputs.hf)
    file = model / "model.safetensors"
    data = file.read_bytes()
    header, start = st_split(data)
    header["lm_head.weigth"] = header.pop("lm_head.weight")
    file.write_bytes(st_join(header, data[start:]))
    _quantize_outcome(fuzz_inputs, model, out, "lm_head.weight renamed", may_succeed=True)


@fuzz_settings(30)
@given(data=st.data())
def test_safetensors_truncated_quantize(fuzz_inputs, case_dirs, hf_weights, data):
    cut = data.draw(st.integers(0, len(hf_weights) - 1))
    model, out = _copy_model(case_dirs, fuzz_inputs.hf)
    (model / "model.safetensors").write_bytes(hf_weights[:cut])
    _quantize_outcome(fuzz_inputs, model, out, f"truncated at {cut}", may_succeed=False)


@fuzz_settings(50)
@given(data=st.data())
def test_safetensors_data_flips_quantize(fuzz_inputs, case_dirs, hf_weights, data):
    """Flipped bits in the weights: finite values quantize; NaN/inf are refused naming the tensor."""
    damaged, what = data.draw(data_flips(hf_weights))
    model, out = _copy_model(case_dirs, fuzz_inputs.hf)
    file = model / "model.safetensors"
    file.write_bytes(damaged)
    bad = _nonfinite_tensors(file)
    code, err = _quantize_outcome(fuzz_inputs, model, out, what, may_succeed=not bad)
    if bad:
        assert any(name in err for name in bad), f"{what}: the error does not name any of {sorted(bad)}: {err}"


@fuzz_settings(40)
@given(data=st.data())
def test_safetensors_eval(fuzz_inputs, case_dirs, hf_weights, data):
    """`lowbit eval` loads a float checkpoint through runtime/loader.py, not the quantize walk."""
    damaged, what = data.draw(safetensors_header_mutation(hf_weights) | value_damage(hf_weights))
    model, _ = _copy_model(case_dirs, fuzz_inputs.hf)
    file = model / "model.safetensors"
    file.write_bytes(damaged)
    if what.startswith("mantissa"):
        load_ok(model, what)  # a finite change of the last bits is a valid checkpoint
    if what.startswith("non-finite"):
        code, _, err = run_lowbit(["eval", model, "--data", fuzz_inputs.text, *EVAL])
        check_outcome(code, err, None, needle=what.rsplit(" ", 1)[-1], what=what)
    else:
        eval_outcome(model, fuzz_inputs.text, what)


_SPEC_VALUES = st.sampled_from([None, 0, -1, 3, 4, 8, 16, 32, 33, 2**40, "int4", "nf4", "xyz", "", True, [], {}, "float16",
                                 "e8m0", "group", "tensor", "block", 1.5])


@st.composite
def quant_config_mutation(draw, config: dict):
    """config.json of a lowbit checkpoint with its quantization_config damaged."""
    config = json.loads(json.dumps(config))
    qc = config["quantization_config"]
    module = draw(st.sampled_from(sorted(qc["modules"])))
    meta = qc["modules"][module]
    kind = draw(st.sampled_from(["spec", "spec", "shape", "meta", "top", "modules"]))
    if kind == "spec":
        key = draw(st.sampled_from(sorted(meta["spec"])))
        meta["spec"][key] = draw(_SPEC_VALUES)
        what = f"{module} spec.{key} = {meta['spec'][key]!r}"
    elif kind == "shape":
        meta["shape"] = draw(st.lists(st.sampled_from([0, 1, 16, 32, 64, -1, 2**40]), max_size=3) | _JUNK)
        what = f"{module} shape = {meta['shape']!r}"
    elif kind == "meta":
        qc["modules"][module] = draw(_JUNK)
        what = f"{module} meta = {qc['modules'][module]!r}"
    elif kind == "top":
        key = draw(st.sampled_from(["quant_method", "version", "outliers"]))
        qc[key] = draw(_JUNK | st.sampled_from([3, 2, {module: {"count": 5}}]))
        what = f"quantization_config.{key} = {qc[key]!r}"
    else:
        del qc["modules"][module]
        what = f"{module} dropped from modules"
    return config, what


def test_eval_huge_finite_weights(fuzz_inputs, case_dirs):
    from safetensors.torch import load_file, save_file

    model, _ = _copy_model(case_dirs, fuzz_inputs.hf)
    weights = load_file(model / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1e36  # still finite in bf16
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    eval_outcome(model, fuzz_inputs.text, "lm_head scaled by 1e36")


@fuzz_settings(40)
@given(data=st.data())
def test_quantized_config_damage(fuzz_inputs, case_dirs, data):
    config = json.loads((fuzz_inputs.quant / "config.json").read_text())
    damaged, what = data.draw(quant_config_mutation(config))
    model, out = _copy_model(case_dirs, fuzz_inputs.quant)
    (model / "config.json").write_text(json.dumps(damaged))
    code, _, err = run_lowbit(["inspect", model, "--json"])
    check_outcome(code, err, None, may_succeed=True, what=f"inspect, {what}")
    eval_outcome(model, fuzz_inputs.text, f"eval, {what}")
    code, _, err = run_lowbit(["convert", model, "--to", "hf", "-o", out])
    if check_outcome(code, err, out, may_succeed=True, what=f"convert, {what}"):
        assert_finite_dir(out, what)


@fuzz_settings(60)
@given(data=st.data())
def test_quantized_checkpoint_damage(fuzz_inputs, case_dirs, quant_weights, data):
    """A damaged lowbit checkpoint through `inspect` and `convert --to hf`."""
    damaged, what = data.draw(safetensors_header_mutation(quant_weights) | data_flips(quant_weights)
                              | st.integers(0, len(quant_weights) - 1).map(lambda c: (Blob(quant_weights[:c]), f"truncated at {c}")))
    model, out = _copy_model(case_dirs, fuzz_inputs.quant)
    (model / "model.safetensors").write_bytes(damaged)
    code, _, err = run_lowbit(["inspect", model, "--json"])
    check_outcome(code, err, None, may_succeed=True, what=f"inspect, {what}")
    if not what.startswith("data flips"):  # flipped scales may be finite and 1e4: no perplexity to compare
        eval_outcome(model, fuzz_inputs.text, f"eval, {what}")
    code, _, err = run_lowbit(["convert", model, "--to", "hf", "-o", out])
    if check_outcome(code, err, out, may_succeed=True, what=f"convert, {what}"):
        assert_finite_dir(out, what)


# ---------------------------------------------------------------------------------------------
# config.json

_CONFIG_KEYS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "num_hidden_layers",
                "vocab_size", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta",
                "rope_scaling", "tie_word_embeddings", "model_type", "architectures", "bos_token_id", "eos_token_id",
                "hidden_act", "sliding_window", "layer_types", "attention_bias"]
_CONFIG_VALUES = st.sampled_from(["<missing>", "32", "abc", "", -1, -32, 0, 1, 3, 7, 17, 31, 33, 1.5, 32.0, 2**31, 2**40, 10**12,
                                  float("nan"), float("inf"), None, True, False, [], [32], {}, {"rope_type": "xyz"},
                                  {"rope_type": "linear"}, {"rope_type": "llama3", "factor": "x"}, ["full_attention"],
                                  ["LlamaForCausalLM", 3], ["NoSuchForCausalLM"], "llama", "gemma3"])


@st.composite
def config_mutation(draw, config: dict):
    config = json.loads(json.dumps(config))
    changes = draw(st.lists(st.tuples(st.sampled_from(_CONFIG_KEYS), _CONFIG_VALUES), min_size=1, max_size=3))
    for key, value in changes:
        if value == "<missing>":
            config.pop(key, None)
        else:
            config[key] = value
    return config, f"config {changes}"


@fuzz_settings(100)
@given(data=st.data())
def test_config_damage(fuzz_inputs, case_dirs, data):
    config = json.loads((fuzz_inputs.hf / "config.json").read_text())
    damaged, what = data.draw(config_mutation(config))
    model, out = _copy_model(case_dirs, fuzz_inputs.hf)
    # json.dumps writes NaN / Infinity, which Python's reader accepts and a strict one would not
    (model / "config.json").write_text(json.dumps(damaged))
    eval_outcome(model, fuzz_inputs.text, what)
    if data.draw(st.booleans()):  # the layer-by-layer model of calibrate / GPTQ reads the config too
        code, _, err = run_lowbit(["quantize", model, *QUANT, "--method", "gptq", "--calib", fuzz_inputs.stats, "-o", out])
        if check_outcome(code, err, out, may_succeed=True, what=f"gptq, {what}"):
            assert_finite_dir(out, what)


@fuzz_settings(20)
@given(data=st.data())
def test_config_truncated(fuzz_inputs, case_dirs, data):
    text = (fuzz_inputs.hf / "config.json").read_text()
    cut = data.draw(st.integers(0, len(text.rstrip()) - 1))
    model, out = _copy_model(case_dirs, fuzz_inputs.hf)
    (model / "config.json").write_text(text[:cut])
    code, _, err = run_lowbit(["eval", model, "--data", fuzz_inputs.text, *EVAL])
    check_outcome(code, err, None, what=f"eval, config cut at {cut}")
    code, _, err = run_lowbit(["quantize", model, *QUANT, "-o", out])
    check_outcome(code, err, out, what=f"quantize, config cut at {cut}")


def test_config_heads_not_dividing_hidden(fuzz_inputs, case_dirs):
    model, _ = _copy_model(case_dirs, fuzz_inputs.hf)
    config = json.loads((model / "config.json").read_text())
    config.pop("head_dim")
    config["num_attention_heads"] = 3
    (model / "config.json").write_text(json.dumps(config))
    code, _, err = run_lowbit(["eval", model, "--data", fuzz_inputs.text, *EVAL])
    check_outcome(code, err, None, needle="num_attention_heads", what="heads 3, hidden 32")


# ---------------------------------------------------------------------------------------------
# tokenizer.json / tokenizer_config.json

_TOKENIZER_JUNK = st.sampled_from([None, 0, -1, "x", "", [], [1], {}, {"type": "XYZ"}, {"type": "BPE"}, [["a", "b"]], True])


@st.composite
def tokenizer_mutation(draw, tokenizer_text: str, config_text: str):
    """(tokenizer.json text, tokenizer_config.json text, description)."""
    kind = draw(st.sampled_from(["truncate", "structure", "structure", "model", "vocab", "added", "config", "bytes"]))
    if kind == "truncate":
        cut = draw(st.integers(0, len(tokenizer_text) - 1))
        return tokenizer_text[:cut], config_text, f"tokenizer.json cut at {cut}"
    if kind == "bytes":
        raw = list(tokenizer_text)
        for pos, ch in draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.sampled_from('{}[]",:0a\\ ')), min_size=1, max_size=4)):
            raw[pos] = ch
        return "".join(raw), config_text, "tokenizer.json characters replaced"
    tok = json.loads(tokenizer_text)
    if kind == "structure":
        key = draw(st.sampled_from(sorted(tok)))
        tok[key] = draw(_TOKENIZER_JUNK)
        what = f"tokenizer.json {key} = {tok[key]!r}"
    elif kind == "model":
        key = draw(st.sampled_from(sorted(tok["model"])))
        tok["model"][key] = draw(_TOKENIZER_JUNK | st.integers(-5, 300))
        what = f"tokenizer.json model.{key} = {tok['model'][key]!r}"
    elif kind == "vocab":
        # ids past the model's 258 embeddings (or clashing ones) for characters the text holds
        char = draw(st.sampled_from(["e", "o", "Ġ", "T", "<s>"]))
        tok["model"]["vocab"][char] = draw(st.sampled_from([258, 1000, 2**31, -1, 0, 256]) | st.integers(0, 400))
        what = f"tokenizer.json model.vocab[{char!r}] = {tok['model']['vocab'][char]}"
    elif kind == "added":
        entry = draw(st.sampled_from(["id", "content", "special"]))
        tok["added_tokens"][0][entry] = draw(_TOKENIZER_JUNK | st.integers(-5, 300))
        what = f"tokenizer.json added_tokens[0].{entry} = {tok['added_tokens'][0][entry]!r}"
    else:
        config = json.loads(config_text)
        key = draw(st.sampled_from(["bos_token", "eos_token", "add_bos_token", "chat_template"]))
        config[key] = draw(_TOKENIZER_JUNK | st.sampled_from(["<s>", "</s>", "nope", "{% if %}"]))
        return tokenizer_text, json.dumps(config), f"tokenizer_config.json {key} = {config[key]!r}"
    return json.dumps(tok), config_text, what


@fuzz_settings(80)
@given(data=st.data())
def test_tokenizer_damage(fuzz_inputs, case_dirs, data):
    tokenizer_text = (fuzz_inputs.hf / "tokenizer.json").read_text()
    config_text = (fuzz_inputs.hf / "tokenizer_config.json").read_text()
    tok, config, what = data.draw(tokenizer_mutation(tokenizer_text, config_text))
    model, out = _copy_model(case_dirs, fuzz_inputs.hf)
    (model / "tokenizer.json").write_text(tok)
    (model / "tokenizer_config.json").write_text(config)
    if data.draw(st.booleans()):
        eval_outcome(model, fuzz_inputs.text, what)
    else:  # calibrate tokenizes through compress/token_cache.py and writes an output
        code, _, err = run_lowbit(["calibrate", model, "--data", fuzz_inputs.text, "--samples", "2", "--seqlen", "16",
                                   "-o", out])
        if check_outcome(code, err, out, may_succeed=True, what=f"calibrate, {what}"):
            out.unlink()


# ---------------------------------------------------------------------------------------------
# STATS files


def _gptq(fuzz_inputs, stats: Path, out: Path):
    return run_lowbit(["quantize", fuzz_inputs.hf, *QUANT, "--method", "gptq", "--calib", stats, "-o", out])


def test_stats_of_another_model(fuzz_inputs, case_dirs):
    out = case_dirs() / "q"
    code, _, err = _gptq(fuzz_inputs, fuzz_inputs.stats_other, out)
    check_outcome(code, err, out, needle="calibrated on", what="STATS of hf-other for hf")


def test_stats_not_a_stats_file(fuzz_inputs, case_dirs):
    """Another safetensors file (model weights) passed as STATS."""
    out = case_dirs() / "q"
    code, _, err = _gptq(fuzz_inputs, fuzz_inputs.hf / "model.safetensors", out)
    check_outcome(code, err, out, needle="STATS", what="weights as STATS")


@st.composite
def stats_mutation(draw, data: bytes):
    """The STATS header JSON (identity, sites, tokens) or its tensors damaged."""
    header, start = st_split(data)
    body = data[start:]
    meta = json.loads(header["__metadata__"]["lowbit_stats"])
    kind = draw(st.sampled_from(["meta_key", "meta_site", "tokens", "meta_text", "tensor", "nan", "binary"]))
    if kind == "binary":
        return draw(safetensors_header_mutation(data) | data_flips(data) |
                    st.integers(0, len(data) - 1).map(lambda c: (Blob(data[:c]), f"truncated at {c}")))
    if kind == "meta_key":
        key = draw(st.sampled_from(sorted(meta)))
        meta[key] = draw(_JUNK)
        what = f"header {key} = {meta[key]!r}"
    elif kind == "meta_site":
        site = draw(st.sampled_from(sorted(meta["sites"])))
        meta["sites"][site] = draw(_JUNK | st.just(["model.layers.0.nope"]))
        what = f"site {site} = {meta['sites'][site]!r}"
    elif kind == "tokens":
        site = draw(st.sampled_from(sorted(meta["tokens"])))
        meta["tokens"][site] = draw(_JUNK)
        what = f"tokens {site} = {meta['tokens'][site]!r}"
    elif kind == "meta_text":
        text = header["__metadata__"]["lowbit_stats"]
        header["__metadata__"]["lowbit_stats"] = text[: draw(st.integers(0, len(text) - 1))]
        return st_join(header, body), "header JSON cut"
    elif kind == "tensor":
        # swap two tensors' entries: each keeps a valid place in the data, but not its own shape
        names = sorted(k for k in header if k != "__metadata__")
        a, b = draw(st.lists(st.sampled_from(names), min_size=2, max_size=2, unique=True))
        header[a], header[b] = header[b], header[a]
        return st_join(header, body), f"tensors {a} and {b} swapped"
    else:
        names = sorted(k for k in header if k != "__metadata__")
        name = draw(st.sampled_from(names))
        lo, _ = header[name]["data_offsets"]
        out = bytearray(data)
        out[start + lo : start + lo + 4] = struct.pack("<f", draw(st.sampled_from([float("nan"), float("inf"), -float("inf")])))
        return Blob(out), f"non-finite first value of {name}"
    header["__metadata__"]["lowbit_stats"] = json.dumps(meta)
    return st_join(header, body), what


@fuzz_settings(60)
@given(data=st.data())
def test_stats_damage(fuzz_inputs, case_dirs, data):
    damaged, what = data.draw(stats_mutation(fuzz_inputs.stats.read_bytes()))
    case = case_dirs()
    stats = case / "stats.safetensors"
    stats.write_bytes(damaged)
    (case / "out").mkdir()
    out = case / "out" / "q"
    code, _, err = _gptq(fuzz_inputs, stats, out)
    if check_outcome(code, err, out, may_succeed=True, what=what):
        assert_finite_dir(out, what)
        load_ok(out, what)
