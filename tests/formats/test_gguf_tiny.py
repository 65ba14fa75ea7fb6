"""GGUF import on tiny files written here with gguf.GGUFWriter: mapping, q/k un-permutation,
tied embeddings, quantized tensors, Gemma norm offsets, sharding, rope_freqs, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from lowbit.errors import LowbitError
from lowbit.formats import gguf_import
from lowbit.formats.gguf_arch import llama3_rope_divisors, permute_qk, unpermute_qk
from lowbit.formats.gguf_import import convert_gguf

HIDDEN, HEADS, KV_HEADS, FF, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _add_gpt2_vocab(w: gguf.GGUFWriter) -> int:
    tokens = ["<|endoftext|>", *_bytes_to_unicode(), "Ġt", "he", "Ġthe"]
    types = [3] + [1] * (len(tokens) - 1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    return len(tokens)


def _add_spm_vocab(w: gguf.GGUFWriter) -> int:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁", "a", "b", "c", "▁a", "ab", "▁ab"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * 7
    scores = [0.0] * 260 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    return len(tokens)


def _llama_permute(x: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py formula, written out independently of lowbit's code
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def write_tiny(path: Path, arch: str = "llama", *, tied: bool = True, rope_freqs: np.ndarray | None = None,
               output_type: T = T.Q4_1) -> dict:
    """Write a tiny model; return the HF-side weights the converter should reproduce."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch in ("gemma3", "qwen3"):
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_sliding_window(8)
        vocab = _add_spm_vocab(w)
    else:
        vocab = _add_gpt2_vocab(w)
    expected: dict[str, np.ndarray] = {}
    stored_as: dict[str, T] = {}

    def add(gguf_name: str, hf_name: str, value: np.ndarray, qtype: T = T.F32, stored: np.ndarray | None = None):
        stored = value if stored is None else stored
        if qtype == T.F32:
            w.add_tensor(gguf_name, stored.astype(np.float32))
        elif qtype == T.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
        else:
            w.add_tensor(gguf_name, quantize(stored.astype(np.float32), qtype), raw_dtype=qtype)
        expected[hf_name] = value.astype(np.float32)
        stored_as[hf_name] = qtype

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    add("token_embd.weight", "model.embed_tokens.weight", normal(vocab, HIDDEN), T.Q8_0)
    norm_shift = 1.0 if arch == "gemma3" else 0.0  # llama.cpp stores Gemma norms as 1 + w
    out_norm = normal(HIDDEN) + (1 - norm_shift)
    add("output_norm.weight", "model.norm.weight", out_norm, stored=out_norm + norm_shift)
    if not tied:
        add("output.weight", "lm_head.weight", normal(vocab, HIDDEN), output_type)
    for i in range(LAYERS):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        q, k = normal(HEADS * HEAD_DIM, HIDDEN), normal(KV_HEADS * HEAD_DIM, HIDDEN)
        if arch == "llama":
            add(p + "attn_q.weight", h + "self_attn.q_proj.weight", q, stored=_llama_permute(q, HEADS))
            add(p + "attn_k.weight", h + "self_attn.k_proj.weight", k, stored=_llama_permute(k, KV_HEADS))
        else:
            add(p + "attn_q.weight", h + "self_attn.q_proj.weight", q, T.Q5_0)
            add(p + "attn_k.weight", h + "self_attn.k_proj.weight", k)
        add(p + "attn_v.weight", h + "self_attn.v_proj.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN), T.F16)
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", normal(HIDDEN, HEADS * HEAD_DIM), T.BF16)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", normal(FF, HIDDEN), T.Q4_0)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", normal(FF, HIDDEN), T.Q5_1)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", normal(HIDDEN, FF), T.Q8_0)
        if arch == "gemma3":
            for g, hf in (
                ("attn_norm", "input_layernorm"),
                ("ffn_norm", "pre_feedforward_layernorm"),
                ("post_attention_norm", "post_attention_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"),
            ):
                value = normal(HIDDEN)
                add(p + f"{g}.weight", h + f"{hf}.weight", value, stored=value + norm_shift)
            for g, hf in (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")):
                value = normal(HEAD_DIM)
                add(p + f"{g}.weight", h + f"{hf}.weight", value, stored=value + norm_shift)
        else:
            if arch == "qwen2":
                for g, hf, rows in (("attn_q", "q_proj", HEADS), ("attn_k", "k_proj", KV_HEADS), ("attn_v", "v_proj", KV_HEADS)):
                    add(p + f"{g}.bias", h + f"self_attn.{hf}.bias", normal(rows * HEAD_DIM))
            if arch == "qwen3":
                add(p + "attn_q_norm.weight", h + "self_attn.q_norm.weight", 1 + normal(HEAD_DIM))
                add(p + "attn_k_norm.weight", h + "self_attn.k_norm.weight", 1 + normal(HEAD_DIM))
            add(p + "attn_norm.weight", h + "input_layernorm.weight", 1 + normal(HIDDEN))
            add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + normal(HIDDEN))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"expected": expected, "stored_as": stored_as}


