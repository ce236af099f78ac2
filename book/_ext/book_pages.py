"""Sphinx extension: pages read as a book's pages do.

- every figure's image gets its caption as alt text (myst-nb writes the file name), unless the cell gave one
  (`mystnb: image: alt:`);
- the symbols of myst-nb's execution table (U+2705, U+274C) need an emoji font that a plain Linux browser
  lacks, where they show as an empty box: they become words;
- `book_pages.css`: glued values in the weight of the text around them (myst-nb sets them bold), code and
  outputs that wrap inside the column instead of running past it or behind a scroll bar, tables that fit.
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

STATIC = Path(__file__).parent / "static"
CSS = "book_pages.css"
# code points that need a colour-emoji font, and the words that replace them
SYMBOLS = {"\u2705": "passed", "\u274c": "failed"}


def figure_alt(figure: nodes.figure) -> str | None:
    """The text of a figure's caption, as alt text for its image (None without a caption)."""
    caption = next(iter(figure.findall(nodes.caption)), None)
    text = caption.astext().strip() if caption is not None else ""
    return f"Figure: {text}" if text else None


def is_file_name(alt: str | None, uri: str) -> bool:
    return not alt or alt.strip() == uri or Path(alt.strip()).name == Path(uri).name


class CaptionAsAlt(SphinxPostTransform):
    """Set each figure's image alt text from its caption, after glued values are in the caption."""

    default_priority = 20  # after myst-nb's glue and execution-table transforms, before writing

    def run(self, **kwargs) -> None:
        for figure in self.document.findall(nodes.figure):
            alt = figure_alt(figure)
            if alt is None:
                continue
            for image in figure.findall(nodes.image):
                if is_file_name(image.get("alt"), image.get("uri", "")):
                    image["alt"] = alt


class PlainSymbols(SphinxPostTransform):
    """Replace the symbols that need an emoji font by words (myst-nb's execution table writes them)."""

    default_priority = 20  # after ExecutionStatsPostTransform (8) has built the table

    def run(self, **kwargs) -> None:
        for text in list(self.document.findall(nodes.Text)):
            plain = str(text)
            for symbol, word in SYMBOLS.items():
                plain = plain.replace(symbol, word)
            if plain != str(text):
                text.parent.replace(text, nodes.Text(plain))


def _static_path(app, config):
    config.html_static_path.append(str(STATIC))


def setup(app):
    app.connect("config-inited", _static_path)
    app.add_css_file(CSS)
    app.add_post_transform(CaptionAsAlt)
    app.add_post_transform(PlainSymbols)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
