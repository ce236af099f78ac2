"""The package's layout is its architecture: the runtime at the top of `qmtp` imports nothing from the tiny
model's tooling (`qmtp.tiny`) or the book's helpers (`qmtp.book`), so a user who only loads, converts and
decodes never pays for them, and the folder list reads as the path of the data."""

import ast
import subprocess
import sys
from pathlib import Path

import qmtp

PACKAGE = Path(qmtp.__file__).parent
TOOLING = ("qmtp.tiny", "qmtp.book")
# The command line is the front door to every part: it may reach the tooling for its commands (bench,
# synthetic), but only inside the command that needs it, never when it is imported: every module of the
# `qmtp.cli` package (one per command) keeps to that.
FRONT_DOOR = "qmtp.cli"


def package_of(path: Path) -> str:
    return ".".join(("qmtp",) + path.relative_to(PACKAGE).parent.parts)


def imported_modules(source: str, package: str, top_level_only: bool) -> set[str]:
    """Absolute names of the modules `source` imports (relative imports resolved against `package`)."""
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def runtime_modules() -> list[Path]:
    return sorted(PACKAGE.glob("*.py")) + sorted((PACKAGE / "cli").glob("*.py"))


def in_front_door(path: Path) -> bool:
    return package_of(path) == FRONT_DOOR or f"{package_of(path)}.{path.stem}" == FRONT_DOOR


def test_the_runtime_imports_nothing_from_the_tooling():
    offenders = {}
    for path in runtime_modules():
        imports = imported_modules(path.read_text(), package_of(path), top_level_only=in_front_door(path))
        bad = sorted(name for name in imports if name.startswith(TOOLING))
        if bad:
            offenders[path.name] = bad
    assert not offenders, offenders


def test_the_check_sees_every_spelling_of_an_import():
    # The check above must be able to fail: each way a runtime module could reach the tooling is caught.
    source = ("from .book import bench\nfrom . import model\nfrom .tiny.corpus import REGISTERS\n"
              "def later():\n    import qmtp.book.plots\n")
    found = imported_modules(source, "qmtp", top_level_only=False)
    assert {"qmtp.book.bench", "qmtp.model", "qmtp.tiny.corpus", "qmtp.book.plots"} <= found
    assert "qmtp.book.plots" not in imported_modules(source, "qmtp", top_level_only=True)
    assert "qmtp.convert" in imported_modules("from ..convert import convert\n", "qmtp.book", top_level_only=True)


def test_importing_qmtp_and_its_command_line_loads_no_tooling():
    code = "import sys, qmtp, qmtp.cli; print(' '.join(m for m in sys.modules if m.startswith(('qmtp.tiny', 'qmtp.book'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_every_module_lives_in_one_of_the_three_parts():
    folders = {p.parent.name for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert folders == {"qmtp", "cli", "tiny", "book"}  # cli: the runtime's command line, a module per command
