"""The admin API's ``Leave`` stops a node, so it takes the node's token, which only the node's
user can read; ``Status`` answers anyone who reaches the port (issue 46, item 10)."""

from __future__ import annotations

import stat

import pytest

from cgad.node.daemon.admin import AdminServer, call_admin, token_path


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("CGAD_ADMIN_DIR", str(tmp_path / "admin"))
    left: list[bool] = []
    admin = AdminServer("127.0.0.1", 0, status=lambda: {"round": 3}, leave=lambda: left.append(True))
    yield admin, left
    admin.stop()


def test_leave_needs_the_token_only_the_nodes_user_can_read(server) -> None:
    admin, left = server
    path = token_path(admin.address)
    assert path == admin.token_file and path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the node's user alone
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    assert call_admin(admin.address, "Status") == {"round": 3}  # no token needed to look
    for wrong in ("", "0" * 32, path.read_text() + "x"):
        with pytest.raises(PermissionError, match="refused Leave"):
            call_admin(admin.address, "Leave", token=wrong)
    assert left == []
    assert call_admin(admin.address, "Leave") == {"leaving": True}  # the same user: read from the file
    assert left == [True]


def test_a_caller_without_the_file_is_refused_and_the_file_goes_with_the_node(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CGAD_ADMIN_DIR", str(tmp_path / "node"))
    left: list[bool] = []
    admin = AdminServer("127.0.0.1", 0, status=dict, leave=lambda: left.append(True))
    try:
        monkeypatch.setenv("CGAD_ADMIN_DIR", str(tmp_path / "another-user"))  # cannot read the node's
        with pytest.raises(PermissionError):
            call_admin(admin.address, "Leave")
        assert left == []
    finally:
        admin.stop()
    assert not admin.token_file.exists()


def test_a_node_on_every_address_is_found_by_its_port(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CGAD_ADMIN_DIR", str(tmp_path / "admin"))
    left: list[bool] = []
    admin = AdminServer("0.0.0.0", 0, status=dict, leave=lambda: left.append(True))
    try:
        port = admin.address.rpartition(":")[2]
        assert call_admin(f"127.0.0.1:{port}", "Leave") == {"leaving": True} and left == [True]
    finally:
        admin.stop()


def test_a_node_whose_token_cannot_be_written_runs_with_leave_off(tmp_path, monkeypatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("CGAD_ADMIN_DIR", str(blocked / "admin"))
    left: list[bool] = []
    admin = AdminServer("127.0.0.1", 0, status=lambda: {"round": 1}, leave=lambda: left.append(True))
    try:
        assert call_admin(admin.address, "Status") == {"round": 1}
        with pytest.raises(PermissionError):
            call_admin(admin.address, "Leave", token="")
        assert left == []
    finally:
        admin.stop()


def test_the_token_file_is_the_users_own_whatever_the_umask(tmp_path, monkeypatch) -> None:
    import os

    monkeypatch.setenv("CGAD_ADMIN_DIR", str(tmp_path / "admin"))
    old = os.umask(0)
    try:
        admin = AdminServer("127.0.0.1", 0, status=dict, leave=lambda: None)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(admin.token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(admin.token_file.parent.stat().st_mode) & 0o077 == 0
    finally:
        admin.stop()
