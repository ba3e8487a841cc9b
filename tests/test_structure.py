"""The house rules of the code base: no file over 500 lines in node/, protocol/ or optim/, no
import circles between modules (the layering contracts in pyproject.toml keep the rooms' order;
this keeps each room free of circles too), and no path of the machine a file was made on in any
tracked file, results and their compressed logs included."""

from __future__ import annotations

import gzip
import re
import subprocess
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


# a checkout's or a bench's scratch folder: /work/..., /tmp/dev, /tmp/cgad-scale-XXXX, /tmp/tmpXXXX
MACHINE_PATH = re.compile(rb"/work/\w|/tmp/(?:dev|cgad-[a-z]+-\w{6,}|tmp\w{6,})\b")


def machine_paths(root: Path, names: list[str]) -> list[str]:
    """Each named file (under ``root``) that holds a machine's path, with the first one found."""
    found = []
    for name in names:
        path = root / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if name.endswith(".gz"):
            data = gzip.decompress(data)
        match = MACHINE_PATH.search(data)
        if match:
            found.append(f"{name}: {match.group().decode(errors='replace')}")
    return found


def test_no_tracked_file_holds_a_path_of_the_machine_it_was_made_on():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    own = str(Path(__file__).resolve().relative_to(ROOT))  # its examples of what it looks for
    names = [n for n in listed.stdout.splitlines() if not n.endswith((".png", ".pyc")) and n != own]
    assert len(names) > 100
    assert machine_paths(ROOT, names) == []


def test_no_file_in_node_protocol_or_optim_is_over_500_lines():
    assert long_files(ROOT) == []


def test_no_module_imports_itself_round_a_circle():
    graph = grimp.build_graph(*(f"cgad.{package}" for package in PACKAGES))
    modules = {m for m in graph.modules if m.startswith("cgad.")}
    assert len(modules) > 40
    assert import_cycles(graph, modules) == []


def simulator_only(graph, package: str = "cgad.protocol") -> list[str]:
    """Modules of ``package`` that nothing but the simulator reaches: protocol/ holds what crosses
    a process, so each of its modules must be imported, directly or through another of them, by a
    room of node/ other than the simulator."""
    users = {m for m in graph.modules if m.startswith("cgad.node.") and not m.startswith("cgad.node.sim")}
    reached: set[str] = set()
    todo = [m for u in users for m in graph.find_modules_directly_imported_by(u) if m.startswith(package)]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [m for m in graph.find_modules_directly_imported_by(module) if m.startswith(package)]
    own = {m for m in graph.modules if m.startswith(package + ".") and not m.endswith("__init__")}
    return sorted(own - reached - {package})


def test_protocol_has_no_module_only_the_simulator_uses():
    graph = grimp.build_graph(*(f"cgad.{package}" for package in PACKAGES))
    assert "cgad.node.sim.memory" in graph.modules  # the in-memory network lives with its simulator
    assert simulator_only(graph) == []


def test_the_rules_catch_what_they_are_for(tmp_path):
    package = tmp_path / "node"
    package.mkdir()
    (package / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (package / "small.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path) == [f"node/big.py: {MAX_LINES + 1} lines"]

    (tmp_path / "run.json").write_text('{"flags": ["--maddrs-file", "/tmp/cgad-scale-pxnlmdb_/small-0/m"]}')
    (tmp_path / "log.jsonl.gz").write_bytes(gzip.compress(b'File "/tmp/dev/.venv/lib/x.py"'))
    (tmp_path / "Dockerfile").write_text("RUN pip install -r /tmp/requirements.txt\n")  # inside an image
    assert machine_paths(tmp_path, ["run.json", "log.jsonl.gz", "Dockerfile"]) == [
        "run.json: /tmp/cgad-scale-pxnlmdb_", "log.jsonl.gz: /tmp/dev"
    ]  # fmt: skip

    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

    class Graph:  # the part of grimp's graph the search reads
        def find_modules_directly_imported_by(self, module):
            return edges.get(module, set())

    assert import_cycles(Graph(), {"a", "b", "c", "d"}) == [["a", "b", "c"]]

    class Layout(Graph):
        modules = frozenset({
            "cgad.node.daemon.node", "cgad.node.sim.simulate", "cgad.protocol",
            "cgad.protocol.wire", "cgad.protocol.codec", "cgad.protocol.memory",
        })  # fmt: skip

        def find_modules_directly_imported_by(self, module):
            return {
                "cgad.node.daemon.node": {"cgad.protocol.wire"},
                "cgad.protocol.wire": {"cgad.protocol.codec"},
                "cgad.node.sim.simulate": {"cgad.protocol.memory", "cgad.protocol.wire"},
            }.get(module, set())

    assert simulator_only(Layout()) == ["cgad.protocol.memory"]
