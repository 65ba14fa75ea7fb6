"""bench/weight_error.py's relative MSE is Σ(ŵ − w)² / Σw² over the decoder Linears, computed directly."""

from __future__ import annotations

import torch

from lowbit.quant.registry import as_spec, get_format
from lowbit.runtime.loader import load_model
from tests.bench.bench_scripts import load_bench


def test_relative_mse_matches_direct_sum(tiny_float_model):
    src = tiny_float_model("llama")
    rows = load_bench("weight_error").weight_errors(str(src), ["int8", "int4-g32"])
    model = load_model(src, dtype=torch.float32)
    expected = {}
    for f in ("int8", "int4-g32"):
        spec = as_spec(f)
        err = norm = 0.0
        for name, mod in model.named_modules():
            if ".layers." in name and name.endswith("proj") and isinstance(mod, torch.nn.Linear):
                w = mod.weight.detach().float()
                q = get_format(spec).quantize(w, spec).dequantize(torch.float32)
                err += float(((q - w) ** 2).sum())
                norm += float((w * w).sum())
        expected[f] = err / norm
    assert [r["format"] for r in rows] == ["int8", "int4-g32"]
    for r in rows:
        assert abs(r["relative_mse"] - expected[r["format"]]) <= 1e-6 * expected[r["format"]]
    assert rows[0]["vs_first"] == 1.0 and rows[1]["vs_first"] > 10  # 4 bits are far coarser than 8
