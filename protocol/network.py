"""The network transport: hivemind's DHT says who holds what; gRPC or libp2p streams move bytes.

Publishing (``publishing``) encodes the tensor off the trainer's thread, keeps the bytes in a
bounded local store (``store``) and announces them under the fragment's DHT key, signed.
Everything else runs on an event loop in a background thread (``loop``): polling the DHT,
choosing which offers to fetch (``selection``) and when (``scheduling``), pulling the bytes from
any holder that announced the same content hash and checking them against the hash in the
publisher's own signed record (``fetching``), decoding, validating, and announcing this peer as
one more holder; and serving what it holds (``serving``). ``receive`` only hands over what that
pipeline has already accepted.

Threads, and who owns what:

- the trainer's thread (any caller): ``publish``, ``receive``, ``report_progress``, ``expect``
  and the read-only views. It replaces ``_progress`` and adds to ``_interest``; the loop thread
  reads them (reference swap and a ``dict`` copy, atomic under the GIL).
- the event-loop thread "cgad-net-<end of the peer id>": the DHT node, P2P, the fetcher, the
  server, the selector's ledgers, the fetch queue and its meters, ``_in_flight``, ``polls`` and
  ``_live`` (replaced whole by each poll, its own entry set in place when it reports; read by the
  trainer as a copy). It puts into ``_inbox``, which
  the trainer pops (an ``Inbox``, with its own lock).
- the codec worker thread "cgad-codec" (one torch thread): encoding for ``publish``, with the
  publisher's error-feedback residuals (touched nowhere else), and decoding fetched bytes.
- ``store`` is shared by all three and guarded by its own lock. ``stats`` counters are bumped from
  the loop thread, and ``published`` from whichever thread publishes; they are counts to read,
  not to synchronise on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import torch
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

from cgad.protocol.auth import AllowedCallers, SwarmAuthorizer, SwarmKey
from cgad.protocol.codec import Codec, kept_in
from cgad.protocol.config import PATHS, NetworkOptions
from cgad.protocol.errors import FragmentError
from cgad.protocol.fetching import MAX_DESCRIPTION, Fetcher, decode_and_check
from cgad.protocol.loop import EventLoopThread
from cgad.protocol.publishing import Publisher
from cgad.protocol.records import (
    Holdings,
    Identity,
    ParseCache,
    Progress,
    fragment_key,
    parse_holdings,
    parse_live_progress,
    progress_key,
    read_records,
    run_validator,
    state_key,
)
from cgad.protocol.scheduling import FetchQueue, LinkMeter, VersionClock, poll_pause, round_budget
from cgad.protocol.selection import Candidate, OfferSelector, Rejection, own_version, swarm_version
from cgad.protocol.serving import FragmentServer
from cgad.protocol.store import FragmentStore, StoredFragment, fragment_header
from cgad.protocol.transport import Fragment, FragmentKey, Inbox, Kind, Transport, TransportStats
from cgad.protocol.wire import ChunkAssembler

__all__ = ["NetworkTransport"]

logger = logging.getLogger(__name__)
T = TypeVar("T", Holdings, Progress)


def _peer_ids(maddrs: Sequence[str]) -> list[str]:
    """The peer ids in bootstrap multiaddrs (``/p2p/<id>``; those without one are skipped)."""
    return [m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m]


STATE_PASSES = 5  # a snapshot's holders are tried this many times over (busy ones free up)
# seconds a progress record's time may run ahead of ours (DHT time is each peer's own); private
# swarms' tickets have their own allowance (auth.CLOCK_SKEW)
PROGRESS_SKEW = 60.0
FAREWELL_TIMEOUT = 5.0  # seconds a leaving peer spends telling the swarm before it goes anyway
REJOIN_EVERY = 10.0  # seconds between pings of the peers it knew, while a peer sees none live
KNOWN_PEERS = 64  # the most recently seen peers it remembers for that (records are cheap to forge)
DISCOVERY_POLLS = 1.5  # --codec auto: a delivery's seconds besides its bytes, in poll intervals


class NetworkTransport(Transport):
    """``Transport`` over a hivemind DHT, with bytes over direct gRPC or libp2p streams.

    ``options`` may be any ``NetworkOptions`` subclass (a node's whole configuration): only its
    ``NetworkOptions`` fields are read, copied once here. ``fragment_numel`` names the fragments
    to receive, with the number of values each must have; ``identity`` defaults to the key file
    ``options.identity`` (created if missing), or a fresh key. ``stale_after`` is the age (in
    versions of this peer's own fragment) from which a delivery no longer counts in the outer
    step: such offers are not fetched, and fetches in flight are cancelled once they reach it
    (``scheduling``); None when every age counts. ``max_ahead`` is how many versions ahead of
    this peer's own an offer may claim to be and still be fetched (the outer step's cutoff);
    None: the history horizon. An ``observer`` (a swarm monitor) reads the records and writes
    none: it never appears as a peer."""

    def __init__(
        self,
        options: NetworkOptions,
        *,
        num_fragments: int,
        fragment_numel: Mapping[int, int],
        identity: Identity | None = None,
        stale_after: int | None = None,
        max_ahead: int | None = None,
        observer: bool = False,
    ) -> None:
        fields = set(NetworkOptions.model_fields)
        self.options = NetworkOptions.model_validate(options.model_dump(include=fields))
        self.num_fragments = num_fragments
        self.observer = observer
        if identity is None:
            identity = Identity.load_or_create(self.options.identity) if self.options.identity else Identity()
        self.identity = identity
        self.peer_id = identity.peer_id
        self.stats = TransportStats()
        # --allow and this peer itself (empty: every peer is allowed)
        self._allow = frozenset([*self.options.allow, self.peer_id]) if self.options.allow else frozenset()
        self.polls = 0  # looks at the DHT completed: what a caller waits on to see a poll through
        self.store = FragmentStore(self.options.keep_versions, self.options.keep_reserved)
        self.dht_node: DHTNode | None = None
        self.p2p: P2P | None = None
        self.swarm_key = SwarmKey.load(self.options.swarm_key) if self.options.swarm_key else None
        self._fetcher = Fetcher(self.options, self.stats, self._reject, self.swarm_key)
        self._server = FragmentServer(self.options, self.store, self.stats, self.peer_id, self.swarm_key)
        self._selector = OfferSelector(
            self.options.run_id,
            self.peer_id,
            fan_in=self.options.fan_in,
            history_versions=self.options.history_versions,
            record_ttl=self.options.record_ttl,
            max_ahead=max_ahead,
        )
        self._queue = FetchQueue(stale_after)
        self._downlink = LinkMeter()
        self._version_clock = VersionClock()
        self._in_flight: dict[FragmentKey, tuple[asyncio.Task, Candidate]] = {}
        self._metered = (0, False)  # bytes fetched and whether a fetch ran, at the last reading
        self._interest = dict(fragment_numel)
        self._state_candidates: list[Candidate] = []  # replaced whole by each poll
        self._inbox = Inbox()
        self._logged_reasons: set[str] = set()
        self._holdings = ParseCache(parse_holdings)  # holders' records, parsed once while they stand
        self._live: dict[str, Progress] = {}
        # whom to ping when no peer is left: --peers always, and the peers last seen live (newest
        # last; bounded, as identities are free to make)
        self._bootstrap_ids = _peer_ids(self.options.peers)
        self._known: OrderedDict[str, None] = OrderedDict()
        self._rejoined_at = 0.0
        self._progress = Progress(
            peer_id=self.peer_id,
            versions=[0] * num_fragments,
            inner_step=0,
            tokens_per_second=0.0,
            time=get_dht_time(),
        )
        self._closed = False
        self._fetching_state = False  # set on the loop while a snapshot downloads

        # Codec work runs here, one torch thread: the kernels are memory-bound, and a second
        # OpenMP team beside the trainer's makes both spin on a busy machine (3x slower measured).
        self._codec_worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cgad-codec", initializer=torch.set_num_threads, initargs=(1,)
        )
        self._runner = EventLoopThread(f"cgad-net-{self.peer_id[-6:]}")
        self.loop = self._runner.loop
        self._publisher = Publisher(
            self.options, identity, self.store, self.stats, self._runner, self._codec_worker,
            grpc_contact=self._server.contact, on_own=self._own_stored,
            on_progress=self._progress_stored, progress=self._progress,
        )  # fmt: skip
        try:
            self._runner.call(self._start(), timeout=self.options.startup_timeout)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- the trainer's side

    @property
    def grpc_endpoint(self) -> str | None:
        """``host:port`` of this peer's direct gRPC path; None when it serves over libp2p only."""
        return self._server.grpc_endpoint

    @property
    def bytes_by_path(self) -> Counter[str]:
        """Bytes fetched over each path ("grpc", "libp2p")."""
        return self._fetcher.bytes_by_path

    def publish(self, fragment: Fragment, codec: Codec | str | None = None) -> None:
        """Snapshot the tensor and return: encoding, hashing and announcing happen on the
        transport's threads. Raises ``FragmentError("non_finite")`` at once for NaN or Inf."""
        self._publisher.publish(fragment, codec)

    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        """Offer bytes that are already encoded (by ``publish``, or the outer loop)."""
        self._publisher.publish_encoded(key, data, codec=codec, numel=numel, tokens=tokens)

    def round_budget(self) -> float | None:
        """From the downlink's measured rate, the seconds per round less the time a delivery takes
        to be seen (``DISCOVERY_POLLS`` poll intervals: a peer sees a new offer up to one interval
        after its announcement, itself a DHT store), and the peers that fetch each fragment (live
        ones, at most ``fan_in``). The uplink is not measured: the downlink stands in for the link
        (symmetric on the testbed; an asymmetric volunteer's uplink is overrated)."""
        fetchers = min(len(self.live_peers()), self.options.fan_in)
        latency = DISCOVERY_POLLS * self.options.poll_interval
        return round_budget(self._downlink.rate, self._version_clock.seconds_per_version, fetchers, latency)

    def receive(self, index: int, kind: Kind = Kind.DELTA) -> list[Fragment]:
        return self._inbox.pop(index, kind)

    def arrived(self, index: int, base_version: int) -> int:
        """Publishers whose pseudo-gradient of this fragment, of this version or newer, has
        arrived and waits for ``receive``."""
        return self._inbox.publishers(index, base_version)

    def live_peers(self) -> list[str]:
        now = get_dht_time()
        return sorted(
            peer
            for peer, progress in self._live.items()
            if peer != self.peer_id and progress.time + self.options.liveness_ttl > now
        )

    def transfers(self) -> dict[FragmentKey, tuple[int, int]]:
        """Fetches in progress: bytes received so far and in all, per fragment key."""
        return {key: (a.received, a.byte_length) for key, a in list(self._fetcher.transfers.items())}

    def swarm_progress(self) -> dict[str, Progress]:
        """The latest progress record of every live peer, this one included."""
        return dict(self._live)

    def report_progress(self, versions: Sequence[int], inner_step: int, tokens_per_second: float) -> None:
        """What this peer tells the swarm about itself; refreshed in the DHT in the background.
        ``versions`` (one per fragment) is also the horizon that old offers are judged by."""
        self._progress = Progress(
            peer_id=self.peer_id,
            versions=list(versions),
            inner_step=inner_step,
            tokens_per_second=float(tokens_per_second),
            time=get_dht_time(),
            published=self.stats.published,
        )
        self._publisher.progress = self._progress
        self.loop.call_soon_threadsafe(self._version_clock.update, time.monotonic(), list(versions))
        self._runner.submit(self._publisher.store_progress())

    def expect(self, fragment: int, numel: int) -> None:
        """Start receiving a fragment (with this many values) that ``fragment_numel`` did not list."""
        if not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment {fragment} outside 0..{self.num_fragments - 1}")
        self._interest[fragment] = numel

    def maddrs(self) -> list[str]:
        """Multiaddrs other peers can bootstrap from."""
        assert self.p2p is not None
        return [str(addr) for addr in self._runner.call(self.p2p.get_visible_maddrs(), timeout=10)]

    def download(
        self, holder: Holdings, digest: bytes, byte_length: int, path: str, timeout: float = 600.0
    ) -> bytearray:
        """Pull the bytes with this content hash from one holder over one path, verified against
        the hash; blocks the caller (for tools, benchmarks, and a joining peer's state). Raises
        ``FragmentError("unavailable")`` when the holder does not deliver verified bytes."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}")
        assembler = ChunkAssembler(digest, byte_length)
        try:
            data = self._runner.call(self._fetcher.fetch_from(holder, assembler, paths=(path,)), timeout)
        except FragmentError as error:  # not_held, or bad_hash: what it sent is not these bytes
            said = "does not keep it" if error.reason == "not_held" else f"sent other bytes ({error.detail})"
            raise FragmentError("unavailable", f"{holder.peer_id} {said}") from error
        if data is None:
            raise FragmentError("unavailable", f"{holder.peer_id} did not deliver over {path}")
        return data

    def describe_as(self, swarm_json: str) -> None:
        """What this peer tells a peer that asks who it is (``describe``): its node's identity
        of the swarm, as JSON."""
        if len(swarm_json) > MAX_DESCRIPTION:
            raise ValueError(f"a description of {len(swarm_json)} characters; at most {MAX_DESCRIPTION}")
        self._server.description = swarm_json

    def describe(self, peer_id: str) -> tuple[str, str]:
        """The run id and swarm identity (JSON) a peer states; ``FragmentError`` when it does not
        answer. Blocks the caller: for a joining node, before it waits for anything else."""
        return self._runner.call(self._fetcher.describe(peer_id), self.options.connect_timeout * 5 + 10)

    def forget_feedback(self) -> None:
        self._publisher.forget_feedback()

    def publish_state(self, data: bytes, versions: Sequence[int]) -> None:
        """Offer a snapshot of this peer's outer state (packed by the caller) to peers that join
        or fall behind, in place of the previous one; its record says the oldest of ``versions``
        (the rest is in the bytes, checked by whoever adopts them)."""
        self._publisher.publish_state(data, versions)

    def state_offers(self) -> list[Candidate]:
        """Other peers' snapshots seen at the last look at the DHT, newest first."""
        return list(self._state_candidates)

    def fetch_state(self, candidate: Candidate, timeout: float) -> bytearray:
        """A snapshot's bytes, verified against its publisher's record; blocks the caller.
        ``FragmentError("unavailable")`` says what failed and how far it got."""
        return self._runner.call(self._fetch_state(candidate, timeout), timeout + 30)

    async def _fetch_state(self, candidate: Candidate, timeout: float) -> bytearray:
        # The state is what this peer needs before anything else: no fragment fetch shares the
        # downlink with it (a 1 Mbit joiner's download ran at a quarter of its link beside them),
        # and those under way stop; fragments fetched now would be of versions it is leaving.
        self._meter()  # what came before; the download's bytes count as busy time on the link
        self._metered = (self._metered[0], True)
        self._fetching_state = True
        for task, _ in list(self._in_flight.values()):
            task.cancel()
            self.stats.skipped["for_state"] += 1
        try:
            return await self._fetcher.fetch(candidate, timeout, STATE_PASSES)
        finally:
            self._fetching_state = False
            self._dispatch()

    def reserve_state(self, candidate: Candidate, data: bytes | bytearray) -> None:
        """Serve a snapshot fetched from others onward (the next joiner finds one more holder)."""
        self._publisher.reserve_state(candidate, data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._codec_worker.shutdown(wait=True)  # publishes already handed over still go out
        if self._runner.running:
            with contextlib.suppress(Exception):
                self._runner.call(self._stop(), timeout=30)
        self._runner.stop(timeout=30)

    def _reject_all(self, rejections: Sequence[Rejection]) -> None:
        for rejection in rejections:
            self._reject(rejection.reason, rejection.detail, rejection.publisher)

    def _reject(self, reason: str, detail: str, publisher: str | None = None) -> None:
        if publisher is not None:  # one to blame: its signed offer, or the bytes it vouched for
            self.stats.rejected_by_peer[publisher] += 1
        self.stats.rejected[reason] += 1
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.warning("rejected (%s): %s; more of these are only counted", reason, detail)

    # ---------------------------------------------------------------- start and stop (on the loop)

    async def _start(self) -> None:
        options = self.options
        with self.identity.key_file(options.identity) as identity_path:
            self.p2p = await P2P.create(
                initial_peers=options.peers or None,
                host_maddrs=options.host_maddrs,
                announce_maddrs=options.announce_maddrs or None,
                identity_path=identity_path,
                check_if_identity_free=False,
                use_relay=options.use_relay,
                use_auto_relay=options.client_mode,
                dht_mode="client" if options.client_mode else "server",
            )
        if self.p2p.peer_id.to_base58() != self.peer_id:
            raise RuntimeError("libp2p identity and signing key disagree")
        self._fetcher.p2p = self.p2p
        validator = run_validator(options.run_id, self.num_fragments, self.identity)
        try:
            self.dht_node = await DHTNode.create(
                p2p=self.p2p,
                initial_peers=options.peers or None,
                record_validator=validator,
                client_mode=options.client_mode,
                authorizer=SwarmAuthorizer(self.swarm_key) if self.swarm_key else None,
            )
        except RuntimeError as error:  # hivemind's "none of the initial_peers responded"
            has = "its swarm key" if self.swarm_key else "no --swarm-key"
            raise ConnectionError(
                f"no peer at --peers answered ({error}); is the address right, and if"
                f" the swarm is private, is this node's key its key? (it has {has})"
            ) from None
        if self._allow:
            await self._answer_only_allowed(self.dht_node.protocol)
        await self._server.start(self.p2p)
        self._runner.spawn(self._poll_forever())
        self._publisher.dht_node = self.dht_node
        if not self.observer:
            self._runner.spawn(self._publisher.refresh_forever(self.num_fragments))

    async def _answer_only_allowed(self, protocol: DHTProtocol) -> None:
        """Re-register the DHT's handlers behind ``--allow``: hivemind's authorizer hook sees a
        request but not its sender, so the check wraps the handlers, which get the caller's
        libp2p-authenticated peer id: the same check the fragment server makes."""
        await protocol.remove_p2p_handlers(self.p2p)
        servicer = AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer)
        await protocol.add_p2p_handlers(self.p2p, AllowedCallers(servicer, self._server.caller_allowed))

    async def _stop(self) -> None:
        await self._runner.cancel_tasks()
        with contextlib.suppress(Exception):  # peers stop waiting for this one now, not in a TTL
            await asyncio.wait_for(self._publisher.store_farewell(), FAREWELL_TIMEOUT)
        await self._server.stop()
        await self._fetcher.close()
        if self.dht_node is not None:
            await self.dht_node.shutdown()
        if self.p2p is not None:
            await self.p2p.shutdown()
        # hivemind leaves helper tasks behind; end them here rather than at loop.close()
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    # ---------------------------------------------------------------- finding, fetching, accepting

    def _own_stored(self, entry: StoredFragment) -> None:
        header = entry.header  # this peer's own content is never fetched back from a peer
        self._selector.mark_attempted(header.content_hash, header.fragment, header.base_version)

    def _progress_stored(self, progress: Progress) -> None:
        self._live[self.peer_id] = progress

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._poll_once()
                self.polls += 1
                if not self.live_peers() and time.monotonic() - self._rejoined_at > REJOIN_EVERY:
                    await self._rejoin()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("polling the DHT failed; retrying")
            versions = self._progress.versions
            await asyncio.sleep(
                poll_pause(self.options.poll_interval, self._version_clock.seconds_per_version, len(versions))
            )

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
        interest = dict(self._interest)
        keys = [fragment_key(run_id, f) for f in interest] + [progress_key(run_id), state_key(run_id)]
        found = await self.dht_node.get_many(keys, sufficient_expiration_time=float("inf"))
        now = get_dht_time()
        self._state_candidates = self._parse_states(found.get(state_key(run_id)), now)

        live = {p.peer_id: p for p in self._records(found.get(progress_key(run_id)), "progress", now)}
        live.setdefault(self.peer_id, self._progress)
        self._live = live
        for peer in live.keys() - {self.peer_id}:
            self._known[peer] = None
            self._known.move_to_end(peer)
        while len(self._known) > KNOWN_PEERS:
            self._known.popitem(last=False)

        versions = self._progress.versions
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
                if self._queue.push(candidate) is not None:
                    self.stats.skipped["queue_full"] += 1
        self._selector.forget(versions, now)
        self._holdings.rotate()
        for task, candidate in list(self._in_flight.values()):
            if self._queue.is_stale(candidate, versions):  # it could no longer count when it lands
                task.cancel()
                self.stats.skipped["stale_in_flight"] += 1
        self._dispatch()

    def _meter(self) -> None:
        """Feed the downlink meter what arrived since its last reading."""
        fetched, was_busy = self._metered
        self._downlink.update(time.monotonic(), self._fetcher.bytes_in - fetched, was_busy)
        self._metered = (self._fetcher.bytes_in, bool(self._in_flight))

    def _dispatch(self) -> None:
        """Start queued fetches, youngest first, while fewer than ``max_fetches`` run (none while
        a state download runs)."""
        if self._closed or self._fetching_state:
            return
        self._meter()
        versions = self._progress.versions
        while len(self._in_flight) < self.options.max_fetches:
            ahead = sum(total - received for received, total in self.transfers().values())
            candidate, passed = self._queue.pop(
                versions,
                link_rate=self._downlink.rate,
                seconds_per_version=self._version_clock.seconds_per_version,
                bytes_ahead=ahead,
            )
            for item in passed:
                self.stats.skipped[item.reason] += 1
            if candidate is None:
                break
            task = self._runner.spawn(self._fetch(candidate))
            self._in_flight[candidate.key] = (task, candidate)
            self._metered = (self._metered[0], True)

    @property
    def downlink_rate(self) -> float | None:
        """Bytes per second the downlink carried while fetching (None before it is measured)."""
        return self._downlink.rate

    @property
    def fetches_waiting(self) -> int:
        return len(self._queue)

    def _records(self, entry: object, record: int | str, now: float) -> list:
        """The sound records under one key: progress records for ``record`` "progress", else
        holdings (``record`` names the key in the ledger of faulty records, which counts each
        faulty record once)."""

        def faulty(error: FragmentError, owner: bytes, expiration: float) -> None:
            if self._selector.judge((record, owner, expiration), now):
                self._reject(error.reason, error.detail)

        if record == "progress":
            parse = partial(parse_live_progress, now=now, clock_skew=PROGRESS_SKEW)
            return read_records(entry, self._allowed(parse), faulty)
        return read_records(entry, self._allowed(self._holdings), faulty)

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

    async def _fetch(self, candidate: Candidate) -> None:
        try:
            data = await self._fetcher.fetch(candidate)
        except FragmentError as error:
            # bytes that never came are no proof against the publisher (a slow link, a holder
            # that left, a crowd of false holders): only what it vouched for and was refused is
            blame = None if error.reason == "unavailable" else candidate.key.publisher
            self._reject(error.reason, f"from {candidate.key.publisher}: {error.detail}", blame)
            return
        finally:
            self._in_flight.pop(candidate.key, None)
            self._dispatch()
        await self._accept(candidate, data)

    async def _accept(self, candidate: Candidate, data: bytearray) -> None:
        """Decode and validate off the loop; deliver; offer the bytes onward."""
        key, offer = candidate.key, candidate.offer
        try:
            decoding = self.loop.run_in_executor(
                self._codec_worker, decode_and_check, data, offer.numel, self.options.max_norm
            )
        except RuntimeError:  # closing: the codec worker takes no more work
            return
        try:
            tensor = await decoding
        except FragmentError as error:
            self._reject(error.reason, f"{key} from {key.publisher}: {error.detail}", key.publisher)
            return
        if not self._selector.deliver(key, offer.content_hash):  # a second announcement raced this
            if key.kind is Kind.DELTA:
                self._reject("replay", f"{key} delivered already")
            return
        kept = kept_in(data) if offer.codec == Codec.SPARSE else None
        self._inbox.put(Fragment(key=key, tensor=tensor, tokens=offer.tokens, kept=kept))
        self.stats.received += 1
        self.stats.bytes_received += len(data)
        self.store.put(StoredFragment(fragment_header(key, offer), data, offer, own=False))
        self._publisher.announce_soon(key.fragment)
