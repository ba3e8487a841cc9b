"""Prometheus metrics on ``--metrics-port``: the numbers of the status, as gauges."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

__all__ = ["Metrics"]

_GAUGES = {
    "round": "outer rounds completed",
    "inner_step": "inner steps taken",
    "loss": "mean training loss of recent inner steps",
    "eval_loss": "latest held-out loss",
    "tokens_per_second": "inner training throughput",
    "peers": "live peers seen in the swarm",
    "published": "pseudo-gradient fragments published",
    "applied": "peers' fragments applied by the outer optimizer",
    "dropped_stale": "fragments the staleness gate dropped",
    "mean_age": "mean age in rounds of applied peer fragments",
}


class Metrics:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        self.gauges = {
            name: Gauge(f"cgad_{name}", doc, registry=self.registry) for name, doc in _GAUGES.items()
        }
        self.rejected = Gauge(
            "cgad_rejected", "fragments rejected, by reason", ["reason"], registry=self.registry
        )
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def update(self, status: dict[str, Any]) -> None:
        for name, gauge in self.gauges.items():
            value = status.get(name)
            if value is not None:
                gauge.set(value)
        for reason, count in status.get("rejected", {}).items():
            self.rejected.labels(reason=reason).set(count)

    def stop(self) -> None:
        self.server.shutdown()
