"""`cgad-node swarm`: every live peer of a run, read from the signed progress records in the DHT.

The monitor joins the DHT as a client and an observer: it trains nothing, publishes nothing and
never shows up as a peer itself. Each row is a peer's own report (versions, inner steps,
tokens per second, held-out loss) with how long ago it made it, and its credit: how many of its
fragments the other live peers signed they applied (node/daemon/credit.py). The records are
signed, so a row cannot be forged by another peer, but what a peer says of itself is its claim;
its credit is the others' word, never its own.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from hivemind.utils import get_dht_time

from cgad.node.daemon.credit import Credit, contributions
from cgad.protocol.config import NetworkOptions
from cgad.protocol.network import NetworkTransport

__all__ = ["as_json", "open_monitor", "render", "swarm_rows"]

FIRST_LOOK_SECONDS = 30.0


def open_monitor(options: NetworkOptions) -> NetworkTransport:
    """A read-only view of the swarm at ``options.peers``, once it has looked at the DHT."""
    options = options.model_copy(update={"client_mode": True, "grpc_host": "none"})
    transport = NetworkTransport(options, num_fragments=1, fragment_numel={}, observer=True)
    deadline = time.monotonic() + FIRST_LOOK_SECONDS
    while transport.polls < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    return transport


def swarm_rows(transport: NetworkTransport) -> list[dict[str, Any]]:
    """Every live peer's latest report and credit (this peer's too, marked ``this_node``), the
    most advanced first.

    Args:
        transport: a node's transport, or a monitor's (``open_monitor``: it has no record).
    """
    now = get_dht_time()
    live = {
        peer: p
        for peer, p in transport.swarm_progress().items()
        if p.time + transport.options.liveness_ttl > now
        and not (transport.observer and peer == transport.peer_id)  # a monitor is no peer
    }
    credit = contributions(live)
    rows = []
    for peer, p in live.items():
        row = {
            "peer_id": peer,
            "this_node": peer == transport.peer_id,
            "version": min(p.versions, default=0),
            "versions": list(p.versions),
            "inner_step": p.inner_step,
            "tokens_per_second": p.tokens_per_second,
            "eval_loss": p.eval_loss,
            "published": p.published,
            "applied_by_others": credit.get(peer, Credit()).applied_by_others,
            "credited_by": credit.get(peer, Credit()).reporters,
            "seen_seconds_ago": max(0.0, now - p.time),
            "direct_path": p.grpc is not None,
        }
        for extra in ("reachability", "path"):  # shown where a record states them
            if getattr(p, extra, None) is not None:
                row[extra] = getattr(p, extra)
        rows.append(row)
    return sorted(rows, key=lambda r: (-r["version"], r["peer_id"]))


def render(run_id: str, rows: list[dict[str, Any]]) -> str:
    """The table a person reads: one line per peer, then the swarm in one line, then what the
    credit column means.

    Args:
        run_id: the run the rows are of.
        rows: ``swarm_rows``.
    """
    if not rows:
        return f"run {run_id}: no live peer found (is --peers right, and --run-id that swarm's?)"
    head = (
        f"{'peer':<52} {'version':>7} {'inner steps':>11} {'tokens/s':>9} {'held-out':>8} {'published':>9}"
        f" {'applied by others':>17} {'seen':>6}"
    )
    lines = [f"{head}  path"]
    for r in rows:
        path = r.get("path") or ("grpc+libp2p" if r["direct_path"] else "libp2p")
        if r.get("reachability"):
            path += f" ({r['reachability']})"
        loss = "-" if r.get("eval_loss") is None else f"{r['eval_loss']:.3f}"
        credit = f"{r.get('applied_by_others', 0)} by {r.get('credited_by', 0)}"
        name = r["peer_id"] + (" *" if r.get("this_node") else "")
        lines.append(
            f"{name:<52} {r['version']:>7} {r['inner_step']:>11} {r['tokens_per_second']:>9.0f}"
            f" {loss:>8} {r['published']:>9} {credit:>17} {r['seen_seconds_ago']:>5.0f}s  {path}"
        )
    median = statistics.median_low(r["version"] for r in rows)
    total = sum(r["tokens_per_second"] for r in rows)
    applied = sum(r.get("applied_by_others", 0) for r in rows)
    lines.append(
        f"run {run_id}: {len(rows)} live peer(s), median version {median}, {total:.0f} tokens/s in all,"
        f" {applied} fragment(s) applied across peers"
    )
    lines.append(
        "applied by others: N by K = K other live peers signed that they applied N of its fragments"
        " (a peer's word about itself counts for nothing; one peer's word at most what any could apply)"
    )
    lines.append("held-out, tokens/s, published: each peer's own claim, not checked")
    return "\n".join(lines)


def as_json(run_id: str, rows: list[dict[str, Any]]) -> str:
    """``swarm_rows`` as the document ``swarm --json`` prints."""
    return json.dumps({"run_id": run_id, "time": time.time(), "peers": rows}, indent=1)
