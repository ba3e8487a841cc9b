"""`cgad-node demo`: a small real swarm on this machine, N `cgad-node join` processes on 127.0.0.1.

The first node starts the swarm and writes its multiaddrs to a file; the others join through it.
While they train, a status line per node is refreshed from their admin APIs. At the end every
node is asked to leave, and the demo prints a summary table and writes a PNG of the held-out loss
curves. Ctrl-C stops every process it started (each runs in its own process group, so the libp2p
daemons they spawned go with them).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgad.node.config import DemoConfig, OuterOptions, TrainingOptions
from cgad.node.daemon.admin import call_admin
from cgad.node.daemon.status import status_line

__all__ = ["run_demo"]


@dataclass
class _Proc:
    index: int
    process: subprocess.Popen
    admin: str
    log: Path
    status: dict[str, Any] | None = None


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
    cmd = [sys.executable, "-m", "cgad.node.front.cli", "join", "--run-id", "demo"]
    cmd += ["--checkpoint-dir", str(workdir / f"node{index}"), "--admin-port", str(ports[0])]
    cmd += ["--dashboard-port", str(ports[1])]
    cmd += ["--identity", str(workdir / f"node{index}.key")]
    if index == 0:
        cmd += ["--maddrs-file", str(workdir / "bootstrap.maddrs")]
    else:
        cmd += ["--peers", *peers]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def _start(index: int, workdir: Path, peers: list[str], options: dict[str, Any]) -> _Proc:
    port, dashboard = _free_port(), _free_port()
    log = workdir / f"node{index}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # N nodes share the cores
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            _join_command(index, workdir, (port, dashboard), peers, options),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    print(f"node {index}: dashboard http://127.0.0.1:{dashboard}/", flush=True)
    return _Proc(index, process, f"127.0.0.1:{port}", log)


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
                raise RuntimeError(f"node {p.index} exited early; see {p.log}:\n{p.log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"the bootstrap node wrote no multiaddrs within {timeout:.0f} s; see {procs[0].log}")


def _poll(procs: list[_Proc]) -> None:
    for p in procs:
        if p.process.poll() is None:
            try:
                p.status = call_admin(p.admin, "Status", timeout=5)
            except ConnectionError:
                pass  # still starting, or busy: keep the last status


def _line(p: _Proc) -> str:
    return f"node {p.index}: starting" if p.status is None else f"node {p.index}: {status_line(p.status)}"


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
    procs: list[_Proc] = []
    interrupted = False
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            procs.append(_start(0, workdir, [], options))
            peers = _wait_for(workdir / "bootstrap.maddrs", procs, timeout=180)
            print(f"bootstrap node up at {peers[0]}; starting {nodes - 1} more", flush=True)
            for i in range(1, nodes):
                procs.append(_start(i, workdir, peers, options))
            _watch(procs, deadline=time.monotonic() + minutes * 60)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping every node (Ctrl-C again to kill them at once)", file=sys.stderr)
        _leave(procs)
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: the nodes are killed below
    finally:
        _stop_all(procs, signal.SIGTERM)
        time.sleep(1.0)
        _stop_all(procs, signal.SIGKILL)
        signal.signal(signal.SIGINT, previous)
    _summary(procs)
    return _plot(procs, out / "demo_loss.png"), interrupted


def _watch(procs: list[_Proc], deadline: float) -> None:
    """A live line per node until the deadline; a node that dies ends the demo with its log."""
    tty = sys.stdout.isatty()
    shown = 0.0
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.process.poll() is not None]
        if dead:
            tail = dead[0].log.read_text()[-2000:]
            raise RuntimeError(f"node {dead[0].index} exited; see {dead[0].log}:\n{tail}")
        _poll(procs)
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


def _leave(procs: list[_Proc]) -> None:
    """The last status of each node, then each asked to finish its step and checkpoint."""
    _poll(procs)
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
    print(f"{'node':>4} {'eval start':>10} {'eval end':>9} {'published':>9} {'applied':>8} {'mean age':>8}")
    for p in procs:
        s = p.status or {}
        history = s.get("eval_history") or [[0, float("nan")]]
        print(
            f"{p.index:>4} {history[0][1]:>10.3f} {history[-1][1]:>9.3f} {s.get('published', 0):>9} "
            f"{s.get('applied', 0):>8} {s.get('mean_age', 0.0):>8.2f}"
        )


def _plot(procs: list[_Proc], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p in procs:
        history = (p.status or {}).get("eval_history") or []
        if history:
            ax.plot([h[0] for h in history], [h[1] for h in history], marker=".", label=f"node {p.index}")
    ax.set(
        xlabel="outer round", ylabel="held-out loss", title=f"cgad-node demo: {len(procs)} nodes on 127.0.0.1"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
