"""English Wikipedia text from gensim's test dump, cleaned to plain prose and split by article.

The dump (a shortened `enwiki-latest-pages-articles1` .bz2 inside gensim's test data) is read with
the standard library only: gensim itself is never imported, because its import pulls in scipy.

Cleaning keeps case and punctuation, since perplexity is measured on this text. It removes markup
(templates, tables, references, HTML, file/category links), turns links into their visible text,
keeps section headings and list items as plain lines, and drops the sections that are only
citations or link lists (References, External links, See also, ...).

Split rule: the non-redirect articles of the main namespace, in dump order, are numbered from 0;
article i goes to `wiki-eval` when i % 4 == 1 and to `wiki-calib` otherwise. The sample holds 106
such articles (one more page is in the Wikipedia: namespace), giving 27 eval / 79 calib articles.
"""

from __future__ import annotations

import bz2
import html
import importlib.util
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lowbit.errors import LowbitError

DUMP_NAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
EVAL_EVERY = 4
EVAL_REMAINDER = 1

# Sections whose body is citations or link lists rather than prose.
DROPPED_SECTIONS = frozenset(
    {
        "references", "external links", "see also", "further reading", "notes", "bibliography",
        "sources", "footnotes", "citations", "notes and references", "works cited", "references and notes",
    }
)
# Link namespaces that show no text in the rendered article.
HIDDEN_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})
# Tags whose content is not running text.
DROPPED_TAG_CONTENT = ("ref", "math", "gallery", "timeline", "references", "imagemap", "score", "chem", "ce")


@dataclass(slots=True)
class Article:
    title: str
    text: str


