"""`cgad-node demo`: a small real swarm on this machine, N `cgad-node join` processes on 127.0.0.1,
beside one more node that trains alone on the same settings: the floor, what a volunteer would
get without the swarm.

The first node starts the swarm and writes its multiaddrs to a file; the others join through it.
The lone node starts with the first, in a run of its own, with node 0's data order (node i gets
``--data-seed i``), so the two see the same batches. While they train, a status line per node is
refreshed from their admin APIs, and the lone node's held-out loss is written to a file every
swarm node's dashboard draws beside its own (``--dashboard-floor``). At the end every node is
asked to leave, and the demo prints a summary table, the swarm's held-out loss against the lone
node's by round and by wall-clock with the gain in words, and writes a PNG of both. Ctrl-C stops
every process it started (each runs in its own process group, so the libp2p daemons they spawned
go with them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgad.node.config import DemoConfig, OuterOptions, TrainingOptions
from cgad.node.daemon.admin import call_admin
from cgad.node.daemon.status import status_line
from cgad.protocol.files import atomic_write

__all__ = ["run_demo"]


ALONE = -1  # the index of the node that trains alone
JOIN_GRACE = 300.0  # seconds the countdown waits for every node to train


@dataclass
class _Proc:
    index: int  # ALONE for the lone node
    process: subprocess.Popen
    admin: str
    log: Path
    status: dict[str, Any] | None = None
    eval_seconds: dict[int, float] = field(default_factory=dict)  # round -> when its loss was first seen

    @property
    def name(self) -> str:
        return "alone" if self.index == ALONE else f"node {self.index}"

    def evals(self) -> dict[int, float]:
        """Held-out loss by round, from the last status."""
        return {int(r): loss for r, loss in (self.status or {}).get("eval_history") or []}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_options(config: DemoConfig) -> dict[str, Any]:
    """What every node is told: the demo's training and outer settings, and its codec."""
    names = [*TrainingOptions.model_fields, *OuterOptions.model_fields, "codec"]
    return {n: getattr(config, n) for n in names if getattr(config, n) is not None}


def _join_command(
    index: int, workdir: Path, ports: tuple[int, int], peers: list[str], options: dict[str, Any]
) -> list[str]:
    name = "alone" if index == ALONE else f"node{index}"
    cmd = [sys.executable, "-m", "cgad.node.front.cli", "join"]
    cmd += ["--run-id", "demo-alone" if index == ALONE else "demo"]
    cmd += ["--checkpoint-dir", str(workdir / name), "--admin-port", str(ports[0])]
    cmd += ["--dashboard-port", str(ports[1])]
    cmd += ["--eval-every", "1"]  # the demo compares the swarm with the lone node round by round
    cmd += ["--private-endpoints"]  # its nodes' gRPC endpoints are on 127.0.0.1
    cmd += ["--identity", str(workdir / f"{name}.key")]
    # paired data orders: the lone node sees node 0's batches
    cmd += ["--data-seed", str(max(index, 0))]
    if index == ALONE:
        pass  # a run of its own: no peers, nobody to find it
    elif index == 0:
        cmd += ["--maddrs-file", str(workdir / "bootstrap.maddrs")]
    else:
        cmd += ["--peers", *peers]
    if index != ALONE:
        cmd += ["--dashboard-floor", str(workdir / FLOOR_FILE)]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


FLOOR_FILE = "alone.json"  # the lone node's held-out loss, for the swarm's dashboards


