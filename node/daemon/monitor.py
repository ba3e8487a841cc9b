"""`cgad-node swarm`: every live peer of a run, read from the signed progress records in the DHT.

The monitor joins the DHT as a client and an observer: it trains nothing, publishes nothing and
never shows up as a peer itself. Each row is a peer's own report (versions, inner steps,
tokens per second) with how long ago it made it; the records are signed, so a row cannot be
forged by another peer, but what a peer says of itself is its claim.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from hivemind.utils import get_dht_time

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
    """Every live peer's latest report, the most advanced first."""
    now = get_dht_time()
    rows = [
        {
            "peer_id": peer,
            "version": min(p.versions, default=0),
            "versions": list(p.versions),
            "inner_step": p.inner_step,
            "tokens_per_second": p.tokens_per_second,
            "published": p.published,
            "seen_seconds_ago": max(0.0, now - p.time),
            "direct_path": p.grpc is not None,
        }
        for peer, p in transport.swarm_progress().items()
        if peer != transport.peer_id and p.time + transport.options.liveness_ttl > now
    ]
    return sorted(rows, key=lambda r: (-r["version"], r["peer_id"]))


def render(run_id: str, rows: list[dict[str, Any]]) -> str:
    """The table a person reads: one line per peer, then the swarm in one line."""
    if not rows:
        return f"run {run_id}: no live peer found (is --peers right, and --run-id that swarm's?)"
    head = f"{'peer':<52} {'version':>7} {'inner steps':>11} {'tokens/s':>9} {'published':>9} {'seen':>6}"
    lines = [f"{head}  path"]
    for r in rows:
        path = "grpc+libp2p" if r["direct_path"] else "libp2p"
        lines.append(
            f"{r['peer_id']:<52} {r['version']:>7} {r['inner_step']:>11} {r['tokens_per_second']:>9.0f}"
            f" {r['published']:>9} {r['seen_seconds_ago']:>5.0f}s  {path}"
        )
    median = statistics.median_low(r["version"] for r in rows)
    total = sum(r["tokens_per_second"] for r in rows)
    lines.append(
        f"run {run_id}: {len(rows)} live peer(s), median version {median}, {total:.0f} tokens/s in all"
    )
    return "\n".join(lines)


def as_json(run_id: str, rows: list[dict[str, Any]]) -> str:
    return json.dumps({"run_id": run_id, "time": time.time(), "peers": rows}, indent=1)
