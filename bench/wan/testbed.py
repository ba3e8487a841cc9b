"""A wide-area network on one machine: a network namespace per node, shaped links, real daemons.

Each node lives in its own namespace (``cgadwan-nI``) with one interface, ``eth0``, whose other
end sits on a bridge in the host namespace. Both directions are shaped with ``tc tbf``: the
node's egress (its uplink) inside the namespace, and the bridge port's egress (its downlink)
outside it, so links can be asymmetric and one slow peer is one line of a scenario. The host
holds the bridge's own address and reaches every node's admin API through it.

A node may sit behind a NAT router instead (``nat``): a namespace of its own (``cgadwan-rI``)
holds the bridge end at the node's public address and a private link to the node
(``192.168.(100+I).0/24``), masquerades what the node sends out, and forwards nothing in but the
replies (iptables); the links are shaped on the router's bridge side. The one exception is the
testbed host itself (the monitor), which may reach the node's admin API through the router, as an
operator on the volunteer's own network would: no peer can.

A node may be given a share of the machine's CPU (``cpu``: cores per node, a CFS quota on a
cgroup of its own, ``cgadwan-nI``, that its daemon and the daemon's children run in): N nodes on
one machine then each compute at the same speed whatever N is, as N volunteers' machines would,
and costs per round compare across swarm sizes (the default: every node takes what it gets).

The host's firewall may drop bridged and forwarded frames (a docker engine sets the FORWARD
policy to DROP and turns on br_netfilter): the testbed inserts ACCEPT rules for its own bridge,
marked with a comment, and removes them at teardown.

Needs root and iproute2 (``ip``, ``tc``), iptables for NAT routers, and the cgroup ``cpu``
controller (v1 or v2) for CPU shares. ``Testbed`` is a context
manager whose exit always removes what it made (namespaces, bridge, firewall rules, processes),
and a stale testbed left by a killed run is removed before a new one starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgad.node.daemon.status import read_proc_stat

PREFIX = "cgadwan"
SUBNET = "10.77.0"
BRIDGE = f"{PREFIX}-br"
HOST_ADDRESS = f"{SUBNET}.254"
PRIVATE = "192.168"  # node I behind NAT: 192.168.(100+I).2, its router .1
RULE_MARK = f"{PREFIX}-testbed"  # the comment on the host's firewall rules this testbed inserts

__all__ = ["HOST_ADDRESS", "Link", "NodeProcess", "Testbed", "available", "host_cpu_seconds"]


def available(nat: bool = False, cpu: bool = False) -> str | None:
    """None when a testbed can be made here (with NAT routers, where ``nat``; with CPU shares,
    where ``cpu``), else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if cpu:
        try:  # a quota set on a group of our own, and the group removed: what a share needs
            _cpu_group(f"{PREFIX}-probe", 0.5).parent.rmdir()
        except (OSError, RuntimeError) as error:
            return f"cannot set a CPU share here (cgroup cpu controller): {error}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    if nat and shutil.which("iptables") is None:
        return "iptables is not installed (NAT routers need it; `make iptables` installs it)"
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


