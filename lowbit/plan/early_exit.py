"""Early-exit arithmetic: what an exit at layer L taken by a fraction R of the tokens is worth at decode.

lowbit's early exit (runtime/early_exit.py) checks the exit at layer L with the final norm and the
head, so every token pays one more read of the output matrix there. A token that exits skips the
layers after L, but their K and V for its position are still filled (from the exit's hidden state),
so those layers' k_proj and v_proj are still read. At batch 1 decode reads every weight once per
token, so time follows bytes:

    exited     = L layers + (N - L) × (k_proj + v_proj) + head + other
    not exited = N layers + 2 × head + other          (the exit check's head, then the final one)
    per token  = R × exited + (1 - R) × not exited     against plain decode's N layers + head + other

The break-even rate is where the two are equal: below it early exit is slower than no exit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lowbit.errors import UsageError
from lowbit.plan.model_shape import ModelShape
from lowbit.plan.weights import PlanFormat, WeightBudget, linear_bytes

KV_PROJECTIONS = ("k_proj", "v_proj")


@dataclass(slots=True)
class ExitEstimate:
    exit_layer: int
    exit_rate: float
    bytes_plain: float  # weight bytes a plain decode step reads
    bytes_exited: float  # ... for a token that exits at the layer
    bytes_not_exited: float  # ... for one that does not (it paid for the check)
    bytes_expected: float
    speedup: float  # plain ÷ expected bytes: the batch-1 decode speedup where bandwidth bounds it
    break_even_rate: float  # the exit rate below which early exit is slower than plain decoding

    def to_dict(self) -> dict:
        return asdict(self)


def check_exit(exit_layer: int | None, exit_rate: float | None, num_layers: int) -> None:
    if (exit_layer is None) != (exit_rate is None):
        raise UsageError("--exit-layer and --exit-rate go together (the layer an exit is checked at, and the "
                         "fraction of tokens that leave there)")
    if exit_layer is not None and not 1 <= exit_layer < num_layers:
        raise UsageError(f"--exit-layer must be in [1, {num_layers - 1}] for this {num_layers}-layer model, "
                         f"got {exit_layer}")
    if exit_rate is not None and not 0 <= exit_rate <= 1:
        raise UsageError(f"--exit-rate must be in [0, 1], got {exit_rate}")


def estimate_exit(shape: ModelShape, fmt: PlanFormat, budget: WeightBudget, plain_bytes: float, exit_layer: int,
                  exit_rate: float) -> ExitEstimate:
    """plain_bytes: what one plain decode step reads (estimate.weight_bytes_read at one token)."""
    check_exit(exit_layer, exit_rate, shape.num_layers)
    head, other = budget.output_bytes, budget.other_bytes
    per_layer = (plain_bytes - head - other) / shape.num_layers  # the active share of a MoE layer too
    kv_proj = sum(linear_bytes(fmt, lin.out_features, lin.in_features) for lin in shape.linears
                  if lin.name in KV_PROJECTIONS)
    skipped = shape.num_layers - exit_layer
    exited = exit_layer * per_layer + skipped * kv_proj + head + other
    not_exited = plain_bytes + head
    expected = exit_rate * exited + (1 - exit_rate) * not_exited
    # R × exited + (1 − R) × not_exited = plain  ⇔  R = head ÷ (not_exited − exited), below 1 while a layer
    # outweighs its own k/v projections
    break_even = head / (not_exited - exited)
    return ExitEstimate(exit_layer, exit_rate, plain_bytes, exited, not_exited, expected, plain_bytes / expected,
                        break_even)
