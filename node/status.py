"""A node's status, as one line: what `join` shows on stderr and `demo` shows per node."""

from __future__ import annotations

import math
import os
import re
import threading
from typing import Any

__all__ = ["status_line"]


def _number(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def status_line(s: dict[str, Any]) -> str:
    """Round, step, losses, throughput, peers, fragments out and in, and their mean age."""
    return (
        f"round {s['round']} step {s['inner_step']} loss {_number(s['loss'])} eval {_number(s['eval_loss'])} "
        f"tok/s {s['tokens_per_second']:.0f} peers {s['peers']} "
        f"out {s['published']} in {s['applied']} age {s['mean_age']:.2f}"
    )


def cpu_seconds_by_thread() -> dict[str, float]:
    """CPU seconds each thread of this process has used, by Python thread name (threads that
    Python did not start, e.g. OpenMP's or gRPC's, summed as "native"); empty where /proc is not."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    totals: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return totals
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        name = re.sub(r"_\d+$", "", names.get(int(tid), "native"))  # pool workers under one name
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return totals
