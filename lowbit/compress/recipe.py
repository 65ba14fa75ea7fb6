"""Recipes: which format each Linear gets, by module-name pattern (mixed precision).

A recipe is an ordered list of rules; for each module the FIRST rule whose pattern matches wins,
and a module no rule matches stays dense. A rule's pattern is an fnmatch glob over the full
Hugging Face module name (`model.layers.*.mlp.down_proj`; `*` also crosses dots) or, prefixed
with `re:`, a Python regular expression that must match the whole name
(`re:model\\.layers\\.(0|1)\\..*`). The format `dense` keeps matching modules unquantized.

File format (YAML or JSON; a bare list of rules works too):

    rules:
      - pattern: "model.layers.*.mlp.down_proj"
        format: int8
      - pattern: "*"
        format: nvfp4
      - pattern: "*.self_attn.*"
        format: int4
        group_size: 64
        options: {scale_rule: absmax}     # parse_spec keywords: scale_rule, scale_dtype, double_quant

Every rule must match at least one module (a typo would otherwise silently leave layers in the
wrong format); `match_rules` raises UsageError naming the rule that matched nothing.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from lowbit.compress.options import SpecOptions
from lowbit.errors import UsageError
from lowbit.quant.spec import FormatSpec, parse_spec

DENSE = "dense"
_RULE_KEYS = {"pattern", "format", "group_size", "options"}


@dataclass(slots=True, frozen=True)
class RecipeRule:
    pattern: str  # fnmatch glob, or "re:<regex>"
    spec: FormatSpec | None  # None: keep matching modules dense
    source: str = ""  # where the rule came from, for error messages ("recipe.yaml rule 2", "--skip")

    def matches(self, module: str) -> bool:
        if self.pattern.startswith("re:"):
            return re.fullmatch(self.pattern[3:], module) is not None
        return fnmatch.fnmatchcase(module, self.pattern)

    @property
    def label(self) -> str:
        return self.spec.label if self.spec is not None else DENSE


@dataclass(slots=True, frozen=True)
class Recipe:
    rules: tuple[RecipeRule, ...]

    def with_skips(self, patterns: list[str] | tuple[str, ...]) -> Recipe:
        """Skip patterns (`--skip`) keep modules dense and take precedence over every rule."""
        skips = tuple(make_rule(p, None, source=f"--skip {p}") for p in patterns)
        return Recipe(skips + self.rules)

    def to_list(self) -> list[dict]:
        return [{"pattern": r.pattern, "format": r.label} for r in self.rules]


def make_rule(pattern: str, spec: FormatSpec | None, source: str = "") -> RecipeRule:
    pattern = str(pattern).strip()
    if not pattern:
        raise UsageError(f"{source or 'recipe'}: empty module pattern")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise UsageError(f"{source or 'recipe'}: bad regular expression '{pattern[3:]}': {exc}") from None
    return RecipeRule(pattern=pattern, spec=spec, source=source)


def single_format(spec: FormatSpec) -> Recipe:
    """The recipe of `--format F`: every module in one format."""
    return Recipe((make_rule("*", spec, source=f"--format {spec.label}"),))


def parse_rule(entry: object, where: str) -> RecipeRule:
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: a rule must be a mapping with 'pattern' and 'format', got {entry!r}")
    unknown = sorted(set(entry) - _RULE_KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(_RULE_KEYS))})")
    if "pattern" not in entry or "format" not in entry:
        raise UsageError(f"{where}: a rule needs both 'pattern' and 'format'")
    fmt = str(entry["format"]).strip().lower()
    given = entry.get("options") or {}
    options = SpecOptions.from_mapping(given, where)
    group = entry.get("group_size")
    if fmt == DENSE:
        if group is not None or given:
            raise UsageError(f"{where}: format 'dense' takes no group_size or options")
        return make_rule(entry["pattern"], None, source=where)
    # YAML's `true` is an int to Python, and 0 or -5 would otherwise reach parse_spec without the key's name
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group == 0 or group < -1):
        raise UsageError(f"{where}: group_size must be -1 (one scale per output row) or a positive integer, got {group!r}")
    try:
        spec = parse_spec(fmt, group, **options.keywords())
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return make_rule(entry["pattern"], spec, source=where)


def parse_recipe(data: object, name: str = "recipe") -> Recipe:
    if isinstance(data, dict):
        if set(data) - {"rules"}:
            raise UsageError(f"{name}: top-level keys must be just 'rules', found {', '.join(sorted(data))}")
        data = data.get("rules")
    if not isinstance(data, list) or not data:
        raise UsageError(f"{name}: expected a non-empty list of rules (or a mapping with 'rules')")
    return Recipe(tuple(parse_rule(entry, f"{name} rule {i + 1}") for i, entry in enumerate(data)))


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read a YAML (.yaml/.yml) or JSON recipe file; one-line UsageError for anything malformed."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UsageError(f"recipe file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - yaml and json raise unrelated types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"recipe {path.name} is not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {first}") from None
    return parse_recipe(data, path.name)


def match_rules(recipe: Recipe, modules: list[str], also: list[str] = ()) -> dict[str, RecipeRule | None]:
    """module -> the first rule that matches it (None: no rule, stays dense).

    Raises UsageError for a rule that matches no module at all (`also`: modules matched elsewhere,
    which count as matches here: the MoE routers a router-only rule quantizes)."""
    out: dict[str, RecipeRule | None] = {}
    used = [False] * len(recipe.rules)
    for module in modules:
        out[module] = None
        for i, rule in enumerate(recipe.rules):
            if rule.matches(module):
                out[module] = rule
                used[i] = True
                break
    for rule, hit in zip(recipe.rules, used):
        if not hit and not any(rule.matches(m) for m in (*modules, *also)):
            example = modules[0] if modules else "none"
            raise UsageError(f"{rule.source or 'recipe'}: pattern '{rule.pattern}' matches no quantizable module (e.g. {example})")
    return out
