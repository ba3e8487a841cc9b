"""The one transport interface: what a node hands to the swarm and what it takes from it.

Two implementations: ``cgad.node.sim.memory`` (in one process, with injected delay, loss,
bandwidth and failure, for the simulator and tests) and ``cgad.protocol.network`` (hivemind DHT
for who-has-what, gRPC or libp2p streams for the bytes). The outer loop sees only this.

A ``Fragment`` is one fragment's tensor as published by one peer: a pseudo-gradient
(``Kind.DELTA``) that started from outer version ``base_version``, or that peer's outer
parameters at that version (``Kind.PARAMS``, for gossip and NoLoCo mixing).
"""

from __future__ import annotations

import abc
import enum
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from torch import Tensor

if TYPE_CHECKING:
    from cgad.protocol.codec import Codec

__all__ = ["Fragment", "FragmentKey", "Kind", "Transport", "TransportStats"]


class Kind(enum.StrEnum):
    DELTA = "delta"
    PARAMS = "params"
    STATE = "state"  # a snapshot of a peer's whole outer state (network transport only)
    MOMENTS = "moments"  # the inner optimizer's first moment beside a DELTA (node/member/moments.py)


@dataclass(frozen=True, slots=True)
class FragmentKey:
    """Names a published tensor; a DELTA is applied at most once per key."""

    run_id: str
    fragment: int
    base_version: int
    publisher: str
    kind: Kind = Kind.DELTA


@dataclass(slots=True)
class Fragment:
    key: FragmentKey
    tensor: Tensor  # 1-D, the fragment's parameters flattened in a fixed order
    tokens: int = 0  # tokens the publisher trained on to produce it (the weight in a mean)
    kept: int | None = None  # as delivered in ``sparse``: the values per block it kept (None: dense)


@dataclass
class TransportStats:
    """Counters every transport keeps; ``rejected`` maps a reason to how often it happened."""

    published: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    rejected_by_peer: Counter[str] = field(default_factory=Counter)  # whose fetched bytes were refused
    # offers passed over by policy, not for a fault: the fan-in cap, too old to count on arrival
    skipped: Counter[str] = field(default_factory=Counter)
    # signed DHT writes of this peer's records, by record: holdings, state (snapshot holdings),
    # progress (the heartbeat); each goes to every replica of its key, so they are what polling
    # and re-announcing cost the swarm
    records_stored: Counter[str] = field(default_factory=Counter)
    dht_lookups: int = 0  # this peer's looks at the DHT (one poll: its fragments' and progress keys)
    dht_keys_looked_up: int = 0  # keys over those looks (the snapshots' key only where due)
    # the DHT requests this peer answered for others, by kind (find, store): where a swarm's
    # records land, and so what a DHT server carries as the swarm grows
    dht_served: Counter[str] = field(default_factory=lambda: Counter(find=0, store=0))
    # requests other peers made of this one (its identity, a fragment, a snapshot): a sign that
    # someone may fetch what it publishes even before it is seen live (a joiner)
    asked: int = 0


class Transport(abc.ABC):
    """Publish and receive fragments without ever blocking the trainer."""

    peer_id: str
    stats: TransportStats
    fan_in: int | None = None  # peers' fragments taken per fragment and round at most; None: all

    @abc.abstractmethod
    def publish(self, fragment: Fragment) -> None:
        """Offer a fragment to the swarm and return at once."""

    @abc.abstractmethod
    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        """Offer bytes the caller encoded (``codec.encode``: the member's sender, which owns the
        codec choice and error feedback) as they are, and return at once."""

    @abc.abstractmethod
    def receive(self, index: int, kind: Kind = Kind.DELTA) -> list[Fragment]:
        """Fragments with this fragment index and of this kind from other peers that arrived and
        passed validation since the last call. Never blocks; never returns the same DELTA key
        twice."""

    @abc.abstractmethod
    def live_peers(self) -> list[str]:
        """Peer ids currently seen alive, this peer excluded."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets, threads and child processes."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Inbox:
    """Fragments that arrived and wait for ``receive``, by (fragment index, kind). Thread-safe:
    a transport's network thread puts, the trainer's thread pops."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[int, Kind], list[Fragment]] = {}
        self._lock = threading.Lock()

    def put(self, fragment: Fragment) -> None:
        with self._lock:
            self._waiting.setdefault((fragment.key.fragment, fragment.key.kind), []).append(fragment)

    def pop(self, index: int, kind: Kind) -> list[Fragment]:
        with self._lock:
            return self._waiting.pop((index, kind), [])

    def publishers(self, index: int, base_version: int) -> int:
        """How many publishers' pseudo-gradients of this fragment, of this version or newer, wait."""
        with self._lock:
            waiting = self._waiting.get((index, Kind.DELTA), [])
            return len({f.key.publisher for f in waiting if f.key.base_version >= base_version})
