"""Import a script of bench/ (a folder of scripts, not a package) by name, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str):
    """bench/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        # scripts put bench/ first on the path for their siblings; left there, a script's name
        # could shadow a package later tests import
        sys.path[:] = path
    return module
