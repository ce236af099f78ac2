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
    # cli: the runtime's command line, a module per command; serve: the HTTP server over the runtime
    assert folders == {"qmtp", "cli", "tiny", "book", "serve"}


# ---- no import cycle, no long function, the tiny model's tooling below the book's ------------------------------
MAX_FUNCTION_LINES = 80  # from `def` to its last line, the docstring left out


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("qmtp",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def import_graph() -> dict[str, set[str]]:
    """qmtp's modules -> the qmtp modules each imports anywhere in it (inside functions too). A package's
    `__init__` is left out of the graph: `from . import x` names the package only as where x lives."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    modules = {name for name, p in paths.items() if p.name != "__init__.py"}
    graph = {}
    for name in sorted(modules):
        path = paths[name]
        imported = imported_modules(path.read_text(), package_of(path), top_level_only=False)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_qmtp_imports_itself_in_a_circle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_circle_closed_inside_a_function():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = "def later():\n    from .throughput import x\n"
    assert "qmtp.book.throughput" in imported_modules(source, "qmtp.book", top_level_only=False)


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """name -> lines, for every function (methods and nested ones included) longer than `limit` lines from
    `def` to its last line, its docstring not counted."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines -= first.end_lineno - first.lineno + 1
            if lines > limit:
                found[node.name] = lines
    return found


def test_no_function_of_the_runtime_or_the_command_line_is_over_80_lines():
    paths = runtime_modules() + sorted((PACKAGE / "cli").glob("*.py")) + sorted((PACKAGE / "serve").glob("*.py"))
    offenders = {f"{p.relative_to(PACKAGE)}:{name}": n for p in paths
                 for name, n in long_functions(p.read_text()).items()}
    assert not offenders, offenders


def test_the_length_check_counts_from_def_to_the_last_line_without_the_docstring():
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    doc = '    """one\n    two\n    """\n'
    assert long_functions(f"def f():\n{doc}{body}") == {}  # 1 + 79 lines
    assert long_functions(f"def f():\n{doc}{body}    x = 0\n") == {"f": 81}


def test_the_tiny_models_tooling_never_imports_the_book():
    offenders = {}
    for path in sorted((PACKAGE / "tiny").glob("*.py")):
        bad = sorted(m for m in imported_modules(path.read_text(), package_of(path), top_level_only=False)
                     if m.startswith("qmtp.book"))
        if bad:
            offenders[path.name] = bad
    assert not offenders, offenders
