"""Polling the DHT: what the swarm's records say, read, checked and turned into fetches.

Each poll gets the records under the run's keys in one request: every peer's progress record (who
is live, and how far) and every holder's record of each fragment this peer receives; the
snapshots on offer only where they may be wanted (``states_due``): while a joiner or a re-sync
reads them, while this peer trails the swarm, and at least every ``STATE_REFRESH`` seconds.
Sound records of allowed peers (``--allow``) are parsed (holdings once while they stand,
``records.ParseCache``); faulty ones are counted once each. The selector (``selection``) chooses
the offers to fetch, which go to the receiver's queue (``receiving``); then the receiver drops the
fetches in flight that could no longer count and starts queued ones. While no peer is live, the
peers this one knew are pinged, so that both sides of a healed partition find each other again.

Threads: a ``Poller`` runs on the transport's event-loop thread. ``interest`` gains entries from
the trainer's thread (read here as a copy); ``live`` is replaced whole by each poll, its own
entry set in place when it reports, and read by the trainer as a copy; ``progress`` returns a
reference the trainer's thread replaces whole. ``state_offers(fresh=)`` runs on a syncing thread
(never the loop's): it wakes the loop with ``call_soon_threadsafe`` and blocks that thread for up
to ``fresh`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import TypeVar

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID, BinaryDHTValue, Subkey
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from cgad.protocol.config import NetworkOptions
from cgad.protocol.dhtbounds import search_beam
from cgad.protocol.errors import FragmentError
from cgad.protocol.receiving import Receiver
from cgad.protocol.records import (
    Holdings,
    ParseCache,
    Progress,
    fragment_key,
    parse_holdings,
    parse_live_progress,
    peer_id_of_owner,
    progress_key,
    read_records,
    state_key,
)
from cgad.protocol.scheduling import VersionClock, poll_pause
from cgad.protocol.selection import Candidate, OfferSelector, Rejection, own_version, swarm_version
from cgad.protocol.transport import TransportStats

__all__ = [
    "KNOWN_PEERS", "MAX_ENDPOINTS_PER_HOST", "MAX_FAULTY_RECORDS", "PROGRESS_SKEW", "REJOIN_EVERY",
    "STATE_REFRESH", "STATE_WANTED", "EndpointClaims", "FaultLedger", "Poller", "live_progress",
    "states_due",
]  # fmt: skip

logger = logging.getLogger(__name__)
T = TypeVar("T", Holdings, Progress)

# seconds a progress record's time may run ahead of ours (DHT time is each peer's own); private
# swarms' tickets have their own allowance (auth.CLOCK_SKEW)
PROGRESS_SKEW = 60.0
REJOIN_EVERY = 10.0  # seconds between pings of the peers it knew, while a peer sees none live
KNOWN_PEERS = 64  # the most recently seen peers it remembers for that (records are cheap to forge)
MAX_FAULTY_RECORDS = 4096  # faulty records remembered (to count each once): identities are free
# gRPC endpoints a record may make this peer dial: each named by one peer, so many identities
# cannot aim every fetcher at one host:port, and at most this many ports per host
MAX_ENDPOINTS_PER_HOST = 32
MAX_ENDPOINTS = 1024  # endpoints (and their claimants) remembered, least recently seen forgotten
# seconds between looks at the snapshots on offer while nothing reads them: a poll's key fewer
# (each key is a search of its own, answered by num_replicas nodes); a sync asks for a fresh look
STATE_REFRESH = 30.0
STATE_WANTED = 30.0  # seconds after a read of the offers during which every poll looks them up


def live_progress(records: Sequence[Progress], now: float, liveness_ttl: float) -> dict[str, Progress]:
    """The records younger than ``liveness_ttl`` by peer: the swarm's view (who is live, the median
    version) is taken from these only, never from a record its peer stopped refreshing.

    Args:
        records: sound progress records.
        now: the DHT time.
        liveness_ttl: seconds a record counts as live after its time.
    """
    return {p.peer_id: p for p in records if p.time + liveness_ttl > now}


class FaultLedger:
    """Faulty records already counted (key, owner, expiration), so that each is counted once:
    bounded by ``size`` (least recently seen forgotten) and by age (``keep`` seconds)."""

    def __init__(self, size: int = MAX_FAULTY_RECORDS, keep: float = 3600.0) -> None:
        self.size = size
        self.keep = keep
        self._seen: OrderedDict[tuple, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def first_time(self, record: tuple, now: float) -> bool:
        """Whether ``record`` is new here (and remember it).

        Args:
            record: what names the faulty record (hashable, small).
            now: the DHT time.
        """
        while self._seen and (
            len(self._seen) >= self.size or next(iter(self._seen.values())) < now - self.keep
        ):
            self._seen.popitem(last=False)
        new = record not in self._seen
        self._seen[record] = now
        self._seen.move_to_end(record)
        return new


def states_due(now: float, looked_at: float, wanted_at: float, versions: Sequence[int],
               reports: Collection[Sequence[int]]) -> bool:  # fmt: skip
    """Whether a poll looks up the snapshots on offer too: someone read them within
    ``STATE_WANTED`` seconds (a joiner, a re-sync), the last look is ``STATE_REFRESH`` seconds old,
    or this peer trails the swarm's median on some fragment by more than one version (a re-sync
    may be near: its offers should be fresh when it comes).

    Args:
        now: monotonic seconds.
        looked_at: when the offers were last looked up (monotonic; -inf: never).
        wanted_at: when they were last read.
        versions: this peer's versions.
        reports: the live peers' versions.
    """
    if now - wanted_at < STATE_WANTED or now - looked_at >= STATE_REFRESH:
        return True
    columns = list(reports)
    for fragment, own in enumerate(versions):
        swarm = swarm_version(columns, fragment)
        if swarm is not None and swarm - own > 1:
            return True
    return False


def public_endpoint(endpoint: str) -> bool:
    """Whether a record's gRPC endpoint is a public IP address: not a host name (which may resolve
    to anything), nor a private, loopback, link-local, multicast or reserved address."""
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if not address.is_global or address.is_multicast:
        return False
    if isinstance(address, ipaddress.IPv6Address):  # an IPv4 address inside it must be public too
        inside = [address.ipv4_mapped, address.sixtofour, address.teredo[1] if address.teredo else None]
        value = int(address)
        # IPv4-compatible (::/96), IPv4-translated (::ffff:0:0/96), NAT64 (64:ff9b::/96, 64:ff9b:1::/48)
        if value >> 32 in (0, 0xFFFF0000, 0x64FF9B << 64) or value >> 80 == 0x64FF9B0001:
            inside.append(ipaddress.IPv4Address(value & 0xFFFFFFFF))
        return all(v is None or (v.is_global and not v.is_multicast) for v in inside)
    return True


class EndpointClaims:
    """Which holder may name which gRPC endpoint: only a public IP address unless ``private`` (a
    record naming a private one would aim this node's fetches at a service on its own network),
    the first to name one keeps it while it is remembered, and a host gets at most ``per_host``
    endpoints; a holder over any bound keeps its record without the endpoint (it is still reached
    over libp2p)."""

    def __init__(
        self, per_host: int = MAX_ENDPOINTS_PER_HOST, size: int = MAX_ENDPOINTS, *, private: bool = False
    ) -> None:
        self.private = private
        self.per_host = per_host
        self.size = size
        self._owner: OrderedDict[str, str] = OrderedDict()  # endpoint -> peer id
        self._per_host: Counter[str] = Counter()

    def check(self, holdings: Holdings) -> Holdings:
        """``holdings``, its endpoint removed when another peer named it first or its host has
        ``per_host`` endpoints already.

        Args:
            holdings: a sound holder's record.
        """
        endpoint = holdings.grpc
        if endpoint is None:
            return holdings
        if not self.private and not public_endpoint(endpoint):
            return holdings.copy(update={"grpc": None, "tls": None})
        owner = self._owner.get(endpoint)
        if owner is None:
            host = endpoint.rsplit(":", 1)[0]
            if self._per_host[host] >= self.per_host:
                return holdings.copy(update={"grpc": None, "tls": None})
            self._owner[endpoint] = owner = holdings.peer_id
            self._per_host[host] += 1
            while len(self._owner) > self.size:
                forgotten, _ = self._owner.popitem(last=False)
                self._per_host[forgotten.rsplit(":", 1)[0]] -= 1
                if self._per_host[forgotten.rsplit(":", 1)[0]] <= 0:
                    del self._per_host[forgotten.rsplit(":", 1)[0]]
        if owner != holdings.peer_id:
            return holdings.copy(update={"grpc": None, "tls": None})
        self._owner.move_to_end(endpoint)
        return holdings


def _peer_ids(maddrs: Sequence[str]) -> list[str]:
    """The peer ids in bootstrap multiaddrs (``/p2p/<id>``; those without one are skipped)."""
    return [m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m]


class Poller:
    """This peer's view of the swarm, refreshed by ``poll_forever``. ``interest`` maps the
    fragments to receive to the number of values each must have; ``allow`` is ``--allow`` with
    this peer in it (empty: every peer is allowed); ``progress`` returns this peer's latest own
    report; ``reject`` counts a refusal (blaming the publisher named, if any)."""

    def __init__(
        self,
        options: NetworkOptions,
        peer_id: str,
        *,
        interest: dict[int, int],
        allow: Collection[str],
        stats: TransportStats,
        selector: OfferSelector,
        receiver: Receiver,
        version_clock: VersionClock,
        progress: Callable[[], Progress],
        reject: Callable[[str, str, str | None], None],
    ) -> None:
        self.options = options
        self.peer_id = peer_id
        self.interest = interest
        self.stats = stats
        self.dht_node: DHTNode | None = None  # set once the loop has started it
        self.polls = 0  # looks at the DHT completed
        self.live: dict[str, Progress] = {}
        self._progress_id = DHTID.generate(source=progress_key(options.run_id))
        self._dates: OrderedDict[tuple[Subkey, bytes], float | None] = OrderedDict()  # ``_dated``
        self.state_candidates: list[Candidate] = []  # replaced whole by each look at the offers
        self.states_looked_at = float("-inf")  # monotonic: the last look at the snapshots on offer
        self.states_wanted_at = float("-inf")  # monotonic: the last read of them (any thread)
        self._loop: asyncio.AbstractEventLoop | None = None  # the poller's, once it runs
        self._wake: asyncio.Event | None = None  # set: poll now (a fresh read of the offers)
        self._allow = allow
        self._selector = selector
        self._receiver = receiver
        self._version_clock = version_clock
        self._progress = progress
        self._reject = reject
        self._holdings = ParseCache(parse_holdings)  # holders' records, parsed once while they stand
        self.faulty = FaultLedger(keep=2 * options.record_ttl)  # faulty records counted once
        self.endpoints = EndpointClaims(private=options.private_endpoints)
        # whom to ping when no peer is left: --peers always, and the peers last seen live (newest
        # last; bounded, as identities are free to make)
        self._bootstrap_ids = _peer_ids(options.peers)
        self._known: OrderedDict[str, None] = OrderedDict()
        self._rejoined_at = 0.0

    def state_offers(self, fresh: float = 0.0) -> list[Candidate]:
        """The snapshots on offer, newest first; from now on for ``STATE_WANTED`` seconds every poll
        looks them up. ``fresh``: wake the poller and wait up to that many seconds for a look that
        began after this call (a re-sync reads once, and the last look may be ``STATE_REFRESH``
        old); else those of the last look. Called from other threads, never the loop's: the
        floats it writes are stored whole, the list is replaced whole.

        Args:
            fresh: seconds to wait for a fresh look (0: none).
        """
        asked = time.monotonic()
        self.states_wanted_at = asked
        loop, wake = self._loop, self._wake
        if fresh > 0 and loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop has closed: no look is coming
                return list(self.state_candidates)
            while self.states_looked_at < asked and time.monotonic() < asked + fresh:
                if self._loop is None:  # the poller stopped (the transport is closing)
                    break
                time.sleep(0.05)
            if self.states_looked_at < asked:
                logger.debug("no look at the snapshots on offer within %.0f s: the last look's", fresh)
        return list(self.state_candidates)

    def live_peers(self) -> list[str]:
        """The other peers whose progress record is younger than ``liveness_ttl``."""
        now = get_dht_time()
        return sorted(
            peer
            for peer, progress in self.live.items()
            if peer != self.peer_id and progress.time + self.options.liveness_ttl > now
        )

    def evictable(self, key: DHTID, subkey: Subkey, value: BinaryDHTValue) -> bool:
        """Whether a record this node's DHT holds is dead, so that a new owner's record of a full
        key may take its room (``dhtbounds.BoundedLocalStorage``): at the progress key, a record
        dated more than twice the liveness TTL back, or one the poll refuses (withdrawn,
        unreadable, forged, dated ahead); at the others, a holder with no live progress record
        in this node's view. Throwaway identities' dead records then never keep a live peer's
        out; live ones fill a key only while they keep reporting."""
        if key != self._progress_id:
            try:  # as stored, a subkey is the raw owner
                return not isinstance(subkey, bytes) or peer_id_of_owner(subkey) not in self.live
            except FragmentError:
                return True
        now = get_dht_time()
        dated = self._dated(subkey, value, now)
        return dated is None or dated + 2 * self.options.liveness_ttl < now

    def _dated(self, subkey: Subkey, value: BinaryDHTValue, now: float) -> float | None:
        """A stored progress record's time, as the poll would take it (None: refused), parsed
        once per content: a full key is scanned at every new owner's store."""
        memo = (subkey, hashlib.blake2b(value, digest_size=16).digest())
        if memo in self._dates:
            self._dates.move_to_end(memo)
            return self._dates[memo]
        try:
            record = DHTProtocol.serializer.loads(RSASignatureValidator._SIGNATURE_RE.sub(b"", value))
            dated: float | None = parse_live_progress(subkey, record, now, PROGRESS_SKEW).time
        except Exception:  # withdrawn (None), unreadable (msgpack's errors share no base), forged
            dated = None
        self._dates[memo] = dated
        if len(self._dates) > 4096:
            self._dates.popitem(last=False)
        return dated

    async def poll_forever(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        try:
            await self._poll_until_cancelled(self._wake)
        finally:  # a reader waiting for a fresh look stops waiting
            self._loop = self._wake = None

    async def _poll_until_cancelled(self, wake: asyncio.Event) -> None:
        while True:
            wake.clear()
            try:
                await self._poll_once()
                self.polls += 1
                if not self.live_peers() and time.monotonic() - self._rejoined_at > REJOIN_EVERY:
                    await self._rejoin()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("polling the DHT failed; retrying")
            spv, versions = self._version_clock.seconds_per_version, self._progress().versions
            pause = poll_pause(self.options.poll_interval, spv, len(versions))
            # or sooner, woken for a fresh read of the offers (asyncio.timeout: 3.11's wait_for
            # may swallow a cancellation that comes as the event is set)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await wake.wait()

    async def _rejoin(self) -> None:
        """Ping the peers this one knew. After a partition both sides have dropped each other
        from their DHT routing tables (every request across it failed), so neither would look
        for the other again; a ping that is answered puts each in the other's table."""
        self._rejoined_at = time.monotonic()
        assert self.dht_node is not None
        pings = []
        for peer in dict.fromkeys([*self._bootstrap_ids, *self._known]):
            with contextlib.suppress(Exception):  # an id that does not parse is not pinged
                pings.append(self.dht_node.protocol.call_ping(PeerID.from_base58(peer), strict=False))
        replies = await asyncio.gather(*pings, return_exceptions=True)
        answered = sum(1 for reply in replies if reply is not None and not isinstance(reply, BaseException))
        if answered:
            logger.info("no live peer: %d of %d known peers answered a ping", answered, len(pings))

    async def _poll_once(self) -> None:
        assert self.dht_node is not None
        run_id = self.options.run_id
        interest = dict(self.interest)
        versions = self._progress().versions
        looked_at = time.monotonic()
        reports = [p.versions for peer, p in self.live.items() if peer != self.peer_id]
        states = states_due(looked_at, self.states_looked_at, self.states_wanted_at, versions, reports)
        keys = [fragment_key(run_id, f) for f in interest] + [progress_key(run_id)]
        keys += [state_key(run_id)] if states else []
        # asks the nodes a record is stored on, not every node of a swarm of up to 20
        beam = search_beam(self.dht_node)
        found = await self.dht_node.get_many(keys, sufficient_expiration_time=float("inf"), beam_size=beam)
        self.stats.dht_lookups += 1
        self.stats.dht_keys_looked_up += len(keys)
        now = get_dht_time()
        if states:
            self.state_candidates = self._parse_states(found.get(state_key(run_id)), now)
            self.states_looked_at = looked_at

        records = self._records(found.get(progress_key(run_id)), "progress", now)
        live = live_progress(records, now, self.options.liveness_ttl)
        live.setdefault(self.peer_id, self._progress())
        self.live = live
        for peer in live.keys() - {self.peer_id}:
            self._known[peer] = None
            self._known.move_to_end(peer)
        while len(self._known) > KNOWN_PEERS:
            self._known.popitem(last=False)

        versions = self._progress().versions  # the trainer may have gone on during the lookup
        reports = [p.versions for peer, p in live.items() if peer != self.peer_id]
        for fragment, numel in interest.items():
            holdings = self._records(found.get(fragment_key(run_id, fragment)), fragment, now)
            if not holdings:
                continue
            own, swarm = own_version(versions, fragment), swarm_version(reports, fragment)
            selection = self._selector.choose(fragment, numel, holdings, own, now, swarm)
            self._reject_all(selection.rejections)
            self.stats.skipped["fan_in"] += selection.fan_in_skipped
            self.stats.skipped["behind"] += selection.behind
            for candidate in selection.candidates:
                self._receiver.enqueue(candidate)
        self._selector.forget(versions, now)
        self._holdings.rotate()
        self._receiver.cancel_stale(versions)
        self._receiver.dispatch()

    # ---------------------------------------------------------------- reading the records

    def _records(self, entry: object, record: int | str, now: float) -> list:
        """The sound records under one key: progress records for ``record`` "progress", else
        holdings (``record`` names the key in the ledger of faulty records, which counts each
        faulty record once)."""

        def faulty(error: FragmentError, owner: bytes, expiration: float) -> None:
            # the owner by digest: an owner key is ~400 bytes, and the ledger holds thousands
            if self.faulty.first_time(
                (record, hashlib.blake2b(owner, digest_size=16).digest(), expiration), now
            ):
                self._reject(error.reason, error.detail, None)

        if record == "progress":
            parse = partial(parse_live_progress, now=now, clock_skew=PROGRESS_SKEW)
            return read_records(entry, self._allowed(parse), faulty)
        return [self.endpoints.check(h) for h in read_records(entry, self._allowed(self._holdings), faulty)]

    def _allowed(self, parse: Callable[[bytes, object], T]) -> Callable[[bytes, object], T]:
        """``parse``, refusing the record of a peer outside ``--allow`` (and, in a holder's
        record, passing over offers of fragments such a peer published)."""
        allowed = self._allow
        if not allowed:
            return parse

        def parse_allowed(owner: bytes, value: object) -> T:
            record = parse(owner, value)
            if record.peer_id not in allowed:
                raise FragmentError("not_allowed", f"{record.peer_id} is not in --allow")
            if isinstance(record, Holdings):
                record = record.copy(update={"offers": [o for o in record.offers if o.publisher in allowed]})
            return record

        return parse_allowed

    def _parse_states(self, entry: object, now: float) -> list[Candidate]:
        selection = self._selector.choose_states(
            self._records(entry, "state", now), self.options.max_state_bytes, now
        )
        self._reject_all(selection.rejections)
        return selection.candidates

    def _reject_all(self, rejections: Sequence[Rejection]) -> None:
        for rejection in rejections:
            self._reject(rejection.reason, rejection.detail, rejection.publisher)
