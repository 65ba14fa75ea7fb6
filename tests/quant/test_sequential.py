"""`lowbit quantize --method gptq|awq|awq+gptq` through compress/pipeline.py: sequential calibration
is deterministic, a killed run resumes to the same bytes, and --calib STATS from another model is refused."""

from __future__ import annotations

import hashlib

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.compress.calibrate import CalibrationInputs, LayerwiseModel, calibrate
from lowbit.compress.options import CalibrationSource, GptqOptions, MethodOptions, OutlierOptions
from lowbit.compress.pipeline import quantize_model
from lowbit.compress.workdir import work_dir_for

TEXT = " ".join(f"The {i}th river flows past the old mill near town number {i * 7 % 13}." for i in range(200))


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _quantize(model, out, method="gptq", fmt="int4-g32", text=None, float_target=False, snapshot_every_s=60.0):
    opts = MethodOptions(method=method, calibration=CalibrationSource(data=str(text), samples=4, seqlen=32),
                         gptq=GptqOptions(float_target=float_target), work_dir=str(work_dir_for(out)),
                         snapshot_every_s=snapshot_every_s)
    return quantize_model(model, fmt, out_dir=out, method=method, method_options=opts)


def _from_stats(method, stats, keep_outliers=0.0):
    return MethodOptions(method=method, calibration=CalibrationSource(calib=str(stats)),
                         outliers=OutlierOptions(keep_outliers=keep_outliers))


@pytest.mark.demo
@pytest.mark.parametrize("method, extra", [("gptq", {}), ("awq+gptq", {}), ("gptq", {"float_target": True})])
def test_deterministic_and_resumable(tiny_model, tmp_path, method, extra, monkeypatch):
    # float_target runs the float model's hidden states beside the quantized ones; a resumed run
    # reloads both snapshots (or replays both streams) and must reach the same bytes.
    model = tiny_model("llama", with_tokenizer=True)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    summary = _quantize(model, a, method, text=text, **extra)
    assert summary.linear_bits_per_weight == pytest.approx(4.5)
    # config.json records how the weights were made, not where the work folder was
    import json

    recorded = json.loads((a / "config.json").read_text())["quantization_config"]["method_options"]
    assert recorded == {"data": str(text), "samples": 4, "seqlen": 32, "seed": 0, **extra}
    _quantize(model, b, method, text=text, **extra)
    assert _digest(a) == _digest(b)

    # Kill the run right after layer 1's result is saved; the rerun continues from the work folder
    # (replaying layer 1 from its saved result, where gptq computed it stage by stage).
    from lowbit.compress.workdir import WorkDir

    real = WorkDir.save_layer

    def dying(self, index, tensors, meta):
        real(self, index, tensors, meta)
        if index == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(WorkDir, "save_layer", dying)
    with pytest.raises(KeyboardInterrupt):
        _quantize(model, c, method, text=text, snapshot_every_s=0.0, **extra)
    assert not c.exists() and work_dir_for(c).is_dir()
    monkeypatch.setattr(WorkDir, "save_layer", real)
    _quantize(model, c, method, text=text, snapshot_every_s=0.0, **extra)
    assert _digest(c) == _digest(a)
    assert not work_dir_for(c).exists()


@pytest.mark.demo
@pytest.mark.parametrize("change", [{"method": "awq+gptq"}, {"fmt": "int8"}])
def test_a_work_folder_of_another_method_or_format_is_not_resumed(tiny_model, tmp_path, monkeypatch, capsys, change):
    # A killed gptq int4 run leaves its layers; a rerun asking for another method or format must start
    # afresh (it once resumed them, silently mixing the two) and equal a run that never saw the folder.
    from lowbit.compress.workdir import WorkDir

    model = tiny_model("llama", with_tokenizer=True)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    real = WorkDir.save_layer

    def dying(self, index, tensors, meta):
        real(self, index, tensors, meta)
        if index == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(WorkDir, "save_layer", dying)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _quantize(model, out, text=text)
    assert work_dir_for(out).is_dir()
    monkeypatch.setattr(WorkDir, "save_layer", real)
    capsys.readouterr()
    _quantize(model, out, text=text, **change)
    assert "resuming" not in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    _quantize(model, fresh, text=text, **change)
    assert _digest(out) == _digest(fresh)


