"""Whether anyone could fetch this member's pseudo-gradients: a member alone encodes for nobody.

A published Δ costs an encode on the encoder thread (at ``small``, ~5% of two cores), the
residual its error feedback carries (2 bytes a parameter) and the bytes held to serve it. While a
member is alone nobody fetches any of it, except a joiner: one that adopts this member's snapshot
of version v replays the deltas published from v on (``OuterLoop.apply(swarm_version=)``), and
asks this member (its identity, the snapshot) before its heartbeat is seen. So a member shares
its Δ while it has an audience: a live peer, or any peer's request to it (its identity, a
fragment, a snapshot: ``TransportStats.asked``), within the last ``cutoff`` rounds (counted in
shared publishes, cutoff x fragments). A member that joined through peers
starts with one; the first of a swarm starts without. Past the cutoff a returning peer re-syncs
from a snapshot anyway, so what a silent member forgets (its residual) is in the φ it serves.

What it can miss: a joiner that starts in the ~2 s (at ``small``) between the member's step to
v + 1 and its next snapshot, and adopts the snapshot of v, lacks the member's Δ_v, as after a
fetch that failed; late mixing (the default with ``cga``) closes that offset. An all-reduce
exchange is asked for nothing: there only live peers count.
"""

from __future__ import annotations

from cgad.protocol.transport import Transport

__all__ = ["Audience"]


class Audience:
    """Counts the turns since anyone could have fetched this member's Δ.

    Args:
        transport: whose live peers and ``stats.asked`` are the signs of an audience.
        turns: shared publishes an audience outlasts its last sign (the cutoff in rounds x
            fragments, at least 1).
        heard: whether the member starts with one (it joined through peers; the simulator's
            members, which start together).
    """

    def __init__(self, transport: Transport, turns: int, heard: bool = True) -> None:
        self.transport, self.turns = transport, max(1, turns)
        self._asked = transport.stats.asked
        self.silent = 0 if heard else self.turns + 1  # turns in a row without a sign of an audience

    def listening(self) -> bool:
        """Called once per publish: whether this turn's Δ may be fetched by anyone."""
        asked = self.transport.stats.asked
        if asked != self._asked or self.transport.live_peers():
            self.silent = 0
        else:
            self.silent += 1
        self._asked = asked
        return self.silent <= self.turns
