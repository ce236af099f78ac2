"""The chapters: every .py/.ipynb pair in step, committed without outputs, and listed in _toc.yml."""

from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def toc_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = []
    for part in toc.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    return files


def test_there_are_chapters():
    assert CHAPTERS


@pytest.mark.parametrize("script", CHAPTERS, ids=lambda p: p.stem)
def test_pair_in_step_and_without_outputs(script):
    paired = script.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} missing: run jupytext --to ipynb {script.relative_to(ROOT)}"
    from_script = jupytext.read(script)
    from_notebook = nbformat.read(paired, as_version=4)
    sources = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]  # noqa: E731
    assert sources(from_script) == sources(from_notebook), f"{script.name} and {paired.name} differ: re-sync them"
    for cell in from_notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{paired.name} is committed with outputs"


@pytest.mark.parametrize("script", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_in_toc(script):
    assert f"notebooks/{script.stem}" in toc_files()


def test_first_code_cell_imports_qmtp_and_names_the_model():
    for script in CHAPTERS:
        first = next(c for c in jupytext.read(script).cells if c.cell_type == "code")
        assert "import qmtp" in first.source and "describe(" in first.source, script.name
