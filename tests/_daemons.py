"""Real `cgad-node join` processes on 127.0.0.1, for the daemon tests: start one (or several at
once), read its status through the admin API, wait for what it reports, kill it."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cgad.node.daemon.admin import call_admin

HOSTILE_NODE = Path(__file__).with_name("_hostile_node.py")
JOIN_AFTER = Path(__file__).with_name("_join_after.py")
CLI = str(Path(sys.executable).with_name("cgad-node"))
FRESH_LOSS = 8.3  # ln(4096): what an untrained model scores on the held-out split
# --eval-every 1: the tests watch learning round by round
SETTINGS = [
    "--run-id", "itest", "--model", "tiny", "--inner-steps", "16", "--batch-size", "2", "--seq-len", "32",
    "--eval-batches", "4", "--eval-every", "1", "--inner-lr", "2e-3", "--codec", "fp16",
    "--checkpoint-every", "1", "--admin-port", "0", "--dashboard-port", "0",
    "--private-endpoints",  # one machine: every gRPC endpoint is on 127.0.0.1
]  # fmt: skip


class NodeProcess:
    """One `cgad-node join`, started at once. With ``wait`` (the default) the constructor returns
    once the node has printed its admin address; without, it returns at once and the address is
    waited for the first time it is needed (``admin``), so that nodes that do not need each other
    can start side by side: a daemon takes seconds to start on a busy machine.

    ``after``: nodes (started already, up or not) that this one joins once all of them are up,
    through the first one's multiaddrs (instead of ``peers``): its process starts now and does
    its imports meanwhile (tests/_join_after.py)."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        peers: list[str],
        extra: Sequence[str] = (),
        hostile: str | None = None,
        wait: bool = True,
        after: Sequence["NodeProcess"] = (),
    ) -> None:
        self.name = name
        self.dir = workdir / name
        self.dir.mkdir(exist_ok=True)
        self.log = self.dir / "log.txt"
        # a hostile node runs the same daemon through tests/_hostile_node.py, forging what it sends
        start = [CLI, "join"] if hostile is None else [sys.executable, str(HOSTILE_NODE), hostile]
        if after:
            assert not peers, "the peers of a node started with after= are the first one's"
            files = ",".join(str(node.dir / "maddrs") for node in after)
            start = [sys.executable, str(JOIN_AFTER), files, "join" if hostile is None else hostile]
        cmd = [*start, *SETTINGS, "--checkpoint-dir", str(self.dir / "ckpt"), "--identity",
               str(self.dir / "id.key"), "--maddrs-file", str(self.dir / "maddrs"), *extra]  # fmt: skip
        if peers:
            cmd += ["--peers", *peers]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CGAD_CACHE_DIR": os.environ["CGAD_CACHE_DIR"]}
        self.launched = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        self._admin: str | None = None
        if wait:
            self._admin = self._wait_for_admin()

    @property
    def admin(self) -> str:
        """The admin API's address, as the node printed it (waited for the first time)."""
        if self._admin is None:
            self._admin = self._wait_for_admin()
        return self._admin

    def _wait_for_admin(self) -> str:
        deadline = self.launched + 180
        while time.monotonic() < deadline:
            found = re.search(r"^admin\s+(\S+)", self.log.read_text(), re.M)
            if found:
                return found.group(1)
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")

    @property
    def dashboard(self) -> str:
        """The dashboard's URL, as the node printed it."""
        found = re.search(r"^dashboard\s+(\S+)", self.log.read_text(), re.M)
        assert found, f"{self.name} printed no dashboard URL"
        return found.group(1)

    def maddrs(self) -> list[str]:
        path, deadline = self.dir / "maddrs", time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:  # written atomically, once
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.2)
        return path.read_text().split()

    def status(self) -> dict:
        return call_admin(self.admin, "Status", timeout=20)

    def wait(self, predicate, what: str, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"
            try:
                status = self.status()
            except ConnectionError:
                status = None
            if status is not None and predicate(status):
                return status
            time.sleep(1.0)
        raise AssertionError(
            f"{self.name}: timed out waiting for {what}; last {status}\n{self.log.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
