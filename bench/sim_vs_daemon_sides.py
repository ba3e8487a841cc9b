"""The two sides of bench/sim_vs_daemon.py: the simulator's run of a scenario, and the same
scenario through real `cgad-node join` processes (on 127.0.0.1, or on the namespace testbed),
polled through their admin API; and the testbed's link probe, which tells the simulator the rate
the daemons had.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgad.node.daemon.admin import call_admin
from cgad.node.sim.config import SimConfig

if TYPE_CHECKING:
    from cgad.bench.sim_vs_daemon import Scenario

ROOT = Path(__file__).resolve().parent.parent
POLL_SECONDS = 0.25
START_TIMEOUT = 240.0  # seconds for a node to print its admin address (imports, p2pd) on a busy machine

Say = Callable[[str], None]


# ---------------------------------------------------------------------------------- checks


def check_data_order(scenario: Scenario, dataset: Any) -> None:
    """Node w's ``--data-seed`` draws the very batches the simulator's worker w draws."""
    from cgad.node.sim.simulate import worker_batches

    c = scenario.sim_config()
    for w in range(scenario.members):
        sim = worker_batches(dataset, c, w)
        daemon = dataset.shard(0, 1).batches(c.batch_size, c.seq_len, seed=scenario.data_seed(w))
        for _ in range(3):
            if not bool((next(sim) == next(daemon)).all()):
                raise RuntimeError(
                    f"worker {w}: --data-seed {scenario.data_seed(w)} does not give the simulator's batch "
                    "order (worker_batches changed?)"
                )


# ---------------------------------------------------------------------------------- the simulator


def run_simulator(
    scenario: Scenario,
    optimizer: str,
    dataset: Any,
    vocab_size: int,
    say: Say,
    wire: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One side's run in the simulator: per-member final losses, the loss by round (round 0
    included), what was applied at which age.

    Args:
        wire: the network the simulator is given (``bandwidth``: uplink bytes per second,
            ``step_time``: seconds per inner step), as measured on the testbed; None: none.
    """
    from cgad.node.sim.simulate import simulate

    c = scenario.sim_config(optimizer)
    if wire:
        c = SimConfig(**{**c.model_dump(), **wire})
    on = f", {c.bandwidth / 1e6:.3f} MB/s uplinks, {c.step_time:.3f} s per step" if wire else ""
    say(f"simulator, {optimizer}: {c.workers} workers x {c.rounds} rounds of {c.inner_steps} steps{on}")
    started = time.monotonic()

    def on_round(round_: int, loss: float) -> None:
        if round_ % 10 == 0:
            say(f"  simulator, {optimizer}: round {round_}, loss of the members' mean phi {loss:.3f}")

    record = simulate(c, dataset, vocab_size, on_round=on_round)
    ages = {int(a): n for a, n in record["age_counts"].items()}
    finals = record["worker_final_losses"]
    side = {
        "optimizer": optimizer,
        "final_losses": finals,
        "mean_final_loss": _mean(finals),
        "initial_loss": record["initial_loss"],
        "loss_by_round": [record["initial_loss"], *record["losses"]],
        "applied": record["applied"],
        "age_histogram": {str(a): ages[a] for a in sorted(ages)},
        "mean_age": _hist_mean(ages),
        "simulator_mean_age": record["mean_age"],
        "replayed": record["replayed"],
        "resyncs": record["resyncs"],
        "dropped_stale": record["dropped_stale"],
        "mixed": record["mixed"],
        "sent_as": record.get("sent_as", {}),
        "wall_seconds": time.monotonic() - started,
    }
    say(
        f"simulator, {optimizer}: final held-out loss {side['mean_final_loss']:.4f} "
        f"(members {_fmt(finals)}), applied {side['applied']}, mean age {side['mean_age']:.2f}, "
        f"{side['wall_seconds']:.0f} s"
    )
    return side


# ---------------------------------------------------------------------------------- the daemons


class _Node:
    def __init__(self, index: int, process: subprocess.Popen, log: Path, maddrs_file: Path) -> None:
        self.index, self.process, self.log, self.maddrs_file = index, process, log, maddrs_file
        self.admin: str | None = None
        self.status: dict[str, Any] | None = None  # the latest status read
        self.final: dict[str, Any] | None = None  # the status read at the end of round R
        self.round_seen: list[tuple[int, float]] = []  # (round, when a poll first saw it)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


