"""Shared fixtures. Tests marked `demo` need `lowbit assets` to have run (.ci/run does it)."""

from __future__ import annotations

import os

import pytest
import torch

from lowbit.paths import data_asset_path, model_asset_path

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _require(path):
    if not path.exists():
        # In CI the assets are installed first, so a missing one is a failure, not a skip.
        if os.environ.get("CI"):
            pytest.fail(f"demo asset missing in CI: {path}")
        pytest.skip(f"demo asset missing: {path} (run `lowbit assets`)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    return _require(model_asset_path("smollm2-135m"))


@pytest.fixture(scope="session")
def gemma3_dir():
    return _require(model_asset_path("gemma3-270m"))


@pytest.fixture(scope="session")
def wiki_eval_path():
    return _require(data_asset_path("wiki-eval"))
