"""bench/machine.py: a script's latest results file, and its --json output."""

from __future__ import annotations

import json

from tests.bench.bench_scripts import load_bench


def test_save_results_writes_the_file_and_prints_only_for_json(tmp_path, capsys):
    machine = load_bench("machine")
    result = {"script": "x", "rows": [1.5, 2]}
    target = tmp_path / "results" / "x.json"
    assert machine.save_results(target, result, False) is False
    assert json.loads(target.read_text()) == result and target.read_text().endswith("\n")
    assert capsys.readouterr().out == ""
    assert machine.save_results(target, {"script": "y"}, True) is True
    assert json.loads(capsys.readouterr().out) == {"script": "y"} == json.loads(target.read_text())
