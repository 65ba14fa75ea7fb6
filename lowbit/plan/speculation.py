"""Speculative decoding arithmetic: what k draft tokens with acceptance rate A are worth.

With each draft token accepted independently with probability A, and the target's own token
added after the first rejection (or after all k), one target pass yields on average
1 + A + A² + … + A^k = (1 − A^(k+1)) / (1 − A) tokens (Leviathan et al., 2023).
A pass costs k draft steps plus one target step that checks k + 1 tokens per sequence.
"""

from __future__ import annotations

from lowbit.errors import UsageError


def check_acceptance(acceptance: float) -> float:
    if not 0 < acceptance <= 1:
        raise UsageError(f"--acceptance must be in (0, 1], not {acceptance}")
    return acceptance


def expected_tokens_per_pass(acceptance: float, draft_tokens: int) -> float:
    """Mean tokens one target pass produces with k = draft_tokens proposals."""
    check_acceptance(acceptance)
    if draft_tokens < 0:
        raise UsageError(f"--draft-tokens must be at least 0, not {draft_tokens}")
    if acceptance == 1:
        return float(draft_tokens + 1)
    return (1 - acceptance ** (draft_tokens + 1)) / (1 - acceptance)


def speculative_cycle_seconds(draft_step_s: float, verify_step_s: float, draft_tokens: int) -> float:
    """Wall time of one round: k sequential draft steps, then one verifying target pass."""
    return draft_tokens * draft_step_s + verify_step_s
