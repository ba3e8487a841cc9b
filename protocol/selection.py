"""Which offers a peer fetches, and from whom: the selection policy as pure bookkeeping.

Given the parsed holdings records of one fragment, ``OfferSelector.choose`` decides which new
offers are worth fetching and returns them with the holders to try, plus what it refused and why.
It does no I/O and reads no clock (the time comes in as an argument); its randomness comes from
its own ``random.Random``, so a seeded selector decides the same way every time.

The rules:

- only a publisher's own record vouches for an offer (its hash, length and tokens); other
  holders' offers of the same hash only say where else the bytes live;
- an offer far behind this peer's OWN version of the fragment (``history_versions``) is ignored
  unseen; never measured against what others claim, so a record announcing a far-future version
  cannot make honest offers look stale;
- an offer more than ``max_ahead`` versions AHEAD of this peer's own is refused unfetched, but
  not remembered as attempted: once this peer has caught up (a re-sync), it counts; so no ledger
  holds versions an attacker picks far ahead. It is counted once as a fault (``future``) only when
  it is that far ahead of the swarm too (the median of live peers' reports, which the caller
  passes and no single peer moves); within that it only says this peer is behind (joining or
  re-syncing), counted in ``behind``; either is counted once per publisher, fragment and kind
  while the verdict is remembered, whatever versions it names;
- at most ``fan_in`` publishers per (fragment, kind, base version), drawn at random, publishers
  whose bytes verified before first; a slot is spent on bytes that arrived and verified
  (``deliver``), and held meanwhile only while the fetch may still deliver: a fetch that brought
  nothing (``retry_later``) frees it at once, one that never reports back after
  ``pending_seconds``. An offer passed over for want of a slot is not attempted: it is chosen
  when a slot frees. A publisher has at most ``MAX_PENDING_PER_PUBLISHER`` unverified offers of a
  fragment and kind at once, and a version ahead of this peer's own (and of the swarm's) fills at
  most half its slots with unverified offers until this peer gets there: identities that
  announce future versions first, and send nothing, cannot take the slots of those that do;
- a DELTA key (publisher, fragment, base version) is delivered at most once: the same key
  announced again with other bytes is a replay, re-announcing the same bytes is nothing;
- an offer whose record already shows it unusable (``check_offer``) is refused before any byte
  moves; an offer once attempted (fetched, in flight or refused) is not tried again, unless no
  holder delivered it (``retry_later``) and a holder not tried yet announces the same bytes: a
  publisher behind NAT is reached through the public peers that fetched its fragment and serve
  it onward, and they announce themselves after the first try failed;
- holders are tried re-servers first (up to ``MAX_RESERVERS``, drawn at random) and the
  publisher last, so that a popular fragment's load spreads over those who already hold it.

Threads: not thread-safe; the network transport uses a selector only on its event-loop thread
("cgad-net-*").
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from cgad.protocol.codec import SPARSE_MAX_KEPT, Codec, encoded_size, sparse_kept
from cgad.protocol.fan_in import PENDING_SECONDS, FanInSlots, RoundKey, fan_in_order, round_key
from cgad.protocol.records import Holdings, Offer
from cgad.protocol.transport import FragmentKey, Kind

__all__ = [
    "MAX_PENDING_PER_PUBLISHER",
    "STATE_CODEC",
    "Candidate",
    "Deliveries",
    "OfferSelector",
    "Rejection",
    "Selection",
    "check_offer",
]

STATE_CODEC = "state"  # a snapshot's encoding: the node's own packing, opaque to the transport
MAX_RESERVERS = 3  # re-servers a fetch tries (drawn at random) before the publisher
# unverified offers of one fragment and kind a publisher may have chosen at once: an honest one
# has its own version's and at most the next one's in flight
MAX_PENDING_PER_PUBLISHER = 2


@dataclass(frozen=True)
class Rejection:
    reason: str  # a ``FragmentError`` reason, as the transport counts them
    detail: str
    publisher: str | None = None  # whose signed offer it was, when one is to blame


@dataclass
class Candidate:
    key: FragmentKey
    offer: Offer  # from the publisher's own record
    holders: list[Holdings]  # in the order to try: re-servers, then the publisher


@dataclass
class Selection:
    candidates: list[Candidate] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    fan_in_skipped: int = 0  # publishers passed over because of the fan-in cap
    behind: int = 0  # offers too far ahead of this peer, but not of the swarm: it is behind


def check_offer(offer: Offer, numel: int) -> Rejection | None:
    """What can be refused from the signed record alone, before any byte moves."""
    if offer.numel != numel:
        return Rejection("bad_shape", f"{offer.numel} values, expected {numel}")
    try:
        # sparse: any k a publisher may choose, up to the largest
        expected = encoded_size(numel, offer.codec, kept=SPARSE_MAX_KEPT)
    except ValueError:
        return Rejection("unknown_codec", offer.codec)
    if offer.byte_length > expected:
        return Rejection("oversized", f"{offer.byte_length} bytes for {numel} values in {offer.codec}")
    if offer.codec == Codec.SPARSE:
        if sparse_kept(numel, offer.byte_length - encoded_size(0, Codec.SPARSE)) is None:
            return Rejection("bad_length", f"{offer.byte_length} bytes fit no sparse encoding of {numel}")
    elif offer.byte_length != expected:
        return Rejection("bad_length", f"{offer.byte_length} bytes, expected {expected}")
    return None


class Deliveries:
    """The keys taken, each at most once, a daemon's and the simulator's alike: the first delivery
    of a key (publisher, fragment, base version, kind) is taken, with its content hash where the
    transport has one; any later one of the same key is a replay. Iterates and counts as its keys.
    """

    def __init__(self) -> None:
        self._taken: dict[FragmentKey, bytes | None] = {}

    def take(self, key: FragmentKey, digest: bytes | None = None) -> bool:
        """True, and ``key`` recorded, the first time; False for a replay."""
        if key in self._taken:
            return False
        self._taken[key] = digest
        return True

    def get(self, key: FragmentKey) -> bytes | None:
        """The content hash ``key`` was taken with (None: not taken, or taken without one)."""
        return self._taken.get(key)

    def forget(self, old: Callable[[FragmentKey], bool]) -> None:
        """Drop the keys ``old`` names (versions long past: refused unseen anyway)."""
        self._taken = {k: v for k, v in self._taken.items() if not old(k)}

    def __contains__(self, key: object) -> bool:
        return key in self._taken

    def __iter__(self) -> Iterator[FragmentKey]:
        return iter(self._taken)

    def __len__(self) -> int:
        return len(self._taken)


def _holders_by_hash(holdings: Sequence[Holdings]) -> dict[bytes, list[Holdings]]:
    by_hash: dict[bytes, list[Holdings]] = defaultdict(list)
    for holder in holdings:
        for offer in holder.offers:
            by_hash[offer.content_hash].append(holder)
    return by_hash


def own_version(versions: Sequence[int], fragment: int) -> int:
    """This peer's version of ``fragment`` from its progress report (0 before it reports one)."""
    return versions[fragment] if fragment < len(versions) else 0


