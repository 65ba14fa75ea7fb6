"""Tiny inputs for the file fuzzers (built once per session) and the one contract every case ends in.

The builders and the layout parsers are plain functions so that bench/fuzz_long.py can use them
without pytest: `build_inputs(root)` writes every input, `run_lowbit(args)` runs the CLI in process,
`check_outcome(...)` states the contract.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import _byte_tokenizer
from tests.formats.test_gguf_tiny import _bytes_to_unicode

# ---------------------------------------------------------------------------------------------
# running the CLI


class Hang(BaseException):
    """Raised by the alarm: a BaseException so that the CLI's `except Exception` cannot hide it."""


def _on_alarm(signum, frame):
    raise Hang()


# Warnings a user would see on stderr (the interpreter hides the deprecation kinds by default).
_HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning, FutureWarning)


def run_lowbit(args: list[str], timeout_s: int = 60) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `lowbit ARGS`, in process. Shown warnings count as stderr lines,
    as they would in a real process; running past `timeout_s` is reported as a hang (code None)."""
    from lowbit.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    code: int | None
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Hang:
                code = None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        # a SIGTERM handler installed by main() must not outlive the call
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    shown = [w for w in caught if not issubclass(w.category, _HIDDEN_WARNINGS)]
    stderr = err.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in shown)
    return code, out.getvalue(), stderr


def leftovers(out_path: Path) -> list[str]:
    """What a failed command left at or beside its output path (the whole parent folder is the
    case's own, so anything there is a leftover: partial output, atomic temp siblings, work dirs)."""
    parent = out_path.parent
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


def check_outcome(code, err: str, out_path: Path | None, *, may_succeed: bool = False, needle: str | None = None,
                  what: str = "") -> bool:
    """The contract. Failure: exit code 1 or 2, exactly one stderr line `lowbit: error: ...` (last,
    after at most the CLI's `lowbit: ` status lines) that is not the CLI's unexpected-exception line,
    nothing left at or beside the output. Success only when
    `may_succeed`. Returns whether the command succeeded (the caller then checks its output).
    `needle`: a substring the error line must contain (the problem it must name)."""
    assert code is not None, f"{what}: hang (no exit within the time limit)"
    assert "Traceback" not in err, f"{what}: traceback on stderr:\n{err}"
    if code == 0:
        assert may_succeed, f"{what}: succeeded on damaged input; stderr: {err!r}"
        return True
    lines = [line for line in err.splitlines() if line.strip()]
    # In a log the CLI says what starts and how far it got (`lowbit: loading model and text`,
    # `lowbit: quantizing 3/9 ...`); those lines may come before the error, nothing else may.
    errors = [line for line in lines if line.startswith("lowbit: error: ")]
    other = [line for line in lines if not line.startswith("lowbit: ")]
    assert len(errors) == 1 and not other and lines[-1] == errors[0], \
        f"{what}: exit {code} without exactly one final `lowbit: error:` line:\n{err}"
    line = errors[0]
    assert "--debug for the traceback" not in line, f"{what}: unexpected exception (a bug): {line}"
    assert code in (1, 2), f"{what}: exit code {code}: {line}"
    if needle is not None:
        assert needle.lower() in line.lower(), f"{what}: error does not name {needle!r}: {line}"
    if out_path is not None:
        left = leftovers(out_path)
        assert not left, f"{what}: failure left {left} beside {out_path.name}: {line}"
    return False


def assert_finite_dir(directory: Path, what: str = "") -> None:
    """Every floating tensor of a written checkpoint is finite (a success must not carry NaN/inf)."""
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.is_floating_point():
                    assert torch.isfinite(t.float()).all(), f"{what}: {file.name} holds NaN/inf in {name}"


# ---------------------------------------------------------------------------------------------
# GGUF layout: where each header field lies, so mutations can aim at one


@dataclass(frozen=True, slots=True)
class Field:
    kind: str  # magic, version, n_tensors, n_kv, key_len, value_type, str_len, array_type, array_len,
    #            value, tensor_name_len, n_dims, dim, ggml_type, tensor_offset
    offset: int
    size: int  # bytes; integers are little-endian unsigned of this width (value: its own type)
    label: str  # the key or tensor it belongs to


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes) -> tuple[list[Field], int]:
    """The header fields of a well-formed GGUF v3 file and the offset where the tensor infos end."""
    fields = [Field("magic", 0, 4, ""), Field("version", 4, 4, ""), Field("n_tensors", 8, 8, ""), Field("n_kv", 16, 8, "")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(kind: str, label: str) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, pos)
        fields.append(Field(kind, pos, 8, label))
        return data[pos + 8 : pos + 8 + length].decode("utf-8", "replace"), pos + 8 + length

    def value(vtype: int, label: str, at: int) -> int:
        nonlocal pos
        pos = at
        if vtype == 8:
            _, pos = string("str_len", label)
        elif vtype == 9:
            (etype,) = struct.unpack_from("<I", data, pos)
            (count,) = struct.unpack_from("<Q", data, pos + 4)
            fields.append(Field("array_type", pos, 4, label))
            fields.append(Field("array_len", pos + 4, 8, label))
            pos += 12
            for _ in range(count):
                value(etype, label, pos)
        else:
            fields.append(Field("value", pos, _SCALAR[vtype], label))
            pos += _SCALAR[vtype]
        return pos

    for _ in range(n_kv):
        key, pos = string("key_len", "")
        (vtype,) = struct.unpack_from("<I", data, pos)
        fields.append(Field("value_type", pos, 4, key))
        value(vtype, key, pos + 4)
    for _ in range(n_tensors):
        name, pos = string("tensor_name_len", "")
        (n_dims,) = struct.unpack_from("<I", data, pos)
        fields.append(Field("n_dims", pos, 4, name))
        pos += 4
        for _ in range(n_dims):
            fields.append(Field("dim", pos, 8, name))
            pos += 8
        fields.append(Field("ggml_type", pos, 4, name))
        fields.append(Field("tensor_offset", pos + 4, 8, name))
        pos += 12
    return fields, pos


