"""lowbit → X → lowbit is bit-exact for every exact pair; other pairs refuse or report the requantization."""

import json

import pytest
import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.formats.convert import convert
from lowbit.formats.foreign import detect_checkpoint_kind, load_foreign, read_checkpoint
from lowbit.quant.qtensor import QTensor

EXACT_PAIRS = [
    ("int4-g32", "compressed-tensors"), ("int4-asym-g64", "compressed-tensors"), ("int4-channel", "compressed-tensors"),
    ("int8-channel", "compressed-tensors"), ("int2-asym-g32", "compressed-tensors"), ("int3-g32", "compressed-tensors"),
    ("fp8", "compressed-tensors"), ("fp8-block32", "compressed-tensors"), ("fp8-tensor", "compressed-tensors"),
    ("nvfp4", "compressed-tensors"), ("mxfp4", "compressed-tensors"),
    ("int4-g32", "gptq"), ("int4-asym-g64", "gptq"), ("int8-g32", "gptq"), ("int4-channel", "gptq"),
    ("int4-g32", "awq"), ("int4-asym-g64", "awq"), ("int4-g32-sbf16", "gptq"),
    ("int4-g32", "gguf"), ("int8-g32", "gguf"), ("mxfp4", "gguf"),
    ("nf4-dq", "native"), ("int4-asym-g32", "native"), ("int4-asym-g32-dq", "native"),
]


def _no_zero_points_at_zero(qtensors):
    # GPTQ v1 cannot store a zero point of 0: keep those random draws out of the exact test
    return all(qt.zeros is None or bool((qt.zeros > 0).all()) for qt in qtensors.values())


@pytest.mark.parametrize("label, target", EXACT_PAIRS)
def test_round_trip_is_bit_exact(make_native, tmp_path, label, target):
    src, qtensors = make_native(label)
    if target == "gptq":
        assert _no_zero_points_at_zero(qtensors)
    out = tmp_path / ("out.gguf" if target == "gguf" else "out")
    result = convert(src, out, target)
    assert result.exact and result.changes == []
    assert detect_checkpoint_kind(out) == target
    back = read_checkpoint(out)
    assert set(back.qtensors) == set(qtensors) and not back.unexpressed
    for module, qt in qtensors.items():
        got = back.qtensors[module]
        assert got.shape == qt.shape
        assert torch.equal(got.dequantize(), qt.dequantize()), module
    # and back again into lowbit's own format, through the public loader
    again = tmp_path / "again"
    assert convert(out, again, "native").exact
    config, tensors = load_foreign(again)
    assert config["model_type"] == "llama" and "quantization_config" not in config
    for module, qt in qtensors.items():
        assert isinstance(tensors[f"{module}.weight"], QTensor)
        assert torch.equal(tensors[f"{module}.weight"].dequantize(), qt.dequantize())
    assert torch.equal(tensors["model.norm.weight"], read_checkpoint(src).dense["model.norm.weight"])


