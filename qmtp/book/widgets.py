"""Interactive explorers for the chapters (ipywidgets; the static book shows their saved state)."""

from __future__ import annotations

import html

from .plots import ACCEPTED, REJECTED, TRUNK, shown_passes


def _span(text: str, colour: str, strike: bool = False) -> str:
    style = f"background:{colour};color:white;border-radius:3px;padding:0 2px;margin:0 1px"
    if strike:
        style += ";text-decoration:line-through"
    return f'<span style="{style}">{html.escape(text)}</span>'


def steps_html(generation, tokenizer, upto: int) -> str:
    """The text after `upto` trunk passes, each pass's tokens coloured by what happened to them."""
    parts = [html.escape(tokenizer.decode(generation.prompt_tokens))]
    parts.append(_span(tokenizer.decode([generation.tokens[0]]), TRUNK))
    for accepted, rejected, trunk in shown_passes(generation)[:upto]:
        for d in accepted:
            parts.append(_span(tokenizer.decode([d]), ACCEPTED))
        if rejected is not None:
            parts.append(_span(tokenizer.decode([rejected]), REJECTED, strike=True))
        if trunk is not None:
            parts.append(_span(tokenizer.decode([trunk]), TRUNK))
    # overflow-wrap: a token longer than the column (no space to break at) wraps instead of widening the page
    return ('<div style="font-family:monospace;white-space:pre-wrap;overflow-wrap:anywhere;line-height:1.8">'
            + "".join(parts) + "</div>")


def step_explorer(generation, tokenizer):
    """A slider over trunk passes: green drafts accepted, red (struck) the first rejected, blue the trunk's,
    with a legend that says so above the slider.

    Every step's text is rendered up front and the slider picks one in the browser (jslink), so the book's
    saved widget state answers the slider without a kernel: offline, in a downloaded copy.
    """
    import ipywidgets as w

    def fitting():
        """A layout never wider than the text column it sits in: ipywidgets' defaults are fixed widths, and
        width 100% would add the widget's own margins past the column; "auto" fills what the margins leave."""
        return w.Layout(width="auto", max_width="100%")

    n = len(shown_passes(generation))
    legend = w.HTML("what each colour means: " + " ".join([
        _span("draft accepted", ACCEPTED), _span("draft rejected", REJECTED, strike=True),
        _span("the trunk's own token", TRUNK)]), layout=fitting())
    views = w.Stack([w.HTML(steps_html(generation, tokenizer, k), layout=fitting()) for k in range(n + 1)],
                    selected_index=n, layout=fitting())
    slider = w.IntSlider(value=n, min=0, max=n, description="passes", layout=fitting())
    w.jslink((slider, "value"), (views, "selected_index"))
    return w.VBox([legend, slider, views], layout=fitting())
