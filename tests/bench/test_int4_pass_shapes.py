"""bench/int4_pass_shapes.py: its C harness builds against native/int4_vnni.c both ways and runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.bench.bench_scripts import load_bench

needs_vnni = pytest.mark.skipif(shutil.which("gcc") is None or "avx512_vnni" not in Path("/proc/cpuinfo").read_text(),
                                reason="needs gcc and AVX512-VNNI")


@needs_vnni
def test_both_pass_shapes_build_and_time_a_layer(tmp_path):
    script = load_bench("int4_pass_shapes")
    times = {}
    for pass_rows in script.SHAPES:
        binary = script.build(pass_rows, tmp_path)
        times[pass_rows] = script.run(binary, rows=8, layers=1, group=32)
    # one layer of SmolLM2's int4 matrices at 8 rows: tens of microseconds, not nothing and not seconds
    assert all(0.005 < t < 50 for t in times.values()), times


def test_rows_below_eight_are_refused(monkeypatch, capsys):
    script = load_bench("int4_pass_shapes")
    monkeypatch.setattr("sys.argv", ["int4_pass_shapes.py", "--rows", "4,16"])
    with pytest.raises(SystemExit, match="8 or more"):
        script.main()


def test_groups_other_than_32_64_128_are_refused(monkeypatch):
    script = load_bench("int4_pass_shapes")
    monkeypatch.setattr("sys.argv", ["int4_pass_shapes.py", "--rows", "8", "--groups", "32,48"])
    with pytest.raises(SystemExit, match="--groups"):
        script.main()
