"""`lowbit doctor`: its JSON shape, the dispatch table in it, the C sources' report (faked here so
the test does not depend on which sources built), and exit 0 whatever the machine."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from lowbit.kernels.dispatch import CPU_FLAGS, TABLE
from lowbit.native import build


@dataclass(frozen=True, slots=True)
class FakeStatus:  # lowbit.native.build.SourceStatus's contract
    source: str
    built: bool
    reason: str
    library: str


FAKE = [FakeStatus("lut_gemv.c", True, "", "/k/liblut.so"), FakeStatus("int4_vnni.c", False, "no C compiler", "")]


def doctor_json(run_cli):
    code, out, err = run_cli(["doctor", "--json"])
    assert code == 0, err
    return json.loads(out)


def test_doctor_json_shape(run_cli, monkeypatch):
    monkeypatch.setattr(build, "report", lambda *a, **k: FAKE, raising=False)
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")
    monkeypatch.delenv("LOWBIT_NO_NATIVE", raising=False)
    r = doctor_json(run_cli)
    assert set(r) == {"torch", "cuda", "cpu", "kernel_paths", "int4_activations", "dense_activations", "int8_activations",
                      "native", "env"}
    assert set(r["torch"]) == {"version", "threads", "triton"} and r["torch"]["threads"] >= 1
    assert isinstance(r["cuda"]["available"], bool)
    assert r["cpu"]["flags"] is None or set(r["cpu"]["flags"]) == set(CPU_FLAGS)
    paths = r["kernel_paths"]
    assert [p["name"] for p in paths] == [p.name for p in TABLE]
    for p in paths:
        assert isinstance(p["usable"], bool) and (p["reason"] is None) == p["usable"], p
    assert paths[-1]["name"] == "reference" and paths[-1]["usable"]
    assert set(r["int4_activations"]) == {"mode", "note"} and r["int4_activations"]["mode"] in ("int8", "bf16", None)
    assert r["dense_activations"] == {"mode": "f32", "note": "$LOWBIT_DENSE_ACTIVATIONS"}  # conftest's f32
    assert r["int8_activations"] == {"mode": "f32", "note": "$LOWBIT_INT8_ACTIVATIONS"}  # conftest's f32
    assert r["native"] == {"note": None, "sources": [
        {"source": "lut_gemv.c", "built": True, "reason": None, "library": "/k/liblut.so"},
        {"source": "int4_vnni.c", "built": False, "reason": "no C compiler", "library": None}]}
    env = {e["name"]: e for e in r["env"]}
    assert {"LOWBIT_KERNEL", "LOWBIT_INT4_ACTIVATIONS", "LOWBIT_INT8_ACTIVATIONS", "LOWBIT_NO_NATIVE", "TRITON_INTERPRET"} <= set(env)
    assert env["LOWBIT_KERNEL"]["value"] == "reference" and env["LOWBIT_NO_NATIVE"]["value"] is None
    assert all(e["meaning"] for e in r["env"])


@pytest.mark.parametrize("kind", ["missing", "failing"])
def test_doctor_without_a_native_report_still_exits_0(run_cli, monkeypatch, kind):
    if kind == "missing":
        monkeypatch.delattr(build, "report", raising=False)
    else:
        def broken(*args, **kwargs):
            raise OSError("disk full")

        monkeypatch.setattr(build, "report", broken, raising=False)
    r = doctor_json(run_cli)
    assert r["native"]["sources"] is None and r["native"]["note"]
    assert kind != "failing" or "disk full" in r["native"]["note"]


def test_doctor_human_output_names_every_path(run_cli, monkeypatch):
    monkeypatch.setattr(build, "report", lambda *a, **k: FAKE, raising=False)
    code, out, err = run_cli(["doctor"])
    assert code == 0 and out == ""
    flat = " ".join(err.split())
    for p in TABLE:
        assert p.name in flat
    assert "int4_vnni.c not built: no C compiler" in flat and "LOWBIT_NO_NATIVE" in flat


def test_doctor_reports_an_invalid_activation_switch(run_cli, monkeypatch):
    from lowbit.kernels import cpu_int4dot

    if not cpu_int4dot.available():
        pytest.skip("no int4 decode kernel on this machine")
    monkeypatch.setenv("LOWBIT_INT4_ACTIVATIONS", "int7")
    r = doctor_json(run_cli)
    assert r["int4_activations"]["mode"] is None and "int8 or bf16" in r["int4_activations"]["note"]


def test_doctor_reports_the_default_dense_activations_and_a_bad_switch(run_cli, monkeypatch):
    from lowbit.kernels import cpu_f32

    monkeypatch.delenv("LOWBIT_DENSE_ACTIVATIONS")
    expected = ("bf16", "default: the CPU has AVX512-BF16") if cpu_f32.bf16_available() else ("f32", "default: no AVX512-BF16")
    assert tuple(doctor_json(run_cli)["dense_activations"].values()) == expected
    monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "fp8")
    r = doctor_json(run_cli)["dense_activations"]
    assert r["mode"] is None and "f32 or bf16, not 'fp8'" in r["note"]