def find_dump() -> Path:
    """The Wikipedia sample inside the pip-installed gensim, located without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.origin:
        raise LowbitError("the gensim package (Wikipedia sample) is not installed; run `pip install --no-deps -r requirements-demo.txt`")
    path = Path(spec.origin).parent / "test" / "test_data" / DUMP_NAME
    if not path.is_file():
        raise LowbitError(f"gensim is installed but its Wikipedia sample is missing: {path}")
    return path


def iter_articles(dump: str | Path | None = None) -> Iterator[Article]:
    """Cleaned main-namespace articles in dump order; redirects and other namespaces skipped."""
    path = Path(dump) if dump is not None else find_dump()
    try:
        with bz2.open(path, "rb") as stream:
            for _, element in ET.iterparse(stream, events=("end",)):
                if _local(element.tag) != "page":
                    continue
                article = _article_from_page(element)
                element.clear()
                if article is not None:
                    yield article
    except (OSError, EOFError, ET.ParseError) as exc:
        raise LowbitError(f"cannot read the Wikipedia dump {path}: {exc}") from exc


def split_articles(articles: list[Article]) -> tuple[list[Article], list[Article]]:
    """(calib, eval): article i goes to eval when i % 4 == 1, else to calib."""
    calib = [a for i, a in enumerate(articles) if i % EVAL_EVERY != EVAL_REMAINDER]
    evaluation = [a for i, a in enumerate(articles) if i % EVAL_EVERY == EVAL_REMAINDER]
    return calib, evaluation


def join_articles(articles: list[Article]) -> str:
    return "\n\n".join(a.text for a in articles if a.text) + "\n"


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _child_text(element: ET.Element, name: str) -> str | None:
    for child in element.iter():
        if _local(child.tag) == name:
            return child.text
    return None


def _article_from_page(page: ET.Element) -> Article | None:
    if (_child_text(page, "ns") or "").strip() != "0":
        return None
    if any(_local(child.tag) == "redirect" for child in page):
        return None
    markup = _child_text(page, "text") or ""
    if markup.lstrip()[:9].upper() == "#REDIRECT":
        return None
    return Article(title=_child_text(page, "title") or "", text=clean_wikitext(markup))


# ---------------------------------------------------------------------------------------------
# wikitext → plain text

_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
_SELF_CLOSING_REF = re.compile(r"<ref\b[^>]*/\s*>", re.I)
_DROPPED_ELEMENTS = re.compile(
    r"<(" + "|".join(DROPPED_TAG_CONTENT) + r")\b[^>]*>.*?</\1\s*>", re.I | re.S
)
# Inline templates whose rendering is one of their own arguments (no nested markup inside).
_TEXT_TEMPLATE = re.compile(r"\{\{\s*(lang|lang-[A-Za-z-]+|nowrap|nobr|convert)\s*\|([^{}\[\]]*)\}\}", re.I)
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:|mailto:|//)[^\s\]]*(?:\s+([^\]]*))?\]")
_HIDDEN_LINK_START = re.compile(r"\[\[\s*(?:" + "|".join(HIDDEN_LINK_NAMESPACES) + r")\s*:", re.I)
_INNER_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_LINE_BREAK_TAG = re.compile(r"<br\s*/?>", re.I)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*>")
_EMPHASIS = re.compile(r"'{2,}")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_SPACES = re.compile(r"[ \t\u00a0]+")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?)])")
_EMPTY_PARENS = re.compile(r"\(\s*[,;]?\s*\)")
_INTERLANGUAGE = re.compile(r"^[a-z][a-z-]{1,11}:")
_HEADING_MARK = "\x00"


def clean_wikitext(markup: str) -> str:
    """Plain readable text from one article's wikitext (case and punctuation kept)."""
    text = _COMMENT.sub("", markup)
    text = _SELF_CLOSING_REF.sub("", text)
    text = _DROPPED_ELEMENTS.sub("", text)
    text = _TEXT_TEMPLATE.sub(_template_text, text)
    text = _remove_nested(text, "{{", "}}")
    text = _remove_nested(text, "{|", "|}")
    text = _remove_hidden_links(text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    text = _replace_internal_links(text)
    text = _LINE_BREAK_TAG.sub(" ", text)
    text = _HTML_TAG.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = html.unescape(text)
    return _tidy_lines(text)


def _template_text(match: re.Match) -> str:
    name = match.group(1).strip().lower()
    args = [a.strip() for a in match.group(2).split("|") if "=" not in a]
    if name == "lang":
        return args[1] if len(args) > 1 else ""
    if name == "convert":
        return " ".join(args[:2])
    return args[0] if args else ""


def _remove_nested(text: str, open_mark: str, close_mark: str) -> str:
    """Drop every balanced open_mark … close_mark span, nested ones included.

    An opener that is never closed is kept as literal text, as MediaWiki shows it.
    """
    out: list[str] = []
    depth = 0
    span_start = 0
    kept_from = 0
    i = 0
    n = len(text)
    while i < n:
        if text.startswith(open_mark, i):
            if depth == 0:
                out.append(text[kept_from:i])
                span_start = i
            depth += 1
            i += len(open_mark)
        elif depth and text.startswith(close_mark, i):
            depth -= 1
            i += len(close_mark)
            if depth == 0:
                kept_from = i
        else:
            i += 1
    if depth:
        # Unclosed: keep the opener as text and clean what follows it.
        rest = text[span_start + len(open_mark):]
        out.append(open_mark + _remove_nested(rest, open_mark, close_mark))
    else:
        out.append(text[kept_from:])
    return "".join(out)


def _remove_hidden_links(text: str) -> str:
    """Drop [[File:…]], [[Category:…]] links whole: captions hold nested links and stray brackets."""
    out: list[str] = []
    pos = 0
    while (match := _HIDDEN_LINK_START.search(text, pos)) is not None:
        out.append(text[pos : match.start()])
        depth, i = 1, match.end()
        while i < len(text) and depth:
            if text.startswith("[[", i):
                depth, i = depth + 1, i + 2
            elif text.startswith("]]", i):
                depth, i = depth - 1, i + 2
            else:
                i += 1
        if depth:
            # Never closed: MediaWiki would show it as text, so keep it rather than lose the rest.
            out.append(text[match.start() :])
            return "".join(out)
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _replace_internal_links(text: str) -> str:
    # Innermost first, so a file caption's own links are resolved before the file link is dropped.
    while True:
        replaced = _INNER_LINK.sub(_link_text, text)
        if replaced == text:
            return replaced
        text = replaced


def _link_text(match: re.Match) -> str:
    inner = match.group(1)
    target, _, label = inner.partition("|")
    target = target.strip()
    namespace = target.lstrip(":").partition(":")[0].strip().lower() if ":" in target else ""
    if namespace in HIDDEN_LINK_NAMESPACES and not target.startswith(":"):
        return ""
    if label.strip():
        # A label with further pipes is a file-style option list; the last part is the caption.
        return label.rsplit("|", 1)[-1].strip() if "|" in label else label.strip()
    if _INTERLANGUAGE.match(target):
        return ""
    return target.lstrip(":").split("#", 1)[0] or target.lstrip(":#")


def _tidy_lines(text: str) -> str:
    lines: list[str] = []
    for raw in text.split("\n"):
        line = _SPACES.sub(" ", raw).strip()
        heading = _HEADING.match(line)
        if heading:
            title = heading.group(2).strip()
            if title:
                lines.append(f"{_HEADING_MARK}{len(heading.group(1))}{title}")
            continue
        line = _LIST_MARKER.sub("", line)
        if line.startswith(("|", "!", "{|", "|}")) or set(line) <= set("-"):
            # Table or template residue, or a horizontal rule.
            line = ""
        line = _EMPTY_PARENS.sub("", line)
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
        lines.append(_SPACES.sub(" ", line).strip())
    return "\n".join(_drop_sections(lines)).strip()


def _drop_sections(lines: list[str]) -> list[str]:
    """Drop citation sections and headings left with no body; collapse blank lines."""
    kept: list[str] = []
    dropping_level = 0
    for line in lines:
        if line.startswith(_HEADING_MARK):
            level, title = int(line[1]), line[2:]
            if dropping_level and level > dropping_level:
                continue
            dropping_level = level if title.strip().lower() in DROPPED_SECTIONS else 0
            if dropping_level:
                continue
            kept.append(line)
        elif not dropping_level:
            kept.append(line)
    out: list[str] = []
    for i, line in enumerate(kept):
        if line.startswith(_HEADING_MARK):
            if not _section_has_body(kept, i):
                continue
            if out and out[-1] != "":
                out.append("")
            out.append(line[2:])
        elif line:
            out.append(line)
        elif out and out[-1] != "":
            out.append("")
    while out and out[-1] == "":
        out.pop()
    return out


def _section_has_body(lines: list[str], index: int) -> bool:
    """True when text follows before the next heading of the same or a higher level."""
    level = int(lines[index][1])
    for line in lines[index + 1:]:
        if line.startswith(_HEADING_MARK):
            if int(line[1]) <= level:
                return False
        elif line:
            return True
    return False
