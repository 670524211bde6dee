"""The package layering of docs/interfaces.md ("Package layering") is the code's: the graph built
from every import of backend/, simulator/, firmware/ and testkit/ equals the page's table, its
circles are exactly the page's, the bridge process never loads the simulator, and nothing that
ships imports the test harness."""

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("backend", "simulator", "firmware", "testkit")
DOC = ROOT / "docs" / "interfaces.md"

Graph = dict[str, set[str]]


def package_of(module: str) -> str | None:
    """The layering node of a dotted module name; None outside the scanned trees (the standard
    library, third parties, and the firmware's own `lib` modules imported by bare name)."""
    parts = module.split(".")
    if parts[0] in ("simulator", "firmware", "testkit"):
        return parts[0]
    if parts[0] != "backend":
        return None
    return "backend" if len(parts) == 1 else f"backend.{parts[1]}"


def _module_name(path: Path) -> tuple[str, str]:
    """(the module's dotted name, the package its relative imports start from)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    return ".".join(parts), ".".join(parts[:-1])


def imported_modules(path: Path) -> Iterator[str]:
    """Every module `path` imports, anywhere in the file, relative imports resolved."""
    _name, package = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join([*base, node.module] if node.module else base)
            elif node.module:
                yield node.module


def code_graph() -> Graph:
    """Package → the other packages it imports, from the source files."""
    graph: Graph = {}
    for tree in SCANNED:
        for path in sorted((ROOT / tree).rglob("*.py")):
            name, _package = _module_name(path)
            source = package_of(name)
            assert source is not None, path
            targets = graph.setdefault(source, set())
            for module in imported_modules(path):
                target = package_of(module)
                if target is not None and target != source:
                    targets.add(target)
    return graph


def _layering_section() -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^### Package layering\n(.*?)(?=^### )", text, re.S | re.M)
    assert match, "docs/interfaces.md has no '### Package layering' section"
    return match.group(1)


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def doc_graph() -> Graph:
    """The page's table: one row per package, the packages it imports (— for none)."""
    graph: Graph = {}
    for line in _layering_section().splitlines():
        row = re.fullmatch(r"\| `([^`]+)` \| (.*) \|", line.strip())
        if row:
            assert row.group(1) not in graph, f"two rows for {row.group(1)}"
            graph[row.group(1)] = _names(row.group(2))
    assert graph, "the layering table has no rows"
    return graph


def doc_circles() -> set[frozenset[str]]:
    """The page's circles: the list under 'Circles', one circle per item."""
    paragraph = _layering_section().split("\nCircles", 1)[1].split("\n\n", 1)[0]
    return {frozenset(_names(line)) for line in paragraph.splitlines() if line.startswith("- ")}


def circles(graph: Mapping[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.add(frozenset(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _difference(code: Graph, doc: Graph) -> list[str]:
    problems = []
    for package in sorted(set(code) | set(doc)):
        if package not in doc:
            problems.append(f"{package}: no row in the table")
            continue
        extra = code.get(package, set()) - doc[package]
        stale = doc[package] - code.get(package, set())
        if extra:
            problems.append(f"{package} imports {sorted(extra)}, which the table does not allow")
        if stale:
            problems.append(f"{package} no longer imports {sorted(stale)}: drop them from its row")
    return problems


def test_the_import_graph_is_the_documented_table() -> None:
    problems = _difference(code_graph(), doc_graph())
    assert not problems, "docs/interfaces.md 'Package layering' and the code differ:\n" + "\n".join(
        problems
    )


def test_every_package_has_a_row() -> None:
    packages = {p.name for p in (ROOT / "backend").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "backend").glob("*.py") if not p.stem.startswith("_")}
    expected = {f"backend.{name}" for name in packages | modules}
    assert expected <= set(doc_graph())


def test_the_circles_are_the_documented_ones() -> None:
    assert circles(code_graph()) == doc_circles()


def test_the_firmware_imports_nothing_of_the_bridge() -> None:
    assert code_graph().get("firmware", set()) == set()


def test_the_bridge_process_never_loads_the_simulator() -> None:
    graph = code_graph()
    assert "simulator" not in reachable(graph, "backend.server")
    assert {name for name, targets in graph.items() if "simulator" in targets} <= {
        "backend.cli",
        "simulator",
        "testkit",
    }


def test_nothing_that_ships_imports_the_test_harness() -> None:
    # testkit (the fake LLM, hostile clients, throwaway brokers) is not in the wheel.
    graph = code_graph()
    assert {name for name, targets in graph.items() if "testkit" in targets} == set()


def test_a_new_import_would_be_caught() -> None:
    """The check can fail: one import the table does not allow is reported, both ways."""
    doc = doc_graph()
    code = {package: set(targets) for package, targets in doc.items()}
    code["backend.errors"].add("backend.api")
    assert _difference(code, doc) == [
        "backend.errors imports ['backend.api'], which the table does not allow"
    ]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}


def test_relative_imports_are_resolved() -> None:
    assert package_of("backend.devices.registry") == "backend.devices"
    assert package_of("backend") == "backend"
    assert package_of("json") is None
    init = ROOT / "backend" / "provisioning" / "__init__.py"
    assert _module_name(init) == ("backend.provisioning", "backend.provisioning")
    assert _module_name(ROOT / "backend" / "devices" / "registry.py")[1] == "backend.devices"
