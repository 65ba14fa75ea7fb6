"""bench/calibration.py's rows are what bench/plots.py's quality picture reads, and its markdown
picks the right best recipe."""

from __future__ import annotations

import json

import pytest

from tests.bench.bench_scripts import load_bench


def _row(fmt, method, pct, bpw, kld, ppl=20.0):
    return {"model": "gemma3-270m", "format": fmt, "method": method, "outliers_pct": pct, "linear_bpw": bpw,
            "ppl": ppl, "ppl_err": 0.5, "kld": kld, "kld_err": kld / 50, "same_top": 80.0, "quantize_s": 3.0,
            "eval_s": 2.0, "notes": []}


def _report():
    rows = [_row("bf16", "rtn", 0.0, 16.0, 0.0, ppl=18.0),
            _row("int4-g64", "rtn", 0.0, 4.25, 0.30), _row("int4-g64", "gptq", 0.0, 4.25, 0.15),
            _row("int4-g64", "awq", 0.0, 4.25, 0.20), _row("int4-g64", "awq+gptq", 0.0, 4.25, 0.14),
            _row("int4-g64", "awq+gptq", 0.5, 4.49, 0.09), _row("int4-g64", "awq+gptq", 1.0, 4.73, 0.05),
            _row("int8", "gptq", 0.0, 8.03, 0.002)]
    return {"model": "gemma3-270m", "calibration": "wiki-calib 8x256", "eval_data": "wiki-eval", "ctx": 512,
            "chunks": 2, "chunks_run": 2, "command": "python bench/calibration.py --model gemma3-270m", "rows": rows}


def test_configurations_and_best_recipe():
    calib = load_bench("calibration")
    configs = calib.configurations(["int4-g64", "nf4"], ["rtn", "gptq"], [0.0, 0.1], ["nf4"], ["gptq"],
                                   calib.parse_best("nf4:gptq:0.1,int4-asym-g32:awq+gptq:0.2"))
    assert configs == [("int4-g64", "rtn", 0.0), ("int4-g64", "gptq", 0.0), ("nf4", "rtn", 0.0), ("nf4", "gptq", 0.0),
                       ("nf4", "gptq", 0.1), ("int4-asym-g32", "awq+gptq", 0.2)]
    # --formats "" --methods "": only the --best configurations
    assert calib.configurations([], [], [0.0, 0.1], [], [], calib.parse_best("nf4:gptq:0.14")) == [("nf4", "gptq", 0.14)]
    text = calib.markdown(_report())
    assert "| int4-g64 (4.250) | 0.3000 | 0.1500 | 0.2000 | 0.1400 |" in text
    assert "| int4-g64 | awq+gptq | 0.1400 (4.25) | 0.0900 (4.49) | 0.0500 (4.73) |" in text
    # 1 % outliers has the lowest KLD but 4.73 bits; within 4.5 bits the 0.5 % row wins
    assert "Best within 4.5 bits/weight on the Linears: **int4-g64 awq+gptq + 0.5 % outliers**" in text


def test_plots_draw_calibration_rows(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    plots = load_bench("plots")
    monkeypatch.setattr(plots, "RESULTS", tmp_path)
    (tmp_path / "calibration.json").write_text(json.dumps(_report()))  # one rows file, the model named inside
    assert plots.quality_models() == ["gemma3-270m"]
    rows, note = plots.quality_rows("gemma3-270m")
    assert len(rows) == 8 and "ctx 512, 2 chunks" in note
    assert "quality_vs_bits_gemma3-270m.png" in plots.pictures()
    out = tmp_path / "q.png"
    assert plots.plot_quality(out, "gemma3-270m")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
