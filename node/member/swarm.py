"""Where a member stands against its swarm, from its live peers' reported versions.

Every rule here reads ``reports``: the outer versions each live peer last reported (a daemon
reads them from the signed progress records, the simulator from its other workers), this
member's own left out. No single peer's report moves any of them: each is a low median.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Protocol

from cgad.protocol.selection import swarm_version

__all__ = ["SwarmView", "behind", "rounds_behind", "snapshot_ceiling", "swarm_versions"]


class SwarmView(Protocol):
    """What a member needs to know of its peers, whichever network they are on."""

    def live_peers(self) -> list[str]:
        """Peer ids seen alive, this member excluded."""
        ...

    def arrived(self, index: int, base_version: int) -> int:
        """Publishers whose pseudo-gradient of fragment ``index``, of this version or newer, has
        arrived and waits to be taken."""
        ...

    def reports(self) -> dict[str, list[int]]:
        """The versions each live peer last reported, for as many fragments as this member has."""
        ...


def swarm_versions(
    reports: Mapping[str, Sequence[int]], fragments: int, source: str | None = None
) -> list[int] | None:
    """The swarm's version of each fragment: the low median over live peers' reports; None with
    no report. ``source``, the peer whose state this member has just adopted, raises it to that
    peer's own report: its state was taken as the swarm's, and so is how far it went on since
    (at the start, three joiners a round behind the first node are the median's majority).

    Args:
        reports: live peers' reported versions, by peer id.
        fragments: how many fragments this member has (reports of another length are left out).
        source: the peer whose state was adopted last, until the first outer step after it.
    """
    columns = [list(v) for v in reports.values() if len(v) == fragments]
    if not columns:
        return None
    swarm = [swarm_version(columns, f) or 0 for f in range(fragments)]
    told = reports.get(source) if source is not None else None
    if told is None or len(told) != fragments:
        return swarm
    return [max(s, int(v)) for s, v in zip(swarm, told, strict=True)]


def behind(reports: Mapping[str, Sequence[int]], versions: Sequence[int]) -> int:
    """How far this member's slowest fragment trails the swarm's (``swarm_versions``); 0 with no
    report. The re-sync rule compares it with the cutoff.

    Args:
        reports: live peers' reported versions, by peer id.
        versions: this member's own versions.
    """
    swarm = swarm_versions(reports, len(versions))
    if swarm is None:
        return 0
    return max(s - v for s, v in zip(swarm, versions, strict=True))


def rounds_behind(reports: Mapping[str, Sequence[int]], versions: Sequence[int]) -> int:
    """How many whole rounds the swarm is past this member: its slowest fragment's version against
    this member's slowest (a peer part-way through its round counts as the round it is in); 0
    with no report, negative when this member is ahead.

    Args:
        reports: live peers' reported versions, by peer id.
        versions: this member's own versions.
    """
    swarm = swarm_versions(reports, len(versions))
    return min(swarm) - min(versions) if swarm else 0


def snapshot_ceiling(reports: Mapping[str, Sequence[int]], versions: Sequence[int], cutoff: int) -> int:
    """The furthest version a snapshot to adopt may be at: the cutoff past the low median of the
    live peers' reports, leaving out peers that report nothing past version 0 (joiners waiting like
    this one would pull it down to where no snapshot is). With two peers in view the low median is
    the lower report: a liar claiming a far version cannot raise it. With no report in view,
    nothing past this member's own version.

    Args:
        reports: live peers' reported versions, by peer id.
        versions: this member's own versions.
        cutoff: the age at which a delivery stops counting (``--cutoff``).
    """
    told = [min(v) for v in reports.values() if len(v) == len(versions) and v and max(v) > 0]
    base = statistics.median_low(told) if told else min(versions)
    return base + cutoff


# versions an adopted snapshot may trail the swarm by: its parameters lack the rounds in between
# for good (pseudo-gradient averaging never closes an offset), so a newer one is fetched first
ADOPTED_LAG = 1


def snapshot_order(
    version: int, holders: int, misses: int, median: int, max_sources: int
) -> tuple[int, bool, int, int, bool, int]:
    """The sort key that picks which snapshot to adopt, a daemon's and a simulated worker's alike
    (lowest first): publishers whose downloads brought nothing last; then those within
    ``ADOPTED_LAG`` of the swarm's low median, the most holders first among them (a download
    draws from every holder at once, and the rounds it lacks are replayed after it); then the
    rest, nearest the median first, below it before above it (the highest claim is an
    attacker's favourite), the newest first.

    Args:
        version: the snapshot's version.
        holders: how many peers hold its bytes.
        misses: downloads from its publisher that brought nothing.
        median: the swarm's low median version (``snapshot_ceiling`` − the cutoff).
        max_sources: holders a download draws from at once (more count as that many).
    """
    near = abs(version - median) <= ADOPTED_LAG
    counted = min(holders, max_sources) if near else 0
    return (misses, not near, -counted, abs(version - median), version > median, -version)
