"""Docstrings that the API page (book/api.md, autodoc with napoleon) renders as written.

Napoleon reads a property's first docstring line as "type: description" when it holds a colon, so the words before
the colon were shown as the type and the rest as the description; an indented example needs a `::` before it, or
it renders as a quotation in prose."""

import ast
import inspect
import re
from pathlib import Path

import qmtp

ROOT = Path(__file__).resolve().parent.parent
SINGLE_COLON = re.compile(r"(?<!:):(?!:)")  # napoleon's own test for the "type: description" split


def test_no_property_docstring_starts_with_a_type_and_a_colon():
    found = []
    for source in sorted((ROOT / "qmtp").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "property"
                                                         for d in node.decorator_list):
                doc = ast.get_docstring(node)
                if doc and SINGLE_COLON.search(doc.splitlines()[0]):
                    found.append(f"{source.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not found, "property docstrings whose first line napoleon splits at a colon:\n" + "\n".join(found)


def test_conversation_example_is_a_literal_block():
    doc = inspect.getdoc(qmtp.Conversation)
    intro, example = doc.split("\n\n", 1)
    assert intro.endswith("::") and example.startswith("    conv = qmtp.Conversation(")
