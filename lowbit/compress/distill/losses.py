"""The two losses: a decoder layer's output against the teacher's (normalized MSE), and the
KL divergence KL(teacher || student) of the next-token distributions, mean per token."""

from __future__ import annotations

import torch


def normalized_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean((out - target)²) / mean(target²): the same learning rate suits every layer, whatever the
    size of its hidden states (SmolLM2's grow a hundredfold from the first layer to the last)."""
    return (out - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-20)


def kl_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """Σ_v p_t (log p_t − log p_s), averaged over every position, in float32, `rows` positions at a
    time so that only one block of [rows, vocab] softmax intermediates is alive beside the logits."""
    s = student_logits.reshape(-1, student_logits.shape[-1])
    t = teacher_logits.reshape(-1, teacher_logits.shape[-1])
    total = s.new_zeros(())
    for lo in range(0, s.shape[0], rows):
        log_p = torch.log_softmax(t[lo:lo + rows].float(), dim=-1)
        log_q = torch.log_softmax(s[lo:lo + rows].float(), dim=-1)
        total = total + (log_p.exp() * (log_p - log_q)).sum()
    return total / s.shape[0]
