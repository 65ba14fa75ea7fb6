"""A dense Llama checkpoint turned into an equivalent Mixtral (mixture-of-experts) checkpoint.

    python bench/dense_to_moe.py DENSE_DIR OUT_DIR [--experts 4]

A real-weight MoE for testing the MoE runtime without downloading one (issue #26): each layer's MLP
(gate/up [I, H], down [H, I]) is cut along the intermediate dimension into E slices of I/E, and
expert e gets slice e's gate/up rows and down columns. The router's weight is zero, so softmax gives
every expert 1/E; top-k is E, so every expert runs; and expert e's down_proj is multiplied by E, so
the weighted sum over experts of 1/E * E * down_e(act(gate_e x) * up_e x) is the dense MLP.

Mixtral always renormalizes its top-k probabilities (config.json has no switch for it); with E a
power of two that is exact (E copies of 1/E sum to exactly 1), and so are the scalings by 1/E and
E, so the MoE differs from the dense model only in the summation order of the down projection
(E partial matmuls added up instead of one). E must divide the intermediate size. Written as
Mixtral's hub layout (`block_sparse_moe.experts.E.w1/w3/w2.weight`, `block_sparse_moe.gate.weight`)
in one model.safetensors; the tokenizer and generation files are copied.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_MLP = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
               "tokenizer.model", "vocab.json", "merges.txt")


def moe_config(dense: dict, experts: int) -> dict:
    """Mixtral config.json keys for the dense Llama config `dense` split into `experts` experts."""
    if dense.get("model_type") != "llama":
        raise ValueError(f"expected a llama checkpoint, got model_type {dense.get('model_type')!r}")
    if dense.get("attention_bias") or dense.get("mlp_bias"):
        raise ValueError("Mixtral has no attention or MLP biases")
    if experts < 1 or experts & (experts - 1) or dense["intermediate_size"] % experts:
        raise ValueError(f"experts {experts} must be a power of two dividing intermediate_size {dense['intermediate_size']}")
    config = {k: v for k, v in dense.items() if k not in ("architectures", "model_type", "mlp_bias", "attention_bias",
                                                         "pretraining_tp", "intermediate_size")}
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=None,
                  intermediate_size=dense["intermediate_size"] // experts, num_local_experts=experts,
                  num_experts_per_tok=experts, router_jitter_noise=0.0)
    return config


def dense_to_moe(src: str | Path, dst: str | Path, experts: int = 4) -> Path:
    """Write the Mixtral equivalent of the dense Llama directory `src` to `dst`; returns dst."""
    src, dst = Path(src), Path(dst)
    dense = json.loads((src / "config.json").read_text())
    config = moe_config(dense, experts)
    files = sorted(src.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                m = _MLP.match(name)
                if m is None:
                    out[name] = t
                    continue
                layer, proj = m.groups()
                moe = f"{layer}.block_sparse_moe"
                # gate/up split their rows, down its columns; down is scaled by E (exact: a power of two)
                parts = t.chunk(experts, dim=1 if proj == "down_proj" else 0)
                for e, part in enumerate(parts):
                    part = part * experts if proj == "down_proj" else part
                    out[f"{moe}.experts.{e}.{_MIXTRAL[proj]}.weight"] = part.contiguous()
                if proj == "gate_proj":
                    out[f"{moe}.gate.weight"] = torch.zeros(experts, t.shape[1], dtype=t.dtype)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in _SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dense", help="a dense Llama checkpoint directory (config.json + safetensors)")
    parser.add_argument("out", help="the Mixtral checkpoint directory to write")
    parser.add_argument("--experts", type=int, default=4, help="experts per layer (a power of two)")
    args = parser.parse_args()
    print(dense_to_moe(args.dense, args.out, args.experts))


if __name__ == "__main__":
    main()
