"""The recipes shipped in bench/recipes load, cover every Linear of a Llama-shaped model, and cost
the bits/weight that docs/benchmarks.md quotes for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowbit.quant.outlier_matrix import BITS_PER_OUTLIER
from lowbit.compress.recipe import load_recipe, match_rules
from lowbit.quant.registry import bits_per_weight

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "bench" / "recipes").glob("*.yaml"))

# SmolLM2-135M's decoder Linears: [out_features, in_features]
SMOLLM2 = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
           "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
           "mlp.down_proj": (576, 1536)}
MODULES = {f"model.layers.{i}.{name}": shape for i in range(30) for name, shape in SMOLLM2.items()}


def linear_bits(recipe_path: Path, outliers_pct: float = 0.0) -> float:
    rules = match_rules(load_recipe(recipe_path), list(MODULES))
    bits = weights = 0.0
    for module, rule in rules.items():
        shape = MODULES[module]
        n = shape[0] * shape[1]
        bits += (16.0 if rule is None or rule.spec is None else bits_per_weight(rule.spec, shape)) * n
        weights += n
    return bits / weights + BITS_PER_OUTLIER * outliers_pct / 100


def test_recipes_are_shipped():
    assert len(RECIPES) >= 5


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_quantizes_every_linear(path):
    rules = match_rules(load_recipe(path), list(MODULES))
    assert all(rule is not None and rule.spec is not None for rule in rules.values())


@pytest.mark.parametrize(("name", "pct", "expected"), [
    ("v5-int4-asym-g32-dq.yaml", 0.14, 4.4982),  # the recipe level with Q4_K_M
    ("v5-int4-asym-g32-dq.yaml", 0.1, 4.4790),
    ("v6-int4-asym-g32-dq.yaml", 0.07, 4.4967),
    ("v6-int4-asym-g64.yaml", 0.1, 4.4855),
])
def test_best_recipes_fit_the_budget(name, pct, expected):
    bits = linear_bits(ROOT / "bench" / "recipes" / name, pct)
    assert bits == pytest.approx(expected, abs=1e-3)
    assert bits <= 4.5


def test_layout_bits_match_the_measured_row():
    # the bench counts bits from the quantized tensors it made; the layout must agree exactly
    rows = json.loads((ROOT / "bench" / "results" / "calibration-dq-512x512-10chunks.json").read_text())["rows"]
    row = next(r for r in rows if r["format"].endswith("v5-int4-asym-g32-dq.yaml") and r["outliers_pct"] == 0.14)
    assert linear_bits(ROOT / "bench" / "recipes" / "v5-int4-asym-g32-dq.yaml", 0.14) == pytest.approx(row["linear_bpw"], abs=2e-5)
