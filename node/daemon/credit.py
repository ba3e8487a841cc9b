"""Contribution credit: how many of a peer's fragments the rest of the swarm applied.

Every node signs, in its progress record, how many fragments it applied from each publisher
(``Progress.applied_from``, at most ``MAX_CREDITS`` publishers). A publisher's credit is the sum
of those counts over the records of the *other* live peers: what a record says of its own peer
counts for nothing, and each reporter counts once (one record per peer id in the live view), so
no peer can raise its own credit by what it signs. What one peer signs about another is that
peer's word: a liar can credit a friend by as much as it likes, once per identity it runs (the
page says whose word each number rests on: ``reporters``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cgad.protocol.records import Progress

__all__ = ["Credit", "contributions"]


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
    for reporter, progress in records.items():
        for publisher, count in progress.applied_from.items():
            if publisher == reporter or publisher == progress.peer_id or count <= 0:
                continue  # a peer's word about itself is worth nothing
            totals[publisher] = totals.get(publisher, 0) + count
            reporters[publisher] = reporters.get(publisher, 0) + 1
    return {p: Credit(totals[p], reporters[p]) for p in totals}