def _reference(value: np.ndarray, qtype: T) -> np.ndarray:
    """What the stored tensor decodes to: exact for float types, the block decoder's output otherwise."""
    if qtype == T.F32:
        return value
    if qtype == T.F16:
        return value.astype(np.float16).astype(np.float32)
    return dequantize(quantize(value, qtype), qtype)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_llama")
    record = write_tiny(root / "tiny.gguf")
    out = convert_gguf(root / "tiny.gguf", root / "hf", dtype="f32")
    return root, record, out


def test_llama_tensors_are_mapped_unpermuted_and_decoded(tiny_llama):
    _, record, out = tiny_llama
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(record["expected"])
    for name, value in record["expected"].items():
        qtype = record["stored_as"][name]
        got = weights[name].numpy()
        if "q_proj" in name or "k_proj" in name:
            # stored permuted in F32: the round trip must be exact
            np.testing.assert_array_equal(got, value, err_msg=name)
            continue
        np.testing.assert_array_equal(got, _reference(value, qtype), err_msg=name)
        # and the decode is close to the original floats (a layout mix-up would not be)
        bound = {T.F32: 0, T.F16: 1e-3, T.BF16: 4e-3, T.Q8_0: 0.01, T.Q5_1: 0.05, T.Q4_0: 0.12}[qtype]
        assert np.abs(got - value).max() <= bound * np.abs(value).max() + 1e-7, name


def test_llama_config_and_tied_embeddings(tiny_llama):
    _, _, out = tiny_llama
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (HIDDEN, HEADS, KV_HEADS)
    assert (config["intermediate_size"], config["num_hidden_layers"], config["head_dim"]) == (FF, LAYERS, HEAD_DIM)
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["add_bos_token"] is False and tok["eos_token"] == "<|endoftext|>"


def test_converted_tiny_llama_matches_transformers_gguf_loading(tiny_llama):
    transformers = pytest.importorskip("transformers")
    root, _, out = tiny_llama
    kwargs = {"dtype": torch.float32}
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(root), gguf_file="tiny.gguf", **kwargs)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), **kwargs)
    ids = torch.tensor([[5, 17, 200, 256, 258, 3, 99]])
    with torch.no_grad():
        diff = (ref(ids).logits - ours(ids).logits).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_converted_tiny_qwen_matches_transformers_gguf_loading(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    record = write_tiny(tmp_path / "q.gguf", arch=arch, tied=False)
    out = convert_gguf(tmp_path / "q.gguf", tmp_path / "hf", dtype="f32")
    assert set(load_file(str(out / "model.safetensors"))) == set(record["expected"])
    # transformers' GGUF loader ignores qwen3.attention.key_length (it keeps head_dim=128); tell it
    ref_config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file="q.gguf")
    ref_config.head_dim = HEAD_DIM
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="q.gguf", config=ref_config, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(ours).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ids = torch.tensor([[5, 17, 200, 256, 258, 3, 99]])
    with torch.no_grad():
        assert (ref(ids).logits - ours(ids).logits).abs().max().item() < 1e-5


