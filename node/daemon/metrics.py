"""Prometheus metrics on ``--metrics-host``:``--metrics-port``: the numbers of the status, read at
scrape time. What only grows (steps, rounds, fragments published, applied, dropped, clipped,
discarded, rejected and skipped by reason, records stored, bytes) is a counter; what goes up and
down is a gauge."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["Metrics"]

GAUGES = {
    "loss": "mean training loss of recent inner steps",
    "eval_loss": "latest held-out loss",
    "tokens_per_second": "inner training throughput over the last round",
    "peers": "live peers seen in the swarm",
    "mean_age": "mean age in rounds of applied peer fragments",
    "outer_momentum": "momentum of the next outer step (cga: --cga-momentum x the running freshness)",
    "fetches_waiting": "fragment fetches waiting for a slot",
}
COUNTERS = {  # status key -> (metric name, help); Prometheus adds the _total suffix
    "round": ("rounds", "outer rounds completed"),
    "inner_step": ("inner_steps", "inner steps taken"),
    "published": ("published", "pseudo-gradient fragments published"),
    "unheard": ("unheard", "own pseudo-gradients not encoded: nobody could fetch them"),
    "applied": ("applied", "peers' fragments applied by the outer optimizer"),
    "dropped_stale": ("dropped_stale", "fragments too old to count"),
    "clipped": ("clipped", "peers' fragments clipped around this node's own"),
    "tokens_capped": ("tokens_capped", "peers' token claims cut to twice this node's own"),
    "clipped_params": ("clipped_params", "peers' outer parameters held near this node's before mixing"),
    "discarded": ("discarded", "own blocks discarded after adopting a state (inner optimizer warm-up)"),
    "replayed": ("replayed", "extra outer steps on versions this node had missed (catching up)"),
    "held_ahead": ("held_ahead", "peers' deltas of a version this node had not reached, held for that step"),
    "resyncs": ("resyncs", "times this node adopted a peer's state after falling behind"),
    "bytes_in": ("received_bytes", "fragment and snapshot bytes fetched"),
    "bytes_out": ("sent_bytes", "fragment and snapshot bytes served"),
}
LABELLED = {"rejected": ("reason", "fragments, records and requests refused, by reason"),
            "skipped": ("reason", "offers passed over by policy, by reason"),
            "records_stored": ("record", "signed DHT writes of this node's records, by record")}  # fmt: skip


class _StatusCollector:
    """Yields the latest status's numbers whenever Prometheus scrapes."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        status = self.status
        for key, doc in GAUGES.items():
            if status.get(key) is not None:
                yield GaugeMetricFamily(f"cgad_{key}", doc, value=status[key])
        for key, (name, doc) in COUNTERS.items():
            if status.get(key) is not None:
                yield CounterMetricFamily(f"cgad_{name}", doc, value=status[key])
        for key, (label, doc) in LABELLED.items():
            family = CounterMetricFamily(f"cgad_{key}", doc, labels=[label])
            for value, count in sorted((status.get(key) or {}).items()):
                family.add_metric([value], count)
            yield family


class Metrics:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        self._collector = _StatusCollector()
        self.registry.register(self._collector)
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def update(self, status: dict[str, Any]) -> None:
        self._collector.status = status

    def stop(self) -> None:
        self.server.shutdown()
