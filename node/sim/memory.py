"""The in-memory transport: every peer in one process, with injected delay, loss and bandwidth.

A ``VirtualNetwork`` connects ``MemoryTransport`` peers. Each peer has its own virtual clock and
round counter, which its driver (the simulator) advances with ``MemoryTransport.advance``. A
delivery becomes visible to its receiver once both hold:

- the receiver's round has reached (its round at publish time) + τ, where τ is the injected delay
  in outer rounds, fixed or drawn uniformly from 0..max for every (publish, receiver) pair;
- the receiver's clock has passed the moment the bytes finished crossing the sender's uplink,
  when a bandwidth is set: a sender's uplink is a queue, and a sender whose previous upload has not
  finished waits for it (that wait is ``blocked_seconds``, time not spent computing).

What goes on the wire is the member's sender's choice (``node/member/sender.py``, the one owner
of the codec, a daemon's and a simulated worker's alike): it hands over bytes
(``publish_encoded``), and a tensor handed over whole travels as float32. Every receiver gets the
decoded tensor.

Deliveries are dropped with a given probability; a peer that is down neither sends nor receives,
and what was addressed to it meanwhile is lost. A DELTA is delivered at most once per
(publisher, fragment, base version); for PARAMS only the newest per publisher is kept.

With a ``fan_in``, a receiver takes at most that many publishers' fragments per (fragment, kind,
base version), as a daemon's selector does: of what one instant offers it, a draw of its own, the
publishers it already heard from first; of later instants, the first sent while room is left.
The rest are skipped unsent (counted ``skipped["fan_in"]`` at the receiver), so a sender's uplink
carries only what was taken; a publisher sending the same version again takes no second slot,
and a delivery lost in flight frees its slot for the next sender.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cgad.protocol.codec import Codec, decode, kept_in
from cgad.protocol.fan_in import FanInSlots, RoundKey, fan_in_order, round_key, takeable
from cgad.protocol.scheduling import round_budget
from cgad.protocol.selection import Deliveries
from cgad.protocol.transport import Fragment, FragmentKey, Kind, Transport, TransportStats

__all__ = ["Delay", "MemoryTransport", "VirtualNetwork"]

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Delay:
    """τ in outer rounds: ``fixed`` always, or uniform in 0..``maximum`` when ``random``."""

    rounds: int
    random: bool = False

    @classmethod
    def parse(cls, text: str) -> Delay:
        """'4' is a fixed delay of 4 rounds; 'random:8' is uniform in 0..8."""
        body = text.removeprefix("random:")
        try:
            rounds = int(body)
        except ValueError:
            raise ValueError(f"delay must be an integer or random:MAX, got {text!r}") from None
        if rounds < 0:
            raise ValueError(f"delay must be >= 0 rounds, got {text!r}")
        return cls(rounds, random=text.startswith("random:"))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(0, self.rounds) if self.random else self.rounds

    def __str__(self) -> str:
        return f"random:{self.rounds}" if self.random else str(self.rounds)


@dataclass
class _Delivery:
    fragment: Fragment
    ready_round: int
    ready_time: float
    size: int  # bytes on the wire


class VirtualNetwork:
    """Shared medium of a set of in-memory peers."""

    def __init__(
        self,
        *,
        delay: Delay = Delay(0),
        drop: float = 0.0,
        bandwidth: float | None = None,
        fan_in: int | None = None,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"drop probability must be in [0, 1), got {drop}")
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
        if fan_in is not None and fan_in < 1:
            raise ValueError(f"fan_in must be >= 1 peers, got {fan_in}")
        self.delay = delay
        self.drop = drop
        self.bandwidth = bandwidth
        self.fan_in = fan_in
        self.rng = random.Random(seed)
        self.peers: dict[str, MemoryTransport] = {}
        # sends of the instant under way, when a driver runs several peers at one virtual instant
        # (``hold``): they land together at ``flush``, so that no peer of the instant sees another's
        # before it has published its own
        self._held: list[tuple[MemoryTransport, Fragment, int]] | None = None
        self._slot_rng = random.Random(seed * 7 + 3)  # receivers' fan-in draws (not the delays')

    def hold(self) -> None:
        """Keep what is sent from now on until ``flush`` (one virtual instant)."""
        self._held = []

    def flush(self) -> None:
        """Send what was published since ``hold``, each receiver drawing its fan-in among it, and
        send at once again from now on. Uplink time is charged here (``blocked_seconds``)."""
        held, self._held = self._held or [], None
        for (sender, fragment, size), receivers in zip(held, self._draw(held), strict=True):
            self._dispatch(sender, fragment, size, receivers)

    def _draw(self, held: list[tuple[MemoryTransport, Fragment, int]]) -> list[list[MemoryTransport]]:
        """Per held send, the receivers that take it: every live peer but its sender, each within
        its fan-in per version, drawn per receiver where an instant offers more than its room."""
        alive = [p for p in self.peers.values() if p.alive]
        takers: list[set[str]] = [set() for _ in held]
        for receiver in alive:
            offers: dict[RoundKey, list[int]] = {}
            for i, (sender, fragment, _) in enumerate(held):
                if sender is not receiver:
                    offers.setdefault(round_key(fragment.key), []).append(i)
            for indices in offers.values():
                if self.fan_in is not None and len(indices) > 1:
                    heard = receiver._heard_from

                    def known(i: int, heard: set[str] = heard) -> bool:
                        return held[i][1].key.publisher in heard

                    fan_in_order(indices, self._slot_rng, known)
                for i in indices:
                    if receiver._take_slot(held[i][1].key):
                        takers[i].add(receiver.peer_id)
        # in the peers' order, as sends that are not held go: the delay draws follow it
        return [[p for p in alive if p.peer_id in taken] for taken in takers]

    def _receivers(self, sender: MemoryTransport) -> list[MemoryTransport]:
        return [p for p in self.peers.values() if p is not sender and p.alive]

    def join(self, peer_id: str) -> MemoryTransport:
        if peer_id in self.peers:
            raise ValueError(f"peer {peer_id!r} already joined")
        transport = MemoryTransport(self, peer_id)
        self.peers[peer_id] = transport
        return transport

    def _send(self, sender: MemoryTransport, fragment: Fragment, size: int | None = None) -> None:
        """``size``: the fragment came encoded (``publish_encoded``) in that many bytes."""
        if size is None:
            size = fragment.tensor.numel() * _FLOAT32_BYTES
        if self._held is not None:
            self._held.append((sender, fragment, size))
            return
        receivers = [r for r in self._receivers(sender) if r._take_slot(fragment.key)]
        self._dispatch(sender, fragment, size, receivers)

    def _dispatch(
        self, sender: MemoryTransport, fragment: Fragment, size: int, receivers: list[MemoryTransport]
    ) -> None:
        """Put ``fragment`` on the wire to ``receivers``: the sender's uplink time, losses, delays."""
        ready_time = sender.now
        if self.bandwidth is not None and receivers:
            start = max(sender.now, sender.uplink_free_at)
            sender.blocked_seconds += start - sender.now
            sender.uplink_free_at = start + size * len(receivers) / self.bandwidth
            ready_time = sender.uplink_free_at
        for receiver in receivers:
            sender.stats.bytes_sent += size
            if self.rng.random() < self.drop:
                sender.stats.rejected["dropped_in_flight"] += 1
                receiver._slots.release(round_key(fragment.key), fragment.key.publisher)  # as a failed fetch
                continue
            receiver._slots.verify(round_key(fragment.key), fragment.key.publisher)
            delivery = _Delivery(fragment, receiver.round + self.delay.draw(self.rng), ready_time, size)
            receiver._heard_from.add(fragment.key.publisher)
            receiver.inbox.append(delivery)


