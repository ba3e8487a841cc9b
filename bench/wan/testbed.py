"""A wide-area network on one machine: a network namespace per node, shaped links, real daemons.

Each node lives in its own namespace (``cgadwan-nI``) with one interface, ``eth0``, whose other
end sits on a bridge in the host namespace. Both directions are shaped with ``tc tbf``: the
node's egress (its uplink) inside the namespace, and the bridge port's egress (its downlink)
outside it, so links can be asymmetric and one slow peer is one line of a scenario. The host
holds the bridge's own address and reaches every node's admin API through it.

Needs root and iproute2 (``ip``, ``tc``). ``Testbed`` is a context manager whose exit always
removes what it made (namespaces, bridge, processes), and a stale testbed left by a killed run
is removed before a new one starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgad.node.daemon.status import read_proc_stat

PREFIX = "cgadwan"
SUBNET = "10.77.0"
BRIDGE = f"{PREFIX}-br"
HOST_ADDRESS = f"{SUBNET}.254"

__all__ = ["HOST_ADDRESS", "Link", "NodeProcess", "Testbed", "available"]


def available() -> str | None:
    """None when a testbed can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = f"{PREFIX}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")
    return result


@dataclass
class Link:
    """A node's link to the bridge, in megabits per second each way (None: unshaped)."""

    up_mbit: float | None = None
    down_mbit: float | None = None


@dataclass
class NodeProcess:
    index: int
    namespace: str
    address: str
    process: subprocess.Popen
    log: Path
    admin: str
    workdir: Path
    command: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.process.poll() is None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by each live process of this node's session,
        summed by command name: the daemon (python) and its p2pd, which its own accounting of
        threads does not see."""
        used: dict[str, float] = {}
        for entry in Path("/proc").iterdir():
            stat = read_proc_stat(f"{entry}/stat") if entry.name.isdigit() else None
            # the session id: start_new_session made the daemon its session's leader
            if stat is not None and int(stat[2][3]) == self.process.pid:
                used[stat[0]] = used.get(stat[0], 0.0) + stat[1]
        return used


class Testbed:
    """``nodes`` namespaces on one bridge, each with its ``Link``."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links
        self.nodes: dict[int, NodeProcess] = {}

    # -- the network ------------------------------------------------------------------------

    def namespace(self, index: int) -> str:
        return f"{PREFIX}-n{index}"

    def address(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def __enter__(self) -> Testbed:
        teardown_stale()
        try:
            self._build()
        except BaseException:
            teardown_stale()
            raise
        return self

    def _build(self) -> None:
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        for index, link in enumerate(self.links):
            ns, port = self.namespace(index), f"{PREFIX}-p{index}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", port, "master", BRIDGE)
            _sh("ip", "link", "set", port, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            self.shape(index, link)

    def __exit__(self, *exc_info: object) -> None:
        try:
            for node in self.nodes.values():
                _kill(node.process)
        finally:
            teardown_stale()

    def shape(self, index: int, link: Link) -> None:
        """Set (or change, while nodes run) a node's link rates."""
        self.links[index] = link
        ns, port = self.namespace(index), f"{PREFIX}-p{index}"
        _set_rate(["ip", "netns", "exec", ns, "tc"], "eth0", link.up_mbit)
        _set_rate(["tc"], port, link.down_mbit)

    def set_link(self, index: int, up: bool) -> None:
        """Cut a node off the network (a partition) or bring it back."""
        _sh("ip", "link", "set", f"{PREFIX}-p{index}", "up" if up else "down")

    # -- the nodes --------------------------------------------------------------------------

    def start(
        self, index: int, executable: str, args: list[str], workdir: Path, env: dict[str, str] | None = None
    ) -> NodeProcess:
        """``cgad-node join`` in node ``index``'s namespace, listening on its address, with its
        admin API on that address too (reached from the host through the bridge)."""
        workdir.mkdir(parents=True, exist_ok=True)
        address = self.address(index)
        admin_port = 7780
        command = [
            "ip", "netns", "exec", self.namespace(index), executable, "join",
            "--host-maddrs", f"/ip4/{address}/tcp/31337", "--grpc-host", address, "--grpc-port", "31338",
            "--admin-host", address, "--admin-port", str(admin_port), *args,
        ]  # fmt: skip
        log = workdir / "log.txt"
        with log.open("a") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
            )
        node = NodeProcess(index, self.namespace(index), address, process, log, f"{address}:{admin_port}",
                           workdir, command)  # fmt: skip
        self.nodes[index] = node
        return node

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        node = self.nodes.get(index)
        if node is not None:
            _kill(node.process, sig)

    def multiaddr(self, index: int, timeout: float = 180.0) -> str:
        """The first multiaddr node ``index`` printed (its peer id included)."""
        node = self.nodes[index]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in node.log.read_text().splitlines():
                if line.startswith("multiaddr ") and node.address in line:
                    return line.split(None, 1)[1].strip()
            if not node.alive():
                raise RuntimeError(f"node {index} exited:\n{node.log.read_text()[-2000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"node {index} printed no multiaddr within {timeout:.0f} s")

    def describe(self) -> dict[str, Any]:
        return {
            "links": [{"up_mbit": link.up_mbit, "down_mbit": link.down_mbit} for link in self.links],
            "addresses": [self.address(i) for i in range(len(self.links))],
        }


def _set_rate(tc: list[str], device: str, mbit: float | None) -> None:
    subprocess.run([*tc, "qdisc", "del", "dev", device, "root"], capture_output=True)
    if mbit is None:
        return
    # burst: at least one MTU and ~10 ms at the rate; latency bounds the queue (~50 ms)
    burst = max(1600, int(mbit * 1e6 / 8 * 0.01))
    _sh(*tc, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
        "latency", "50ms")  # fmt: skip


def _kill(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            process.wait(timeout=30)


def teardown_stale() -> None:
    """Remove every namespace and link this testbed makes, from this run or a killed one."""
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{PREFIX}-"):
            pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", name, check=False)
    # a host end outlives its namespace while anything still holds that namespace open
    for line in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":")
        name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        if name.startswith(f"{PREFIX}-") and name != BRIDGE:
            _sh("ip", "link", "del", name, check=False)
    _sh("ip", "link", "del", BRIDGE, check=False)
