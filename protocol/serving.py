"""Serving what this peer holds, by content hash: fragments, and state snapshots for joiners.

The same call on both paths: a gRPC server on ``NetworkOptions.grpc_listen`` (unless that is
none, behind NAT) and a libp2p protobuf handler. Each stream is a header, then the bytes from the
requested offset in ``CHUNK_BYTES`` chunks, all streams together paced to ``upload_limit`` bytes
per second (a volunteer's uplink is usually the scarcest thing it lends). gRPC gets the messages
pre-serialized (``serialized_response_stream``), libp2p as messages.

A state snapshot goes first: while one streams out, each fragment stream holds its next chunk
until no snapshot streams, or for ``FRAGMENT_HOLD`` seconds (below the fetcher's silence
timeout, so the fetch survives), so a joiner gets the uplink instead of a share of it (a fragment
that waits only arrives a little older). At most ``MAX_STATE_STREAMS`` snapshots stream
at once, at most ``MAX_STATE_STREAMS_PER_ASKER`` to one asker (its libp2p peer id, or its
address on gRPC); a further asker is refused and tries another holder, and the askers refused
are served in turn before any other (``SnapshotTurns``). A snapshot stream must
keep up an average rate that rises with its age: ``MIN_STATE_SERVE_RATE`` at the end of the grace
period, then in proportion to the time it has held its slot, so that no reader, however steady,
keeps a slot for ever (a reader at 8.7 kB/s held both slots against an 8 kB/s floor for good).

Threads: a ``FragmentServer`` runs on the transport's event-loop thread ("cgad-net-*"), as do all
its handlers; ``stats.bytes_sent`` is counted there. The store it serves from has its own lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator

import grpc
from hivemind.p2p import P2P, P2PContext

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.auth import DESCRIBE_PURPOSE, FETCH_PURPOSE, NonceLedger, SwarmKey
from cgad.protocol.config import NetworkOptions
from cgad.protocol.framing import add_capped_stream_handler
from cgad.protocol.store import FragmentStore
from cgad.protocol.tls import ServerCertificate
from cgad.protocol.transport import TransportStats
from cgad.protocol.wire import (
    CHUNK_BYTES,
    LIBP2P_DESCRIBE,
    LIBP2P_FETCH,
    NOT_HELD,
    SERVICE,
    response_stream,
    serialized_response_stream,
)

__all__ = ["FragmentServer"]

logger = logging.getLogger(__name__)

Outgoing = AsyncIterator[pb.FetchResponse | bytes]
MAX_STATE_STREAMS = 2
# A snapshot stream holds one of the few slots and holds fragment streams back: one read slower
# than this on average, after the grace period, is ended (the asker resumes elsewhere or later).
# Honest joiners got 69 kB/s each through a shared 2 Mbit uplink; under --upload-limit the floor
# is at most the limit's share of a full set of snapshot streams and a fragment stream.
MIN_STATE_SERVE_RATE = 8_000.0
STATE_SERVE_GRACE = 30.0  # seconds; the floor at time t past it is MIN_STATE_SERVE_RATE * t / grace
MAX_STATE_STREAMS_PER_ASKER = 1  # a joiner downloads from several holders, one range from each
# Snapshot slots go round: while an asker turned away in the last WAITING_SECONDS waits, a free
# slot goes to the one that has waited longest (two identities that reopened their streams the
# moment they closed kept joiners out, 150 refusals of 150). A refused joiner asks the same holder
# again after ``fetching.RETRY_SECONDS``, well within the wait.
WAITING_SECONDS = 5.0
MAX_REMEMBERED_ASKERS = 1024
MAX_GRPC_STREAMS = 64  # gRPC refuses further calls at once (RESOURCE_EXHAUSTED): they try elsewhere
FRAGMENT_HOLD = 5.0  # seconds a fragment chunk waits at most while a snapshot streams
# a FetchRequest is a hash, two ints and a ticket (~130 bytes): a larger frame is never read
MAX_FETCH_REQUEST_BYTES = 1024
NOT_ALLOWED = "not allowed: this peer trains only with the peers it lists"


def _not_a_hang_up(record: logging.LogRecord) -> bool:
    """gRPC logs a traceback (``ExecuteBatchError``) when it cannot write to a stream whose client
    has gone; fetchers cancel streams all the time (a fragment too old, a state download that
    replaces fragment fetches), so that is no error of this peer's."""
    return (
        record.exc_info is None
        or record.exc_info[0] is None
        or record.exc_info[0].__name__ != "ExecuteBatchError"
    )


logging.getLogger("grpc._cython.cygrpc").addFilter(_not_a_hang_up)


