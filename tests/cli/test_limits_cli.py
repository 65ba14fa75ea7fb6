"""Sizes checked before anything is allocated (#25 items 4, 5, 9): calibration windows against the
model's positions and the machine's memory, --max-model-len / --max-tokens / bench lengths against
the model, --kv-memory against the memory there is, group sizes that mean nothing, an architecture
lowbit cannot run, and one size syntax (512MiB, 2GiB, 1.5GB, bytes) for every size option.

Each refusal is one `lowbit: error:` line naming the option, exit 2 (1 for the architecture, as
GPTQ reports it). "Before anything is allocated" is checked by tripwires: the calibration text, the
activations, the engine and the server are replaced by stand-ins that fail or record, so a check
that came too late shows up as a different exit code, not as a slow test."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save_file

from lowbit.errors import LowbitError

# Generous on a shared 2-core machine; the tripwires are what proves nothing heavy ran.
FAST_S = 20.0
SMOL_POSITIONS = "8192"  # SmolLM2-135M's max_position_embeddings


def _write_checkpoint(directory, config: dict, shapes: dict[str, tuple[int, ...]]):
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """One Llama layer whose Linears have 48 and 80 input columns (neither a multiple of 32)."""
    d, inter, heads, kv, hd, vocab = 48, 80, 3, 1, 16, 64
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,),
              p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
              p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
              p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
              p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
              p + "mlp.down_proj.weight": (d, inter)}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d, "intermediate_size": inter,
              "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "vocab_size": vocab, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    return _write_checkpoint(tmp_path_factory.mktemp("limits") / "tiny-llama", config, shapes)


@pytest.fixture(scope="module")
def tiny_neox(tmp_path_factory):
    """A GPT-NeoX checkpoint: decoder layers named like `gpt_neox.layers.0.…`, an architecture lowbit does not run."""
    d, vocab, p = 32, 64, "gpt_neox.layers.0."
    shapes = {"gpt_neox.embed_in.weight": (vocab, d), "embed_out.weight": (vocab, d),
              "gpt_neox.final_layer_norm.weight": (d,), "gpt_neox.final_layer_norm.bias": (d,),
              p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
              p + "attention.query_key_value.weight": (3 * d, d), p + "attention.dense.weight": (d, d),
              p + "mlp.dense_h_to_4h.weight": (4 * d, d), p + "mlp.dense_4h_to_h.weight": (d, 4 * d)}
    config = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": d,
              "intermediate_size": 4 * d, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": vocab,
              "max_position_embeddings": 128, "torch_dtype": "bfloat16"}
    return _write_checkpoint(tmp_path_factory.mktemp("limits") / "tiny-neox", config, shapes)


class Tripwires:
    def __init__(self):
        self.engines: list[dict] = []  # kwargs of every Engine built
        self.served: list[object] = []  # ServerConfig of every server started


@pytest.fixture(autouse=True)
def tripwires(monkeypatch):
    """Stand-ins for everything heavy: reading the calibration text, the activations, the engine
    (records its arguments, then stops the command with exit 1) and the HTTP server (records)."""
    wires = Tripwires()

    def no_text(*args, **kwargs):
        raise AssertionError("the calibration text was read before the sizes were checked")

    def no_activations(*args, **kwargs):
        raise AssertionError("calibration activations were allocated")

    class StopEngine:
        def __init__(self, model, **kwargs):
            wires.engines.append(kwargs)
            raise LowbitError("engine reached")

    monkeypatch.setattr("lowbit.compress.calibrate.load_text", no_text)
    monkeypatch.setattr("lowbit.compress.calibrate.LayerwiseModel.embed", no_activations)
    monkeypatch.setattr("lowbit.runtime.engine.engine.Engine", StopEngine)
    from lowbit.runtime.server.app import Stopped

    # records the config; a SIGTERM stop, after the model loaded
    monkeypatch.setattr("lowbit.runtime.server.app.serve",
                        lambda config, build, *cascade: wires.served.append(config) or Stopped(False, False))
    return wires


@pytest.fixture
def fails_fast(run_cli):
    """fails_fast(args, code, *needles) -> the error line: exit `code`, one `lowbit: error:` line
    holding every needle, within FAST_S."""

    def run(args, code, *needles):
        start = time.perf_counter()
        got, out, err = run_cli([str(a) for a in args])
        elapsed = time.perf_counter() - start
        # progress notes ("lowbit: loading ...") may precede it in a log; the error is one line, the last
        lines = err.strip().splitlines()
        errors = [line for line in lines if line.startswith("lowbit: error: ")]
        assert got == code and len(errors) == 1 and lines[-1] == errors[0], (got, err)
        for needle in needles:
            assert needle in errors[0], (needle, err)
        assert elapsed < FAST_S, f"took {elapsed:.1f} s"
        return errors[0]

    return run


HUGE_WINDOWS = ["--samples", "100000", "--seqlen", SMOL_POSITIONS]  # 100000 x 8192 x 576 hidden states: ~880 GiB


# ---------------------------------------------------------------------------------------------
# item 4: calibration windows


def test_quantize_seqlen_beyond_the_models_positions(smollm2_dir, tmp_path, fails_fast):
    out = tmp_path / "out"
    fails_fast(["quantize", smollm2_dir, "--format", "int4", "--method", "gptq", "--data", "wiki-calib",
                "--seqlen", "100000", "-o", out], 2, "--seqlen", "100000", SMOL_POSITIONS)
    assert not out.exists()


def test_quantize_windows_beyond_the_machines_memory(smollm2_dir, tmp_path, fails_fast):
    out = tmp_path / "out"
    fails_fast(["quantize", smollm2_dir, "--format", "int4", "--method", "gptq", "--data", "wiki-calib",
                *HUGE_WINDOWS, "-o", out], 2, "--samples", "--seqlen", "available")
    assert not out.exists()


def test_calibrate_seqlen_and_memory(smollm2_dir, tmp_path, fails_fast):
    out = tmp_path / "x.stats"
    base = ["calibrate", smollm2_dir, "--data", "wiki-calib", "-o", out]
    fails_fast([*base, "--seqlen", "100000"], 2, "--seqlen", "100000", SMOL_POSITIONS)
    fails_fast([*base, *HUGE_WINDOWS], 2, "--samples", "--seqlen", "available")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# item 5: group sizes, architectures


@pytest.mark.parametrize("group", ["0", "-5"])
def test_group_size_other_than_minus_one_or_positive(group, tiny_llama, tmp_path, fails_fast):
    out = tmp_path / "out"
    fails_fast(["quantize", tiny_llama, "--format", "int4", "--group-size", group, "-o", out], 2, "--group-size", group)
    assert not out.exists()


def test_group_zero_in_a_format_name(tiny_llama, tmp_path, fails_fast):
    out = tmp_path / "out"
    fails_fast(["quantize", tiny_llama, "--format", "int4-g0", "-o", out], 2, "int4-g0")
    assert not out.exists()


@pytest.mark.parametrize("group", [0, -5, True])
def test_group_size_in_a_recipe_rule(group, tiny_llama, tmp_path, fails_fast):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"rules:\n  - pattern: '*'\n    format: int4\n    group_size: {json.dumps(group)}\n")
    out = tmp_path / "out"
    fails_fast(["quantize", tiny_llama, "--recipe", recipe, "-o", out], 2, "r.yaml rule 1", "group_size")
    assert not out.exists()


def test_rtn_refuses_an_architecture_lowbit_cannot_run(tiny_neox, tmp_path, fails_fast):
    out = tmp_path / "out"
    fails_fast(["quantize", tiny_neox, "--format", "int4", "-g", "16", "-o", out], 1,
               "unsupported architecture GPTNeoXForCausalLM")
    assert not out.exists()


def test_group_not_dividing_the_columns_is_a_ragged_last_group(tiny_llama, tmp_path, run_cli):
    """Not a refusal: 48 and 80 columns with g32 store a narrower last group (docs/quantize.md), and
    a group wider than the row is one group. Guards that the checks above leave this working."""
    for group in ("32", "128"):
        out = tmp_path / f"g{group}"
        code, _, err = run_cli(["quantize", str(tiny_llama), "--format", "int4", "-g", group, "-o", str(out), "--json"])
        assert code == 0, err
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"]["modules"]["model.layers.0.mlp.down_proj"]["spec"]["group_size"] == int(group)


# ---------------------------------------------------------------------------------------------
# items 4 and 9: serve, bench, generate


def test_serve_max_model_len_beyond_the_models_positions(smollm2_dir, fails_fast, tripwires):
    fails_fast(["serve", smollm2_dir, "--max-model-len", "100000"], 2, "--max-model-len", "100000", SMOL_POSITIONS)
    assert not tripwires.served


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_kv_memory_beyond_the_machines_memory(command, smollm2_dir, fails_fast, tripwires):
    fails_fast([command, smollm2_dir, "--kv-memory", "1000TiB"], 2, "--kv-memory", "1000TiB", "available")
    assert not tripwires.served and not tripwires.engines


@pytest.mark.parametrize("command", ["serve", "bench"])
@pytest.mark.parametrize("value, message", [("lots", "a size like"), ("2XB", "a size like"), ("0", "a size like"),
                                            ("-1GiB", "a size like"), ("512", "at least 1MiB")])
def test_bad_kv_memory(command, value, message, smollm2_dir, fails_fast, tripwires):
    fails_fast([command, smollm2_dir, "--kv-memory", value], 2, "--kv-memory", repr(value), message)
    assert not tripwires.served and not tripwires.engines


def test_one_size_syntax_for_serve_and_bench(smollm2_dir, run_cli, tripwires):
    code, _, err = run_cli(["serve", str(smollm2_dir), "--kv-memory", "1.5GB", "--max-body-bytes", "4MiB"])
    assert code == 0, err
    assert tripwires.served[0].max_body_bytes == 4 << 20
    code, _, err = run_cli(["bench", str(smollm2_dir), "--kv-memory", "512MiB"])
    assert code == 1 and "engine reached" in err, err
    assert tripwires.engines[0]["kv_memory"] == 512 << 20


def test_bad_max_body_bytes(smollm2_dir, fails_fast, tripwires):
    fails_fast(["serve", smollm2_dir, "--max-body-bytes", "4 lots"], 2, "--max-body-bytes", "a size like")
    assert not tripwires.served


@pytest.mark.parametrize("extra, option", [(["--prefill-tokens", "100000"], "--prefill-tokens"),
                                           (["--prompt-tokens", "8000", "--gen-tokens", "1000"], "--gen-tokens")])
def test_bench_lengths_beyond_the_models_positions(extra, option, smollm2_dir, fails_fast, tripwires):
    fails_fast(["bench", smollm2_dir, *extra], 2, option, SMOL_POSITIONS)
    assert not tripwires.engines


def test_generate_max_tokens_beyond_the_models_positions(smollm2_dir, fails_fast, tripwires):
    fails_fast(["generate", smollm2_dir, "hello", "--max-tokens", "100000"], 2, "--max-tokens", "100000", SMOL_POSITIONS)
    assert not tripwires.engines
