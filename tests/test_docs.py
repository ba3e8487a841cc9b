"""Every pointer into the design document lands on a section that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("node", "protocol", "optim", "tests", "bench", "docs") for p in (ROOT / d).rglob("*")]
SOURCES += [ROOT / "README.md"]


def test_every_design_reference_resolves_to_a_section_of_docs_design():
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", design, re.M))
    found = 0
    for path in SOURCES:
        if path.suffix not in (".py", ".md", ".proto") or path.name == "test_docs.py":
            continue
        in_docs = path.parent.name == "docs"
        for ref in re.finditer(r"(docs/)?DESIGN\.md(?:\]\([^)]*\))? §(\d+)", path.read_text()):
            found += 1
            where = path.relative_to(ROOT)
            assert ref.group(2) in sections, f"{where} cites §{ref.group(2)}, which docs/DESIGN.md lacks"
            assert in_docs or ref.group(1), f"{where}: say docs/DESIGN.md, the one in the repository"
        assert "shared/DESIGN" not in path.read_text(), f"{path.relative_to(ROOT)} points outside the repo"
    assert found >= 3
