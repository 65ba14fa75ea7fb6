"""The one constructor every projection goes through.

Models call `make_linear` for q/k/v/o, gate/up/down and lm_head and keep the result as a child
module under its Hugging Face name. Quantized checkpoints later swap these modules by name for a
`QuantLinear`, so nothing in a model may reach into a projection's weight directly.
"""

from __future__ import annotations

from torch import nn


def make_linear(in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)
