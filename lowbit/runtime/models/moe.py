"""The sparse mixture-of-experts MLP that every MoE family shares (Mixtral, Qwen2/3-MoE, OLMoE).

A router picks `top_k` of `num_experts` gated MLPs per token; their outputs, scaled by the routing
weights, are summed. The families differ only in ModelConfig.moe's facts (renormalization, the dtype
the weights scale in, Qwen2-MoE's shared expert), never in code paths chosen by model name.

Module names follow the per-expert Hugging Face layout (`mlp.gate.weight`,
`mlp.experts.<e>.gate_proj.weight`, ...): each expert is an ordinary `GatedMLP` of `make_linear`
projections, so quantized checkpoints swap them for QuantLinears per expert and fusion.py joins an
expert's gate/up like a dense MLP's. runtime/moe_weights.py maps the other checkpoint layouts
(transformers' fused [E, 2I, H] tensors, Mixtral's w1/w2/w3) onto these names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.kernels import cpu_moe
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.layers import GatedMLP


class Gate(nn.Module):
    """A dense weight [out, hidden]: the router (out = experts) or Qwen2-MoE's shared-expert gate
    (out = 1). Deliberately not a make_linear projection, so quantization never replaces it: a
    rounded router weight could flip a token's choice of experts."""

    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """forward(x [..., hidden]) -> [..., hidden]: each token through its top-k experts, weighted."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        hidden = config.hidden_size
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        # Calibration (compress/calibrate.py sets it): every token goes through every expert, so
        # each expert's Linears see statistics even when the text routes few or no tokens to it,
        # while the output still sums only the routed experts, as inference does.
        self.every_expert = False
        self.gate = Gate(hidden, moe.num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, moe.intermediate_size, config.hidden_act) for _ in range(moe.num_experts)
        )
        if moe.shared_expert_size is not None:
            self.shared_expert = GatedMLP(hidden, moe.shared_expert_size, config.hidden_act)
            self.shared_expert_gate = Gate(hidden, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, experts [N, k] int64) for rows [N, hidden].

        The logits accumulate in float64 and round to float32: a float32 GEMM's blocking can change
        a logit's last bit with the number of rows, and top-k turns a last bit into another expert,
        so this keeps a token's routing independent of whatever else is in the batch. Softmax,
        top-k and the renormalization run in float32, as transformers does. On CPU in float32 the C
        routing (kernels/cpu_moe.py) computes the same steps, so the one-call decode step routes alike."""
        if cpu_moe.usable(rows, self.gate.weight):  # the one-call decode step routes through the same C
            return cpu_moe.route(rows, self.gate.weight, self.top_k, self.norm_topk_prob)
        logits = F.linear(rows.double(), self.gate.weight.double()).float()
        weights, experts = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def shared_gate(self, rows: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE's sigmoid gate of the shared expert per row, [N, 1]."""
        if cpu_moe.usable(rows, self.shared_expert_gate.weight):
            return cpu_moe.shared_gate(rows, self.shared_expert_gate.weight)
        return torch.sigmoid(self.shared_expert_gate(rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(rows)
        # Group the (token, slot) pairs by expert: each expert then runs one matmul over all its
        # tokens, and experts no token chose are never touched (at batch 1, only top_k of them).
        slots = experts.flatten()
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        scale = weights.flatten()[order, None]
        if self.weights_in_model_dtype:
            scale = scale.to(x.dtype)  # Qwen/OLMoE round the weights first; Mixtral scales in float32
        out = torch.zeros_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts):
            if self.every_expert:
                idx = tokens[start : start + count]
                y = expert(rows).index_select(0, idx)
                out.index_add_(0, idx, (y * scale[start : start + count]).to(out.dtype))
                start += count
            elif count:
                idx = tokens[start : start + count]
                y = expert(rows.index_select(0, idx))
                # a token picks distinct experts, so idx has no repeats: index_add_ is deterministic
                out.index_add_(0, idx, (y * scale[start : start + count]).to(out.dtype))
                start += count
        if self.shared_expert is not None:
            out = out + self.shared_gate(rows) * self.shared_expert(rows)
        return out.view(x.shape)