class MemoryTransport(Transport):
    """One peer's end of a ``VirtualNetwork``."""

    def __init__(self, network: VirtualNetwork, peer_id: str) -> None:
        self.network = network
        self.fan_in = network.fan_in
        self.peer_id = peer_id
        self.stats = TransportStats()
        self.alive = True
        self.now = 0.0
        self.round = 0
        self.uplink_free_at = 0.0
        self.blocked_seconds = 0.0
        self.inbox: list[_Delivery] = []
        self.seconds_per_round: float | None = None  # virtual, over the last round
        self._round_began = 0.0  # when the round under way began (the driver may advance per step)
        self._delivered = Deliveries()  # DELTA keys taken, as a daemon's selector keeps them
        self._slots = FanInSlots(network.fan_in)  # the fan-in's ledger, as a daemon's selector keeps it
        self._heard_from: set[str] = set()  # publishers whose fragments reached this peer

    def _take_slot(self, key: FragmentKey) -> bool:
        """Whether this peer takes ``key``'s fragment: its publisher holds one of the fan-in's
        slots of (fragment, kind, base version) already, or takes one that is left."""
        slot = round_key(key)
        if self._slots.holds(slot, key.publisher, self.now):
            return True
        if self._slots.room(slot, self.now) <= 0:
            self.stats.skipped["fan_in"] += 1
            return False
        self._slots.take(slot, key.publisher, self.now)
        if len(self._slots.verified) > 4096:  # versions long past: their counts are done with
            newest = max(s[2] for s in self._slots.verified)
            self._slots.forget(lambda s: s[2] < newest - 256)
        return True

    def advance(self, now: float, round_: int) -> None:
        """Move this peer's virtual clock and round counter (the driver calls this)."""
        if round_ > self.round:
            if now > self._round_began:
                self.seconds_per_round = (now - self._round_began) / (round_ - self.round)
            self._round_began = now
        self.now = now
        self.round = round_

    def set_alive(self, alive: bool) -> None:
        """Take the peer down (its inbox is lost) or bring it back."""
        if not alive:
            self.inbox.clear()
        self.alive = alive

    def publish(self, fragment: Fragment) -> None:
        if not self.alive:
            raise RuntimeError(f"peer {self.peer_id} is down and cannot publish")
        self.stats.published += 1
        self.network._send(self, fragment)

    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        if not self.alive:
            raise RuntimeError(f"peer {self.peer_id} is down and cannot publish")
        self.stats.published += 1
        self.network._send(self, Fragment(key, decode(data), tokens, kept_in(data)), len(data))

    def round_budget(self) -> float | None:
        """From the network's bandwidth (infinite without one) and this peer's virtual seconds
        per round, as a daemon's transport measures them."""
        if self.network.bandwidth is None:
            return float("inf")
        fetchers = takeable(len(self.network._receivers(self)), self.network.fan_in)
        return round_budget(self.network.bandwidth, self.seconds_per_round, fetchers)

    def receive(self, index: int, kind: Kind = Kind.DELTA) -> list[Fragment]:
        ready, waiting = [], []
        for d in self.inbox:
            is_match = d.fragment.key.fragment == index and d.fragment.key.kind == kind
            if is_match and d.ready_round <= self.round and d.ready_time <= self.now:
                ready.append(d.fragment)
                self.stats.bytes_received += d.size  # replays too: they crossed the wire
            else:
                waiting.append(d)
        self.inbox = waiting
        if kind == Kind.PARAMS:
            newest: dict[str, Fragment] = {}
            for f in ready:
                held = newest.get(f.key.publisher)
                if held is None or f.key.base_version >= held.key.base_version:
                    newest[f.key.publisher] = f
            ready = list(newest.values())
        else:
            fresh = []
            for f in ready:
                if not self._delivered.take(f.key):
                    self.stats.rejected["replay"] += 1
                    continue
                fresh.append(f)
            ready = fresh
        self.stats.received += len(ready)
        return ready

    def arrived(self, index: int, base_version: int) -> int:
        """Publishers whose pseudo-gradient of this fragment, of this version or newer, is ready
        (by this peer's round and clock) and waits for ``receive``."""
        return len({
            d.fragment.key.publisher
            for d in self.inbox
            if d.fragment.key.kind == Kind.DELTA
            and d.fragment.key.fragment == index
            and d.fragment.key.base_version >= base_version
            and d.ready_round <= self.round
            and d.ready_time <= self.now
        })  # fmt: skip

    def live_peers(self) -> list[str]:
        return [p.peer_id for p in self.network.peers.values() if p is not self and p.alive]

    def close(self) -> None:
        self.network.peers.pop(self.peer_id, None)
        self.inbox.clear()
