"""The fan-in cap: how many publishers' fragments a peer takes per round, and which.

One owner for the daemon's selector (``selection.OfferSelector``) and the simulator's in-memory
network (``node/sim/memory.py``):

- ``fan_in_for``: the cap a peer runs with, ``--fan-in`` as given or, under ``auto`` (the
  default), as many peers as a bound on the deliveries held decoded allows, 4 to 16;
- ``takeable``: how many of the live peers a round takes (what the inner lr's count, the round's
  wait and the byte budget read);
- ``fan_in_order``: the order in which a round's offers claim slots;
- ``FanInSlots``: the slots of each (fragment, kind, base version), with a slot's life: taken when
  a fetch is chosen (``take``), spent when its bytes verify (``verify``), free again when the fetch
  brings nothing (``release``) or never reports back within ``pending_seconds``. In the simulator
  a send is taken and, unless lost in flight, verified at the same instant.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from typing import Literal, TypeVar

from cgad.protocol.transport import FragmentKey, Kind

__all__ = [
    "FAN_IN_LEAST", "FAN_IN_MOST", "HELD_BYTES", "PENDING_SECONDS", "FanInSlots", "RoundKey", "fan_in_for",
    "fan_in_order", "round_key", "takeable",
]  # fmt: skip

T = TypeVar("T")
RoundKey = tuple[int, Kind, int]  # fragment, kind, base version: what the cap counts publishers per

# seconds a chosen offer holds its fan-in slot without its bytes verifying: about a fetch's
# timeout (``fetch_timeout``); a fetch that fails says so at once (``release``)
PENDING_SECONDS = 300.0
_NO_CAP = 1 << 30  # fan_in None: every peer's
# ``--fan-in auto``: a round's deliveries (each peer's Δ and first moment, decoded to float32 until
# the outer step) held within HELD_BYTES, and never fewer peers than FAN_IN_LEAST (the fixed cap
# before auto) nor more than FAN_IN_MOST (each one taken is judged and summed at the outer step).
# Under ``--codec auto`` the senders size their deltas to the peers that fetch them, so a wider
# fan-in brings about the same bytes a round, in sparser deltas: at 8 members on the testbed's
# budget every peer's delta captured G 0.76 at 60 rounds, 4 peers' 0.65 (docs/DESIGN.md §1,
# "Under a link budget")
FAN_IN_LEAST, FAN_IN_MOST = 4, 16
HELD_BYTES = 2 << 30
FanIn = int | Literal["auto"] | None


def fan_in_for(fan_in: FanIn, numel: int) -> int | None:
    """The fan-in cap a peer of a model of ``numel`` parameters runs with.

    Args:
        fan_in: ``--fan-in``: a number of peers, None (every peer's), or "auto": as many peers as
            ``HELD_BYTES`` holds a Δ and a first moment of each decoded (8 bytes a parameter),
            within ``FAN_IN_LEAST`` to ``FAN_IN_MOST`` (with the bundled 4096-token BPE: tiny
            16, small 10, base and 1b 4).
        numel: the model's parameters.
    """
    if fan_in != "auto":
        return fan_in
    return max(FAN_IN_LEAST, min(FAN_IN_MOST, HELD_BYTES // (8 * max(numel, 1))))


def takeable(live: int, fan_in: int | None) -> int:
    """How many of ``live`` peers' fragments a round takes under ``fan_in`` (None: every peer's).

    Args:
        live: the live peers.
        fan_in: the cap, or None.
    """
    return live if fan_in is None else min(live, fan_in)


def fan_in_order(items: list[T], rng: random.Random, known: Callable[[T], bool]) -> list[T]:
    """The order in which a round's offers take the fan-in's slots, a daemon's and the
    simulator's alike: drawn at random, then (stably) the publishers that delivered to this peer
    before first, so a throwaway identity never pushes out a peer that has done its share.
    Shuffles ``items`` in place and returns them.

    Args:
        items: the round's offers (one per publisher).
        rng: the peer's draw.
        known: whether an offer's publisher delivered before.
    """
    rng.shuffle(items)
    items.sort(key=lambda item: not known(item))
    return items


def round_key(key: FragmentKey) -> RoundKey:
    """The slot group ``key`` counts in."""
    return key.fragment, Kind(key.kind), key.base_version


class FanInSlots:
    """Per (fragment, kind, base version), the publishers holding a slot: ``pending`` (taken,
    bytes not verified yet, with when) and ``verified`` (bytes arrived and verified: spent).

    Args:
        fan_in: publishers per fragment, kind and base version (None: no cap).
        pending_seconds: how long a taken slot is held without its bytes verifying.
    """

    def __init__(self, fan_in: int | None, pending_seconds: float = PENDING_SECONDS) -> None:
        self.fan_in = fan_in
        self.pending_seconds = pending_seconds
        self.pending: dict[RoundKey, dict[str, float]] = defaultdict(dict)
        self.verified: dict[RoundKey, set[str]] = defaultdict(set)

    def holds(self, key: RoundKey, publisher: str, now: float) -> bool:
        """Whether ``publisher`` holds a slot of ``key`` (pending or spent)."""
        return publisher in self.verified.get(key, ()) or publisher in self.waiting(key, now)

    def room(self, key: RoundKey, now: float, *, ahead: bool = False) -> int:
        """Slots of ``key`` left. A version ``ahead`` of this peer's own (and of the swarm's) is a
        claim nobody can use yet: it fills at most half the slots with unverified offers, so
        identities that announce future versions first and send nothing cannot take them all."""
        cap = _NO_CAP if self.fan_in is None else self.fan_in
        waiting = len(self.waiting(key, now))
        room = cap - len(self.verified.get(key, ())) - waiting
        if ahead:
            room = min(room, max(1, cap // 2) - waiting)
        return room

    def take(self, key: RoundKey, publisher: str, now: float) -> None:
        """``publisher``'s fragment of ``key`` is being fetched: it holds a slot meanwhile."""
        self.pending[key][publisher] = now

    def verify(self, key: RoundKey, publisher: str) -> None:
        """Its bytes arrived and verified: the slot is spent."""
        self.pending.get(key, {}).pop(publisher, None)
        self.verified[key].add(publisher)

    def release(self, key: RoundKey, publisher: str) -> None:
        """The fetch brought nothing (failed, cancelled, lost, refused): the slot is free again."""
        self.pending.get(key, {}).pop(publisher, None)

    def waiting(self, key: RoundKey, now: float) -> dict[str, float]:
        """The publishers of ``key`` whose bytes may still come (taken less than
        ``pending_seconds`` ago, not verified, not released)."""
        pending = self.pending.get(key)
        if not pending:
            return {}
        for publisher in [p for p, since in pending.items() if now - since >= self.pending_seconds]:
            del pending[publisher]
        return pending

    def waiting_of(self, publisher: str, fragment: int, kind: Kind, now: float) -> int:
        """``publisher``'s unverified fetches of ``fragment`` and ``kind`` at any version."""
        return sum(
            publisher in self.waiting(key, now) for key in list(self.pending) if key[:2] == (fragment, kind)
        )

    def forget(self, old: Callable[[RoundKey], bool]) -> None:
        """Drop the slot groups ``old`` says are done with."""
        for ledger in (self.pending, self.verified):
            for key in [k for k in ledger if old(k)]:
                del ledger[key]
