"""`make lint`'s layering contract fails on an upward import (and passes on the tree as it is)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def lint_imports() -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_tree_keeps_the_dependency_rule():
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("folder", "imported"),
    [("optim", "cgad.protocol.codec"), ("optim", "cgad.node"), ("protocol", "cgad.node.config")],
)
def test_an_upward_import_breaks_the_contract(folder, imported):
    probe = ROOT / folder / "_layering_probe.py"
    probe.write_text(f"import {imported}\n")
    try:
        result = lint_imports()
    finally:
        probe.unlink()
    assert result.returncode != 0
    assert f"_layering_probe -> {imported}" in result.stdout
