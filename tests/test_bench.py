"""Every benchmark at least imports against the package as it is (they run by hand, not in CI),
and bench/ keeps the house rules: a package whose shared parts import as ``cgad.bench``, no
``sys.path`` edits, no file over 500 lines."""

import importlib
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
MAX_LINES = 500


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_imports(path):
    module = importlib.import_module(f"cgad.bench.{path.stem}")  # as the installed package has it
    if 'if __name__ == "__main__":' in path.read_text():  # a script, not a shared part
        assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_bench_edits_no_sys_path_and_no_file_is_over_500_lines():
    sources = sorted(BENCH.rglob("*.py"))
    assert len(sources) > 20
    edited = re.compile(r"sys\.path\.(insert|append)")
    edits = [p.relative_to(BENCH) for p in sources if edited.search(p.read_text())]
    assert edits == [], f"import through cgad.bench instead: {edits}"
    lines = {str(p.relative_to(BENCH)): len(p.read_text().splitlines()) for p in sources}
    assert {path: n for path, n in lines.items() if n > MAX_LINES} == {}
