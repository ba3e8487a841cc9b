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


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_is_a_front_door_and_every_link_in_the_docs_lands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md is the front door: 150 lines, the rest in docs/"
    checked = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            landed = (page.parent / path).resolve() if path else page
            assert landed.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and landed.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", landed.read_text(), re.M)
                anchors = {_anchor(h) for h in headings}
                assert anchor in anchors, f"{page.relative_to(ROOT)}: no #{anchor} in {path}"
            checked += 1
    assert checked >= 20
