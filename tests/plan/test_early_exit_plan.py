"""`lowbit plan --exit-layer L --exit-rate R`: the bytes an early exit saves, by hand on SmolLM2's shape."""

from __future__ import annotations

import pytest

from lowbit.errors import UsageError
from lowbit.plan.estimate import Scenario
from lowbit.plan.hardware import Hardware
from lowbit.plan.report import make_plan

# SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64, MLP 1536, tied 49152 x 576 embedding, bf16
LAYER = 2 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
KV_PROJ = 2 * (2 * 192 * 576)
HEAD = 2 * 49152 * 576
NORMS = 2 * (30 * 2 * 576 + 576)


def plan(layer, rate):
    hw = Hardware("test", memory_gib=100.0, bandwidth_gbs=100.0, tflops_bf16=1e9)
    return make_plan("smollm2-135m", hw, Scenario(context=512, concurrency=1), formats=["bf16"], exit_layer=layer,
                     exit_rate=rate)


def test_exit_bytes_by_hand():
    numbers = plan(20, 0.5).tricks[-1].numbers
    plain = 30 * LAYER + HEAD + NORMS
    exited = 20 * LAYER + 10 * KV_PROJ + HEAD + NORMS
    not_exited = plain + HEAD  # the exit check reads the head once more
    assert numbers["bytes_plain"] == pytest.approx(plain)
    assert numbers["bytes_exited"] == pytest.approx(exited)
    assert numbers["bytes_not_exited"] == pytest.approx(not_exited)
    assert numbers["speedup"] == pytest.approx(plain / (0.5 * exited + 0.5 * not_exited))
    # at the break-even rate early exit reads exactly what plain decoding does
    r = numbers["break_even_rate"]
    assert r * exited + (1 - r) * not_exited == pytest.approx(plain)
    assert 0.4 < r < 0.5  # the 57 MB head makes a layer-20 exit pay only when about half the tokens take it


def test_a_late_exit_pays_only_when_nearly_every_token_takes_it_and_the_json():
    numbers = plan(29, 0.5).tricks[-1].numbers
    assert numbers["break_even_rate"] == pytest.approx(HEAD / (LAYER - KV_PROJ + HEAD))  # one layer saved vs a head
    assert numbers["speedup"] < 1
    assert plan(None, None).tricks[-1].buys.startswith("not evaluated")
    assert plan(10, 0.3).to_dict()["settings"]["exit_layer"] == 10


@pytest.mark.parametrize("layer, rate, message", [
    (20, None, "--exit-layer and --exit-rate go together"),
    (30, 0.5, "--exit-layer must be in [1, 29]"),
    (0, 0.5, "--exit-layer must be in [1, 29]"),
    (20, 1.5, "--exit-rate must be in [0, 1]"),
])
def test_bad_exit_values(layer, rate, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan(layer, rate)
