"""Writing a file so that a reader, a crash or another user never sees it half-written or too open.

``atomic_write`` writes into a private temporary folder beside the target (mode 0o700, so that
what is inside is unreadable to other users whatever mode it was created with, and on the same
filesystem, so that the final rename is atomic), fsyncs, narrows the permission bits to ``mode``
and renames the result over the target: a reader sees the old file or the new one, never a mix,
and a failure leaves the old one untouched and nothing else behind.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(
    path: str | os.PathLike[str], data: bytes | Callable[[Path], None], mode: int = 0o644
) -> None:
    """Put ``data`` at ``path`` atomically; its folder must exist.

    ``data`` is the file's bytes, or a writer called with a path (which does not exist yet) to
    create there, e.g. ``lambda tmp: safetensors.torch.save_file(tensors, tmp)``. A writer may
    create a directory instead of a file; a directory replaces only a missing or empty one, as
    ``os.replace`` cannot swap a full directory.

    ``mode`` bounds the permission bits: the result is never wider than ``mode``, nor than the
    process umask allows (a directory also gets search bits wherever it is readable).
    """
    target = Path(path)
    workdir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    tmp = workdir / target.name
    try:
        if callable(data):
            data(tmp)
            _settle(tmp, mode)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _fsync(target.parent)  # the rename itself must reach the disk


def _settle(tmp: Path, mode: int) -> None:
    """Flush what a writer made to disk and narrow its permission bits to ``mode``."""
    if tmp.is_dir():
        for root, _, names in os.walk(tmp):
            for name in names:
                _fsync(Path(root) / name, os.O_RDONLY)
            _fsync(Path(root))
        allowed = mode | (mode & 0o444) >> 2  # r without x would make the folder unusable
    else:
        _fsync(tmp, os.O_RDONLY)
        allowed = mode
    os.chmod(tmp, stat.S_IMODE(tmp.stat().st_mode) & allowed)


def _fsync(path: Path, flags: int = os.O_RDONLY | os.O_DIRECTORY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
