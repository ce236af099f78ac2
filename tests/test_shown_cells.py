"""A shown code cell is one a reader would type: a call into qmtp, a computation the text explains.

Plumbing (glueing values into the prose, saving results, verdict sentences assembled from f-strings) lives in a
cell tagged hide-input / remove-input / remove-cell, or in a qmtp.book function that returns what the page glues.
Reshaping dicts into table cells moves into qmtp.book too (not checked here: a one-line render of rows the reader
computed is fine to show).
"""

import ast
import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Every chapter and page the book executes.
CHECKED = ("01_anatomy", "02_fixes", "03_converting", "04_quantizing", "05_mtp_decoding", "06_throughput", "07_engine",
           "08_claims", "09_beyond", "10_conversations", "11_under_load", "findings", "real_checkpoint")
HIDDEN_TAGS = {"hide-input", "remove-input", "remove-cell"}
# an f-string whose literal text holds this many words is a sentence, not a number's format
SENTENCE_WORDS = 4


def shown_code_cells(script):
    for index, cell in enumerate(jupytext.read(script).cells):
        if cell.cell_type == "code" and not HIDDEN_TAGS & set(cell.metadata.get("tags", [])):
            yield index, cell.source


def sentence_fstrings(source):
    """The f-strings in `source` whose literal parts read as a sentence."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            text = " ".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if len(re.findall(r"[A-Za-z]{2,}", text)) >= SENTENCE_WORDS:
                found.append(text.strip())
    return found


def plumbing(source):
    """What in one shown cell's source is plumbing, each as a short reason."""
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
             for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)}
    reasons = [f"calls {name}()" for name in ("glue", "save") if name in calls]
    reasons += [f"builds a sentence: {text!r}" for text in sentence_fstrings(source)]
    return reasons


def test_the_check_sees_plumbing():
    assert plumbing('glue("x", 1, display=False)') == ["calls glue()"]
    assert plumbing('results.save("01", path, {})') == ["calls save()"]
    assert plumbing('verdict = f"MTP pays {gain:.2f}x here on this machine"')
    assert plumbing('label = f"{x:.3f} s"') == []
    assert plumbing("rows = mistakes.outcome(load, texts, prompt)") == []


@pytest.mark.parametrize("name", CHECKED)
def test_shown_cells_are_not_plumbing(name):
    script = ROOT / "notebooks" / f"{name}.py"
    found = [f"cell {index}: {reason}" for index, source in shown_code_cells(script)
             for reason in plumbing(source)]
    assert not found, f"{name}: shown cells do plumbing (tag them hide-input or move it into qmtp.book):\n" \
        + "\n".join(found)
