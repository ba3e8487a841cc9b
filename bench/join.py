"""What joining costs a volunteer: bytes and seconds to adopt a swarm's state over a shaped link.

On the WAN testbed (bench/wan/testbed.py: a namespace per node, ``tc tbf`` links), each repeat:

1. **one holder**: node A trains alone; once it has offered a snapshot, node B joins it over a
   link of ``--mbit`` each way, every flag at its default. Measured on B's interface: the bytes
   it received until it adopted the state (the status document's ``started_from`` turning to a
   peer, polled every 0.25 s) and until its first training step, per parameter of the model; the
   seconds from its start to that step, and of the download alone (its log's lines); against
   1.3 x the time the bytes to adoption take at the link's rate, plus 20 s.
2. **two holders**: A offers one snapshot only (``--state-every`` large, the exception to the
   defaults that keeps B's adopted copy the newest of those bytes); B joins and serves what it
   adopted onward; then a probe in C's namespace (``--probe``: the transport a joiner downloads
   with, ``fetch_state``) downloads the snapshot both hold, from both at once, over a link with
   ``--joiner-down-mbit`` down (a home line: its downlink several times its uplink; on a
   symmetric link one holder already fills it). Measured: its download rate against one
   holder's uplink.

Writes ``bench/results/join.json`` (with the commit it ran at) and prints a summary. Needs root
and iproute2 (as the WAN runner).

    python bench/join.py --preset small --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from cgad.bench.wan.provenance import tree_state
from cgad.bench.wan.testbed import Link, Testbed, available

ROOT = Path(__file__).resolve().parent.parent

from cgad.node.daemon.admin import call_admin  # noqa: E402

RESULTS = ROOT / "bench" / "results"
EXECUTABLE = str(ROOT / ".venv" / "bin" / "cgad-node")


def _status(admin: str) -> dict[str, Any] | None:
    try:
        return call_admin(admin, "Status", timeout=5)
    except (ConnectionError, OSError, ValueError):
        return None


def _rx_bytes(namespace: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "cat", "/sys/class/net/eth0/statistics/rx_bytes"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout)


def _wait(what: str, predicate: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def _join(bed: Testbed, index: int, args: list[str], peers: list[str], workdir: Path) -> dict[str, Any]:
    """Start node ``index`` joining ``peers``; follow it to its first training step."""
    rx_before = _rx_bytes(bed.namespace(index))
    started = time.monotonic()
    node = bed.start(index, EXECUTABLE, [*args, "--peers", *peers], workdir / f"n{index}")
    adopted_at = rx_adopted = None
    while True:
        if not node.alive():
            raise RuntimeError(f"node {index} exited:\n{node.log.read_text()[-3000:]}")
        status = _status(node.admin)
        now = time.monotonic() - started
        if status and status.get("started_from", "scratch").startswith("peer") and adopted_at is None:
            # what came in until the state was adopted: the join itself (right after it the node
            # starts fetching its peers' fragments, which are training traffic, not joining's)
            adopted_at, rx_adopted = now, _rx_bytes(bed.namespace(index)) - rx_before
        if status and status.get("inner_step", 0) >= 1 and adopted_at is not None:
            break
        if now > 900:
            raise TimeoutError(f"node {index} did not train within 900 s")
        time.sleep(0.25)
    rx = _rx_bytes(bed.namespace(index)) - rx_before
    log = node.log.read_text()
    # the download alone: from the line that starts it to adoption (the status poll's resolution)
    lines = [line for line in log.splitlines() if "state" in line][-6:]
    return {"seconds_to_first_step": now, "seconds_to_adopted": adopted_at, "rx_bytes": rx,
            "rx_bytes_at_adoption": rx_adopted,
            "status": status, "download_lines": lines}  # fmt: skip


def _download_seconds(lines: list[str]) -> float | None:
    """Seconds from the log line that starts the snapshot download to the one that adopts it."""
    stamps = {}
    for line in lines:
        for word, key in (("downloading the state", "start"), ("adopted the outer state", "end")):
            if word in line:
                stamps[key] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    if "start" not in stamps or "end" not in stamps:
        return None
    return (stamps["end"] - stamps["start"]).total_seconds()


def one_repeat(preset: str, mbit: float, down_mbit: float, extra: list[str], workdir: Path) -> dict[str, Any]:
    common = ["--model", preset, "--run-id", "joinbench", *extra]
    link = Link(up_mbit=mbit, down_mbit=mbit)
    home = Link(up_mbit=mbit, down_mbit=down_mbit)
    out: dict[str, Any] = {}
    for phase in ("one_holder", "two_holders"):
        a_args = common + (["--state-every", "100000"] if phase == "two_holders" else [])
        with Testbed([link, link, home]) as bed:
            bed.start(0, EXECUTABLE, a_args, workdir / phase / "n0")
            peers = [bed.multiaddr(0)]
            admin = bed.nodes[0].admin

            def offered(admin: str = admin) -> dict[str, Any] | None:
                status = _status(admin)
                return status if status and status.get("snapshot_bytes") else None

            status = _wait("A's first snapshot", offered, 600)
            b = _join(bed, 1, common, peers, workdir / phase)
            b["download_seconds"] = _download_seconds(b["download_lines"])
            row: dict[str, Any] = {
                "snapshot_bytes": status["snapshot_bytes"], "parameters": status["parameters"], "b": b,
            }  # fmt: skip
            if phase == "two_holders":
                probe = subprocess.run(
                    ["ip", "netns", "exec", bed.namespace(2), sys.executable, __file__, "--probe", *peers],
                    capture_output=True, text=True, timeout=900,
                )  # fmt: skip
                if probe.returncode:
                    raise RuntimeError(f"the probe failed:\n{probe.stderr[-3000:]}")
                row["probe"] = json.loads(probe.stdout.strip().splitlines()[-1])
            out[phase] = row
    return out


def probe(peers: list[str]) -> None:
    """In a joiner's namespace: download the snapshot on offer with the most holders, as a
    joiner does (``fetch_state``), and print its size, holders and seconds as JSON."""
    from cgad.protocol.config import NetworkOptions
    from cgad.protocol.network import NetworkTransport

    options = NetworkOptions(run_id="joinbench", peers=peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    with NetworkTransport(options, num_fragments=1, fragment_numel={}) as transport:
        twice = lambda: [c for c in transport.state_offers() if len(c.holders) >= 2]  # noqa: E731
        offers = _wait("a snapshot held twice", twice, 300)
        candidate = max(offers, key=lambda c: len(c.holders))
        started = time.monotonic()
        data = transport.fetch_state(candidate, timeout=600)
        seconds = time.monotonic() - started
    print(json.dumps({"bytes": len(data), "holders": len(candidate.holders), "seconds": seconds}))


def summarise(repeats: list[dict[str, Any]], mbit: float, parameters: int) -> dict[str, Any]:
    """Per repeat and over them (mean, min, max): bytes per parameter and seconds of the one-holder
    join, against the bound 1.3 x (bytes / link rate) + 20 s; the two-holder download's rate over
    one holder's uplink."""
    rate = mbit * 1e6 / 8  # bytes per second of the link
    one = [r["one_holder"]["b"] for r in repeats]

    def spread(values: list[float]) -> dict[str, float]:
        return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}

    allowed = [1.3 * b["rx_bytes_at_adoption"] / rate + 20 for b in one]
    probes = [r["two_holders"]["probe"] for r in repeats]
    snapshots = [r["one_holder"]["snapshot_bytes"] for r in repeats]
    return {
        "snapshot_bytes_per_parameter": spread([size / parameters for size in snapshots]),
        "bytes_in_to_adoption_per_parameter": spread([b["rx_bytes_at_adoption"] / parameters for b in one]),
        "bytes_in_to_first_step_per_parameter": spread([b["rx_bytes"] / parameters for b in one]),
        "seconds_to_first_step": spread([b["seconds_to_first_step"] for b in one]),
        "download_seconds": spread([b["download_seconds"] or float("nan") for b in one]),
        "seconds_allowed": spread(allowed),
        "within_time": all(b["seconds_to_first_step"] <= lim for b, lim in zip(one, allowed, strict=True)),
        "two_holders_rate_over_uplink": spread([p["bytes"] / p["seconds"] / rate for p in probes]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--mbit", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--joiner-down-mbit", type=float, default=50.0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "join.json"))
    parser.add_argument("--probe", nargs="+", metavar="PEER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe)
        return
    why = available()
    if why:
        sys.exit(f"join bench: {why}")
    extra = ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--inner-steps", str(args.inner_steps)]  # fmt: skip
    state = tree_state(ROOT)
    repeats = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="cgad-join-") as tmp:
            print(f"repeat {repeat + 1}/{args.repeats} ...", flush=True)
            repeats.append(one_repeat(args.preset, args.mbit, args.joiner_down_mbit, extra, Path(tmp)))
            b = repeats[-1]["one_holder"]["b"]
            mb, seconds = b["rx_bytes"] / 1e6, b["seconds_to_first_step"]
            print(f"  one holder: {mb:.1f} MB in, first step at {seconds:.0f} s", flush=True)
    parameters = repeats[0]["one_holder"]["parameters"]
    result = {"preset": args.preset, "mbit": args.mbit, "joiner_down_mbit": args.joiner_down_mbit,
              "settings": extra, **state,
              "parameters": parameters, "repeats": repeats,
              "summary": summarise(repeats, args.mbit, parameters)}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
