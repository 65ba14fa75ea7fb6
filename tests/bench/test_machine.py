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


def test_results_file_by_cpu_class_or_by_tag(monkeypatch):
    import pytest

    machine = load_bench("machine")
    build = __import__("lowbit.native.build", fromlist=["_cpu_flags"])
    monkeypatch.delenv("LOWBIT_RESULTS_TAG", raising=False)
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse avx2 avx512f")
    assert machine.results_file("vs_x").name == "vs_x.json"
    monkeypatch.setattr(build, "_cpu_flags", lambda: "fpu sse avx2")
    assert machine.results_file("vs_x").name == "vs_x-avx2.json"
    monkeypatch.setenv("LOWBIT_RESULTS_TAG", "zen4")  # another machine of a class: its own file
    assert machine.results_file("vs_x").name == "vs_x-zen4.json"
    monkeypatch.setenv("LOWBIT_RESULTS_TAG", "../up")
    with pytest.raises(SystemExit, match="LOWBIT_RESULTS_TAG"):
        machine.results_file("vs_x")