def test_untied_output_becomes_lm_head(tmp_path):
    record = write_tiny(tmp_path / "untied.gguf", tied=False)
    out = convert_gguf(tmp_path / "untied.gguf", tmp_path / "hf", dtype="bf16")
    weights = load_file(str(out / "model.safetensors"))
    assert weights["lm_head.weight"].dtype == torch.bfloat16
    lm_head = _reference(record["expected"]["lm_head.weight"], T.Q4_1)
    torch.testing.assert_close(weights["lm_head.weight"], torch.from_numpy(lm_head).bfloat16(), rtol=0, atol=0)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_tiny_gemma3_norm_offset_layer_types_and_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    record = write_tiny(tmp_path / "g.gguf", arch="gemma3")
    out = convert_gguf(tmp_path / "g.gguf", tmp_path / "hf", dtype="f32")
    weights = load_file(str(out / "model.safetensors"))
    np.testing.assert_allclose(
        weights["model.layers.1.post_feedforward_layernorm.weight"].numpy(),
        record["expected"]["model.layers.1.post_feedforward_layernorm.weight"], atol=1e-6,
    )
    np.testing.assert_allclose(
        weights["model.layers.0.self_attn.k_norm.weight"].numpy(),
        record["expected"]["model.layers.0.self_attn.k_norm.weight"], atol=1e-6,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 8
    assert config["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert config["query_pre_attn_scalar"] == HEAD_DIM and config["rope_local_base_freq"] == 10000.0
    # transformers' GGUF loader leaves query_pre_attn_scalar at its default 256; llama.cpp scales
    # queries by 1/sqrt(head_dim) (which is 256 in every released Gemma-3 but the 27B), as lowbit does.
    ref_config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file="g.gguf")
    ref_config.query_pre_attn_scalar = HEAD_DIM
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="g.gguf", config=ref_config, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([[2, 260, 264, 265, 7, 100]])
    with torch.no_grad():
        assert (ref(ids).logits - ours(ids).logits).abs().max().item() < 1e-5
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["add_bos_token"] is True and tok["bos_token"] == "<bos>"


def test_unpermute_inverts_llama_cpp_permutation():
    x = torch.randn(3 * 2 * 8, 5)
    np.testing.assert_array_equal(unpermute_qk(torch.from_numpy(_llama_permute(x.numpy(), 3)), 3).numpy(), x.numpy())
    np.testing.assert_array_equal(permute_qk(x, 3).numpy(), _llama_permute(x.numpy(), 3))
    assert not torch.equal(permute_qk(x, 3), x)


def test_llama3_rope_freqs_become_rope_scaling_that_transformers_reproduces(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    divisors = llama3_rope_divisors(10000.0, HEAD_DIM, 8.0, 1.0, 4.0, 8192).numpy()
    write_tiny(tmp_path / "l3.gguf", rope_freqs=divisors)
    out = convert_gguf(tmp_path / "l3.gguf", tmp_path / "hf", dtype="f32")
    config = transformers.AutoConfig.from_pretrained(str(out))
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    # transformers' own llama3 frequencies, divided into the plain ones, give llama.cpp's rope_freqs back
    np.testing.assert_allclose((base / scaled.double()).numpy(), divisors, rtol=1e-5)
    assert divisors.min() == 1.0 and divisors.max() == 8.0


def test_sharding_writes_an_index_covering_every_tensor(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setattr(gguf_import, "SHARD_BYTES", 200_000)
    root, record, whole = tiny_llama
    out = convert_gguf(root / "tiny.gguf", tmp_path / "sharded", dtype="f32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    merged = {}
    for f in files:
        merged.update(load_file(str(out / f)))
    reference = load_file(str(whole / "model.safetensors"))
    assert set(merged) == set(reference) == set(index["weight_map"])
    assert all(torch.equal(merged[k], reference[k]) for k in reference)
    assert not list(out.glob("*.partial"))


# ---- bad input ----------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(LowbitError, match="not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_text_file_named_gguf(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not a model\n")
    with pytest.raises(LowbitError, match="not a GGUF file"):
        convert_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.99, 0.5, 0.001])
def test_truncated_file(tmp_path, keep):
    write_tiny(tmp_path / "t.gguf")
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(LowbitError, match="truncated") as err:
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "tq.gguf"), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(1)
    _add_gpt2_vocab(w)
    w.add_tensor("token_embd.weight", np.zeros((260, 256), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", quantize(np.ones((256, 256), np.float32), T.TQ1_0), raw_dtype=T.TQ1_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LowbitError, match=r"blk\.0\.ffn_up\.weight.*TQ1_0"):
        convert_gguf(tmp_path / "tq.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "tq.gguf"]


def test_unknown_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LowbitError, match="architecture 'mamba'"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")


# ---- CLI ----------------------------------------------------------------------------------------


def _run_cli(args, capsys):
    from lowbit.cli.main import main

    try:
        main(args)
        code = 0  # success returns normally
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_converts_and_reports_json(tiny_llama, tmp_path, capsys):
    root, _, _ = tiny_llama
    out = tmp_path / "cli-out"
    code, stdout, _ = _run_cli(["convert", str(root / "tiny.gguf"), "-o", str(out), "--dtype", "f16", "--json"], capsys)
    assert code == 0
    report = json.loads(stdout)
    assert report["dtype"] == "float16" and "model.safetensors" in report["files"]
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == torch.float16
    # a second run refuses to replace the output without --overwrite (a usage error)
    code, _, err = _run_cli(["convert", str(root / "tiny.gguf"), "-o", str(out)], capsys)
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "make, code, message",
    [
        (lambda p: None, 1, "not found"),
        (lambda p: p.write_text("hello"), 1, "not a GGUF file"),
        (lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5), 1, "truncated"),
    ],
)
def test_cli_bad_input_one_line_error_and_no_output(tmp_path, capsys, make, code, message):
    src = tmp_path / "in.gguf"
    make(src)
    out = tmp_path / "out"
    got, _, err = _run_cli(["convert", str(src), "-o", str(out)], capsys)
    assert got == code and message in err
    assert err.startswith("lowbit: error:") and err.count("\n") == 1
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_cli_rejects_bad_dtype_and_non_gguf_input(tmp_path, capsys, tiny_llama):
    root, _, _ = tiny_llama
    code, _, err = _run_cli(["convert", str(root / "tiny.gguf"), "-o", str(tmp_path / "o"), "--dtype", "int3"], capsys)
    assert code == 2 and "dtype" in err
    code, _, err = _run_cli(["convert", str(tmp_path), "-o", str(tmp_path / "o")], capsys)
    assert code == 2 and "GGUF" in err


def _write_one_projection(path: Path, ffn_up: np.ndarray, qtype: T) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(1)
    _add_gpt2_vocab(w)
    w.add_tensor("token_embd.weight", np.zeros((260, 256), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", ffn_up, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_nan_weights_are_refused_naming_the_tensor(tmp_path):
    weights = np.ones((256, 256), np.float32)
    weights[3, 5] = np.nan
    _write_one_projection(tmp_path / "nan.gguf", weights, T.F32)
    with pytest.raises(LowbitError, match=r"tensor blk\.0\.ffn_up\.weight in nan\.gguf holds 1 NaN/inf values"):
        convert_gguf(tmp_path / "nan.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inf_block_scale_in_a_quantized_projection_is_refused(tmp_path):
    from lowbit.formats.foreign import read_checkpoint

    packed = quantize(np.ones((256, 256), np.float32), T.Q8_0)
    raw = packed.view(np.uint8).reshape(-1)
    raw[0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # the first block's f16 scale
    _write_one_projection(tmp_path / "inf.gguf", packed, T.Q8_0)
    with pytest.raises(LowbitError, match=r"blk\.0\.ffn_up\.weight \(scales\) in inf\.gguf holds 1 NaN/inf"):
        read_checkpoint(tmp_path / "inf.gguf", "gguf")
