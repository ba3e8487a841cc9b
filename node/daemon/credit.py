"""Contribution credit: how many of a peer's fragments the rest of the swarm applied.

Every node signs, in its progress record, how many fragments it applied from each publisher
(``Progress.applied_from``, at most ``MAX_CREDITS`` publishers). A publisher's credit is the sum
of those counts over the records of the *other* live peers: what a record says of its own peer
counts for nothing, and each reporter counts once (one record per peer id in the live view), so
no peer can raise its own credit by what it signs. What one peer signs about another is that
peer's word: a liar can credit a friend, once per identity it runs (the page says whose word
each number rests on: ``reporters``), but by no more than any peer could have applied: one
fragment per fragment and version, so a reporter's count is cut to the swarm's versions summed
over the fragments (each the low median of the live reports, which no single peer moves).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from cgad.protocol.records import Progress
from cgad.protocol.selection import swarm_version

__all__ = ["Credit", "contributions", "most_applied"]


@dataclass(frozen=True)
class Credit:
    """One publisher's credit: fragments applied by others, and by how many others."""

    applied_by_others: int = 0
    reporters: int = 0


def contributions(records: Mapping[str, Progress]) -> dict[str, Credit]:
    """Every credited publisher's ``Credit``, from the live peers' progress records.

    Args:
        records: the latest progress record of each live peer, by the peer id that signed it
            (the transport's live view checks that a record's ``peer_id`` is its signer's).
    """
    totals: dict[str, int] = {}
    reporters: dict[str, int] = {}
    ceiling = most_applied(records)
    for reporter, progress in records.items():
        for publisher, count in progress.applied_from.items():
            if publisher == reporter or publisher == progress.peer_id or count <= 0:
                continue  # a peer's word about itself is worth nothing
            totals[publisher] = totals.get(publisher, 0) + min(count, ceiling)
            reporters[publisher] = reporters.get(publisher, 0) + 1
    return {p: Credit(totals[p], reporters[p]) for p in totals}


def most_applied(records: Mapping[str, Progress]) -> int:
    """The most fragments any peer can have applied from one publisher: one per fragment and
    version, up to the swarm's version of each fragment (the low median of the live reports).

    Args:
        records: the latest progress record of each live peer.
    """
    reports = [p.versions for p in records.values()]
    if not reports:
        return 0
    # the fragments the low median of the reports has: a liar listing more (each a median of its
    # own claim alone) adds none
    fragments = statistics.median_low(len(v) for v in reports)
    return sum(swarm_version(reports, f) or 0 for f in range(fragments))