def test_calib_stats_of_another_model_are_refused(tiny_model, tmp_path):
    other = tiny_model("gemma3")
    ids = torch.randint(3, 256, (2, 16))
    stats = tmp_path / "gemma.stats"
    calibrate(CalibrationInputs(model=LayerwiseModel(other), ids=ids, data="r", data_hash="0", seed=0), stats)
    with pytest.raises(LowbitError, match="calibrated on"):
        quantize_model(tiny_model("llama"), "int4-g32", out_dir=tmp_path / "q", method="gptq", method_options=_from_stats("gptq", stats))
    assert not (tmp_path / "q").exists()


def test_calib_stats_quantize_every_format(tiny_model, tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (2, 16))
    stats = tmp_path / "llama.stats"
    calibrate(CalibrationInputs(model=LayerwiseModel(model), ids=ids, data="r", data_hash="0", seed=0), stats)
    for fmt in ("nvfp4", "int8"):  # int4 is covered above; these add a global scale and per-row scales
        summary = quantize_model(model, fmt, out_dir=tmp_path / fmt, method="awq+gptq", method_options=_from_stats("awq+gptq", stats))
        assert summary.notes == []


@pytest.mark.parametrize("where, message", [
    ("model.layers.1.input_layernorm.weight", r"non-finite activations .* entering model\.layers\.1\.self_attn\.q_proj"),
    ("model.layers.1.post_attention_layernorm.weight", r"non-finite activations .* entering model\.layers\.1\.mlp\.gate_proj"),
])
def test_gptq_staged_refuses_non_finite_activations(tiny_model, tmp_path, where, message):
    # GPTQ calibrates site by site (compress/staged.py); an inf norm weight poisons that site's input,
    # which must stop the run with one line naming the site, and no output.
    from safetensors.torch import load_file, save_file

    path = tiny_model("llama", with_tokenizer=True)
    weights = load_file(path / "model.safetensors")
    weights[where][0] = float("inf")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / "q"
    with pytest.raises(LowbitError, match=message):
        _quantize(path, out, text=text)
    assert not out.exists()


def test_gptq_staged_gemma3_resumes_to_the_same_bytes(tiny_model, tmp_path, monkeypatch):
    # Gemma-3's sandwich norms (post-attention, pre/post-FFN) and sliding windows go through the
    # site-by-site pass; a resumed run replays finished layers through the plain layer forward, so
    # equal bytes mean the stages computed exactly what the layer computes.
    from lowbit.compress.workdir import WorkDir

    model = tiny_model("gemma3", with_tokenizer=True)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _quantize(model, whole, "gptq", text=text)
    real = WorkDir.save_layer

    def dying(self, index, tensors, meta):
        real(self, index, tensors, meta)
        if index == 0:
            raise KeyboardInterrupt

    monkeypatch.setattr(WorkDir, "save_layer", dying)
    with pytest.raises(KeyboardInterrupt):
        _quantize(model, resumed, "gptq", text=text, snapshot_every_s=1e9)
    monkeypatch.setattr(WorkDir, "save_layer", real)
    _quantize(model, resumed, "gptq", text=text, snapshot_every_s=1e9)
    assert _digest(resumed) == _digest(whole)


@pytest.mark.parametrize("method", ["awq", "awq+gptq"])
def test_apply_outcome_puts_in_what_the_checkpoint_holds(tiny_model, tmp_path, method):
    # apply_outcome (the --data path's propagation, bench/calibration.py's float copies) must leave
    # each Linear holding exactly the checkpoint's dequantized weight plus its side matrix, even when
    # AWQ folded the next group's scale into that Linear (o_proj into v_proj, down_proj into up_proj).
    from lowbit.formats.native import NativeReader
    from lowbit.compress.calibrate import LayerStats
    from lowbit.quant.outlier_matrix import unpack_outliers
    from lowbit.compress.sequential import QuantOptions, apply_outcome, quantize_layer
    from lowbit.quant.spec import parse_spec
    from lowbit.compress.stats import StatsFile
    from lowbit.runtime.loader import load_model

    path = tiny_model("llama")
    stats_path = tmp_path / "llama.stats"
    calibrate(CalibrationInputs(model=LayerwiseModel(path), ids=torch.randint(3, 256, (2, 16)), data="r", data_hash="0", seed=0), stats_path)
    out = tmp_path / "q"
    quantize_model(path, "int4-asym-g32", out_dir=out, method=method, method_options=_from_stats(method, stats_path, keep_outliers=1.0))
    reader = NativeReader(out)

    model = load_model(path, dtype=torch.float32)
    lm, stats_file, spec = LayerwiseModel(path), StatsFile(stats_path), parse_spec("int4-asym-g32")
    folded_into_linear = 0
    for i, layer in enumerate(model.model.layers):
        prefix = lm.layer_prefix(i)
        sites = stats_file.layer_sites(prefix)
        outcome = quantize_layer(layer, prefix, LayerStats(sites={s: stats_file.site(s) for s in sites}, site_modules=sites),
                                 {m: spec for mods in sites.values() for m in mods}, QuantOptions(method=method, keep_outliers=1.0))
        folded_into_linear += sum(name[: -len(".weight")] in outcome.qtensors for name in outcome.dense)
        apply_outcome(layer, prefix, outcome)
        for module in outcome.qtensors:
            qt = reader.quantized(module)
            expected = qt.dequantize(torch.float32) + unpack_outliers(reader.outliers(module), qt.shape)
            torch.testing.assert_close(layer.get_submodule(module[len(prefix):]).weight.data, expected, rtol=0, atol=0, msg=module)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            torch.testing.assert_close(layer.get_submodule(name.rpartition(".")[0]).weight.data, reader.dense(prefix + name).float(),
                                       rtol=0, atol=0)
    assert folded_into_linear > 0  # the case above happened


