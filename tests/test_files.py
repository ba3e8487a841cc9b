"""atomic_write: whole files or none, never wider permissions than asked, nothing left behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cgad.protocol.files import atomic_write
from cgad.protocol.records import Identity

pytestmark = pytest.mark.timeout(60)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_bytes_replace_the_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "blob"
    atomic_write(target, b"old")
    atomic_write(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["blob"]


def test_a_writer_gets_a_fresh_path_beside_the_target(tmp_path: Path) -> None:
    target = tmp_path / "weights.bin"
    seen: list[Path] = []

    def writer(path: Path) -> None:
        assert not path.exists() and path.name == target.name
        seen.append(path)
        path.write_bytes(b"\1" * 10)

    atomic_write(target, writer, mode=0o640)
    assert target.read_bytes() == b"\1" * 10
    assert seen[0].parent.parent == tmp_path  # same filesystem: the rename is atomic
    assert _mode(target) & ~0o640 == 0
    assert os.listdir(tmp_path) == ["weights.bin"]


def test_a_writer_may_make_a_directory(tmp_path: Path) -> None:
    target = tmp_path / "tokenizer"

    def writer(path: Path) -> None:
        path.mkdir()
        (path / "vocab.json").write_text("{}")

    atomic_write(target, writer, mode=0o600)
    assert (target / "vocab.json").read_text() == "{}"
    assert _mode(target) & ~0o700 == 0  # readable means searchable too, for a folder
    assert os.listdir(tmp_path) == ["tokenizer"]


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_a_new_key_file_is_never_wider_than_owner_only(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        path = tmp_path / "peer.key"
        identity = Identity.load_or_create(str(path))
    finally:
        os.umask(previous)
    assert _mode(path) & ~0o600 == 0 and _mode(path) & 0o400
    assert Identity.load_or_create(str(path)).peer_id == identity.peer_id
    assert os.listdir(tmp_path) == ["peer.key"]


def test_the_key_file_never_exists_with_wider_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file that appears while the key is written, in the key's folder or below it, is
    owner-only from the moment it exists (watched at the rename)."""
    replace = os.replace
    seen: list[tuple[str, int]] = []

    def watching_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        for root, dirs, files in os.walk(tmp_path):
            for name in dirs:
                seen.append((name, _mode(Path(root) / name)))
            for name in files:
                seen.append((name, _mode(Path(root) / name)))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", watching_replace)
    previous = os.umask(0)
    try:
        Identity.load_or_create(str(tmp_path / "peer.key"))
    finally:
        os.umask(previous)
    assert seen and all(mode & 0o077 == 0 for _, mode in seen), seen


@pytest.mark.parametrize("how", ["bytes", "writer"])
def test_a_failure_mid_write_keeps_the_old_file_and_leaves_nothing(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state"
    atomic_write(target, b"old state")

    def broken_writer(path: Path) -> None:
        path.write_bytes(b"half of the new")
        raise OSError("disk full")

    if how == "bytes":

        def broken_fsync(fd: int) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, b"new state" if how == "bytes" else broken_writer)
    assert target.read_bytes() == b"old state"
    assert os.listdir(tmp_path) == ["state"]


def test_a_directory_cannot_replace_a_full_one(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "kept").write_text("x")

    def writer(path: Path) -> None:
        path.mkdir()

    with pytest.raises(OSError):
        atomic_write(target, writer)
    assert (target / "kept").read_text() == "x"
    assert os.listdir(tmp_path) == ["out"]