def host_cpu_seconds() -> tuple[float, float]:
    """CPU seconds the whole host has been busy since boot (every core, every process, the kernel
    too) and of them stolen by the hypervisor, from /proc/stat: beside the nodes' own CPU seconds,
    what else ran on the host during a run (a run's inner steps depend on the cores left to it)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, steal / tick


class Testbed:
    """``nodes`` namespaces on one bridge, each with its ``Link``; the nodes in ``nat`` each
    behind a NAT router of its own; with ``cpu``, each node held to that many cores."""

    def __init__(self, links: list[Link], nat: Iterable[int] = (), cpu: float | None = None) -> None:
        if cpu is not None and not cpu > 0:
            raise ValueError(f"cpu is cores per node, > 0: got {cpu}")
        self.links = links
        self.nat = frozenset(nat)
        self.cpu = cpu
        self.nodes: dict[int, NodeProcess] = {}

    # -- the network ------------------------------------------------------------------------

    def namespace(self, index: int) -> str:
        return f"{PREFIX}-n{index}"

    def router(self, index: int) -> str:
        """The namespace of node ``index``'s NAT router (only for nodes behind NAT)."""
        return f"{PREFIX}-r{index}"

    def public_address(self, index: int) -> str:
        """The address peers see node ``index`` at: its own, or its NAT router's."""
        return f"{SUBNET}.{index + 1}"

    def address(self, index: int) -> str:
        """Where node ``index`` listens: behind NAT, its private address."""
        if index in self.nat:
            return f"{PRIVATE}.{100 + index}.2"
        return self.public_address(index)

    def _edge(self, index: int) -> str:
        """The namespace whose ``eth0`` sits on the bridge for node ``index``."""
        return self.router(index) if index in self.nat else self.namespace(index)

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
        _open_host_firewall()
        for index, link in enumerate(self.links):
            edge, port = self._edge(index), f"{PREFIX}-p{index}"
            for ns in {edge, self.namespace(index)}:
                _sh("ip", "netns", "add", ns)
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", edge)
            _sh("ip", "link", "set", port, "master", BRIDGE)
            _sh("ip", "link", "set", port, "up")
            public = f"{self.public_address(index)}/24"
            _sh("ip", "netns", "exec", edge, "ip", "addr", "add", public, "dev", "eth0")
            _sh("ip", "netns", "exec", edge, "ip", "link", "set", "eth0", "up")
            if index in self.nat:
                self._build_router(index)
            self.shape(index, link)

    def _build_router(self, index: int) -> None:
        """Node ``index`` behind a NAT router: out through MASQUERADE, nothing in but replies
        (and the testbed host's own connections to the node's admin API)."""
        ns, router, lan = self.namespace(index), self.router(index), f"{PREFIX}-l{index}"
        private = f"{PRIVATE}.{100 + index}"
        in_router = ["ip", "netns", "exec", router]
        _sh("ip", "link", "add", lan, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "link", "set", lan, "netns", router)
        _sh(*in_router, "ip", "link", "set", lan, "name", "lan0")
        _sh(*in_router, "ip", "addr", "add", f"{private}.1/24", "dev", "lan0")
        _sh(*in_router, "ip", "link", "set", "lan0", "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{private}.2/24", "dev", "eth0")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        _sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", f"{private}.1")
        _sh(*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        iptables = [*in_router, "iptables", "-w", "5"]
        _sh(*iptables, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        _sh(*iptables, "-P", "FORWARD", "DROP")
        _sh(*iptables, "-A", "FORWARD", "-i", "lan0", "-o", "eth0", "-j", "ACCEPT")
        _sh(*iptables, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _sh(*iptables, "-A", "FORWARD", "-i", "eth0", "-s", HOST_ADDRESS, "-j", "ACCEPT")
        # the host (the monitor) reaches the private address through the router
        _sh("ip", "route", "add", f"{private}.0/24", "via", self.public_address(index))

    def __exit__(self, *exc_info: object) -> None:
        try:
            for node in self.nodes.values():
                _kill(node.process)
        finally:
            teardown_stale()

    def shape(self, index: int, link: Link) -> None:
        """Set (or change, while nodes run) a node's link rates."""
        self.links[index] = link
        ns, port = self._edge(index), f"{PREFIX}-p{index}"
        _set_rate(["ip", "netns", "exec", ns, "tc"], "eth0", link.up_mbit)
        _set_rate(["tc"], port, link.down_mbit)

    def set_link(self, index: int, up: bool) -> None:
        """Cut a node off the network (a partition) or bring it back."""
        _sh("ip", "link", "set", f"{PREFIX}-p{index}", "up" if up else "down")

    # -- the nodes --------------------------------------------------------------------------

    def start(
        self,
        index: int,
        executable: str,
        args: list[str],
        workdir: Path,
        env: dict[str, str] | None = None,
        listen_flags: bool = True,
    ) -> NodeProcess:
        """``cgad-node join`` in node ``index``'s namespace, with its admin API on the node's
        address (reached from the host through the bridge). With ``listen_flags`` a public node
        listens on its address at fixed ports (libp2p 31337, gRPC 31338); without, and behind NAT
        always, it takes the daemon's defaults, as a volunteer would."""
        workdir.mkdir(parents=True, exist_ok=True)
        address = self.address(index)
        admin_port = 7780
        listen = []
        if listen_flags and index not in self.nat:
            listen = ["--host-maddrs", f"/ip4/{address}/tcp/31337",
                      "--grpc-host", address, "--grpc-port", "31338"]  # fmt: skip
        command = [
            *self._held(index), "ip", "netns", "exec", self.namespace(index), executable, "join", *listen,
            "--admin-host", address, "--admin-port", str(admin_port),
            "--private-endpoints",  # the testbed's addresses are private ones (10.x, 203.0.113.x)
            *args,
        ]  # fmt: skip
        if "--eval-every" not in args:  # the checks and reports read every round's held-out loss
            command += ["--eval-every", "1"]
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

    def _held(self, index: int) -> list[str]:
        """The command prefix that puts node ``index``'s process (and what it starts) into its
        CPU cgroup before it runs (nothing without ``cpu``); outside the namespace, since
        ``ip netns exec`` mounts a sysfs of the namespace's own over /sys, without the cgroups."""
        if self.cpu is None:
            return []
        procs = _cpu_group(f"{PREFIX}-n{index}", self.cpu)
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        node = self.nodes.get(index)
        if node is not None:
            _kill(node.process, sig)

    def multiaddr(self, index: int, timeout: float = 180.0) -> str:
        """The first multiaddr node ``index`` printed at its own address (its peer id included)."""
        node = self.nodes[index]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in node.log.read_text().splitlines():
                if line.startswith("multiaddr ") and f"/ip4/{node.address}/" in line:
                    return line.split(None, 1)[1].strip()
            if not node.alive():
                raise RuntimeError(f"node {index} exited:\n{node.log.read_text()[-2000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"node {index} printed no multiaddr within {timeout:.0f} s")

    def describe(self) -> dict[str, Any]:
        return {
            "links": [{"up_mbit": link.up_mbit, "down_mbit": link.down_mbit} for link in self.links],
            "addresses": [self.address(i) for i in range(len(self.links))],
            "nat": sorted(self.nat),
            "cpu_per_node": self.cpu,
        }


def _set_rate(tc: list[str], device: str, mbit: float | None) -> None:
    subprocess.run([*tc, "qdisc", "del", "dev", device, "root"], capture_output=True)
    if mbit is None:
        return
    # burst: at least one MTU and ~10 ms at the rate; latency bounds the queue (~50 ms)
    burst = max(1600, int(mbit * 1e6 / 8 * 0.01))
    _sh(*tc, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
        "latency", "50ms")  # fmt: skip


CPU_PERIOD_US = 100_000


def _cpu_cgroups() -> tuple[Path, int] | None:
    """Where CPU cgroups are made here and the cgroup version: the v1 ``cpu`` hierarchy, or the
    v2 root when it delegates ``cpu``; None without either."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, 1
    v2 = Path("/sys/fs/cgroup")
    controls = v2 / "cgroup.subtree_control"
    if controls.exists() and "cpu" in controls.read_text().split() and os.access(v2, os.W_OK):
        return v2, 2
    return None


def _cpu_group(name: str, cores: float) -> Path:
    """Make (or update) cgroup ``name`` with a quota of ``cores`` CPUs; its ``cgroup.procs``."""
    found = _cpu_cgroups()
    if found is None:
        raise RuntimeError("no writable cgroup cpu controller: CPU shares cannot be set here")
    root, version = found
    group = root / name
    group.mkdir(exist_ok=True)
    quota = max(1000, int(cores * CPU_PERIOD_US))
    if version == 1:
        (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
    return group / "cgroup.procs"


def _remove_cpu_groups() -> None:
    """The testbed's CPU cgroups, once their processes are gone (a killed run's too)."""
    found = _cpu_cgroups()
    if found is None:
        return
    for group in found[0].glob(f"{PREFIX}-*"):
        for pid in (group / "cgroup.procs").read_text().split() if (group / "cgroup.procs").exists() else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        for _ in range(50):  # a killed process leaves its group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _kill(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            process.wait(timeout=30)


def _host_rules() -> list[list[str]]:
    """The host's FORWARD rules that let the testbed's bridged and routed frames through."""
    mark = ["-m", "comment", "--comment", RULE_MARK, "-j", "ACCEPT"]
    return [["-i", BRIDGE, *mark], ["-o", BRIDGE, *mark]]


def _open_host_firewall() -> None:
    """Let the testbed's frames through a host firewall that drops forwarded ones (docker's
    FORWARD policy, with br_netfilter filtering bridged frames too). Without iptables there is
    no such firewall to open."""
    if shutil.which("iptables") is None:
        return
    for rule in _host_rules():
        _sh("iptables", "-w", "5", "-I", "FORWARD", *rule)


def _close_host_firewall() -> None:
    if shutil.which("iptables") is None:
        return
    for rule in _host_rules():  # every copy, a killed run's too
        while _sh("iptables", "-w", "5", "-D", "FORWARD", *rule, check=False).returncode == 0:
            pass


def teardown_stale() -> None:
    """Remove every namespace, link and firewall rule this testbed makes, from this run or a
    killed one."""
    _close_host_firewall()
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
    _remove_cpu_groups()