# A joiner's Python starts with node 0's and imports what a daemon runs (torch, hivemind: seconds on
# a busy machine) while node 0 starts; it runs `cgad-node join --peers <node 0>` as soon as node 0
# has written its multiaddrs. So node 0 trains alone only for as long as joining takes, not for as
# long as a Python process takes to import torch.
_JOIN_WHEN_UP = """
import sys, time
from pathlib import Path
import cgad.node.daemon.node
from cgad.node.front.cli import main
maddrs = Path(sys.argv[1])
while not (maddrs.exists() and maddrs.read_text().strip()):
    time.sleep(0.05)
sys.exit(main(["join", *sys.argv[2:], "--peers", *maddrs.read_text().split()]))
"""


def _start_node(
    index: int, flags: list[str], workdir: Path, peers_file: Path | None = None, bed: Any = None
) -> _Node:
    """``cgad-node join`` with ``flags``; with ``peers_file``, joining the peers it names once
    it holds them; with ``bed`` (a testbed.Testbed), in node ``index``'s namespace there."""
    log = workdir / f"node{index}.log"
    maddrs = workdir / f"node{index}.maddrs"
    flags = [*flags, "--maddrs-file", str(maddrs)]
    if bed is not None:
        # the testbed runs `<executable> join <its listen and admin flags> <flags>`: a launcher
        # script of this Python (its code, not whatever `cgad-node` is on the PATH)
        launcher = workdir / f"node{index}.sh"
        if peers_file is None:
            body = f'exec "{sys.executable}" -m cgad.node.front.cli "$@"'
        else:
            script = workdir / "join_when_up.py"
            script.write_text(_JOIN_WHEN_UP)
            body = f'shift\nexec "{sys.executable}" "{script}" "{peers_file}" "$@"'  # the script says `join`
        launcher.write_text(f"#!/bin/sh\n{body}\n")
        launcher.chmod(0o755)
        started = bed.start(index, str(launcher), flags, workdir / f"n{index}")
        return _Node(index, started.process, started.log, maddrs)
    if peers_file is None:
        cmd = [sys.executable, "-m", "cgad.node.front.cli", "join", *flags]
    else:
        cmd = [sys.executable, "-c", _JOIN_WHEN_UP, str(peers_file), *flags]
    # the members share the machine's cores, as the demo's do; each runs in its own process group so
    # the libp2p daemon it spawns goes with it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return _Node(index, process, log, maddrs)


