"""DHT load per node and round as a swarm grows, and where the find requests come from.

N real network transports (each its own libp2p daemon, hivemind DHT node and gRPC server) on
loopback in one process. Each round every node publishes a Δ of one small fragment, fetches the
others' (the fan-in cap of a daemon), reports its progress and offers a snapshot, as a daemon does
at the end of a round; its polls and record refreshes run as in a daemon. After the rounds, per
node and round: the ``rpc_find`` and ``rpc_store`` requests it answered (``dht_served``), the finds
it issued itself by purpose (storing a record: hivemind's ``store`` first searches for the nodes
nearest the key; a poll's lookup; anything else: routing upkeep, cache refreshes), the records it
stored and the lookups it made (and the keys they named: the snapshots' only where due).

Variants (``--beams``): the beam a store's and a lookup's search keeps ("cgad": what the
transport passes, ``dhtbounds.search_beam``; "bucket": hivemind's default, a bucket of 20 nodes;
a number: that many, at least ``num_replicas``), so the growth with N can be told apart from what
the search width does to it.

Usage:
    .venv/bin/python bench/dht_load.py [--sizes 4 8 16] [--rounds 10] [--round-seconds 8]
        [--repeats 2] [--beams bucket cgad] [--out bench/results/dht_load.json]
"""

from __future__ import annotations

import argparse
import contextvars
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from cgad.bench.wan.provenance import tree_state

ROOT = Path(__file__).resolve().parent.parent

from cgad.protocol.config import NetworkOptions  # noqa: E402
from cgad.protocol.network import NetworkTransport  # noqa: E402
from cgad.protocol.transport import Fragment, FragmentKey  # noqa: E402

RUN = "dht-load"
BUCKET = 20  # hivemind's bucket_size: its default beam
NUMEL = 4096  # a small fragment: the records, not the bytes, are measured
# what a find a node issues is for: set around hivemind's store and lookup calls
_PURPOSE: contextvars.ContextVar[str] = contextvars.ContextVar("purpose", default="other")


def _instrument(transport: NetworkTransport, beam: int | None, issued: Counter[str]) -> None:
    """Count the finds ``transport``'s DHT node issues by purpose; with ``beam``, its stores and
    lookups search with that beam instead of the transport's."""
    node = transport.dht_node
    assert node is not None
    protocol = node.protocol
    call_find, store, get_many = protocol.call_find, node.store_many, node.get_many

    async def counted_find(*args: Any, **kwargs: Any) -> Any:
        issued[_PURPOSE.get()] += 1
        return await call_find(*args, **kwargs)

    def purposed(method: Any, purpose: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            token = _PURPOSE.set(purpose)
            try:
                if beam is not None:
                    kwargs["beam_size"] = beam
                return await method(*args, **kwargs)
            finally:
                _PURPOSE.reset(token)

        return call

    protocol.call_find = counted_find  # type: ignore[method-assign]
    node.store_many = purposed(store, "store")  # type: ignore[method-assign]
    node.get_many = purposed(get_many, "lookup")  # type: ignore[method-assign]


def run_swarm(size: int, rounds: int, round_seconds: float, beam: int | None) -> dict[str, Any]:
    """One swarm of ``size`` transports for ``rounds`` rounds: per node and round, what it served
    and issued."""
    options: dict[str, Any] = {"run_id": RUN, "connect_timeout": 2.0}
    transports: list[NetworkTransport] = []
    issued: list[Counter[str]] = []
    try:
        transports.append(_transport(options))
        initial = transports[0].maddrs()
        transports += [_transport({**options, "peers": initial}) for _ in range(size - 1)]
        for t in transports:
            issued.append(Counter())
            t._runner.call(_async_instrument(t, beam, issued[-1]), timeout=10)
        deadline = time.monotonic() + 120
        while any(len(t.live_peers()) < size - 1 for t in transports):
            for n, t in enumerate(transports):
                t.report_progress([0], n, 1.0)
            if time.monotonic() > deadline:
                raise RuntimeError("the swarm did not list every peer in 120 s")
            time.sleep(2.0)
        start = [(Counter(t.stats.dht_served), Counter(t.stats.records_stored), t.stats.dht_lookups,
                  t.stats.dht_keys_looked_up) for t in transports]  # fmt: skip
        issued_start = [Counter(c) for c in issued]
        blob = bytes(2048)
        for version in range(rounds):
            began = time.monotonic()
            for n, t in enumerate(transports):
                delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(version * 1000 + n))
                t.publish(Fragment(FragmentKey(RUN, 0, version, t.peer_id), delta, tokens=10))
                t.report_progress([version + 1], (version + 1) * 10, 1.0)
                t.publish_state(blob, [version + 1])
            for t in transports:
                t.receive(0)
            time.sleep(max(0.0, round_seconds - (time.monotonic() - began)))
            print(
                f"  N={size} beam={beam or 'cgad'}: round {version + 1}/{rounds}", file=sys.stderr, flush=True
            )
        per_node = []
        for t, (served, stored, lookups, keys), got, before in zip(
            transports, start, issued, issued_start, strict=True
        ):
            served_now = Counter(t.stats.dht_served) - served
            per_node.append({
                "served_find": served_now["find"] / rounds,
                "served_store": served_now["store"] / rounds,
                "records_stored": sum((Counter(t.stats.records_stored) - stored).values()) / rounds,
                "lookups": (t.stats.dht_lookups - lookups) / rounds,
                "keys_looked_up": (t.stats.dht_keys_looked_up - keys) / rounds,
                "issued_find": {k: v / rounds for k, v in (got - before).items()},
                "received": t.stats.received,
            })  # fmt: skip
        return {"size": size, "beam": beam or "cgad", "rounds": rounds, "per_node": per_node}
    finally:
        for t in transports:
            t.close()


