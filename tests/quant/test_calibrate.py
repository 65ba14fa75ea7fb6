"""`lowbit calibrate`'s engine: statistics equal a direct computation, the STATS file round-trips
and refuses another model, bad input fails with one line, and a killed run resumes to the same bytes."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.compress.calibrate import CalibrationInputs, LayerwiseModel, calibrate, calibration_samples, first_token_weight
from lowbit.compress.stats import StatsAccumulator, StatsFile
from lowbit.runtime.loader import load_model


def _inputs(path, samples=4, seqlen=16, seed=0, first_weight=1.0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (samples, seqlen), generator=gen)
    return CalibrationInputs(model=LayerwiseModel(path), ids=ids, data="random", data_hash="0", seed=seed,
                             first_weight=first_weight)


def test_stats_equal_direct_computation(tiny_model, tmp_path):
    path = tiny_model("llama")
    inputs = _inputs(path)
    out = tmp_path / "stats.safetensors"
    summary = calibrate(inputs, out)
    assert summary["tokens"] == 64 and summary["sites"] == 4 * 3
    stats = StatsFile(out)
    assert stats.site_modules["model.layers.1.self_attn.q_proj"] == [
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]

    # Reference: the whole float64 model with a hook on layer 1's MLP input.
    model = load_model(path, dtype=torch.float64)
    seen = []
    model.model.layers[1].mlp.gate_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 64)))
    model(inputs.ids)
    x = seen[0]
    st = stats.site("model.layers.1.mlp.gate_proj")
    assert st.tokens == 64
    torch.testing.assert_close(st.hessian.double(), x.T @ x / 64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.mean_abs.double(), x.abs().mean(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st.sq_mean.double(), x.square().mean(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st.max_abs.double(), x.abs().amax(0), rtol=1e-4, atol=1e-6)


def test_stats_from_another_model_are_refused(tiny_model, tmp_path):
    out = tmp_path / "stats.safetensors"
    calibrate(_inputs(tiny_model("llama")), out)
    other = LayerwiseModel(tiny_model("gemma3"))
    with pytest.raises(LowbitError, match="calibrated on .* not on"):
        StatsFile(out).check(other.identity())
    StatsFile(out).check(LayerwiseModel(tiny_model("llama", seed=5)).identity())  # same config: fine


def test_too_few_tokens_says_how_many():
    class Tok:
        bos_id, add_bos = 1, True

        def encode(self, text, add_bos=False):
            return list(range(100))

    with pytest.raises(LowbitError, match=r"has 100 tokens, fewer than --samples 8 x 15 = 120"):
        calibration_samples(Tok(), "text", samples=8, seqlen=16, seed=0)
    ids = calibration_samples(Tok(), "text", samples=6, seqlen=16, seed=0)
    assert ids.shape == (6, 16) and (ids[:, 0] == 1).all()
    assert len({tuple(r) for r in ids[:, 1:].tolist()}) == 6  # distinct, non-overlapping windows


def test_non_finite_activations_fail_without_output(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_model("llama")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "stats.safetensors"
    with pytest.raises(LowbitError, match="non-finite activations .* after layer 1"):
        calibrate(_inputs(path), out)
    assert not out.exists()


class Killed(Exception):
    pass


@pytest.mark.parametrize("snapshot_every_s", [0.0, 1e9])  # resume from a hidden-state snapshot / by replay
def test_resume_after_kill_gives_same_bytes(tiny_model, tmp_path, snapshot_every_s):
    path = tiny_model("gemma3")
    whole = tmp_path / "whole.safetensors"
    calibrate(_inputs(path), whole)

    resumed = tmp_path / "resumed.safetensors"

    def kill_after_layer_2(done, total, replayed):
        if done == 2:
            raise Killed

    with pytest.raises(Killed):
        calibrate(_inputs(path), resumed, on_layer=kill_after_layer_2, snapshot_every_s=snapshot_every_s)
    assert not resumed.exists()
    events = []
    calibrate(_inputs(path), resumed, on_layer=lambda d, t, r: events.append((d, r)), snapshot_every_s=snapshot_every_s)
    assert events[-1] == (3, False) and (2, False) not in events  # layers 1-2 were not recomputed
    assert resumed.read_bytes() == whole.read_bytes()
    assert not any(p.name.endswith("lowbit-work") for p in tmp_path.iterdir())


def test_first_position_weight_equals_weighted_direct_computation(tiny_model, tmp_path):
    # The attention sink's share: each window's first token counts 3 times in H and mean |x|.
    path = tiny_model("llama")
    inputs = _inputs(path, first_weight=3.0)
    out = tmp_path / "stats.safetensors"
    calibrate(inputs, out)
    stats = StatsFile(out)
    assert stats.header["calibration"]["first_token_weight"] == 3.0
    model = load_model(path, dtype=torch.float64)
    seen = []
    model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model(inputs.ids)
    x = seen[0]  # [4 windows, 16 positions, 64]
    w = torch.ones(4, 16, 1, dtype=torch.float64)
    w[:, 0] = 3.0
    total = float(w.sum())
    st = stats.site("model.layers.1.self_attn.o_proj")
    assert st.tokens == 64  # real tokens; the weights only change the averages
    flat, wf = x.reshape(-1, 64), w.reshape(-1, 1)
    torch.testing.assert_close(st.hessian.double(), (flat * wf).T @ flat / total, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.mean_abs.double(), (flat.abs() * wf).sum(0) / total, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st.sq_mean.double(), (flat * flat * wf).sum(0) / total, rtol=1e-4, atol=1e-5)
    # and it differs from the unweighted statistics by more than the tolerance
    plain = flat.T @ flat / 64
    assert (st.hessian.double() - plain).abs().max() > 1e-3 * plain.abs().max()


def test_first_token_weight_rule():
    assert first_token_weight(32) == 1.0 and first_token_weight(16) == 1.0
    assert first_token_weight(512) == 16.0 and first_token_weight(2048) == 64.0
    assert first_token_weight(2048, 1.0) == 1.0 and first_token_weight(128, 8.0) == 8.0
    with pytest.raises(LowbitError, match="--sink-weight must be at least 1"):
        first_token_weight(512, 0.5)


def test_first_position_rows_are_copied_not_kept_as_views():
    # StatsAccumulator keeps each window's position 0 until finish(); callers reuse their buffers.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen)
    want = StatsAccumulator(8, first_weight=4.0)
    want.add(x.clone())
    got = StatsAccumulator(8, first_weight=4.0)
    got.add(x)
    x.fill_(7.0)  # the caller's buffer is overwritten by the next batch
    torch.testing.assert_close(got.finish().hessian, want.finish().hessian, rtol=0, atol=0)
