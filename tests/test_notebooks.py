"""The chapters: every .py/.ipynb pair in step, committed without outputs, and listed in _toc.yml."""

from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
# Pages that read what the chapters saved (qmtp.book.results) in the same build, though shown before them
READERS = ("findings", "real_checkpoint")
PAGES = sorted((ROOT / "notebooks").glob("*.py"))


def toc_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = []
    for part in toc.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    return files


def test_there_are_chapters():
    assert CHAPTERS


@pytest.mark.parametrize("script", PAGES, ids=lambda p: p.stem)
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


@pytest.mark.parametrize("script", PAGES, ids=lambda p: p.stem)
def test_chapter_in_toc(script):
    assert f"notebooks/{script.stem}" in toc_files()


def test_first_code_cell_imports_qmtp_and_names_the_model():
    for script in PAGES:
        first = next(c for c in jupytext.read(script).cells if c.cell_type == "code")
        assert "import qmtp" in first.source and "describe(" in first.source, script.name


@pytest.mark.parametrize("script", PAGES, ids=lambda p: p.stem)
def test_qmtp_is_imported_before_mlx(script):
    """qmtp.blas loads an optimised BLAS for MLX only if it runs before mlx.core is first imported: a chapter that
    imports MLX first times (and computes) with the wheel's reference BLAS while the others use OpenBLAS."""
    imports = [line for line in script.read_text().splitlines()
               if line.startswith(("import ", "from ")) and line.split()[1].split(".")[0] in ("qmtp", "mlx")]
    if imports:
        assert imports[0].split()[1].startswith("qmtp"), f"{script.name}: {imports[0]!r} comes before qmtp"


def test_pages_that_read_the_chapters_run_after_them():
    """Sphinx reads, and myst-nb executes, documents in sorted docname order whatever _toc.yml shows first: a page
    that reads the chapters' saved results must sort after every chapter, and run in every build (force)."""
    chapters = [f"notebooks/{c.stem}" for c in CHAPTERS]
    for reader in READERS:
        docname = f"notebooks/{reader}"
        assert docname in toc_files() and all(docname > c for c in chapters), docname
        metadata = jupytext.read(ROOT / "notebooks" / f"{reader}.py").metadata
        assert metadata.get("mystnb", {}).get("execution_mode") == "force", reader
    assert toc_files().index("notebooks/findings") < toc_files().index(chapters[0])  # shown first
