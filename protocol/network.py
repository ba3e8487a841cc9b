"""The network transport: hivemind's DHT says who holds what; gRPC or libp2p streams move bytes.

``NetworkTransport`` is the facade: it builds the parts, starts and stops them, and answers the
trainer. Publishing (``publishing``) encodes the tensor off the trainer's thread, keeps the bytes
in a bounded local store (``store``) and announces them under the fragment's DHT key, signed.
Everything else runs on an event loop in a background thread (``loop``): polling the DHT and
choosing which offers to fetch (``polling``, ``selection``); fetching them when they may still
count (``receiving``, ``scheduling``), from any holder that announced the same content hash,
checked against the hash in the publisher's own signed record (``fetching``); decoding,
validating, and announcing this peer as one more holder (``receiving``); and serving what it
holds (``serving``). ``receive`` only hands over what that pipeline has already accepted.

Threads, and who owns what:

- the trainer's thread (any caller): ``publish``, ``receive``, ``report_progress``, ``expect``
  and the read-only views. It replaces ``_progress`` and adds to the poller's ``interest``; the
  loop thread reads them (reference swap and a ``dict`` copy, atomic under the GIL).
- the event-loop thread "cgad-net-<end of the peer id>": the DHT node, P2P, the fetcher, the
  server, the selector's ledgers, the poller (``polls``, and ``live``: replaced whole by each
  poll, its own entry set in place when it reports; read by the trainer as a copy) and the
  receiver (the fetch queue and its meters, the fetches in flight). The receiver puts into
  ``_inbox``, which the trainer pops (an ``Inbox``, with its own lock).
- the codec worker thread "cgad-codec" (one torch thread): encoding for ``publish``, with the
  publisher's error-feedback residuals (touched nowhere else), and decoding fetched bytes.
- ``store`` is shared by all three, under its own lock. ``stats`` counters are bumped from the
  loop thread (``published`` from whichever publishes): counts to read, not to synchronise on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, P2PDaemonError
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

from cgad.protocol.auth import AllowedCallers, SwarmAuthorizer, SwarmKey
from cgad.protocol.codec import Codec
from cgad.protocol.config import PATHS, NetworkOptions
from cgad.protocol.dhtbounds import bound_dht
from cgad.protocol.errors import FragmentError
from cgad.protocol.event_thread import EventLoopThread, side_worker
from cgad.protocol.fan_in import fan_in_for, takeable
from cgad.protocol.fetching import MAX_DESCRIPTION, Fetcher
from cgad.protocol.polling import Poller
from cgad.protocol.publishing import Publisher
from cgad.protocol.reachability import (
    FIRST_NODE,
    AnnouncedAddresses,
    DialBackServer,
    Reachability,
    ask_dial_back,
    ask_when_peers,
    relays_in,
    same_port,
    tcp_ports,
)
from cgad.protocol.receiving import Receiver
from cgad.protocol.records import Holdings, Identity, Progress, run_validator, top_credits
from cgad.protocol.scheduling import VersionClock, round_budget
from cgad.protocol.selection import Candidate, OfferSelector
from cgad.protocol.serving import FragmentServer
from cgad.protocol.store import FragmentStore, StoredFragment
from cgad.protocol.text import printable
from cgad.protocol.transport import Fragment, FragmentKey, Inbox, Kind, Transport, TransportStats
from cgad.protocol.wire import ChunkAssembler

__all__ = ["NetworkTransport"]

logger = logging.getLogger(__name__)

FAREWELL_TIMEOUT = 5.0  # seconds a leaving peer spends telling the swarm before it goes anyway
DISCOVERY_POLLS = 1.5  # --codec auto: a delivery's seconds besides its bytes, in poll intervals


class NetworkTransport(Transport):
    """``Transport`` over a hivemind DHT, with bytes over direct gRPC or libp2p streams.

    ``options``: any ``NetworkOptions`` subclass (its ``NetworkOptions`` fields copied once here,
    ``--fan-in auto`` cut to the model: ``fragment_numel``, the fragments to receive and the values
    of each); ``identity`` defaults to the key file ``options.identity`` (made if missing), or a
    fresh key. ``stale_after``: the age (in versions of this peer's fragment) from which a delivery
    no longer counts: such offers are not fetched, fetches in flight are cancelled once they reach
    it (``scheduling``); None: every age counts. ``max_ahead``: how far ahead of this peer's own
    version an offer may claim to be and still be fetched (None: the history horizon). ``kinds``:
    the kinds fetched (None: all). An ``observer`` (a monitor) writes no record: it is no peer."""

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
        kinds: frozenset[str] | None = None,
    ) -> None:
        given = options.model_dump(include=set(NetworkOptions.model_fields))
        given["fan_in"] = fan_in_for(given["fan_in"], sum(fragment_numel.values()))
        self.options = NetworkOptions.model_validate(given)
        self.num_fragments, self.observer, self.fan_in = num_fragments, observer, self.options.fan_in
        if identity is None:
            identity = Identity.load_or_create(self.options.identity) if self.options.identity else Identity()
        self.identity = identity
        self.peer_id = identity.peer_id
        self.stats = TransportStats()
        # --allow and this peer itself (empty: every peer is allowed)
        self._allow = frozenset([*self.options.allow, self.peer_id]) if self.options.allow else frozenset()
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
            kinds=kinds,
        )
        self._version_clock = VersionClock()
        self._inbox = Inbox()
        self._logged_reasons: set[str] = set()
        self._progress = Progress(
            peer_id=self.peer_id,
            versions=[0] * num_fragments,
            inner_step=0,
            tokens_per_second=0.0,
            time=get_dht_time(),
        )
        self._closed = False
        self._dial_back = DialBackServer(self._allow, self.swarm_key)
        self.reachability = Reachability(None, detail="not started")
        self.client_mode = self.options.client_mode

        self._codec_worker = side_worker("cgad-codec")
        self._runner = EventLoopThread(f"cgad-net-{self.peer_id[-6:]}")
        self.loop = self._runner.loop
        self._publisher = Publisher(
            self.options, identity, self.store, self.stats, self._runner, self._codec_worker,
            grpc_contact=self._server.contact, addresses=AnnouncedAddresses(lambda: self.p2p),
            on_own=self._own_stored, on_progress=self._progress_stored, progress=self._progress,
        )  # fmt: skip
        self._receiver = Receiver(
            self.options, stats=self.stats, store=self.store, inbox=self._inbox, fetcher=self._fetcher,
            selector=self._selector, version_clock=self._version_clock, runner=self._runner,
            codec_worker=self._codec_worker, progress=self._own_progress, reject=self._reject,
            announce=self._publisher.announce_soon, stale_after=stale_after,
        )  # fmt: skip
        self._poller = Poller(
            self.options, self.peer_id, interest=dict(fragment_numel), allow=self._allow, stats=self.stats,
            selector=self._selector, receiver=self._receiver, version_clock=self._version_clock,
            progress=self._own_progress, reject=self._reject,
        )  # fmt: skip
        try:
            self._runner.call(self._start(), timeout=self.options.startup_timeout)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- the trainer's side

    @property
    def polls(self) -> int:
        """Looks at the DHT completed: what a caller waits on to see a poll through."""
        return self._poller.polls

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
        fetchers = takeable(len(self.live_peers()), self.options.fan_in)
        latency = DISCOVERY_POLLS * self.options.poll_interval
        rate = self._receiver.downlink_rate
        return round_budget(rate, self._version_clock.seconds_per_version, fetchers, latency)

    @property
    def downlink_rate(self) -> float | None:
        """Bytes per second the downlink carried while fetching (None before it is measured)."""
        return self._receiver.downlink_rate

    @property
    def fetches_waiting(self) -> int:
        return self._receiver.waiting

    def receive(self, index: int, kind: Kind = Kind.DELTA) -> list[Fragment]:
        return self._inbox.pop(index, kind)

    def arrived(self, index: int, base_version: int) -> int:
        """Publishers whose pseudo-gradient of this fragment, of this version or newer, has
        arrived and waits for ``receive``."""
        return self._inbox.publishers(index, base_version)

    def live_peers(self) -> list[str]:
        return self._poller.live_peers()

    def transfers(self) -> dict[FragmentKey, tuple[int, int]]:
        """Fetches in progress: bytes received so far and in all, per fragment key."""
        return {key: (a.received, a.byte_length) for key, a in list(self._fetcher.transfers.items())}

    def swarm_progress(self) -> dict[str, Progress]:
        """The latest progress record of every live peer, this one included."""
        return dict(self._poller.live)

    def report_progress(
        self,
        versions: Sequence[int],
        inner_step: int,
        tokens_per_second: float,
        eval_loss: float | None = None,
        applied_from: Mapping[str, int] | None = None,
    ) -> None:
        """What this peer tells the swarm about itself, and signs about what it applied from
        whom; refreshed in the DHT in the background.

        Args:
            versions: the outer version per fragment; also the horizon old offers are judged by.
            inner_step: inner steps taken so far.
            tokens_per_second: the training throughput over the last round.
            eval_loss: the latest held-out loss (None, or not finite: not reported).
            applied_from: fragments applied per publisher; the record carries the
                ``MAX_CREDITS`` largest (``top_credits``).
        """
        self._progress = Progress(
            peer_id=self.peer_id,
            versions=list(versions),
            inner_step=inner_step,
            tokens_per_second=float(tokens_per_second),
            time=get_dht_time(),
            published=self.stats.published,
            eval_loss=float(eval_loss) if eval_loss is not None and math.isfinite(eval_loss) else None,
            applied_from=top_credits(applied_from or {}),
        )
        self._publisher.progress = self._progress
        self.loop.call_soon_threadsafe(self._version_clock.update, time.monotonic(), list(versions))
        self._runner.submit(self._publisher.store_progress())

    def expect(self, fragment: int, numel: int) -> None:
        """Start receiving a fragment (with this many values) that ``fragment_numel`` did not list."""
        if not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment {fragment} outside 0..{self.num_fragments - 1}")
        self._poller.interest[fragment] = numel

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
        """What this peer tells a peer that asks who it is (``describe``): its swarm, as JSON."""
        if len(swarm_json) > MAX_DESCRIPTION:
            raise ValueError(f"a description of {len(swarm_json)} characters; at most {MAX_DESCRIPTION}")
        self._server.description = swarm_json

    def describe(self, peer_id: str) -> tuple[str, str]:
        """The run id and swarm identity (JSON) a peer states; ``FragmentError`` when it does not
        answer. Blocks the caller: for a joining node, before it waits for anything else."""
        return self._runner.call(self._fetcher.describe(peer_id), self.options.connect_timeout * 5 + 10)

    def publish_state(self, data: bytes, versions: Sequence[int]) -> None:
        """Offer a snapshot of this peer's outer state (packed by the caller) to peers that join
        or fall behind, in place of the previous one; its record says the oldest of ``versions``
        (the rest is in the bytes, checked by whoever adopts them)."""
        self._publisher.publish_state(data, versions)

    def state_offers(self, fresh: float = 0.0) -> list[Candidate]:
        """Other peers' snapshots on offer, newest first (``Poller.state_offers``: ``fresh``)."""
        return self._poller.state_offers(fresh)

    def fetch_state(self, candidate: Candidate, timeout: float) -> bytearray:
        """A snapshot's bytes, verified against its publisher's record; blocks the caller.
        ``FragmentError("unavailable")`` says what failed and how far it got."""
        return self._runner.call(self._receiver.fetch_state(candidate, timeout), timeout + 30)

    def reserve_state(self, candidate: Candidate, data: bytes | bytearray) -> None:
        """Serve a snapshot fetched from others onward (the next joiner finds one more holder)."""
        self._publisher.reserve_state(candidate, data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._receiver.closed = True
        self._codec_worker.shutdown(wait=True)  # publishes already handed over still go out
        if self._runner.running:
            with contextlib.suppress(Exception):
                self._runner.call(self._stop(), timeout=30)
        self._runner.stop(timeout=30)

    def _reject(self, reason: str, detail: str, publisher: str | None = None) -> None:
        if publisher is not None:  # one to blame: its signed offer, or the bytes it vouched for
            self.stats.rejected_by_peer[publisher] += 1
        self.stats.rejected[reason] += 1
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.warning("rejected (%s): %s; more are only counted", reason, printable(detail, 500))

    # ---------------------------------------------------------------- start and stop (on the loop)

    async def _start(self) -> None:
        options = self.options
        listen = options.host_maddrs
        with self.identity.key_file(options.identity) as identity_path:
            if options.client_mode:
                self.reachability = Reachability(False, detail="--client-mode")
            elif self.observer:
                self.reachability = Reachability(None, detail="an observer: not checked")
            elif not options.peers:  # the swarm's first node: the one others dial first
                self.reachability = Reachability(None, detail=FIRST_NODE)  # asks its first peers
            else:  # started as reachable, and again in the mode it found where it is not
                self.p2p = await self._create_p2p(identity_path, True, listen)
                await self._dial_back.start(self.p2p)
                ports = tcp_ports([str(a) for a in await self.p2p.get_visible_maddrs()])
                self.reachability = await ask_dial_back(self.p2p, options.peers, ports, self.swarm_key)
                if self.reachability.public is not True:
                    await self.p2p.shutdown()
                    self.p2p = None
                    # on the port it had: peers that met the first daemon keep its address
                    listen = same_port(options.host_maddrs, ports)
            if self.p2p is None:
                self.p2p = await self._create_p2p(identity_path, self.reachability.public, listen)
                await self._dial_back.start(self.p2p)
        self.client_mode = self.reachability.public is False
        # nobody can dial it (unless told where it is forwarded): else each fetch waits out a dial
        self._server.announces_grpc = not self.client_mode or options.grpc_announce_host is not None
        logger.info("%s", self.reachability.line([]))
        if self.p2p.peer_id.to_base58() != self.peer_id:
            raise RuntimeError("libp2p identity and signing key disagree")
        self._fetcher.p2p = self.p2p
        validator = run_validator(options.run_id, self.num_fragments, self.identity)
        try:
            self.dht_node = await DHTNode.create(
                p2p=self.p2p,
                initial_peers=options.peers or None,
                record_validator=validator,
                client_mode=self.client_mode,
                authorizer=SwarmAuthorizer(self.swarm_key) if self.swarm_key else None,
            )
        except RuntimeError as error:  # hivemind's "none of the initial_peers responded"
            has = "its swarm key" if self.swarm_key else "no --swarm-key"
            raise ConnectionError(
                f"no peer at --peers answered ({error}); is the address right, and if"
                f" the swarm is private, is this node's key its key? (it has {has})"
            ) from None
        # what one key may hold and one reply may carry: at once, before any await lets a store in
        bound_dht(self.dht_node.protocol, self.stats.dht_served, self._poller.evictable)
        await self._reregister_dht_handlers(self.dht_node.protocol)
        await self._server.start(self.p2p)
        self._poller.dht_node = self.dht_node
        self._runner.spawn(self._poller.poll_forever())
        self._publisher.dht_node = self.dht_node
        if not self.observer:
            self._runner.spawn(self._publisher.refresh_forever(self.num_fragments))
        if self.reachability.detail == FIRST_NODE:
            self._runner.spawn(self._learn_reach())

    async def _learn_reach(self) -> None:
        self.reachability = await ask_when_peers(self.p2p, self.live_peers, self.swarm_key)
        logger.info("%s", self.reachability.line([]))

    async def _create_p2p(self, identity_path: str | None, public: bool | None, listen: list[str]) -> P2P:
        """The libp2p daemon, in the mode reachability chose: ``public`` False (behind NAT) dials
        out only, a DHT client, asking its bootstrap peers to relay for it; True serves as a DHT
        server and a relay (libp2p's relay service runs only where reachability is public); None:
        libp2p's own guess. ``ConnectionError``, in plain words, when no bootstrap peer answers."""
        options = self.options
        if public is None and not options.peers:
            public = True  # a swarm's first node is the one every other dials
        try:
            return await P2P.create(
                initial_peers=options.peers or None,
                host_maddrs=listen,
                announce_maddrs=options.announce_maddrs or None,
                identity_path=identity_path,
                check_if_identity_free=False,
                use_relay=options.use_relay,
                use_auto_relay=options.use_relay and public is False,
                trusted_relays=(options.peers or None) if public is False else None,
                force_reachability={True: "public", False: "private"}.get(public),
                dht_mode="client" if public is False else "server",
                startup_timeout=options.startup_timeout,
            )
        except P2PDaemonError as error:
            if "bootstrap" not in str(error):
                raise
            raise ConnectionError(
                f"could not connect to any peer at --peers ({', '.join(options.peers)}): is the address"
                " right, is that node up, and can this machine reach it?"
            ) from None

    def reach(self) -> dict:
        """How others reach this node (the dial-back result at start, and the relays its current
        multiaddrs go through: ``Reachability.as_dict``), and how its peers' fragments reached it:
        ``paths_by_peer``, per publisher, deliveries "direct" (the publisher was the only holder)
        and "re-served" (peers that held its bytes were tried first)."""
        relays: list[str] = []
        with contextlib.suppress(Exception):  # closing, or p2pd busy: no relays to name now
            current = self._runner.call(self.p2p.get_visible_maddrs(latest=True), timeout=5)
            relays = relays_in([str(a) for a in current])
        paths: dict[str, dict[str, int]] = {}
        for (publisher, path), count in list(self._receiver.paths.items()):
            paths.setdefault(publisher, {})[path] = count
        return {**self.reachability.as_dict(relays), "paths_by_peer": paths}

    async def _reregister_dht_handlers(self, protocol: DHTProtocol) -> None:
        """Re-register the DHT's handlers: hivemind's wrapper took each method when the node
        started, before ``bound_dht`` budgeted ``rpc_find``; and behind ``--allow``: hivemind's
        authorizer hook sees a request but not its sender, so the check wraps the handlers, which
        get the caller's libp2p-authenticated peer id: the same check the fragment server makes."""
        if protocol.client_mode:
            return  # a DHT client answers no RPC: nothing is registered
        await protocol.remove_p2p_handlers(self.p2p)
        servicer = AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer)
        if self._allow:
            servicer = AllowedCallers(servicer, self._server.caller_allowed)
        await protocol.add_p2p_handlers(self.p2p, servicer)

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

    # ---------------------------------------------------------------- the parts' callbacks (on the loop)

    def _own_stored(self, entry: StoredFragment) -> None:
        header = entry.header  # this peer's own content is never fetched back from a peer
        self._selector.mark_attempted(header.content_hash, header.fragment, header.base_version)

    def _progress_stored(self, progress: Progress) -> None:
        self._poller.live[self.peer_id] = progress

    def _own_progress(self) -> Progress:
        """This peer's latest report, for the poller and the receiver to judge offers by (the
        trainer's thread replaces it whole, so each reading is one whole report)."""
        return self._progress