def swarm_version(reports: Sequence[Sequence[int]], fragment: int) -> int | None:
    """The swarm's version of ``fragment``: the median (low) of the live peers' reported versions
    (``reports``, one list per peer; a report without that fragment is left out), so that no
    single peer's claim moves it; None with no report."""
    column = [versions[fragment] for versions in reports if fragment < len(versions)]
    return statistics.median_low(column) if column else None


class OfferSelector:
    """The policy above, with its ledgers: ``delivered`` (DELTA or PARAMS key to the content hash
    accepted for it), ``attempted`` (content hash to its fragment and base version), per fragment,
    kind and base version ``chosen`` (publishers chosen once: never again), ``slots`` (the fan-in
    cap's ledger, ``fan_in.FanInSlots``: chosen and pending, or verified) and ``passed``
    (publishers counted as skipped), ``earned`` (publishers whose
    bytes verified, with when) and ``judged`` (faulty records already counted, with when).
    ``forget`` bounds them all.

    Args:
        run_id: the run whose offers these are.
        peer_id: this peer (its own offers are never chosen).
        fan_in: publishers per fragment, kind and base version.
        history_versions: offers further behind this peer's own version are ignored.
        record_ttl: a record's lifetime in the DHT (judged records are forgotten after two).
        max_ahead: offers further ahead of this peer's own version are refused unfetched.
        rng: the draw among publishers (seeded: the same choices every time).
        pending_seconds: how long a chosen offer holds its slot without its bytes verifying.
        kinds: the kinds this peer uses (``Kind`` values; None: every kind): no other is fetched.
    """

    def __init__(
        self,
        run_id: str,
        peer_id: str,
        *,
        fan_in: int | None,
        history_versions: int,
        record_ttl: float,
        max_ahead: int | None = None,
        rng: random.Random | None = None,
        pending_seconds: float = PENDING_SECONDS,
        kinds: frozenset[str] | None = None,
    ) -> None:
        self.run_id = run_id
        self.kinds = kinds
        self.peer_id = peer_id
        self.fan_in = fan_in
        self.history_versions = history_versions
        self.max_ahead = history_versions if max_ahead is None else max_ahead
        self.record_ttl = record_ttl
        self.rng = rng or random.Random()
        self.delivered = Deliveries()
        self.attempted: dict[bytes, tuple[int, int]] = {}
        self.chosen: dict[tuple[int, Kind, int], set[str]] = defaultdict(set)
        self.slots = FanInSlots(fan_in, pending_seconds)
        self.passed: dict[tuple[int, Kind, int], set[str]] = defaultdict(set)
        self.earned: dict[str, float] = {}
        self.judged: dict[Hashable, float] = {}
        self.failed: dict[bytes, set[str]] = {}  # content hash to the holders that did not deliver
        self._now = 0.0  # the DHT time of the latest choice (``deliver`` is told none)

    def retry_later(self, candidate: Candidate) -> None:
        """No holder of ``candidate`` delivered: its fan-in slot is free again, and it is fetched
        again once a holder not among these announces the same bytes (see the rules)."""
        tried = self.failed.setdefault(candidate.offer.content_hash, set())
        tried.update(h.peer_id for h in candidate.holders)
        self.slots.release(round_key(candidate.key), candidate.key.publisher)

    def release(self, candidate: Candidate) -> None:
        """``candidate`` leaves without its bytes verifying (dropped from the fetch queue, its
        fetch cancelled or failed, its bytes refused): its fan-in slot is free again. A slot
        held until the pending expiry instead made its publisher "busy" for minutes after two
        cancelled fetches, and every later offer of it was skipped."""
        self.slots.release(round_key(candidate.key), candidate.key.publisher)

    def too_old(self, base_version: int, own: int) -> bool:
        return base_version < own - self.history_versions

    def judge(self, record: Hashable, now: float) -> bool:
        """True the first time a faulty ``record`` (anything naming it) is seen, so the fault is
        counted once however many polls see the same record; False after that."""
        if record in self.judged:
            return False
        self.judged[record] = now
        return True

    def mark_attempted(self, digest: bytes, fragment: int, base_version: int) -> None:
        """Never fetch these bytes (e.g. this peer's own, which it holds already)."""
        self.attempted[digest] = (fragment, base_version)

    def deliver(self, key: FragmentKey, digest: bytes) -> bool:
        """Record that ``key`` was accepted with these bytes (they verified: its publisher's fan-in
        slot is spent); False (and nothing recorded) when the key was delivered already, e.g. by
        a second announcement that raced this fetch."""
        if not self.delivered.take(key, digest):
            return False
        self.slots.verify(round_key(key), key.publisher)
        self.earned[key.publisher] = self._now
        return True

    def choose(
        self,
        fragment: int,
        numel: int,
        holdings: Sequence[Holdings],
        own: int,
        now: float,
        swarm: int | None = None,
    ) -> Selection:
        """New offers of ``fragment`` (which must have ``numel`` values) worth fetching, within
        the fan-in cap, with their holders; ``own`` is this peer's version of the fragment,
        ``swarm`` the swarm's (the median of live peers' reports; None: unknown) and ``now`` the
        DHT time. Candidates returned count as attempted from here on."""
        selection = Selection()
        self._now = now
        by_hash = _holders_by_hash(holdings)
        fresh: dict[RoundKey, list[Candidate]] = defaultdict(list)
        for holder, offer in self._vouched(holdings):
            if offer.kind == Kind.STATE:
                continue  # a snapshot in a fragment's record: only choose_states takes those
            if self.kinds is not None and offer.kind not in self.kinds:
                continue  # bytes this peer would drop
            if self.too_old(offer.base_version, own):
                continue  # far too old to matter to any outer step
            kind = Kind(offer.kind)
            key = FragmentKey(self.run_id, fragment, offer.base_version, offer.publisher, kind)
            if offer.base_version > own + self.max_ahead:
                # judged per publisher, fragment and kind, not per version: versions are the
                # attacker's to pick, and each would be one more entry
                if not self.judge(("ahead", key.publisher, fragment, kind), now):
                    continue
                if offer.base_version <= max(own, swarm or 0) + self.max_ahead:
                    selection.behind += 1
                else:
                    selection.rejections.append(
                        Rejection("future", f"{key}: this peer is at version {own}", key.publisher)
                    )
                continue
            delivered = self.delivered.get(key)
            if delivered is not None:
                replayed = delivered != offer.content_hash and kind is Kind.DELTA
                if replayed and self.judge(("replay", offer.content_hash), now):
                    selection.rejections.append(
                        Rejection("replay", f"{key} again with other bytes", key.publisher)
                    )
                continue
            if offer.content_hash in self.attempted:
                tried = self.failed.get(offer.content_hash)
                untried = [
                    h for h in self._holders(offer, holder, by_hash) if tried and h.peer_id not in tried
                ]
                if untried:  # chosen already, at the first try: it takes its slot again
                    del self.failed[offer.content_hash]
                    self.slots.take(round_key(key), key.publisher, now)
                    selection.candidates.append(Candidate(key, offer, untried))
                continue
            problem = check_offer(offer, numel)
            if problem is not None:
                self.mark_attempted(offer.content_hash, fragment, offer.base_version)
                selection.rejections.append(
                    Rejection(problem.reason, f"{key}: {problem.detail}", key.publisher)
                )
                continue
            holders = self._holders(offer, holder, by_hash)
            fresh[(fragment, kind, offer.base_version)].append(Candidate(key, offer, holders))
        for slot, candidates in fresh.items():
            taken = self.chosen[slot]
            # a version ahead of this peer (and of the swarm) is a claim nobody can use yet:
            # half its slots wait for this peer to get there
            ahead = slot[2] > max(own, swarm if swarm is not None else own)
            fan_in_order(candidates, self.rng, lambda c: c.key.publisher in self.earned)
            for candidate in candidates:
                publisher = candidate.key.publisher
                if publisher in taken:
                    continue
                busy = self.slots.waiting_of(publisher, fragment, slot[1], now) >= MAX_PENDING_PER_PUBLISHER
                if self.slots.room(slot, now, ahead=ahead) <= 0 or busy:
                    if publisher not in self.passed[slot]:  # counted once
                        self.passed[slot].add(publisher)
                        selection.fan_in_skipped += 1
                    continue
                self.mark_attempted(candidate.offer.content_hash, fragment, candidate.key.base_version)
                taken.add(publisher)
                self.slots.take(slot, publisher, now)
                selection.candidates.append(candidate)
        return selection

    def choose_states(self, holdings: Sequence[Holdings], max_bytes: int, now: float) -> Selection:
        """Every state snapshot on offer (none of this peer's own), vouched for by its
        publisher's record, with its holders (re-servers first, the publisher last), newest
        first. A snapshot larger than ``max_bytes`` or in another encoding is refused unseen."""
        selection = Selection()
        by_hash = _holders_by_hash(holdings)
        for holder, offer in self._vouched(holdings):
            if offer.kind != Kind.STATE:
                continue
            key = FragmentKey(self.run_id, 0, offer.base_version, offer.publisher, Kind.STATE)
            problem = None
            if offer.codec != STATE_CODEC:
                problem = Rejection("unknown_codec", f"{key}: {offer.codec}")
            elif offer.byte_length > max_bytes:
                problem = Rejection("oversized", f"{key}: {offer.byte_length} bytes > {max_bytes}")
            if problem is not None:
                if self.judge(("state", offer.content_hash), now):
                    selection.rejections.append(problem)
                continue
            selection.candidates.append(Candidate(key, offer, self._holders(offer, holder, by_hash)))
        selection.candidates.sort(key=lambda c: -c.key.base_version)
        return selection

    def _vouched(self, holdings: Sequence[Holdings]) -> Iterator[tuple[Holdings, Offer]]:
        """Offers that their publisher's own record vouches for (not this peer's own)."""
        for holder in holdings:
            for offer in holder.offers:
                if offer.publisher == holder.peer_id and offer.publisher != self.peer_id:
                    yield holder, offer

    def _holders(
        self, offer: Offer, publisher: Holdings, by_hash: dict[bytes, list[Holdings]]
    ) -> list[Holdings]:
        """Where to fetch an offer's bytes: up to ``MAX_RESERVERS`` re-servers drawn at random,
        the publisher last. Anyone can announce bytes it does not serve, and each such holder
        costs a fetch its timeouts before the next is tried: the draw bounds what a crowd of
        them can waste, and two or three re-servers already spare the publisher's uplink."""
        others = [h for h in by_hash[offer.content_hash] if h.peer_id != offer.publisher]
        return [*self.rng.sample(others, min(len(others), MAX_RESERVERS)), publisher]

    def forget(self, versions: Sequence[int], now: float) -> None:
        """Bound the ledgers: versions beyond the horizon of this peer's own ``versions`` are
        refused unseen anyway, and a record judged longer ago than two lifetimes has expired from
        the DHT."""

        def old(fragment: int, base_version: int) -> bool:
            return self.too_old(base_version, own_version(versions, fragment))

        self.delivered.forget(lambda k: old(k.fragment, k.base_version))
        self.attempted = {h: fb for h, fb in self.attempted.items() if not old(*fb)}
        self.failed = {h: tried for h, tried in self.failed.items() if h in self.attempted}
        for ledger in (self.chosen, self.passed):
            for slot in [k for k in ledger if old(k[0], k[2])]:
                del ledger[slot]
        self.slots.forget(lambda slot: old(slot[0], slot[2]))
        oldest = now - 2 * self.record_ttl
        self.earned = {publisher: when for publisher, when in self.earned.items() if when > oldest}
        self.judged = {record: when for record, when in self.judged.items() if when > oldest}
