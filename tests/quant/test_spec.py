"""Format names parse into specs, print back, and bad combinations are refused."""

import pytest

from lowbit.errors import UsageError
from lowbit.quant.registry import bits_per_weight, get_format, list_formats, parse_spec, weight_bytes
from lowbit.quant.spec import FormatSpec

LABELS = [
    "int4", "int4-g32", "int4-asym", "int4-asym-g64", "int4-channel", "int4-absmax", "int4-sbf16",
    "int8", "int8-g128", "int3", "int2-asym-g64", "nf4", "nf4-dq", "nf4-g128-absmax", "int4-asym-g32-dq", "int6-g64-dq-absmax",
    "fp8", "fp8-tensor", "fp8-block128", "fp8-e5m2", "mxfp4", "mxfp4-floor", "mxfp4-roundup", "nvfp4",
]


@pytest.mark.parametrize("label", LABELS)
def test_label_round_trip(label):
    spec = parse_spec(label)
    assert spec.label == label
    assert parse_spec(spec.label) == spec
    assert FormatSpec.from_dict(spec.to_dict()) == spec


def test_defaults_and_overrides():
    assert parse_spec("int4").group_size == 128 and parse_spec("int4").symmetric
    assert parse_spec("int4-asym").symmetric is False
    assert parse_spec("int8").granularity == "channel"
    assert parse_spec("int4", group_size=32).label == "int4-g32"
    assert parse_spec("int4", group_size=-1).label == "int4-channel"
    assert parse_spec("nf4").group_size == 64
    assert parse_spec("fp8-block").group_size == 128
    assert parse_spec("fp8-e4m3") == parse_spec("fp8")
    assert parse_spec("int4-g64-asym") == parse_spec("int4-asym-g64")
    assert parse_spec("int4-sym") == parse_spec("int4")
    assert parse_spec("nf4", double_quant=True).label == "nf4-dq"
    assert parse_spec("mxfp4", scale_rule="round-up").label == "mxfp4-roundup"
    assert set(list_formats()) >= {"int4", "int4-asym", "int8", "nf4", "fp8", "mxfp4", "nvfp4"}
    assert get_format("int4-asym").__name__ == "lowbit.quant.intq"


@pytest.mark.parametrize(
    "text, kwargs, message",
    [
        ("int7", {}, "unknown format"),
        ("nf4-asym", {}, "unknown format"),
        ("int4-foo", {}, "unknown option"),
        ("mxfp4", {"group_size": 64}, "exactly 32"),
        ("nvfp4-g32", {}, "exactly 16"),
        ("int4", {"group_size": 100}, "cannot use group size 100"),
        ("nf4-channel", {}, "cannot use channel"),
        ("int4-channel-dq", {}, "option of nf4 and of grouped int formats"),
        ("fp8-dq", {}, "option of nf4 and of grouped int formats"),
        ("mxfp4-absmax", {}, "no scale rule"),
        ("nvfp4-sfp32", {}, "cannot store scales"),
        ("fp8-block100", {}, "100x100"),
    ],
)
def test_bad_specs_are_usage_errors(text, kwargs, message):
    with pytest.raises(UsageError, match=message):
        parse_spec(text, **kwargs)


def test_bits_per_weight_counts_scales():
    assert bits_per_weight("int4-g128", (4096, 4096)) == 4 + 16 / 128
    assert bits_per_weight("int4-asym-g128", (4096, 4096)) == 4 + 24 / 128
    assert bits_per_weight("int8", (4096, 4096)) == 8 + 16 / 4096
    assert bits_per_weight("nf4", (4096, 4096)) == 4.5
    assert bits_per_weight("mxfp4", (4096, 4096)) == 4.25
    assert bits_per_weight("nvfp4", (4096, 4096)) == 4.5 + 32 / 4096**2
    assert bits_per_weight("fp8-tensor", (4096, 4096)) == 8 + 32 / 4096**2
    assert abs(bits_per_weight("nf4-dq", (4096, 4096)) - (4 + 8 / 64 + 32 / 64 / 256 + 32 / 4096**2)) < 1e-12
    # int dq: an 8-bit code per group, 4-bit packed zero points, a float16 step per row
    assert bits_per_weight("int4-asym-g32-dq", (4096, 4096)) == 4 + (8 + 4) / 32 + 16 / 4096
    assert bits_per_weight("int4-g32-dq", (4096, 4096)) == 4 + 8 / 32 + 16 / 4096
    # ragged: 576 columns in groups of 128 → 5 scale columns, no padding of the 4-bit codes
    assert weight_bytes("int4-g128", (10, 576)) == 10 * 288 + 10 * 5 * 2
    assert get_format("int4").bits_per_weight(parse_spec("int4"), 4096) == 4 + 16 / 128
