"""How `--help` names arguments and option values: the conventions of every Unix tool, not typer's.

typer 0.29 shows a Python type after every parameter (`--json <bool>`, `--stop <list[str]>`) and
writes required arguments as `{model}`. Here a flag shows nothing after its name, a value shows an
upper-case placeholder (N, X, TEXT, PATH, or the option's own metavar), and arguments read MODEL
and [PROMPT] in the usage line, the table and the errors ("Missing argument 'MODEL'").
Typer's classes are patched where they exist, so an older or newer typer keeps its own help.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import get_args, get_origin

try:
    from typer.core import TyperArgument, TyperOption
except ImportError:  # pragma: no cover - a typer without these classes renders help its own way
    TyperArgument = TyperOption = None

_PLACEHOLDERS = {int: "N", float: "X", str: "TEXT", Path: "PATH"}


def _placeholder(param) -> str | None:
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None  # a flag takes no value: nothing to show
    if param.metavar is not None:
        return param.metavar
    descriptor = getattr(param, "type_descriptor", None)
    annotation = getattr(descriptor, "annotation", None)
    if get_origin(annotation) is list:  # a repeatable option: the placeholder of one value
        annotation = (get_args(annotation) or (str,))[0]
    return _PLACEHOLDERS.get(annotation, "VALUE")


def _argument_name(self) -> str:
    return self.metavar if self.metavar is not None else self.name.upper()


def _argument_usage(self) -> str:
    name = _argument_name(self)
    name = name if self.required else f"[{name}]"
    return name + ("..." if self.nargs != 1 else "")


def install() -> None:
    if TyperOption is None or not hasattr(TyperOption, "display_type_rich"):
        return
    TyperOption.display_type_rich = lambda self, ctx: _placeholder(self)
    if hasattr(TyperArgument, "display_name_raw") and hasattr(TyperArgument, "_usage_display_name"):
        TyperArgument.display_name_raw = property(_argument_name)
        TyperArgument._usage_display_name = _argument_usage
        TyperArgument.display_type_rich = lambda self, ctx: None  # the name column already says what it is


def first_sentence(callback) -> str:
    """The first sentence of a command's docstring on one line: its row in `lowbit --help`."""
    paragraph = " ".join((inspect.getdoc(callback) or "").split("\n\n")[0].split())
    found = re.match(r"(.+?\.)(\s|$)", paragraph)
    return found.group(1) if found else paragraph


def set_short_helps(commands) -> None:
    """Give each registered command (typer CommandInfo) without a short help its docstring's first
    sentence. Why: typer lists a command by its whole first paragraph with the docstring's own line
    breaks, which broke `lowbit --help`'s rows mid-phrase ("for every Linear" / "input, ...")."""
    for info in commands:
        if info.short_help is None and info.callback is not None:
            info.short_help = first_sentence(info.callback)