@pytest.mark.parametrize("method", ["awq", "awq+gptq"])
def test_awq_folds_into_a_dense_member_of_a_mixed_recipe(tiny_model, tmp_path, method):
    # A recipe that keeps k_proj and gate_proj dense: AWQ still scales their groups (searched on the
    # quantized members alone), and the dense members are written with the folded scale, so
    # norm -> dense member computes what the float model did.
    from lowbit.compress.recipe import parse_recipe
    from lowbit.runtime.loader import load_model

    path = tiny_model("llama")
    stats_path = tmp_path / "llama.stats"
    calibrate(CalibrationInputs(model=LayerwiseModel(path), ids=torch.randint(3, 256, (2, 16)), data="r", data_hash="0", seed=0), stats_path)
    recipe = parse_recipe({"rules": [{"pattern": "*.k_proj", "format": "dense"}, {"pattern": "*.gate_proj", "format": "dense"},
                                     {"pattern": "*", "format": "int4-asym-g32"}]})
    out = tmp_path / "q"
    quantize_model(path, recipe, out_dir=out, method=method, method_options=_from_stats(method, stats_path))
    float_model, quant_model = load_model(path, dtype=torch.float32), load_model(out, dtype=torch.float32)
    h = torch.randn(5, float_model.config.hidden_size)
    changed = 0
    for a, b in zip(float_model.model.layers, quant_model.model.layers):
        for norm, dense in (("input_layernorm", "self_attn.k_proj"), ("post_attention_layernorm", "mlp.gate_proj")):
            assert isinstance(b.get_submodule(dense), torch.nn.Linear)
            changed += not torch.equal(a.get_submodule(norm).weight, b.get_submodule(norm).weight.float())
            with torch.no_grad():
                torch.testing.assert_close(b.get_submodule(dense)(b.get_submodule(norm)(h)), a.get_submodule(dense)(a.get_submodule(norm)(h)),
                                           rtol=1e-4, atol=1e-5)
    assert changed > 0  # AWQ did fold a scale into some norm


@pytest.mark.demo
def test_float_target_brings_the_output_closer_to_the_float_model(tiny_model, tmp_path):
    # GPTQ with float targets minimises each Linear's error against the float model's outputs, so
    # on the calibration windows the quantized model's last hidden states end closer to the float
    # model's than plain sequential GPTQ leaves them (int3: errors large enough to accumulate).
    from lowbit.compress.calibrate import prepare_calibration
    from lowbit.runtime.loader import load_model

    model = tiny_model("llama", with_tokenizer=True)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    plain, matched = tmp_path / "plain", tmp_path / "matched"
    _quantize(model, plain, "gptq", fmt="int3-g32", text=text)
    _quantize(model, matched, "gptq", fmt="int3-g32", text=text, float_target=True)
    ids = prepare_calibration(model, str(text), 4, 32, 0).ids

    def last_hidden(path):
        with torch.no_grad():
            return load_model(path, dtype=torch.float32)(ids).double()

    ref = last_hidden(model)
    err_plain = float(((last_hidden(plain) - ref) ** 2).mean())
    err_matched = float(((last_hidden(matched) - ref) ** 2).mean())
    print("ERRS", err_matched, err_plain)
    assert err_matched < 0.9 * err_plain, (err_matched, err_plain)
