"""The house rules of the code base: no file over 500 lines in node/, protocol/ or optim/, and no
import circles between modules (the layering contracts in pyproject.toml keep the rooms' order;
this keeps each room free of circles too)."""

from __future__ import annotations

from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("node", "protocol", "optim")
MAX_LINES = 500
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def long_files(root: Path) -> list[str]:
    """Source files under ``root``'s packages longer than ``MAX_LINES`` lines, with their length."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def import_cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module) & modules:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_file_in_node_protocol_or_optim_is_over_500_lines():
    assert long_files(ROOT) == []


def test_no_module_imports_itself_round_a_circle():
    graph = grimp.build_graph(*(f"cgad.{package}" for package in PACKAGES))
    modules = {m for m in graph.modules if m.startswith("cgad.")}
    assert len(modules) > 40
    assert import_cycles(graph, modules) == []


def test_the_rules_catch_what_they_are_for(tmp_path):
    package = tmp_path / "node"
    package.mkdir()
    (package / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (package / "small.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path) == [f"node/big.py: {MAX_LINES + 1} lines"]

    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

    class Graph:  # the part of grimp's graph the search reads
        def find_modules_directly_imported_by(self, module):
            return edges.get(module, set())

    assert import_cycles(Graph(), {"a", "b", "c", "d"}) == [["a", "b", "c"]]
