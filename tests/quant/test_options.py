"""compress/options.py: each option object refuses a bad value with one line naming the flag, the
cross-option rules live in MethodOptions, and record() is the flat form config.json keeps."""

import re

import pytest

from lowbit.compress.options import CalibrationSource, GptqOptions, MethodOptions, OutlierOptions
from lowbit.errors import UsageError


@pytest.mark.parametrize("make, message", [
    (lambda: CalibrationSource(), "exactly one of --calib STATS or --data TEXT"),
    (lambda: CalibrationSource(calib="s", data="t"), "exactly one of --calib STATS or --data TEXT"),
    (lambda: CalibrationSource(calib="s", sink_weight=4.0), "--sink-weight goes with --data"),
    (lambda: GptqOptions(refit=101), "--refit-rounds must be between 0 and 100, got 101"),
    (lambda: OutlierOptions(keep_outliers=100), "--keep-outliers is a percentage in [0, 100), got 100"),
    (lambda: OutlierOptions(keep_channels=-1), "--keep-channels is a percentage"),
    (lambda: OutlierOptions(salience="loud"), "--outlier-salience must be one of act, hessian, error, got 'loud'"),
    (lambda: MethodOptions(method="gptq"), "--method gptq needs exactly one of --calib STATS or --data TEXT"),
    (lambda: MethodOptions(method="rtn", outliers=OutlierOptions(keep_outliers=1)), "--keep-outliers / --keep-channels"),
    (lambda: MethodOptions(method="rtn", calibration=CalibrationSource(data="t")), "go with --method gptq, awq or awq+gptq"),
    (lambda: MethodOptions(method="awq", calibration=CalibrationSource(data="t"), gptq=GptqOptions(refit=2)),
     "--refit-rounds goes with --method gptq or awq+gptq, not awq"),
    (lambda: MethodOptions(method="gptq", calibration=CalibrationSource(calib="s"), gptq=GptqOptions(float_target=True)),
     "--float-target goes with --method gptq and --data"),
    (lambda: MethodOptions(method="gptq", calibration=CalibrationSource(calib="s"), custom={"alpha": 1}),
     "method gptq takes no option"),
])
def test_bad_options_are_one_line_usage_errors(make, message):
    with pytest.raises(UsageError, match=re.escape(message)) as info:
        make()
    assert "\n" not in str(info.value)


def test_record_lists_what_was_asked_for():
    plain = MethodOptions(method="gptq", calibration=CalibrationSource(data="wiki-calib", samples=8, seqlen=64), work_dir="w")
    assert plain.record() == {"data": "wiki-calib", "samples": 8, "seqlen": 64, "seed": 0}
    full = MethodOptions(method="gptq", calibration=CalibrationSource(data="t", sink_weight=2.0),
                         gptq=GptqOptions(refit=0, float_target=True), outliers=OutlierOptions(keep_outliers=0.5, salience="act"))
    assert full.record() == {"data": "t", "samples": 128, "seqlen": 2048, "seed": 0, "sink_weight": 2.0, "refit": 0,
                             "float_target": True, "keep_outliers": 0.5, "keep_channels": 0.0, "outlier_salience": "act"}
    assert MethodOptions(method="awq", calibration=CalibrationSource(calib="s.safetensors")).record() == {"calib": "s.safetensors"}
    assert MethodOptions().record() == {} and not MethodOptions().calibrated
    assert MethodOptions(method="my-method", custom={"alpha": 1}).record() == {"alpha": 1}


def test_options_are_frozen():
    with pytest.raises(AttributeError):
        GptqOptions().refit = 3


@pytest.mark.parametrize("options, message", [
    ({"scale_rule": 3}, "mixed.yaml rule 1: option scale_rule must be a string, got 3"),
    ({"double_quant": "yes"}, "mixed.yaml rule 1: option double_quant must be a boolean, got 'yes'"),
    ({"scale": "absmax"}, "mixed.yaml rule 1: options must be a mapping with keys among double_quant, scale_dtype, scale_rule"),
    (["absmax"], "mixed.yaml rule 1: options must be a mapping"),
])
def test_a_bad_recipe_option_names_the_rule(options, message):
    from lowbit.compress.recipe import parse_recipe

    with pytest.raises(UsageError, match=re.escape(message)) as info:
        parse_recipe([{"pattern": "*", "format": "int4", "options": options}], "mixed.yaml")
    assert "\n" not in str(info.value)


def test_recipe_options_become_spec_keywords():
    from lowbit.compress.options import SpecOptions
    from lowbit.compress.recipe import parse_recipe
    from lowbit.quant.spec import parse_spec

    rule = parse_recipe([{"pattern": "*", "format": "int4", "group_size": 64, "options": {"scale_rule": "absmax"}}]).rules[0]
    assert rule.spec == parse_spec("int4", 64, scale_rule="absmax")
    assert SpecOptions(scale_dtype="bfloat16", double_quant=False).keywords() == {"scale_dtype": "bfloat16", "double_quant": False}
