"""A node's status, as one line: what `join` shows on stderr and `demo` shows per node."""

from __future__ import annotations

import math
import os
import re
import threading
from typing import Any

from cgad.protocol.text import printable

__all__ = ["cpu_seconds_by_thread", "exchange_status", "status_line", "status_report"]


def exchange_status(loop: Any, transport: Any) -> dict[str, Any]:
    """The exchange's part of a node's status: what its outer loop took and refused (by peer and
    by age), what its transport fetched, stored and sent, and the data score's distrust.

    Args:
        loop: the node's ``OuterLoop`` (its counters, method, sender and score).
        transport: the node's transport (its stats, live peers, link meter and reach).
    """
    counters, stats = loop.counters, transport.stats
    rejected = dict(stats.rejected)
    for reason, count in dict(counters.rejected).items():
        rejected[reason] = rejected.get(reason, 0) + count
    return {
        "peers": len(transport.live_peers()),
        "fan_in": transport.fan_in,  # the most peers taken a round (--fan-in auto: cut to the model)
        **counters.totals(),
        "applied_by_peer": dict(counters.applied_by_peer.copy()),
        "rejected_by_peer": dict(counters.rejected_by_peer.copy() + stats.rejected_by_peer.copy()),
        "applied_by_age": {str(age): n for age, n in sorted(counters.applied_by_age.copy().items())},
        "rejected": rejected,
        "skipped": dict(stats.skipped),
        "records_stored": dict(stats.records_stored),
        "dht_lookups": stats.dht_lookups,
        "dht_served": dict(stats.dht_served),
        "downlink_bytes_per_second": transport.downlink_rate,
        "send_budget_bytes": transport.round_budget(),  # --codec auto: bytes per round per fetcher
        "sent_as": dict(counters.sent_as.copy()),
        "bytes_in": stats.bytes_received,
        "bytes_out": stats.bytes_sent,
        "fetches_waiting": transport.fetches_waiting,
        "mean_age": counters.mean_age(),
        "outer_momentum": loop.method.momentum_now(loop.optimizer),
        "distrusted": loop.score.distrusted() if loop.score is not None else None,
        "parameters": loop.sender.total_numel,
        "reach": transport.reach(),
    }


def _number(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def status_line(s: dict[str, Any]) -> str:
    """Round, step, losses, throughput, peers, fragments out and in, and their mean age."""
    return printable(
        f"round {s['round']} step {s['inner_step']} loss {_number(s['loss'])} eval {_number(s['eval_loss'])} "
        f"tok/s {s['tokens_per_second']:.0f} peers {s['peers']} "
        f"out {s['published']} in {s['applied']} age {s['mean_age']:.2f}"
    )


def status_report(s: dict[str, Any]) -> str:
    """``cgad-node status`` without ``--json``: the node, its training, its exchange with the
    swarm, and the ages of what it applied as a text histogram. Peers' strings in it (their ids,
    the reasons they were refused, a dial-back answer) print escaped (``protocol.text``)."""
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(s.get("rejected", {}).items())) or "none"
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(s.get("skipped", {}).items()) if v) or "none"
    stored = ", ".join(f"{k} {v}" for k, v in sorted((s.get("records_stored") or {}).items())) or "none"
    rate = s.get("downlink_bytes_per_second")
    budget = s.get("send_budget_bytes")
    sent_as = ", ".join(f"{k} {v}" for k, v in sorted((s.get("sent_as") or {}).items()))
    sent_as = sent_as or "the transport's codec"
    if budget is not None and math.isfinite(budget):
        sent_as += f" (budget {budget / 1e6:.2f} MB per peer and round)"
    lines = [
        f"node       {s['peer_id']} (run {s['run_id']}, {s['optimizer']}, {s['device']})",
        f"uptime     {_duration(s['uptime'])}, started from {s['started_from']}"
        + (", resumed from its checkpoint" if s.get("resumed") else ""),
        f"training   round {s['round']}, inner step {s['inner_step']}, versions {s['versions']}",
        f"loss       train {_number(s['loss'])}, held-out {_number(s['eval_loss'])}",
        f"speed      {s['tokens_per_second']:.0f} tokens/s",
        f"swarm      {s['peers']} live peer(s); {s['resyncs']} re-sync(s)"
        + ("" if s.get("outer_momentum") is None else f"; outer momentum {s['outer_momentum']:.2f}"),
        f"exchange   {s['published']} published"
        + (f" ({s['unheard']} not: nobody could fetch them)" if s.get("unheard") else "")
        + f", {s['applied']} applied, {s['dropped_stale']} too old,"
        f" {s['clipped']} clipped, {s['tokens_capped']} token claims capped;"
        f" downlink {'-' if rate is None else f'{rate / 1e6:.2f} MB/s'},"
        f" {s['fetches_waiting']} fetch(es) waiting",
        f"sent as    {sent_as}",
        f"rejected   {rejected}",
        f"skipped    {skipped}",
        f"DHT writes {stored}",
    ]
    reach = s.get("reach") or {}
    if reach:
        lines.insert(5, f"reach      {reach.get('line')}")
    paths = reach.get("paths_by_peer") or {}
    if paths:
        lines.append("paths      " + "; ".join(
            f"{peer[-8:]} " + ", ".join(f"{k} {v}" for k, v in sorted(by.items()))
            for peer, by in sorted(paths.items())
        ))  # fmt: skip
    by_peer = s.get("applied_by_peer") or {}
    if by_peer:
        lines.append("applied from")
        lines += [f"  {peer}  {count}" for peer, count in sorted(by_peer.items(), key=lambda kv: -kv[1])]
    ages = {int(age): n for age, n in (s.get("applied_by_age") or {}).items()}
    if ages:
        lines.append(f"ages of applied fragments (mean {s['mean_age']:.2f})")
        widest = max(ages.values())
        lines += [
            f"  {age:>3}  {'#' * max(1, round(40 * n / widest))} {n}" for age, n in sorted(ages.items())
        ]
    return printable("\n".join(lines), lines=True)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def read_proc_stat(path: str) -> tuple[str, float, list[str]] | None:
    """A /proc ``stat`` file: the command name, the CPU seconds (user + system) used, and the
    fields after the name (``fields[3]`` is the session id); None when it is gone or unreadable."""
    try:
        with open(path) as stat_file:
            stat = stat_file.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / ticks, fields


def cpu_seconds_by_thread() -> dict[str, float]:
    """CPU seconds each thread of this process has used, by Python thread name (threads that
    Python did not start, e.g. OpenMP's or gRPC's, summed as "native"); empty where /proc is not."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    totals: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return totals
    for tid in tids:
        stat = read_proc_stat(f"/proc/self/task/{tid}/stat")
        if stat is None:
            continue  # the thread ended meanwhile
        name = re.sub(r"_\d+$", "", names.get(int(tid), "native"))  # pool workers under one name
        totals[name] = totals.get(name, 0.0) + stat[1]
    return totals
