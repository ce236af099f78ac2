"""Measurements this project made outside the book's build: neither published by anyone nor measured by the build
that shows them, so kept apart from the field's published figures (`qmtp.book.published`) and labelled as what
they are wherever they are shown. Each names the project's record it comes from (a key of book/references.bib).
"""

from __future__ import annotations

MEASURED_BY = "this project, outside this build (not published)"

# Acceptance of lemon-mlx-engine and qmtp on this book's bundled model, decoding the same 8-bit conversion on the
# same prompts, with lemon-mlx-engine built for the CPU (n_draft=2, greedy). A different model from the field's,
# so no cost-model row.
ON_BUNDLED = (
    {"engine": "lemon-mlx-engine (head's cache reset each step, pre-norm state)", "n_draft": 2,
     "acceptance": (0.74, 0.83), "source": "qmtplemon2026"},
    {"engine": "qmtp (head's cache kept, post-norm state)", "n_draft": 2, "acceptance": (0.87, 0.88),
     "source": "qmtplemon2026"},
)


def sources() -> set[str]:
    """Every bib key a measurement here is recorded in."""
    return {r["source"] for r in ON_BUNDLED}


def on_bundled_table() -> str:
    """`ON_BUNDLED` as a Markdown table, each row citing the record it comes from."""
    from .inventory import markdown_table

    rows = [{"engine": r["engine"], "n_draft": r["n_draft"], "acceptance": "{:.2f} to {:.2f}".format(*r["acceptance"]),
             "measured by": MEASURED_BY, "record": f"{{cite:p}}`{r['source']}`"} for r in ON_BUNDLED]
    return markdown_table(rows, ["engine", "n_draft", "acceptance", "measured by", "record"])