def _wait_started(node: _Node, need_maddrs: bool) -> None:
    """Until the node has printed its admin address (and written its multiaddrs)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            raise RuntimeError(f"node {node.index} exited ({node.process.returncode}):\n{node.tail()}")
        found = re.search(r"^admin\s+(\S+)", node.log.read_text(errors="replace"), re.M)
        if found and (
            not need_maddrs or (node.maddrs_file.exists() and node.maddrs_file.read_text().strip())
        ):
            node.admin = found.group(1)
            return
        time.sleep(0.2)
    raise RuntimeError(f"node {node.index} did not start within {START_TIMEOUT:.0f} s:\n{node.tail()}")


def _stop(nodes: list[_Node]) -> None:
    """Ask every node still running to leave; kill what has not gone a minute later."""
    for node in nodes:
        if node.process.poll() is None and node.admin:
            try:
                call_admin(node.admin, "Leave", timeout=5)
            except ConnectionError:
                pass
    deadline = time.monotonic() + 60
    for node in nodes:
        try:
            node.process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for node in nodes:
        if node.process.poll() is None:
            try:
                os.killpg(node.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.process.wait(timeout=30)


def _links(bed: Any) -> str:
    rates = {(link.up_mbit, link.down_mbit) for link in bed.links}
    return ", ".join(f"{up} Mbit up / {down} down" for up, down in sorted(rates, key=str))


def _reached(status: dict[str, Any], round_: int) -> bool:
    return any(r >= round_ for r, _ in status.get("eval_history") or [])


def run_daemons(
    scenario: Scenario, optimizer: str, workdir: Path, say: Say, timeout: float = 3600, bed: Any = None
) -> dict[str, Any]:
    """One side's run as real daemons: node 0 first, then the others through its multiaddr (or,
    training alone, each by itself), each read at the end of round R, then all asked to leave.

    Args:
        bed: a testbed.Testbed with a namespace per member: the daemons run there, on its links
            (None: on 127.0.0.1).
    """
    alone = optimizer == "local"
    workdir.mkdir(parents=True, exist_ok=True)
    R = scenario.rounds
    flags = [
        *scenario.join_flags(optimizer),
        "--run-id",
        f"sim-vs-daemon-{scenario.seed}",
        "--max-rounds",
        str(R + 1),
        *(["--admin-port", "0"] if bed is None else []),  # the testbed gives each its address and port
        "--no-dashboard",
        "--private-endpoints",  # on 127.0.0.1 or a testbed's private addresses
    ]
    what = "each alone" if alone else "node 0 starts the swarm, the others join it"
    where = "127.0.0.1" if bed is None else f"the testbed's namespaces ({_links(bed)})"
    say(f"daemons, {optimizer}: {scenario.members} cgad-node join processes on {where} ({what}), {R} rounds")
    started = time.monotonic()
    nodes: list[_Node] = []
    try:
        nodes.append(_start_node(0, [*flags, "--data-seed", str(scenario.data_seed(0))], workdir, bed=bed))
        # on the testbed node 0's multiaddr at its namespace's address, written once it is printed
        bootstrap = None if alone else nodes[0].maddrs_file if bed is None else workdir / "peers"
        for i in range(1, scenario.members):
            flags_i = [*flags, "--data-seed", str(scenario.data_seed(i))]
            nodes.append(_start_node(i, flags_i, workdir, peers_file=bootstrap, bed=bed))
        if bed is not None and bootstrap is not None:
            bootstrap.write_text(bed.multiaddr(0, timeout=START_TIMEOUT))
        for node in nodes:
            _wait_started(node, need_maddrs=node.index == 0 and not alone)
        deadline = time.monotonic() + timeout
        joined_said: set[int] = set()
        next_said = 10
        while any(n.final is None for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemons, {optimizer}: not all at round {R} within {timeout:.0f} s")
            for node in nodes:
                if node.final is not None:
                    continue
                if node.process.poll() is not None:
                    code = node.process.returncode
                    raise RuntimeError(f"node {node.index} exited ({code}) before round {R}:\n{node.tail()}")
                try:
                    status = call_admin(node.admin, "Status", timeout=10)
                except ConnectionError:
                    continue  # busy, or still starting: asked again at the next poll
                node.status = status
                if not node.round_seen or status["round"] > node.round_seen[-1][0]:
                    node.round_seen.append((int(status["round"]), time.monotonic()))
                history = status.get("eval_history") or []
                if node.index not in joined_said and history:
                    joined_said.add(node.index)
                    if node.index and not alone:
                        say(
                            f"  node {node.index} joined: started from {status['started_from'][:20]}..., "
                            f"at round {history[0][0]}"
                        )
                if _reached(status, R):
                    node.final = status
            slowest = min((n.status or {}).get("round", 0) for n in nodes)
            if slowest >= next_said and slowest < R:
                took = time.monotonic() - started
                say(f"  daemons, {optimizer}: every node past round {slowest} ({took:.0f} s)")
                next_said += 10
            time.sleep(POLL_SECONDS)
    finally:
        _stop(nodes)
    done = [n for n in nodes if n.final is not None]
    side = _daemon_side(scenario, optimizer, [n.final for n in done], [n.round_seen for n in done])
    side["wall_seconds"] = time.monotonic() - started
    say(
        f"daemons, {optimizer}: final held-out loss {side['mean_final_loss']:.4f} "
        f"(members {_fmt(side['final_losses'])}), applied {side['applied']}, "
        f"mean age {side['mean_age']:.2f}, joined at rounds {side['joined_at_round']}, "
        f"{side['wall_seconds']:.0f} s"
    )
    return side


def measure_link(bed: Any, nbytes: int = 3_000_000, port: int = 5201) -> float:
    """Goodput of one shaped path in bytes per second: node 1's namespace sends ``nbytes`` over
    TCP to node 0's, timed at the receiver from the first byte to the last (through node 1's
    uplink and node 0's downlink, both shaped)."""
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", bed.namespace(0), sys.executable, "-c", _RECEIVE, bed.address(0), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("the link probe's receiver did not start")
        subprocess.run(
            ["ip", "netns", "exec", bed.namespace(1), sys.executable, "-c", _SEND, bed.address(0), str(port),
             str(nbytes)],
            check=True, timeout=300,
        )  # fmt: skip
        got, seconds = (float(x) for x in receiver.communicate(timeout=60)[0].split())
    finally:
        if receiver.poll() is None:
            receiver.kill()
    if got != nbytes or seconds <= 0:
        raise RuntimeError(f"the link probe moved {got:.0f} of {nbytes} bytes in {seconds:.3f} s")
    return got / seconds


_RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = server.accept()
got, first = 0, None
while chunk := conn.recv(1 << 16):
    first = first or time.monotonic()
    got += len(chunk)
print(got, time.monotonic() - first)
"""
_SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
"""


def step_seconds(seen: list[tuple[int, float]], inner_steps: int, skip: int = 2) -> float | None:
    """Wall seconds per inner step of one daemon: the median time between its rounds' ends
    (evaluation included), after its first ``skip`` rounds (joining, warm-up), over H.

    Args:
        seen: ``(round, seconds)``: when the bench's polls (every ``POLL_SECONDS``) first saw
            the daemon at each round.
    """
    points = sorted(seen)[skip:]
    gaps = [(t1 - t0) / (r1 - r0) for (r0, t0), (r1, t1) in itertools.pairwise(points) if r1 > r0]
    return statistics.median(gaps) / inner_steps if gaps else None


def _daemon_side(
    scenario: Scenario, optimizer: str, finals: list[dict[str, Any]], seen: list[list[tuple[int, float]]]
) -> dict[str, Any]:
    R = scenario.rounds
    steps = [step_seconds(points, scenario.join_config().inner_steps) for points in seen]
    known_steps = [x for x in steps if x is not None]
    histories = [{int(r): float(loss) for r, loss in s["eval_history"]} for s in finals]
    ages: Counter[int] = Counter()
    for s in finals:
        ages.update({int(a): int(n) for a, n in (s.get("applied_by_age") or {}).items()})
    by_round = []
    for r in range(R + 1):
        losses = [h[r] for h in histories if r in h]
        by_round.append(_mean(losses) if losses else None)
    final_losses = [h[R] for h in histories]
    sent_as: Counter[str] = Counter()
    for s in finals:
        sent_as.update(s.get("sent_as") or {})
    return {
        "optimizer": optimizer,
        "final_losses": final_losses,
        "mean_final_loss": _mean(final_losses),
        "initial_loss": histories[0].get(0),
        "loss_by_round": by_round,
        "loss_by_round_per_member": [[h.get(r) for r in range(R + 1)] for h in histories],
        "applied": sum(s["applied"] for s in finals),
        "applied_per_member": [s["applied"] for s in finals],
        "age_histogram": {str(a): ages[a] for a in sorted(ages)},
        "age_histogram_per_member": [s.get("applied_by_age") or {} for s in finals],
        "mean_age": _hist_mean(ages),
        # the daemon's own mean_age counts its own delta (age 0) in every step too
        "status_mean_age": [s["mean_age"] for s in finals],
        "replayed": sum(s["replayed"] for s in finals),
        "resyncs": sum(s["resyncs"] for s in finals),
        "dropped_stale": sum(s["dropped_stale"] for s in finals),
        "discarded": sum(s["discarded"] for s in finals),
        "held_ahead": sum(s["held_ahead"] for s in finals),
        "rejected": dict(sum((Counter(s["rejected"]) for s in finals), Counter())),
        "sent_as": dict(sent_as),
        "joined_at_round": [min(h) for h in histories],
        "started_from": [s["started_from"] for s in finals],
        "status_read_at_round": [s["round"] for s in finals],
        "step_seconds_per_member": steps,
        "step_seconds": statistics.median(known_steps) if known_steps else None,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _hist_mean(ages: dict[int, int]) -> float:
    total = sum(ages.values())
    return sum(a * n for a, n in ages.items()) / total if total else 0.0


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)
