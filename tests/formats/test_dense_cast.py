"""What `--to hf` says about its dtype's rounding, and a GGUF's bf16 tensors kept in bf16 (a GGUF
re-exported is the same file; it runs with the same default KV cache as its source directory)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert
from lowbit.formats.dense_cast import RoundingTally, cast_dense
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.native import save_native
from lowbit.quant.rtn import quantize_rtn
from tests.formats.conftest import TINY_CONFIG, tiny_weights


def test_cast_counts_only_what_it_rounds_with_its_relative_error():
    tally = RoundingTally(torch.bfloat16)
    exact = torch.tensor([1.0, -0.5, 3.0, 0.0])
    assert torch.equal(cast_dense("a", exact, torch.bfloat16, tally).float(), exact)
    assert tally.tensors == 0 and tally.max_rel_error == 0.0
    rounded = torch.tensor([1.0 + 2**-12, 3.0, -7.0 - 2**-10], dtype=torch.float64)
    cast_dense("b", rounded, torch.bfloat16, tally)
    want = float((rounded.to(torch.bfloat16).double() - rounded).norm() / rounded.norm())
    assert tally.tensors == 1 and tally.max_rel_error == pytest.approx(want, rel=1e-12) and want > 0
    codes = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert cast_dense("c", codes, torch.bfloat16, tally) is codes and tally.tensors == 1


def test_cast_refuses_a_finite_value_its_dtype_overflows():
    with pytest.raises(LowbitError, match=r"^w: a value of magnitude 7e\+04 overflows float16"):
        cast_dense("w", torch.tensor([1.0, -7e4]), torch.float16)
    # inf already in the source is not the cast's doing (the readers' finite checks own that)
    assert torch.isinf(cast_dense("w", torch.tensor([float("inf")]), torch.float16)).all()


def test_hf_target_in_bf16_is_not_called_exact_and_f32_is(make_native, tmp_path):
    src, qtensors = make_native("int4-g32")
    bf16 = convert(src, tmp_path / "bf16", "hf", dtype="bf16")
    # every int4 weight ((q - 8) x fp16 scale needs up to 15 significant bits) rounds; so do the
    # fixture's float32 embedding and norms
    assert not bf16.exact and bf16.rounded.tensors == len(qtensors) + 6
    worst = max(float((qt.dequantize().double() - qt.dequantize().to(torch.bfloat16).double()).norm()
                      / qt.dequantize().double().norm()) for qt in qtensors.values())
    assert bf16.rounded.max_rel_error >= worst > 0
    assert bf16.to_dict()["rounded"]["dtype"] == "bfloat16" and bf16.to_dict()["exact"] is False
    f32 = convert(src, tmp_path / "f32", "hf", dtype="f32")
    assert f32.exact and f32.rounded.tensors == 0
    weights = load_file(str(tmp_path / "f32" / "model.safetensors"))
    for module, qt in qtensors.items():
        assert torch.equal(weights[f"{module}.weight"], qt.dequantize()), module


def test_cli_summary_names_the_rounding(make_native, tmp_path, capsys):
    from lowbit.cli.main import main

    src, _ = make_native("int4-g32")
    main(["convert", str(src), "-o", str(tmp_path / "out"), "--to", "hf"])  # returns on success
    err = capsys.readouterr().err
    assert "(hf, 20 tensor(s) rounded to bfloat16, relative error up to " in err
    assert "--dtype f32 keeps them exact" in err and "(hf, exact" not in err
    main(["convert", str(src), "-o", str(tmp_path / "out32"), "--to", "hf", "--dtype", "f32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["exact"] is True and report["rounded"]["tensors"] == 0


def test_gguf_reexport_is_the_same_file_and_keeps_bf16(add_tiny_tokenizer, tmp_path):
    weights, dense = tiny_weights()
    dense["model.embed_tokens.weight"] = dense["model.embed_tokens.weight"].to(torch.bfloat16)
    src = tmp_path / "native"
    save_native(src, {m: quantize_rtn(t, "int4-g32") for m, t in weights.items()}, dense, config=TINY_CONFIG)
    add_tiny_tokenizer(src)
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert convert(src, first, "gguf").exact
    ckpt = read_checkpoint(first)
    assert ckpt.dense["model.embed_tokens.weight"].dtype == torch.bfloat16  # BF16 in the file
    assert ckpt.dense["model.norm.weight"].dtype == torch.float32  # F32 in the file
    assert convert(first, second, "gguf").exact
    assert second.read_bytes() == first.read_bytes()
    native = convert(first, tmp_path / "n", "native")
    assert native.exact
    assert read_checkpoint(tmp_path / "n").dense["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_gguf_says_the_dtype_its_float_tensors_were_saved_in(add_tiny_tokenizer, tmp_path):
    from lowbit.runtime.config import ModelConfig
    from lowbit.runtime.engine.paged_cache import resolve_kv_dtype

    weights, dense = tiny_weights()
    qtensors = {m: quantize_rtn(t, "int4-g32") for m, t in weights.items()}
    bf16 = {**dense, "model.embed_tokens.weight": dense["model.embed_tokens.weight"].to(torch.bfloat16)}
    for name, tensors, config, want in (("bf16", bf16, {**TINY_CONFIG, "torch_dtype": "bfloat16"}, "bfloat16"),
                                        ("f32", dense, TINY_CONFIG, None)):
        src = tmp_path / name
        save_native(src, qtensors, tensors, config=config)
        add_tiny_tokenizer(src)
        convert(src, tmp_path / f"{name}.gguf", "gguf")
        got = read_checkpoint(tmp_path / f"{name}.gguf").config.get("torch_dtype")
        assert got == want, name
        # --kv-dtype auto: the GGUF's cache is the one its source directory gets
        kv = [resolve_kv_dtype(None, torch.float32, torch.device("cpu"), ModelConfig.from_dict(c))
              for c in (read_checkpoint(src).config, read_checkpoint(tmp_path / f"{name}.gguf").config)]
        assert kv[0] == kv[1] == ("bf16" if want else None), name
