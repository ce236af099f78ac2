"""No import cycle in `qmtp`, counting imports inside functions, and `qmtp.tiny` never imports `qmtp.book`
(issue 33 item 1): a cycle closed through a function's import still ties the modules into one."""

import ast
from pathlib import Path

import qmtp

from test_architecture import imported_modules, package_of

PACKAGE = Path(qmtp.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the qmtp modules it imports anywhere (top level or inside a function)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = package_of(path)
        found = imported_modules(path.read_text(), package, top_level_only=False)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_book_or_the_tiny_model():
    graph = import_graph()
    tooling = [c for c in cycles(graph) if any(m.startswith(("qmtp.book", "qmtp.tiny")) for m in c)]
    assert not tooling, tooling


def test_the_tiny_model_never_imports_the_book():
    graph = import_graph()
    bad = {m: sorted(i for i in graph[m] if i.startswith("qmtp.book")) for m in graph if m.startswith("qmtp.tiny")}
    assert not {m: b for m, b in bad.items() if b}


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not cycles({"a": {"b"}, "b": set()})
