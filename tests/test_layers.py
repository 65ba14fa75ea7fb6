"""Imports point down the floors of docs/architecture.md, and nowhere else.

Every module under lowbit/ is parsed (not imported) and each `import lowbit.X…` / `from lowbit.X…`
— at the top or inside a function — is checked against the floor plan:

    native < quant < formats, kernels < runtime < compress < cli
    plan and data stand beside runtime: they may use quant and formats (and the root modules)

The root modules errors.py and paths.py are below every floor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lowbit"

# floor -> the floors (besides itself and the root modules) it may import
MAY_IMPORT: dict[str, frozenset[str]] = {
    "native": frozenset(),
    "quant": frozenset({"native"}),
    "formats": frozenset({"native", "quant"}),
    "kernels": frozenset({"native", "quant"}),
    "data": frozenset({"native", "quant", "formats"}),
    "plan": frozenset({"native", "quant", "formats"}),
    "runtime": frozenset({"native", "quant", "formats", "kernels", "data"}),
    "compress": frozenset({"native", "quant", "formats", "kernels", "data", "runtime"}),
    "cli": frozenset({"native", "quant", "formats", "kernels", "data", "plan", "runtime", "compress"}),
}
ROOT_MODULES = frozenset({"errors", "paths"})
ENTRY_POINTS = frozenset({"__init__", "__main__"})  # lowbit/__init__.py and __main__.py may name the CLI


def imported_floors(source: str) -> list[tuple[int, str]]:
    """(line, floor) for every lowbit import in a module's source."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "lowbit" else [f"lowbit.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "lowbit" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def violations(floor: str, source: str) -> list[str]:
    allowed = MAY_IMPORT[floor] | ROOT_MODULES | {floor}
    return [f"line {line}: {floor} imports lowbit.{target}" for line, target in imported_floors(source)
            if target not in allowed]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        yield rel, (rel.parts[0] if len(rel.parts) > 1 else rel.stem)


def test_every_module_sits_on_a_known_floor():
    unknown = {str(rel) for rel, floor in modules() if floor not in MAY_IMPORT and floor not in ROOT_MODULES | ENTRY_POINTS}
    assert not unknown, f"modules outside the floor plan: {sorted(unknown)}"


def test_imports_point_down():
    bad = []
    for rel, floor in modules():
        if floor in MAY_IMPORT:
            bad += [f"lowbit/{rel} {v}" for v in violations(floor, (PACKAGE / rel).read_text())]
        elif floor in ROOT_MODULES:
            bad += [f"lowbit/{rel} line {line}: a root module imports lowbit.{t}"
                    for line, t in imported_floors((PACKAGE / rel).read_text()) if t not in ROOT_MODULES]
    assert not bad, "imports against the floor plan:\n" + "\n".join(bad)


@pytest.mark.parametrize("floor, source", [
    ("quant", "from lowbit.compress.gptq import gptq_quantize\n"),
    ("quant", "def f():\n    from lowbit.kernels import qmatmul\n"),
    ("formats", "import lowbit.runtime.loader\n"),
    ("kernels", "from lowbit.formats import native\n"),
    ("runtime", "from lowbit import compress\n"),
    ("native", "from lowbit.quant.spec import FormatSpec\n"),
    ("plan", "from lowbit.runtime.config import ModelConfig\n"),
])
def test_a_higher_import_is_caught(floor, source):
    assert violations(floor, source), "the checker must flag an import of a higher floor"


@pytest.mark.parametrize("floor, source", [
    ("compress", "from lowbit.runtime.loader import load_model\nfrom lowbit.errors import UsageError\n"),
    ("quant", "from lowbit.native import scale_search\n"),
    ("plan", "from lowbit.quant.registry import weight_bytes\n"),
])
def test_a_lower_import_passes(floor, source):
    assert violations(floor, source) == []