def test_layouts_written_as_each_format_defines(make_native, tmp_path):
    src, qtensors = make_native("int4-asym-g32")
    qt = qtensors["model.layers.0.mlp.down_proj"]  # 64 x 256
    codes = qt.qweight.to(torch.int64)
    codes = torch.stack((codes & 0xF, codes >> 4), -1).reshape(64, 256)
    convert(src, tmp_path / "gptq", "gptq")
    convert(src, tmp_path / "awq", "awq")
    convert(src, tmp_path / "ct", "compressed-tensors")
    from safetensors.torch import load_file

    gp = load_file(tmp_path / "gptq" / "model.safetensors")
    qw = gp["model.layers.0.mlp.down_proj.qweight"].to(torch.int64) & 0xFFFFFFFF
    assert qw.shape == (256 // 8, 64) and qw.dtype == torch.int64
    # row k of the weight's column n sits in word k // 8 at bits 4 * (k % 8)
    assert int((qw[1, 5] >> 12) & 0xF) == int(codes[5, 8 + 3])
    qz = gp["model.layers.0.mlp.down_proj.qzeros"].to(torch.int64) & 0xFFFFFFFF
    assert int((qz[2, 0] >> 8) & 0xF) == int(qt.zeros[2, 2]) - 1  # v1: zero − 1, packed along outputs
    assert torch.equal(gp["model.layers.0.mlp.down_proj.g_idx"], torch.arange(256, dtype=torch.int32) // 32)
    cfg = json.loads((tmp_path / "gptq" / "quantize_config.json").read_text())
    assert cfg["bits"] == 4 and cfg["group_size"] == 32 and cfg["sym"] is False and cfg["desc_act"] is False

    aw = load_file(tmp_path / "awq" / "model.safetensors")
    qw = aw["model.layers.0.mlp.down_proj.qweight"].to(torch.int64) & 0xFFFFFFFF
    assert qw.shape == (256, 64 // 8)
    # AWQ's word slot 1 holds output column 2 of its eight, slot 4 holds column 1
    assert int((qw[7, 0] >> 4) & 0xF) == int(codes[2, 7])
    assert int((qw[7, 0] >> 16) & 0xF) == int(codes[1, 7])
    assert json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]["version"] == "gemm"

    ct = load_file(tmp_path / "ct" / "model.safetensors")
    packed = ct["model.layers.0.mlp.down_proj.weight_packed"].to(torch.int64) & 0xFFFFFFFF
    assert packed.shape == (64, 256 // 8)
    assert int((packed[3, 1] >> 20) & 0xF) == int(codes[3, 8 + 5])  # the even element in the low nibble
    zp = ct["model.layers.0.mlp.down_proj.weight_zero_point"].to(torch.int64) & 0xFFFFFFFF
    assert zp.shape == (64 // 8, 256 // 32)  # packed along the output dimension
    assert int((zp[1, 4] >> 8) & 0xF) == int(qt.zeros[8 + 2, 4])
    assert ct["model.layers.0.mlp.down_proj.weight_shape"].tolist() == [64, 256]


@pytest.mark.parametrize(
    "label, target, fragment",
    [
        ("nf4", "gptq", "not nf4"),
        ("nf4", "compressed-tensors", "no nf4 format"),
        ("int4-g32-sfp32", "gptq", "float16"),
        ("int4-g32-sfp32", "awq", "float16"),
        ("int4-g128", "compressed-tensors", "not a multiple of group size 128"),
        ("int4-asym-g32", "gguf", "not Q4_K"),
        ("fp8-e5m2", "compressed-tensors", "e4m3"),
        ("nvfp4", "gguf", "not Q4_K"),
    ],
)
def test_inexact_pairs_refuse_then_report_error(make_native, tmp_path, label, target, fragment):
    src, qtensors = make_native(label)
    out = tmp_path / ("out.gguf" if target == "gguf" else "out")
    with pytest.raises(LowbitError, match="--allow-requant") as info:
        convert(src, out, target)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    result = convert(src, out, target, allow_requant=True)
    assert not result.exact and {c.module for c in result.changes} <= set(qtensors)
    back = read_checkpoint(out)
    for change in result.changes:
        assert fragment in change.reason
        ref = qtensors[change.module].dequantize().double()
        got = back.tensors()[f"{change.module}.weight"]
        got = (got.dequantize() if isinstance(got, QTensor) else got.float()).double()
        measured = float((got - ref).norm() / ref.norm())
        assert change.rel_error == pytest.approx(measured, rel=1e-5, abs=1e-9)
        assert 0 <= change.rel_error < 0.2


def test_gptq_v1_cannot_hold_zero_point_zero(make_native, tmp_path):
    src, qtensors = make_native("int4-asym-g32", weights={"model.layers.0.mlp.up_proj": torch.rand(256, 64) + 0.01})
    assert bool((qtensors["model.layers.0.mlp.up_proj"].zeros == 0).any())  # all-positive groups start at 0
    with pytest.raises(LowbitError, match="zero point of 0"):
        convert(src, tmp_path / "g", "gptq")
    result = convert(src, tmp_path / "g", "gptq", allow_requant=True)
    back = read_checkpoint(tmp_path / "g").qtensors["model.layers.0.mlp.up_proj"]
    assert bool((back.zeros >= 1).all()) and result.changes[0].rel_error < 0.1


def test_usage_errors(make_native, tmp_path):
    src, _ = make_native("int4-g32")
    with pytest.raises(UsageError, match="unknown target"):
        convert(src, tmp_path / "o", "exl2")
    with pytest.raises(UsageError, match="gguf-type"):
        convert(src, tmp_path / "o", "gptq", gguf_type="q4_0")
    (tmp_path / "exists").mkdir()
    with pytest.raises(UsageError, match="already exists"):
        convert(src, tmp_path / "exists", "gptq")
    with pytest.raises(LowbitError, match="not found"):
        convert(tmp_path / "missing", tmp_path / "o", "gptq")


def test_cli_json_and_one_line_errors(make_native, tmp_path, capsys):
    from lowbit.cli.main import main

    src, _ = make_native("nf4")

    def run(args):
        code = 0
        try:
            main(args)
        except SystemExit as exc:
            code = exc.code
        cap = capsys.readouterr()
        return code, cap.out, cap.err

    code, _, err = run(["convert", str(src), "-o", str(tmp_path / "g"), "--to", "gptq"])
    assert code == 1 and err.startswith("lowbit: error: cannot write") and err.count("\n") == 1
    code, out, _ = run(["convert", str(src), "-o", str(tmp_path / "g"), "--to", "gptq", "--allow-requant", "--json"])
    assert code == 0
    report = json.loads(out)
    assert report["target"] == "gptq" and report["exact"] is False and len(report["requantized"]) == 14
    assert {"module", "source", "target", "reason", "rel_error"} <= set(report["requantized"][0])
    code, _, err = run(["convert", str(src), "-o", str(tmp_path / "x")])
    assert code == 2 and "--to" in err
    code, _, err = run(["convert", str(src), "-o", str(tmp_path / "x"), "--to", "gguf", "--gguf-type", "q3_k"])
    assert code == 2 and "q3_k" in err
