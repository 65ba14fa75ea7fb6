"""Wikipedia cleaning on crafted wikitext (exact output) and on the real gensim sample."""

from __future__ import annotations

import bz2
import importlib.util

import pytest

from lowbit.data.wiki import clean_wikitext, iter_articles, join_articles, split_articles

SNIPPETS = [
    # templates, nested, and references (paired, self-closing, with templates inside)
    (
        "{{Infobox person|name={{nowrap|A B}}|born={{birth date|1900|1|1}}}}'''Ada''' was a poet.<ref name=\"x\">"
        "{{cite book|title=T}}</ref> She wrote.<ref name=y/> More.",
        "Ada was a poet. She wrote. More.",
    ),
    # links: piped, plain, trailing letters, file with nested caption link, category, interlanguage
    (
        "[[Political philosophy|Politics]] and [[anarchy]] with [[bus]]es."
        "[[File:X.jpg|thumb|right|A [[cat]] sitting]]\n[[Category:Poets]]\n[[de:Anarchismus]]",
        "Politics and anarchy with buses.",
    ),
    # external links, bold/italic, HTML comments and tags, entities
    (
        "See [http://example.org the ''site''] or [http://bare.org].<!-- hidden --> It is <small>small</small>&nbsp;&amp; fine.",
        "See the site or. It is small & fine.",
    ),
    # headings kept as lines, lists kept as lines, tables removed, blank lines collapsed
    (
        "Intro.\n\n\n\n==History==\nOld.\n{| class=\"wikitable\"\n|-\n| a || b\n|}\n===Early===\n* one\n* two\n",
        "Intro.\n\nHistory\nOld.\n\nEarly\none\ntwo",
    ),
    # citation-only sections and headings left without a body are dropped
    (
        "Text.\n==Works==\n{{main|Works}}\n==See also==\n* [[Other]]\n==References==\n{{reflist}}\n===Sub===\nx",
        "Text.",
    ),
    # inline templates whose text is one of their arguments
    ("Greek {{lang|grc|ἀναρχία}} is {{convert|5|km|mi}} long.", "Greek ἀναρχία is 5 km long."),
    # an unclosed template is shown literally, as MediaWiki does
    ("a {{broken b", "a {{broken b"),
]


@pytest.mark.parametrize(("markup", "expected"), SNIPPETS)
def test_clean_wikitext_snippets(markup, expected):
    assert clean_wikitext(markup) == expected


def _dump_available() -> bool:
    return importlib.util.find_spec("gensim") is not None


@pytest.fixture(scope="module")
def articles():
    if not _dump_available():
        pytest.skip("gensim (Wikipedia sample) not installed")
    return list(iter_articles())


def test_real_sample_articles(articles):
    # 106 main-namespace articles; redirects and the one Wikipedia:-namespace page are skipped.
    assert len(articles) == 106
    assert articles[0].title == "Anarchism"
    assert articles[0].text.startswith("Anarchism is a political philosophy that advocates self-governed societies")
    text = join_articles(articles)
    for residue in ("{{", "}}", "[[", "]]", "<ref", "</", "'''", "{|", "&nbsp;", "&amp;"):
        assert residue not in text, residue
    assert all(a.text for a in articles)


def test_real_sample_split(articles):
    calib, evaluation = split_articles(articles)
    assert len(calib) == 79 and len(evaluation) == 27
    assert {a.title for a in calib}.isdisjoint(a.title for a in evaluation)
    assert len(calib) + len(evaluation) == len(articles)
    assert evaluation[0].title == articles[1].title
    eval_bytes = len(join_articles(evaluation).encode())
    calib_bytes = len(join_articles(calib).encode())
    assert eval_bytes >= 400_000
    assert calib_bytes > 2 * eval_bytes


def test_iter_articles_on_crafted_dump(tmp_path):
    xml = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
<page><title>A</title><ns>0</ns><revision><text>'''A''' is first.</text></revision></page>
<page><title>R</title><ns>0</ns><redirect title="A"/><revision><text>#REDIRECT [[A]]</text></revision></page>
<page><title>R2</title><ns>0</ns><revision><text>#redirect [[A]]</text></revision></page>
<page><title>Talk:A</title><ns>1</ns><revision><text>chat</text></revision></page>
<page><title>B</title><ns>0</ns><revision><text>B is [[second|2nd]].</text></revision></page>
</mediawiki>"""
    dump = tmp_path / "dump.xml.bz2"
    dump.write_bytes(bz2.compress(xml.encode()))
    got = [(a.title, a.text) for a in iter_articles(dump)]
    assert got == [("A", "A is first."), ("B", "B is 2nd.")]
    assert join_articles([a for a in iter_articles(dump)]) == "A is first.\n\nB is 2nd.\n"
