"""`lowbit quantize` on a MoE with calibration text reports how many calibration tokens the router
sent to each expert (--json `expert_tokens`, a summary line) and names the experts that got none."""

from __future__ import annotations

import json

import torch

from lowbit.compress.calibrate import prepare_calibration
from tests.runtime.moe_models import save_moe


def test_quantize_reports_calibration_tokens_per_expert(tmp_path, run_cli):
    # 8 experts, top-1, a short repetitive text: several experts get no token
    src, hf = save_moe("mixtral", tmp_path / "m", num_local_experts=8, num_experts_per_tok=1)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 30)
    args = ["quantize", str(src), "--format", "int4", "-g", "32", "--method", "gptq", "--data", str(text),
            "--samples", "2", "--seqlen", "16", "-o", str(tmp_path / "q")]
    code, stdout, err = run_cli([*args, "--json"])
    assert code == 0, err
    summary = json.loads(stdout)
    counts = summary["expert_tokens"]
    assert sorted(counts) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(len(c) == 8 and sum(c) == 2 * 16 for c in counts.values())  # every token, one expert each

    # layer 0 sees the float model's hidden states: its counts are transformers' router choices
    ids = prepare_calibration(src, str(text), 2, 16, 0).ids
    with torch.no_grad():
        router = hf(ids, output_router_logits=True).router_logits[0]
    assert counts["model.layers.0.mlp"] == torch.bincount(router.argmax(-1), minlength=8).tolist()

    for block, c in counts.items():
        idle = [str(e) for e, n in enumerate(c) if n == 0]
        flagged = [n for n in summary["notes"] if n.startswith(f"{block}: the router sent no calibration tokens")]
        assert (", ".join(idle) in flagged[0]) if idle else not flagged, (block, c, summary["notes"])
    assert any(0 in c for c in counts.values())  # the case the notes are for actually occurs here

    code, stdout, err = run_cli([*args, "--overwrite"])
    assert code == 0, err
    assert "2 MoE blocks, 16 experts: calibration tokens per expert" in " ".join(err.split())  # the summary is on stderr

    code, stdout, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(tmp_path / "rtn"), "--json"])
    assert code == 0, err
    assert json.loads(stdout)["expert_tokens"] == {}  # RTN reads no text