class SnapshotTurns:
    """Who was turned away from a snapshot slot lately (``WAITING_SECONDS``): while any such
    asker waits, a free slot goes to the one that has waited longest, and every other asker, new
    or not, joins the wait; with nobody waiting an asker is served at once (the next range of
    its download). Keeps the ``MAX_REMEMBERED_ASKERS`` latest askers."""

    def __init__(self) -> None:
        # asker -> (when it was first turned away since it was last served, when last)
        self._waiting: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def turned_away(self, asker: str, now: float) -> None:
        since = self._waiting.pop(asker, (now, now))[0]
        self._waiting[asker] = (since, now)
        while self._waiting and (
            len(self._waiting) > MAX_REMEMBERED_ASKERS
            or next(iter(self._waiting.values()))[1] < now - WAITING_SECONDS
        ):
            self._waiting.popitem(last=False)

    def served(self, asker: str) -> None:
        self._waiting.pop(asker, None)

    def yields(self, asker: str, now: float) -> bool:
        """Whether ``asker`` leaves a free slot to another asker that has waited longer."""
        live = [(since, who) for who, (since, last) in self._waiting.items() if now - last <= WAITING_SECONDS]
        return bool(live) and min(live)[1] != asker


class FragmentServer:
    """Serves what ``store`` holds."""

    def __init__(
        self,
        options: NetworkOptions,
        store: FragmentStore,
        stats: TransportStats,
        peer_id: str,
        swarm_key: SwarmKey | None = None,
    ) -> None:
        self.options = options
        self.swarm_key = swarm_key  # a private swarm: every request must prove it
        self._nonces = NonceLedger()
        self.store = store
        self.stats = stats
        self.peer_id = peer_id
        self.description = ""  # the swarm identity this peer tells askers (JSON, set by its node)
        self.state_streams = 0  # snapshots streaming out now
        self._state_askers: Counter[str] = Counter()  # snapshots streaming out now, per asker
        self._turns = SnapshotTurns()
        self._uplink_free = 0.0  # loop time by which what was sent is out at ``upload_limit``
        self._no_state: asyncio.Event | None = None  # set while no snapshot streams
        self.grpc_endpoint: str | None = None  # host:port others dial, once the server runs
        self.announces_grpc = True  # False behind NAT: the endpoint is served but not announced
        # TLS on the gRPC path: always in a private swarm, else when asked
        tls = options.grpc_listen is not None and (options.grpc_tls or swarm_key is not None)
        self.certificate = ServerCertificate.create() if tls else None
        self._grpc_server: grpc.aio.Server | None = None

    async def start(self, p2p: P2P) -> None:
        """Answer on libp2p, and on gRPC unless ``grpc_listen`` is none."""
        self._no_state = asyncio.Event()
        self._no_state.set()
        # read by hand: hivemind's reader buffers whatever length a caller declares, before any check
        await add_capped_stream_handler(
            p2p, LIBP2P_FETCH, self._fetch_libp2p, pb.FetchRequest,
            max_request_bytes=MAX_FETCH_REQUEST_BYTES, allowed=self.caller_allowed,
            refusal=pb.FetchResponse(error=NOT_ALLOWED), on_refused=self._count_refusal,
        )  # fmt: skip
        await p2p.add_protobuf_handler(LIBP2P_DESCRIBE, self._describe, pb.DescribeRequest)
        listen = self.options.grpc_listen
        if listen is None:
            return
        # bounded: each stream holds a fragment's bytes; idle connections are probed and dropped
        self._grpc_server = grpc.aio.server(
            maximum_concurrent_rpcs=MAX_GRPC_STREAMS,
            options=[
                ("grpc.keepalive_time_ms", 60_000),
                ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.max_connection_idle_ms", 300_000),
            ],
        )
        # no response serializers: the handlers yield messages already serialized
        fetch = grpc.unary_stream_rpc_method_handler(
            self._fetch_grpc, request_deserializer=pb.FetchRequest.FromString
        )
        self._grpc_server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {"Fetch": fetch})]
        )
        if self.certificate is None:
            port = self._grpc_server.add_insecure_port(listen)
        else:
            port = self._grpc_server.add_secure_port(listen, self.certificate.server_credentials())
        if port == 0:
            raise RuntimeError(f"cannot listen for gRPC on {listen}")
        await self._grpc_server.start()
        host = self.options.grpc_announce_host or listen.rsplit(":", 1)[0]
        self.grpc_endpoint = f"{host}:{port}"

    def contact(self) -> tuple[str | None, str | None]:
        """Where to reach this peer over gRPC and the certificate it presents there (None, None:
        libp2p only; a None certificate: plaintext)."""
        if not self.announces_grpc or self.grpc_endpoint is None:
            return None, None
        pem = self.certificate.certificate_pem if self.certificate is not None else None
        return self.grpc_endpoint, pem

    async def stop(self) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=None)

    async def _stream_out(
        self,
        header: pb.FragmentHeader,
        data: bytes | bytearray,
        offset: int,
        serialized: bool,
        end: int | None = None,
    ) -> Outgoing:
        """Header and the chunks of ``data[offset:end]`` (None: to the end), within this peer's
        upload rate; a fragment's behind any snapshot, a snapshot's ended when read too slowly."""
        end = len(data) if end is None else end
        stream = serialized_response_stream if serialized else response_stream
        rate = self.options.upload_limit
        loop = asyncio.get_running_loop()
        started = loop.time()
        position = offset
        state = header.kind == pb.STATE
        floor = min(MIN_STATE_SERVE_RATE, (rate or math.inf) / (MAX_STATE_STREAMS + 1))
        for index, message in enumerate(stream(header, data, offset, end=end)):
            elapsed = loop.time() - started
            # the average rate asked rises with the time held: floor * elapsed / grace
            if (
                state
                and elapsed > STATE_SERVE_GRACE
                and position - offset < floor * elapsed**2 / STATE_SERVE_GRACE
            ):
                self.stats.rejected["slow_reader"] += 1
                logger.info("ended a snapshot stream read at %.0f B/s", (position - offset) / elapsed)
                return
            if index > 0 and not state and self._no_state is not None and not self._no_state.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._no_state.wait(), FRAGMENT_HOLD)
            yield message
            if index == 0:
                continue  # the header
            size = min(CHUNK_BYTES, end - position)
            position += size
            self.stats.bytes_sent += size
            if state:
                self.store.reading(header.content_hash)
            if rate:  # the limit is the peer's, whatever the number of streams sharing it
                now = loop.time()
                self._uplink_free = max(self._uplink_free, now) + size / rate
                await asyncio.sleep(self._uplink_free - now)

    @staticmethod
    def _refusal(reason: str, serialized: bool) -> pb.FetchResponse | bytes:
        message = pb.FetchResponse(error=reason)
        return message.SerializeToString() if serialized else message

    def _authorized(self, request: pb.FetchRequest | pb.DescribeRequest, purpose: bytes) -> bool:
        if self.swarm_key is None or self.swarm_key.check(request, request.ticket, purpose, self._nonces):
            return True
        self.stats.rejected["unauthorized"] += 1
        return False

    async def _fetch(self, request: pb.FetchRequest, serialized: bool, asker: str) -> Outgoing:
        if not self._authorized(request, FETCH_PURPOSE):
            yield self._refusal("unauthorized: this swarm is private", serialized)
            return
        self.stats.asked += 1
        entry = self.store.get(request.content_hash)
        if entry is None:
            yield self._refusal(NOT_HELD, serialized)
            return
        state, now = entry.header.kind == pb.STATE, time.monotonic()
        if state and self._state_askers[asker] >= MAX_STATE_STREAMS_PER_ASKER:
            self.stats.rejected["state_slots"] += 1  # it holds a slot: it waits for none
            yield self._refusal("busy: already serving you a snapshot", serialized)
            return
        if state and self.state_streams >= MAX_STATE_STREAMS:
            self._turns.turned_away(asker, now)
            yield self._refusal("busy: serving other snapshots", serialized)
            return
        if state and self._turns.yields(asker, now):
            self._turns.turned_away(asker, now)  # it waits its turn as others did
            self.stats.rejected["state_turn"] += 1
            yield self._refusal("busy: others wait for a snapshot", serialized)
            return
        if state:
            self._turns.served(asker)
        offset = min(request.offset, len(entry.data))
        # a range (a download from several holders at once), or to the end
        end = min(offset + request.length, len(entry.data)) if request.length else len(entry.data)
        self._count_state_stream(int(state))
        self._state_askers[asker] += int(state)
        try:
            async for message in self._stream_out(entry.header, entry.data, offset, serialized, end):
                yield message
        finally:
            self._count_state_stream(-int(state))
            self._state_askers[asker] -= int(state)
            if self._state_askers[asker] <= 0:  # bounded: only askers streaming now are kept
                del self._state_askers[asker]

    def _count_state_stream(self, change: int) -> None:
        self.state_streams += change
        if self._no_state is not None:
            if self.state_streams:
                self._no_state.clear()
            else:
                self._no_state.set()

    def _count_refusal(self, reason: str) -> None:
        self.stats.rejected[reason] += 1

    def caller_allowed(self, context: P2PContext) -> bool:
        """Whether a libp2p caller (libp2p authenticates its peer id) is in ``--allow``; a refusal
        is counted ``not_allowed``. The DHT's handlers ask this too (``AllowedCallers``)."""
        if not self.options.allow or context.remote_id.to_base58() in self.options.allow:
            return True
        self.stats.rejected["not_allowed"] += 1
        return False

    async def _describe(self, request: pb.DescribeRequest, context: P2PContext) -> pb.DescribeResponse:
        if not self.caller_allowed(context) or not self._authorized(request, DESCRIBE_PURPOSE):
            return pb.DescribeResponse()  # an outsider learns nothing, not even the run id
        self.stats.asked += 1
        return pb.DescribeResponse(run_id=self.options.run_id, swarm_json=self.description)

    async def _fetch_grpc(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> Outgoing:
        # a gRPC caller is anonymous: its address (without the port, which it picks) names it
        async for message in self._fetch(request, serialized=True, asker=_grpc_host(context.peer())):
            yield message

    async def _fetch_libp2p(self, request: pb.FetchRequest, context: P2PContext) -> Outgoing:
        if not self.caller_allowed(context):
            yield self._refusal(NOT_ALLOWED, False)
            return
        async for message in self._fetch(request, serialized=False, asker=context.remote_id.to_base58()):
            yield message


def _grpc_host(peer: str) -> str:
    """The address in gRPC's ``context.peer()`` ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"), less
    the port."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