def put_uint(data: bytearray, field: Field, value: int) -> None:
    data[field.offset : field.offset + field.size] = (value % (1 << (8 * field.size))).to_bytes(field.size, "little")


def get_uint(data: bytes, field: Field) -> int:
    return int.from_bytes(data[field.offset : field.offset + field.size], "little")


# ---------------------------------------------------------------------------------------------
# safetensors layout


class Blob(bytes):
    """File bytes whose repr stays short in Hypothesis's falsifying-example report."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


def st_split(data: bytes) -> tuple[dict, int]:
    """(header dict, offset of the data region) of a well-formed safetensors file."""
    (n,) = struct.unpack_from("<Q", data, 0)
    return json.loads(data[8 : 8 + n]), 8 + n


def st_join(header: dict | str | bytes, body: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    return Blob(struct.pack("<Q", len(raw) if length is None else length % (1 << 64)) + raw + body)


# ---------------------------------------------------------------------------------------------
# builders

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, LAYERS = 32, 2, 1, 16, 64, 1
CALIB_TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).strip()


def write_tiny_gguf(path: Path) -> None:
    """A one-layer llama GGUF with a byte-level BPE vocabulary and a mix of tensor types."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    tokens = ["<|endoftext|>", *_bytes_to_unicode(), "Ġt", "he", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def add(name, value, qtype=T.F32):
        if qtype == T.F32:
            w.add_tensor(name, value)
        elif qtype == T.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)

    add("token_embd.weight", normal(len(tokens), HIDDEN), T.Q8_0)
    add("output_norm.weight", 1 + normal(HIDDEN))
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + normal(HIDDEN))
        add(p + "ffn_norm.weight", 1 + normal(HIDDEN))
        add(p + "attn_q.weight", normal(HEADS * HEAD_DIM, HIDDEN))
        add(p + "attn_k.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN), T.F16)
        add(p + "attn_v.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN), T.Q4_0)
        add(p + "attn_output.weight", normal(HIDDEN, HEADS * HEAD_DIM), T.BF16)
        add(p + "ffn_gate.weight", normal(FF, HIDDEN), T.Q4_0)
        add(p + "ffn_up.weight", normal(FF, HIDDEN), T.Q5_1)
        add(p + "ffn_down.weight", normal(HIDDEN, FF), T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_hf(directory: Path, hidden: int = HIDDEN, seed: int = 1) -> None:
    """A tiny random Llama saved by transformers (bf16, byte tokenizer, vocab 258)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=hidden // HEADS, vocab_size=258,
                         max_position_embeddings=128, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    model.to(torch.bfloat16).save_pretrained(directory)
    _byte_tokenizer(directory)


@dataclass(frozen=True, slots=True)
class Inputs:
    root: Path
    gguf: Path  # tiny llama GGUF
    hf: Path  # tiny HF checkpoint (llama, hidden 32)
    hf_other: Path  # another tiny HF checkpoint (hidden 64): what the foreign STATS file was made on
    quant: Path  # `lowbit quantize hf --format int4 -g 32`
    stats: Path  # `lowbit calibrate hf` (the right model)
    stats_other: Path  # `lowbit calibrate hf_other` (the wrong model for `hf`)
    text: Path  # calibration / eval text


def build_inputs(root: Path) -> Inputs:
    """Write every input under `root` (about two seconds; transformers' import is most of it)."""
    root.mkdir(parents=True, exist_ok=True)
    inputs = Inputs(root=root, gguf=root / "tiny.gguf", hf=root / "hf", hf_other=root / "hf-other",
                    quant=root / "quant", stats=root / "stats.safetensors", stats_other=root / "stats-other.safetensors",
                    text=root / "text.txt")
    inputs.text.write_text(CALIB_TEXT)
    write_tiny_gguf(inputs.gguf)
    write_tiny_hf(inputs.hf)
    write_tiny_hf(inputs.hf_other, hidden=64, seed=2)
    for args in (
        ["quantize", inputs.hf, "--format", "int4", "-g", "32", "-o", inputs.quant],
        ["calibrate", inputs.hf, "--data", inputs.text, "--samples", "2", "--seqlen", "16", "-o", inputs.stats],
        ["calibrate", inputs.hf_other, "--data", inputs.text, "--samples", "2", "--seqlen", "16", "-o", inputs.stats_other],
    ):
        code, _, err = run_lowbit(args, timeout_s=300)
        if code != 0:
            raise RuntimeError(f"building the fuzz inputs failed: lowbit {' '.join(map(str, args))}: {err}")
    return inputs


@pytest.fixture(scope="session")
def fuzz_inputs(tmp_path_factory) -> Inputs:
    return build_inputs(tmp_path_factory.mktemp("fuzz-inputs"))


@pytest.fixture(scope="session")
def case_dirs(tmp_path_factory):
    """case_dirs() -> a fresh empty folder per hypothesis example (a function-scoped tmp_path would
    be shared by every example of a test)."""
    base = tmp_path_factory.mktemp("fuzz-cases")
    counter = iter(range(10**9))

    def make() -> Path:
        path = base / f"case-{next(counter):05d}"
        path.mkdir()
        return path

    return make