def _start(index: int, workdir: Path, peers: list[str], options: dict[str, Any]) -> _Proc:
    port, dashboard = _free_port(), _free_port()
    log = workdir / ("alone.log" if index == ALONE else f"node{index}.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # N nodes share the cores
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            _join_command(index, workdir, (port, dashboard), peers, options),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    proc = _Proc(index, process, f"127.0.0.1:{port}", log)
    print(f"{proc.name}: dashboard http://127.0.0.1:{dashboard}/", flush=True)
    return proc


def _stop_all(procs: list[_Proc], sig: int) -> None:
    for p in procs:
        if p.process.poll() is None:
            try:
                os.killpg(p.process.pid, sig)
            except ProcessLookupError:
                pass


def _wait_for(path: Path, procs: list[_Proc], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        for p in procs:
            if p.process.poll() is not None:
                raise RuntimeError(f"{p.name} exited early; see {p.log}:\n{p.log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"the bootstrap node wrote no multiaddrs within {timeout:.0f} s; see {procs[0].log}")


def _poll(procs: list[_Proc], started: float) -> None:
    """Each node's status, and when (seconds since ``started``) each held-out loss was first seen."""
    for p in procs:
        if p.process.poll() is None:
            try:
                p.status = call_admin(p.admin, "Status", timeout=5)
            except ConnectionError:
                continue  # still starting, or busy: keep the last status
            for round_ in p.evals():
                p.eval_seconds.setdefault(round_, time.monotonic() - started)


def _write_floor(procs: list[_Proc], workdir: Path) -> None:
    """The lone node's held-out loss so far, where the swarm's dashboards read it."""
    alone = procs[-1]
    points = [[r, alone.eval_seconds[r], loss] for r, loss in sorted(alone.evals().items())]
    atomic_write(workdir / FLOOR_FILE, json.dumps({"points": points}).encode())


def _line(p: _Proc) -> str:
    return f"{p.name}: starting" if p.status is None else f"{p.name}: {status_line(p.status)}"


def run_demo(config: DemoConfig) -> tuple[Path, bool]:
    """Run the swarm for ``config.minutes`` (or until Ctrl-C); return the path of the loss-curve
    PNG and whether it was interrupted. Either way every node is asked to leave, then stopped,
    and the summary covers what ran."""
    nodes, minutes, out = config.nodes, config.minutes, Path(config.out)
    options = _join_options(config)
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "demo-swarm"
    workdir.mkdir(exist_ok=True)
    (workdir / "bootstrap.maddrs").unlink(missing_ok=True)
    (workdir / FLOOR_FILE).unlink(missing_ok=True)
    procs: list[_Proc] = []  # the swarm's nodes, then the lone one
    alone: _Proc | None = None
    started = time.monotonic()
    interrupted = False
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            procs.append(_start(0, workdir, [], options))
            alone = _start(ALONE, workdir, [], options)  # the floor, started with the swarm
            peers = _wait_for(workdir / "bootstrap.maddrs", [procs[0], alone], timeout=180)
            print(f"bootstrap node up at {peers[0]}; starting {nodes - 1} more", flush=True)
            for i in range(1, nodes):
                procs.append(_start(i, workdir, peers, options))
            procs.append(alone)
            _watch(procs, workdir, started, seconds=minutes * 60)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping every node (Ctrl-C again to kill them at once)", file=sys.stderr)
        if alone is not None and alone not in procs:
            procs.append(alone)  # interrupted before the others started
        _leave(procs, started)
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: the nodes are killed below
    finally:
        if alone is not None and alone not in procs:
            procs.append(alone)
        _stop_all(procs, signal.SIGTERM)
        time.sleep(1.0)
        _stop_all(procs, signal.SIGKILL)
        signal.signal(signal.SIGINT, previous)
    swarm = [p for p in procs if p.index != ALONE]
    _summary(procs)
    _versus(swarm, alone)
    return _plot(swarm, alone, out / "demo_loss.png"), interrupted


def _training(p: _Proc) -> bool:
    return p.status is not None and p.status.get("inner_step", 0) > 0


def _watch(procs: list[_Proc], workdir: Path, started: float, seconds: float) -> None:
    """A live line per node for ``seconds``, and at least half of them with every node training
    (a joiner first adopts the swarm's state: on a busy machine that can take most of a short
    demo; at most ``JOIN_GRACE`` seconds are waited for it); a node that dies ends the demo with
    its log."""
    tty = sys.stdout.isatty()
    shown = 0.0
    begun = time.monotonic()
    deadline: float | None = None
    while deadline is None or time.monotonic() < deadline:
        if deadline is None and (all(_training(p) for p in procs) or time.monotonic() > begun + JOIN_GRACE):
            deadline = max(begun + seconds, time.monotonic() + seconds / 2)
            print(
                f"every node trains: the demo ends in {(deadline - time.monotonic()) / 60:.1f} minute(s)",
                flush=True,
            )
            shown = 0.0  # a fresh block of lines below the message
        dead = [p for p in procs if p.process.poll() is not None]
        if dead:
            tail = dead[0].log.read_text()[-2000:]
            raise RuntimeError(f"{dead[0].name} exited; see {dead[0].log}:\n{tail}")
        _poll(procs, started)
        _write_floor(procs, workdir)
        if tty:  # redraw one line per node in place
            if shown:
                sys.stdout.write(f"\x1b[{len(procs)}F")
            sys.stdout.write("".join(f"\x1b[2K{_line(p)}\n" for p in procs))
            sys.stdout.flush()
            shown = 1.0
        elif time.monotonic() - shown >= 15.0:
            print(" | ".join(_line(p) for p in procs), flush=True)
            shown = time.monotonic()
        time.sleep(2.0)


def _leave(procs: list[_Proc], started: float) -> None:
    """The last status of each node, then each asked to finish its step and checkpoint."""
    _poll(procs, started)
    for p in procs:
        try:
            call_admin(p.admin, "Leave", timeout=5)
        except ConnectionError:
            p.process.terminate()
    for p in procs:
        try:
            p.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _stop_all([p], signal.SIGKILL)


def _summary(procs: list[_Proc]) -> None:
    print(f"{'node':>5} {'eval start':>10} {'eval end':>9} {'published':>9} {'applied':>8} {'mean age':>8}")
    for p in procs:
        s = p.status or {}
        history = s.get("eval_history") or [[0, float("nan")]]
        print(
            f"{'alone' if p.index == ALONE else p.index:>5} {history[0][1]:>10.3f} {history[-1][1]:>9.3f}"
            f" {s.get('published', 0):>9} {s.get('applied', 0):>8} {s.get('mean_age', 0.0):>8.2f}"
        )


def _versus(swarm: list[_Proc], alone: _Proc | None) -> None:
    """The swarm's held-out loss (the mean over its nodes) against the lone node's, by round and
    by wall-clock, and the gain in words."""
    from cgad.node.front.report import by_round, by_time, gain_in_words, thin

    if alone is None:
        return
    rounds = by_round([p.evals() for p in swarm], alone.evals())
    times = by_time([_timed(p) for p in swarm], _timed(alone))
    print(f"\nthe swarm ({len(swarm)} nodes, mean) against one node training alone on the same settings")
    print(f"{'':>14} {'swarm':>7} {'alone':>7} {'gain':>7}")
    for label, rows in (("round", thin(rounds, 8)), ("minute", times)):
        for at, mean, lone in rows:
            shown = f"{at}" if label == "round" else f"{at / 60:.1f}"
            print(f"{label:>7} {shown:>6} {mean:>7.3f} {lone:>7.3f} {lone - mean:>+7.3f}")
    # the words compare at the last round every node evaluated: equal inner steps, the whole swarm
    every = by_round([p.evals() for p in swarm], alone.evals(), every=True)
    print(gain_in_words(every, times, len(swarm), alone.evals()))


def _timed(p: _Proc) -> list[tuple[float, float]]:
    """(seconds since the demo began, held-out loss) of each evaluation, in order."""
    evals = p.evals()
    return sorted((p.eval_seconds[r], evals[r]) for r in evals if r in p.eval_seconds)


def _plot(swarm: list[_Proc], alone: _Proc | None, path: Path) -> Path:
    from cgad.node.front.report import plot_demo

    return plot_demo(
        [p.evals() for p in swarm],
        [_timed(p) for p in swarm],
        alone.evals() if alone else {},
        _timed(alone) if alone else [],
        path,
    )
