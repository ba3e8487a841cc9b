"""A node's status, as one line: what `join` shows on stderr and `demo` shows per node."""

from __future__ import annotations

import math
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
