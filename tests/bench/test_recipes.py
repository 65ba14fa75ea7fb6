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
GEMMA3 = {"self_attn.q_proj": (1024, 640), "self_attn.k_proj": (256, 640), "self_attn.v_proj": (256, 640),
          "self_attn.o_proj": (640, 1024), "mlp.gate_proj": (2048, 640), "mlp.up_proj": (2048, 640),
          "mlp.down_proj": (640, 2048)}
# decoder Linears of the models bench/calibration.py's rows file may hold
MODEL_MODULES = {"smollm2-135m": MODULES,
                 "gemma3-270m": {f"model.layers.{i}.{name}": shape for i in range(18) for name, shape in GEMMA3.items()}}


def linear_bits(recipe_path: Path, outliers_pct: float = 0.0, whole_outliers: bool = False, modules=None) -> float:
    """Bits/weight over the Linears (SmolLM2's unless `modules` says); with whole_outliers, each matrix
    keeps round(n · pct / 100) weights, as compress/outliers.py counts them (else the nominal pct)."""
    modules = MODULES if modules is None else modules
    rules = match_rules(load_recipe(recipe_path), list(modules))
    bits = weights = 0.0
    for module, rule in rules.items():
        shape = modules[module]
        n = shape[0] * shape[1]
        bits += (16.0 if rule is None or rule.spec is None else bits_per_weight(rule.spec, shape)) * n
        if whole_outliers:
            bits += BITS_PER_OUTLIER * int(round(n * outliers_pct / 100.0))
        weights += n
    return bits / weights + (0.0 if whole_outliers else BITS_PER_OUTLIER * outliers_pct / 100)


def test_recipes_are_shipped():
    assert len(RECIPES) >= 5


HEAD = {"lm_head": (49152, 576)}  # SmolLM2's tied embedding/head, quantized with --quantize-head


def _names_head(path: Path) -> bool:
    return any(rule.pattern == "lm_head" for rule in load_recipe(path).rules)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_quantizes_every_linear(path):
    # a recipe with an lm_head rule is meant for --quantize-head: the head is then one of the modules
    modules = list(MODULES) + (list(HEAD) if _names_head(path) else [])
    rules = match_rules(load_recipe(path), modules)
    assert all(rule is not None and rule.spec is not None for rule in rules.values())


def test_the_q4km_budget_recipe_fits_q4km_bytes():
    # issue 27's budget: no more bytes than llama.cpp's Q4_K_M file of SmolLM2 (105.5 MB), the
    # quantized tied head, norms and 0.1 % outliers included (the measured directory: 100.1 MB)
    from lowbit.quant.registry import weight_bytes

    path = ROOT / "bench" / "recipes" / "q4km-budget.yaml"
    modules = {**MODULES, **HEAD}
    rules = match_rules(load_recipe(path), list(modules))
    total = sum(weight_bytes(rules[m].spec, shape) for m, shape in modules.items())
    n_linear = sum(a * b for a, b in MODULES.values())
    total += BITS_PER_OUTLIER * n_linear * 0.1 / 100 / 8 + (2 * 30 + 1) * 576 * 2  # outliers, bf16 norms
    assert rules["lm_head"].spec.bits == 8
    assert 95e6 < total <= 105.5e6


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
    # the bench counts bits from the quantized tensors it made; the layout must agree exactly for
    # every recipe row bench/calibration.py kept (bench/results/calibration.json holds the latest run)
    report = json.loads((ROOT / "bench" / "results" / "calibration.json").read_text())
    assert report["model"] in MODEL_MODULES, f"no Linear shapes here for {report['model']}"
    rows = [r for r in report["rows"] if r["format"].startswith("@bench/recipes/")]
    assert rows, "bench/results/calibration.json has no recipe row to check"
    for row in rows:
        bits = linear_bits(ROOT / row["format"][1:], row["outliers_pct"], whole_outliers=True,
                           modules=MODEL_MODULES[report["model"]])
        assert bits == pytest.approx(row["linear_bpw"], abs=1e-9), row["format"]
