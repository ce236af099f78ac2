"""The chapters' interactive explorer: what it shows, and that it fits the book's text column."""

from types import SimpleNamespace

import pytest

from qmtp.book import widgets

pytest.importorskip("ipywidgets")


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def decode(self, tokens):
        return "".join(chr(97 + t) for t in tokens)


def generation():
    # prompt "a"; the prefill chose "b"; one pass accepted "c", rejected "x" and emitted "d"
    step = SimpleNamespace(drafts=[2, 23], accepted=1, emitted=[2, 3])
    return SimpleNamespace(prompt_tokens=[0], tokens=[1, 2, 3], stats=SimpleNamespace(steps=[step]))


def test_steps_html_colours_each_token_and_wraps_long_ones():
    text = widgets.steps_html(generation(), Letters(), 1)
    assert text.index(">b<") < text.index(">c<") < text.index(">x<") < text.index(">d<")
    assert "line-through" in text.split(">x<")[0].rsplit("<span", 1)[1]  # the rejected draft is struck out
    assert "overflow-wrap:anywhere" in text  # a token with no space to break at cannot widen the page


def test_the_explorer_is_never_wider_than_the_column():
    explorer = widgets.step_explorer(generation(), Letters())
    legend, slider, views = explorer.children
    for widget in (explorer, legend, slider, views, *views.children):
        assert widget.layout.width == "auto" and widget.layout.max_width == "100%", type(widget).__name__
    assert slider.max == 1 and views.selected_index == 1
