"""The all-reduce's hivemind processes start or are started again: a forked child that never
says it is ready (a fork of a threaded process can hang on a lock another thread held) is killed
with its own children, and a node never waits on it for ever."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import subprocess
import time

import pytest

from cgad.protocol.allreduce import NotReady, start_child


class _Child(mp.Process):
    """A process with hivemind's start interface (``run_in_background``, ready or not); it starts
    a child of its own, as hivemind's DHT starts its p2pd."""

    def __init__(self, ready: bool, fails: bool = False) -> None:
        super().__init__(daemon=True)
        self.ready, self.fails = ready, fails
        self._ready, self._grandchild = mp.Event(), mp.Value("i", 0)

    def run(self) -> None:
        self._grandchild.value = subprocess.Popen(["sleep", "600"]).pid
        if self.ready:
            self._ready.set()
        time.sleep(600)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        self.start()
        if self.fails:  # the child's own error, at once, of the type a deadline raises too
            raise TimeoutError("the child's own timeout")
        deadline = time.monotonic() + 60  # its own child started first, however loaded the machine
        while not self._grandchild.value and time.monotonic() < deadline:
            time.sleep(0.01)
        if await_ready and not self._ready.wait(timeout):
            raise TimeoutError(f"not ready within {timeout} s")

    @property
    def grandchild(self) -> int:
        return self._grandchild.value


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"  # a zombie: killed, not yet reaped
    except FileNotFoundError:
        return True


@pytest.fixture
def made():
    """The children a test makes, each killed with its own child at the end, whatever happened."""
    children: list[_Child] = []
    yield children
    for child in children:
        child.kill()
        child.join(5)
        if child.grandchild:
            subprocess.run(["kill", "-9", str(child.grandchild)], capture_output=True)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="kills the process tree through /proc")
def test_a_child_that_never_gets_ready_is_killed_with_its_children_and_started_again(made, caplog) -> None:

    def make() -> _Child:
        made.append(_Child(ready=len(made) > 0))  # the first hangs, the second starts
        return made[-1]

    with caplog.at_level(logging.WARNING, logger="cgad.protocol.allreduce"):
        started = start_child(make, "DHT", timeout=2.0, tries=3)
    assert started is made[1] and started.is_alive()
    hung = made[0]
    deadline = time.monotonic() + 10
    while not (_gone(hung.pid) and hung.grandchild and _gone(hung.grandchild)):
        assert time.monotonic() < deadline, "the hung child or its own child still runs"
        time.sleep(0.05)
    assert any("not ready within 2 s (start 1 of 3): killed" in r.message for r in caplog.records)


def test_a_child_that_never_gets_ready_in_any_try_is_an_error(made) -> None:
    def make() -> _Child:
        made.append(_Child(ready=False))
        return made[-1]

    with pytest.raises(NotReady, match="averager process was not ready within 1 s, 2 times"):
        start_child(make, "averager", timeout=1.0, tries=2)
    assert len(made) == 2 and not any(child.is_alive() for child in made)


def test_an_error_of_the_child_itself_is_raised_not_taken_for_the_deadline(made) -> None:
    def make() -> _Child:
        made.append(_Child(ready=False, fails=True))
        return made[-1]

    with pytest.raises(TimeoutError, match="the child's own timeout"):
        start_child(make, "DHT", timeout=30.0, tries=3)
    assert len(made) == 1  # not started again


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the command line through /proc")
def test_a_killed_p2pds_unix_socket_is_removed(tmp_path) -> None:
    """A SIGKILLed p2pd cannot remove the socket it listened on; kill_tree does (they piled up in
    /tmp by the thousand)."""
    import sys

    from cgad.protocol.allreduce import kill_tree

    path = tmp_path / "p2pd.sock"
    listens = (
        "import socket, sys, time; s = socket.socket(socket.AF_UNIX);"
        " s.bind(sys.argv[1][len('-listen=/unix'):]); print(flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", listens, f"-listen=/unix{path}"], stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        assert path.is_socket()
        kill_tree(proc.pid)
        assert proc.wait(10) == -9
        assert not path.exists()
    finally:
        proc.kill()
        proc.wait(10)
