"""book/_ext/book_pages.py without a build: a figure's caption becomes its image's alt text (unless the cell
gave one), and the execution table's emoji become words. tests/test_browser.py checks the built pages."""

from __future__ import annotations

import sys
from pathlib import Path

from docutils import nodes
from docutils.frontend import get_default_settings
from docutils.parsers.rst import Parser
from docutils.utils import new_document

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "book" / "_ext"))
import book_pages  # noqa: E402


def document():
    return new_document("test", get_default_settings(Parser))


def figure(alt=None, caption="Acceptance falls with each draft position."):
    image = nodes.image(uri="_images/abc123.png")
    if alt is not None:
        image["alt"] = alt
    fig = nodes.figure("", image)
    if caption:
        fig += nodes.caption(text=caption)
    return fig, image


def run(transform, doc):
    t = transform.__new__(transform)
    t.document = doc
    t.run()


def test_caption_becomes_alt_text():
    doc = document()
    for alt in (None, "_images/abc123.png", "abc123.png"):
        fig, image = figure(alt)
        doc += fig
        run(book_pages.CaptionAsAlt, doc)
        assert image["alt"] == "Figure: Acceptance falls with each draft position."


def test_alt_text_given_by_the_cell_is_kept():
    doc = document()
    fig, image = figure("Bars of acceptance per register")
    doc += fig
    run(book_pages.CaptionAsAlt, doc)
    assert image["alt"] == "Bars of acceptance per register"


def test_a_figure_without_caption_keeps_its_image_as_it_is():
    doc = document()
    fig, image = figure(caption="")
    doc += fig
    run(book_pages.CaptionAsAlt, doc)
    assert "alt" not in image


def test_emoji_become_words():
    doc = document()
    doc += nodes.paragraph("", "", nodes.Text("\u2705"), nodes.Text(" and \u274c"))
    run(book_pages.PlainSymbols, doc)
    assert doc.astext() == "passed and failed"


def test_bibliography_parses_and_every_cited_key_exists():
    """A merge once dropped an entry's closing brace: sphinxcontrib-bibtex then fails the whole build at its
    first step, with a message far from the cause. Every key a page cites must be an entry."""
    import re
    from pathlib import Path

    import pybtex.database

    root = Path(__file__).resolve().parents[1]
    entries = pybtex.database.parse_file(root / "book" / "references.bib").entries
    pages = [*root.glob("notebooks/*.py"), *root.glob("book/*.md")]
    cited = {key.strip() for page in pages for keys in re.findall(r"\{cite:[pt]\}`([^`]+)`", page.read_text())
             for key in keys.split(",")}
    cited -= {"%s"}  # a format string that builds citations from qmtp.book.published
    assert cited and not cited - set(entries), sorted(cited - set(entries))
