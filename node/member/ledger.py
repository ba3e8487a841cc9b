"""What a member keeps count of: the deliveries its outer steps took, its counters, and which
parameter tensors make up each fragment."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counters", "Delivery", "strided_fragments"]


@dataclass(frozen=True)
class Delivery:
    """A pseudo-gradient as the optimizer saw it."""

    fragment: int
    publisher: str
    base_version: int
    age: int
    weight: float  # σ(τ) for the age-aware family, 1 otherwise
    own: bool  # this peer's own fresh pseudo-gradient


def strided_fragments(num_params: int, count: int) -> list[list[int]]:
    """Parameter indices of each fragment: strided, so every fragment spans the whole depth."""
    if count > num_params:
        raise ValueError(f"{count} fragments for only {num_params} parameter tensors")
    return [list(range(f, num_params, count)) for f in range(count)]


def layout_numels(params: list[Any], fragments: int) -> list[int]:
    """How many values each fragment holds, for a transport that validates what it fetches.

    Args:
        params: the model's parameter tensors, in order.
        fragments: F.
    """
    return [sum(params[i].numel() for i in idx) for idx in strided_fragments(len(params), fragments)]


# what every report of a loop counts (a daemon's status, the simulator's record): one list
COUNTED = ("published", "unheard", "applied", "dropped_stale", "clipped", "tokens_capped", "discarded",
           "held_ahead", "mixed", "clipped_params", "replayed", "tensors_cut", "moments_sent",
           "moments_received", "moments_mixed", "probed", "probe_tokens")  # fmt: skip


@dataclass
class Counters:
    published: int = 0
    unheard: int = 0  # own deltas not encoded: nobody could fetch them (``audience``)
    applied: int = 0
    dropped_stale: int = 0
    clipped: int = 0  # peers' deliveries clipped around the own update (--aggregation clip)
    tensors_cut: int = 0  # peers' deliveries with a tensor cut around the own update's (the same)
    tokens_capped: int = 0  # peers' token claims cut to TOKEN_CAP × the own block's
    discarded: int = 0  # own blocks kept from peers and from the own step (after adopting a state)
    held_ahead: int = 0  # peers' deltas of a version this peer had not reached, kept for it
    rejected: Counter[str] = field(default_factory=Counter)
    applied_by_peer: Counter[str] = field(default_factory=Counter)
    applied_by_age: Counter[int] = field(default_factory=Counter)  # peers' deliveries taken
    rejected_by_peer: Counter[str] = field(default_factory=Counter)
    age_sum: int = 0
    age_count: int = 0
    mixed: int = 0
    clipped_params: int = 0  # peers' φ held within the radius before mixing (--aggregation clip)
    moments_sent: int = 0  # own inner first moments published beside their deltas (``moments``)
    moments_received: int = 0  # peers' inner first moments that reached the mix, taken or not
    moments_mixed: int = 0  # peers' inner first moments averaged into this member's (``moments``)
    replayed: int = 0  # extra outer steps on versions this peer had missed (catching up)
    sent_as: Counter[str] = field(default_factory=Counter)  # own deltas per codec this loop chose
    probed: int = 0  # peers' deltas judged on held-out windows (``scoring``; refused: "harmful")
    probe_tokens: int = 0  # the tokens those forward passes read, the loss at φ's included

    def mean_age(self) -> float:
        """The mean age in rounds of the deliveries taken."""
        return self.age_sum / self.age_count if self.age_count else 0.0

    def totals(self) -> dict[str, int]:
        """The counts every report shows (``COUNTED``), by name."""
        return {name: getattr(self, name) for name in COUNTED}


def summed_totals(counters: Iterable[Counters]) -> dict[str, int]:
    """``Counters.totals`` summed over several loops (a simulated swarm's workers).

    Args:
        counters: each loop's counters.
    """
    totals: Counter[str] = Counter({name: 0 for name in COUNTED})
    for each in counters:
        totals.update(each.totals())
    return dict(totals)