def _transport(options: dict[str, Any]) -> NetworkTransport:
    return NetworkTransport(NetworkOptions(**options), num_fragments=1, fragment_numel={0: NUMEL})


async def _async_instrument(transport: NetworkTransport, beam: int | None, issued: Counter[str]) -> None:
    _instrument(transport, beam, issued)


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """Medians over the nodes of each per-round count, and the finds a lookup and a store cost
    (issued by purpose over the lookups and records; the poll rate falls where one process holds
    many transports, so per operation is the fairer comparison)."""
    nodes = run["per_node"]
    purposes = sorted({k for n in nodes for k in n["issued_find"]})
    out: dict[str, Any] = {
        key: statistics.median(n[key] for n in nodes)
        for key in ("served_find", "served_store", "records_stored", "lookups")
    }
    out["issued_find"] = {p: statistics.median(n["issued_find"].get(p, 0.0) for n in nodes) for p in purposes}
    out["keys_per_lookup"] = statistics.median(
        n["keys_looked_up"] / n["lookups"] for n in nodes if n["lookups"]
    )
    out["finds_per_lookup"] = statistics.median(
        n["issued_find"].get("lookup", 0.0) / n["lookups"] for n in nodes if n["lookups"]
    )
    out["finds_per_store"] = statistics.median(
        n["issued_find"].get("store", 0.0) / n["records_stored"] for n in nodes if n["records_stored"]
    )
    return {"size": run["size"], "beam": run["beam"], "repeat": run["repeat"], **out}


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Finds served per node and round, and finds per lookup and per store, against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(
        axes,
        ("served_find", "finds_per_lookup", "finds_per_store"),
        ("finds answered per node and round", "finds a lookup issues", "finds a store's search issues"),
        strict=True,
    ):
        for beam in sorted({r["beam"] for r in summaries}):
            rows = [r for r in summaries if r["beam"] == beam]
            sizes = sorted({r["size"] for r in rows})
            means = [statistics.mean(r[key] for r in rows if r["size"] == n) for n in sizes]
            ax.plot(sizes, means, marker="o", label=f"beam {beam}")
            ax.scatter([r["size"] for r in rows], [r[key] for r in rows], s=10, alpha=0.5)
        ax.set_xlabel("nodes (N)")
        ax.set_title(title)
        ax.set_xticks(sorted({r["size"] for r in summaries}))
        ax.grid(alpha=0.3)
    axes[0].legend()
    beams = ", ".join(sorted({str(r["beam"]) for r in summaries}))
    fig.suptitle(f"DHT load per node and round (beams: {beams}; bucket = hivemind's 20, cgad = num_replicas)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--round-seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--beams", nargs="+", default=["bucket", "cgad"], help="cgad, bucket or a number")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "dht_load.json"))
    args = parser.parse_args()
    state = tree_state(ROOT)
    runs = []
    for repeat in range(1, args.repeats + 1):
        for name in args.beams:
            beam = None if name == "cgad" else BUCKET if name == "bucket" else int(name)
            for size in args.sizes:
                run = {
                    **run_swarm(size, args.rounds, args.round_seconds, beam),
                    "beam": name,
                    "repeat": repeat,
                }
                runs.append(run)
                print(json.dumps(summary(run)), flush=True)
    summaries = [summary(r) for r in runs]
    result = {
        "benchmark": "dht_load",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **state,
        "settings": {
            "sizes": args.sizes,
            "rounds": args.rounds,
            "round_seconds": args.round_seconds,
            "repeats": args.repeats,
            "beams": args.beams,
            "fragment_numel": NUMEL,
        },
        "summary": summaries,
        "runs": runs,
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(summaries, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
