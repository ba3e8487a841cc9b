"""When a daemon takes its outer steps: the turn awaiting its step, and keeping block boundaries
in phase with the peers'.

A node publishes fragment f's pseudo-gradient at the end of its block and takes the outer step
up to ``--apply-delay`` inner steps later, as soon as every live peer's fragment of the same
version is in (node/daemon/node.py). That makes ages 0 only if the peers' blocks end near its own.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Turn", "adopted_block_over", "phase_nudge"]


@dataclass(frozen=True)
class Turn:
    """A published fragment awaiting its outer step."""

    fragment: int
    version: int
    latest: int  # the inner step by which the outer step is taken at the latest
    awaited: int | None  # peers' fragments that end the wait early (None: a fixed --apply-delay)
    early: int  # peers' fragments of this version already in when it was published


def phase_nudge(block: int, early: int, arrived: int, awaited: int, lead: int = 0) -> int:
    """Inner steps to add to the next block (negative: to take away) so that this node's block
    boundaries stay near its peers' and their fragments of a version reach its outer step at age
    0. Nothing else aligns them: a joiner starts its first block when its download ends, and the
    first node then publishes most of a block ahead for good, taking every peer's fragment a
    round late (docs/WAN.md). ``early``: peers' fragments of the version already in when this
    node published it; ``arrived``: in by its outer step; ``awaited``: what would have ended the
    wait. A node whose wait ended short of that is ahead: its next block is a quarter longer; one
    that had them all before it published is behind: a quarter shorter. A block at a time, so a
    peer that lies about its timing shifts it by no more than that.

    ``lead``: how many rounds this node's version of the fragment is past the swarm's (the low
    median of live peers' reports). A node two or more rounds ahead is faster than its peers, not
    out of phase: it lengthens its block by a further quarter for each round of lead past the
    first, up to a whole block more (twice the inner steps per round). Without that a faster node
    pulls ahead until its peers' fragments reach it older than the cutoff and its own reach them
    as from the future: it trains alone (seen with a first node 1.4x as fast as its four peers,
    over 200 rounds ahead of them after 15 minutes). Reports lag a round, so a lead of one is phase."""
    nudge = max(1, block // 4)
    if arrived < awaited:
        return nudge * (1 + min(max(lead - 1, 0), 3))
    if awaited and early >= awaited:
        return -nudge
    return 0


def adopted_block_over(steps: int, block: int, peers_in: int, peers_live: bool) -> bool:
    """Whether the first block after adopting a state is over, ``steps`` inner steps into it.
    The download ends wherever the peers are in their blocks, so a block counted from there
    trails theirs by up to a whole block, and its fragments reach them a round late until phase
    nudges close the gap a quarter block at a time (on 10 Mbit the first node took 12-19 of its
    30-39 peer fragments at age 1, most of them in the rounds after the joins: docs/WAN.md). That
    block is kept from the peers anyway, so it ends when they end theirs: when ``peers_in``, the
    peers' fragments of its version that have arrived, is no longer 0. After one step at least
    (an empty pseudo-gradient weighs nothing), and, while peers are live, a block and a half at
    most: a peer that publishes early or never moves it no further."""
    if steps < 1:
        return False
    if peers_in > 0:
        return True
    return steps >= (block + block // 2 if peers_live else block)
