"""The network transport: hivemind's DHT says who holds what; gRPC or libp2p streams move bytes.

Publishing encodes the tensor (in the caller's thread: the encoded bytes are the snapshot, so the
trainer may reuse its tensor at once), keeps the bytes in a bounded local store and announces them
under the fragment's DHT key, signed. Everything else runs on an event loop (uvloop) in a
background thread: polling the DHT, choosing which publishers to fetch (at most ``fan_in`` per
fragment, kind and base version, drawn at random), pulling bytes from any holder that announced
the same content hash (peers that re-serve first, the publisher last, so a popular fragment's load
spreads), checking them against the hash in the publisher's own signed record, decoding,
validating, and announcing this peer as one more holder. ``receive`` only hands over what that
pipeline has already accepted.

Two data paths: a direct gRPC stream to the holder's announced ``host:port`` when it answers
within ``connect_timeout``, else hivemind's libp2p protobuf stream (which goes through relays and
NAT). Either way the same ``FetchResponse`` messages flow, in 1 MiB chunks, and a transfer that
breaks off resumes at the next holder from where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import tempfile
import threading
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch
import uvloop
from google.protobuf.message import Message
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils import get_dht_time

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.codec import Codec, ErrorFeedback, decode, encode, encoded_size
from cgad.protocol.errors import FragmentError
from cgad.protocol.records import (
    MAX_OFFERS,
    Holdings,
    Identity,
    Offer,
    Progress,
    fragment_key,
    parse_holdings,
    parse_progress,
    progress_key,
    schema_validator,
)
from cgad.protocol.transport import Fragment, FragmentKey, Kind, Transport, TransportStats
from cgad.protocol.wire import (
    CHUNK_BYTES,
    ChunkAssembler,
    content_hash,
    parse,
    response_stream,
    serialized_response_stream,
    split_chunk,
)

__all__ = ["FragmentStore", "NetworkConfig", "NetworkTransport", "StoredFragment"]

logger = logging.getLogger(__name__)

_SERVICE = pb.DESCRIPTOR.services_by_name["FragmentService"].full_name
GRPC_FETCH = f"/{_SERVICE}/Fetch"
GRPC_STATE = f"/{_SERVICE}/DownloadState"
FETCH_HANDLER = f"{_SERVICE}.Fetch"  # libp2p protocol names
STATE_HANDLER = f"{_SERVICE}.DownloadState"
PATHS = ("grpc", "libp2p")
_KIND_TO_PB = {Kind.DELTA: pb.DELTA, Kind.PARAMS: pb.PARAMS}
T = TypeVar("T")


@dataclass
class NetworkConfig:
    run_id: str
    num_fragments: int
    fragment_numel: Mapping[int, int]  # fragments to receive, with the numel each must have
    initial_peers: Sequence[str] = ()  # multiaddrs of peers already in the swarm
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: Sequence[str] | None = None
    identity_path: str | None = None  # a libp2p RSA key file for a stable peer id (made if absent)
    grpc_listen: str | None = "127.0.0.1:0"  # None: no direct endpoint (NAT): serve over libp2p only
    grpc_announce_host: str | None = None  # the host others dial, when it differs from the listen one
    codec: Codec = Codec.FP4  # for pseudo-gradients (Streaming DiLoCo exchanges 4-bit floats)
    params_codec: Codec = Codec.FP32  # for outer parameters, which mixing averages as they are
    error_feedback: bool = True  # carry lossy codecs' residual into the next DELTA of a fragment
    keep_versions: int = 2  # own encoded versions kept per fragment and kind
    keep_reserved: int = 8  # others' fragments kept per fragment to serve onward
    fan_in: int = 4  # at most this many publishers per (fragment, kind, base version)
    # offers this many versions behind this peer's own (``report_progress``) are ignored unseen
    history_versions: int = 64
    paths: Sequence[str] = PATHS  # data paths this peer fetches over, in order of preference
    max_norm: float | None = None  # refuse a fragment whose L2 norm is larger
    poll_interval: float = 1.0
    record_ttl: float = 120.0
    liveness_ttl: float = 30.0
    connect_timeout: float = 2.0
    chunk_timeout: float = 15.0  # longest silence within a transfer before trying another holder
    fetch_timeout: float = 300.0
    upload_bytes_per_s: float | None = None  # cap on what this peer serves (volunteers' uplinks)
    startup_timeout: float = 60.0
    client_mode: bool = False  # behind NAT: dial out only, be reached through relays
    use_relay: bool = True  # let libp2p relay connections (to and from NATed peers)
    max_state_bytes: int = 1 << 36  # the largest state blob a joining peer accepts

    def __post_init__(self) -> None:
        unknown = set(self.paths) - set(PATHS)
        if unknown or not self.paths:
            raise ValueError(f"paths must be a non-empty subset of {PATHS}, got {self.paths}")
        self.codec = Codec(self.codec)
        self.params_codec = Codec(self.params_codec)


@dataclass
class StoredFragment:
    header: pb.FragmentHeader
    data: bytes | bytearray
    offer: Offer
    own: bool


class FragmentStore:
    """Encoded fragments this peer serves, by content hash, bounded per fragment: the newest
    ``keep_own`` own versions per fragment and kind, and the newest ``keep_reserved`` others'."""

    def __init__(self, keep_own: int, keep_reserved: int) -> None:
        self.keep_own = keep_own
        self.keep_reserved = keep_reserved
        self._by_hash: dict[bytes, StoredFragment] = {}
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> StoredFragment | None:
        with self._lock:
            return self._by_hash.get(digest)

    def put(self, entry: StoredFragment) -> None:
        with self._lock:
            self._by_hash[entry.header.content_hash] = entry
            fragment = entry.header.fragment
            if entry.own:
                group = [e for e in self._by_hash.values() if e.own and self._same(e, fragment, entry)]
                keep = self.keep_own
            else:
                group = [e for e in self._by_hash.values() if not e.own and e.header.fragment == fragment]
                keep = self.keep_reserved
            group.sort(key=lambda e: e.header.base_version)
            for old in group[: max(0, len(group) - keep)]:
                del self._by_hash[old.header.content_hash]

    @staticmethod
    def _same(entry: StoredFragment, fragment: int, other: StoredFragment) -> bool:
        return entry.header.fragment == fragment and entry.header.kind == other.header.kind

    def discard(self, digest: bytes) -> None:
        with self._lock:
            self._by_hash.pop(digest, None)

    def offers(self, fragment: int) -> list[Offer]:
        """What to announce for a fragment: own versions first, newest first."""
        with self._lock:
            entries = [e for e in self._by_hash.values() if e.header.fragment == fragment]
        entries.sort(key=lambda e: (not e.own, -e.header.base_version))
        return [e.offer for e in entries[:MAX_OFFERS]]


@dataclass
class _Candidate:
    key: FragmentKey
    offer: Offer
    holders: list[Holdings]  # in the order to try


class NetworkTransport(Transport):
    """``Transport`` over a hivemind DHT, with bytes over direct gRPC or libp2p streams."""

    def __init__(self, config: NetworkConfig, identity: Identity | None = None) -> None:
        self.config = config
        if identity is None:
            identity = Identity.load_or_create(config.identity_path) if config.identity_path else Identity()
        self.identity = identity
        self.peer_id = self.identity.peer_id
        self.stats = TransportStats()
        self.bytes_by_path: Counter[str] = Counter()  # bytes fetched over each path
        self.fan_in_skipped = 0  # publishers passed over because of the fan-in cap
        self.store = FragmentStore(config.keep_versions, config.keep_reserved)
        self.grpc_endpoint: str | None = None
        self.dht_node: DHTNode | None = None
        self.p2p: P2P | None = None

        self._interest = dict(config.fragment_numel)
        self._inbox: dict[tuple[int, Kind], list[Fragment]] = defaultdict(list)
        self._inbox_lock = threading.Lock()
        self._delivered: dict[FragmentKey, bytes] = {}
        self._transfers: dict[FragmentKey, ChunkAssembler] = {}
        # content hashes fetched, in flight or given up, with their (fragment, base version)
        self._attempted: dict[bytes, tuple[int, int]] = {}
        # publishers chosen per (fragment, kind, base version): the fan-in cap's ledger
        self._chosen: dict[tuple[int, Kind, int], set[str]] = defaultdict(set)
        self._judged: dict[tuple, float] = {}  # DHT records already counted as rejected, and when
        self._logged_reasons: set[str] = set()
        self._feedback: dict[int, ErrorFeedback] = {}
        self._live: dict[str, Progress] = {}
        self._progress = Progress(
            peer_id=self.peer_id,
            versions=[0] * config.num_fragments,
            inner_step=0,
            tokens_per_second=0.0,
            time=get_dht_time(),
        )
        self._tasks: set[asyncio.Task] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._grpc_server: grpc.aio.Server | None = None
        self._closed = False
        self._state_provider: Callable[[], bytes] | None = None

        # Codec work runs here, one torch thread: the kernels are memory-bound, and a second
        # OpenMP team beside the trainer's makes both spin on a busy machine (3x slower measured).
        self._codec_worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cgad-codec", initializer=torch.set_num_threads, initargs=(1,)
        )
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, name=f"cgad-net-{self.peer_id[-6:]}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._start(), timeout=config.startup_timeout)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- the trainer's side

    def publish(self, fragment: Fragment, codec: Codec | str | None = None) -> None:
        """Snapshot the tensor and return: encoding, hashing and announcing happen on the
        transport's threads. Raises ``FragmentError("non_finite")`` at once for NaN or Inf."""
        key = fragment.key
        codec = Codec(codec or (self.config.codec if key.kind is Kind.DELTA else self.config.params_codec))
        snapshot = fragment.tensor.detach().reshape(-1).to(device="cpu", copy=True)
        if snapshot.numel() and not all(math.isfinite(float(v)) for v in torch.aminmax(snapshot.float())):
            raise FragmentError("non_finite", f"{key} holds NaN or Inf")
        self._codec_worker.submit(self._encode_and_publish, key, snapshot, codec, fragment.tokens)

    def _encode_and_publish(self, key: FragmentKey, tensor: torch.Tensor, codec: Codec, tokens: int) -> None:
        try:
            if key.kind is Kind.DELTA and self.config.error_feedback and codec in (Codec.INT8, Codec.FP4):
                feedback = self._feedback.get(key.fragment)
                if feedback is None or feedback.codec is not codec:
                    feedback = self._feedback[key.fragment] = ErrorFeedback(codec)
                data = feedback.encode(tensor)
            else:
                data = encode(tensor, codec)
            self.publish_encoded(key, data, codec=codec, numel=tensor.numel(), tokens=tokens)
        except Exception:
            logger.exception("publishing %s failed", key)

    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        """Offer bytes that are already encoded (by ``publish``, or re-sent state)."""
        if key.publisher != self.peer_id:
            raise ValueError(f"this peer is {self.peer_id}; it cannot publish as {key.publisher}")
        digest = content_hash(data)
        offer = Offer(
            publisher=self.peer_id,
            base_version=key.base_version,
            kind=str(key.kind),
            tokens=tokens,
            codec=str(codec),
            numel=numel,
            content_hash=digest,
            byte_length=len(data),
        )
        entry = StoredFragment(self._header(key, offer), data, offer, own=True)
        self.stats.published += 1
        self.loop.call_soon_threadsafe(self._spawn, self._add_and_announce(entry))

    def receive(self, fragment: int, kind: Kind = Kind.DELTA) -> list[Fragment]:
        with self._inbox_lock:
            return self._inbox.pop((fragment, kind), [])

    def live_peers(self) -> list[str]:
        now = get_dht_time()
        return sorted(
            peer
            for peer, progress in self._live.items()
            if peer != self.peer_id and progress.time + self.config.liveness_ttl > now
        )

    def transfers(self) -> dict[FragmentKey, tuple[int, int]]:
        """Fetches in progress: bytes received so far and in all, per fragment key."""
        return {key: (a.received, a.byte_length) for key, a in list(self._transfers.items())}

    def swarm_progress(self) -> dict[str, Progress]:
        """The latest progress record of every live peer, this one included."""
        return dict(self._live)

    def report_progress(self, versions: Sequence[int], inner_step: int, tokens_per_second: float) -> None:
        """What this peer tells the swarm about itself; refreshed in the DHT in the background."""
        self._progress = Progress(
            peer_id=self.peer_id,
            versions=list(versions),
            inner_step=inner_step,
            tokens_per_second=float(tokens_per_second),
            time=get_dht_time(),
        )
        self.loop.call_soon_threadsafe(self._spawn, self._store_progress())

    def expect(self, fragment: int, numel: int) -> None:
        """Start receiving a fragment (with this many values) that the config did not list."""
        if not 0 <= fragment < self.config.num_fragments:
            raise ValueError(f"fragment {fragment} outside 0..{self.config.num_fragments - 1}")
        self._interest[fragment] = numel

    def maddrs(self) -> list[str]:
        """Multiaddrs other peers can bootstrap from."""
        assert self.p2p is not None
        return [str(addr) for addr in self._call(self.p2p.get_visible_maddrs(), timeout=10)]

    def download(
        self, holder: Holdings, digest: bytes, byte_length: int, path: str, timeout: float = 600.0
    ) -> bytearray:
        """Pull the bytes with this content hash from one holder over one path, verified against
        the hash; blocks the caller (for tools, benchmarks, and a joining peer's state). Raises
        ``FragmentError("unavailable")`` when the holder does not deliver verified bytes."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}")
        assembler = ChunkAssembler(digest, byte_length)
        data = self._call(self._fetch_from(holder, assembler, paths=(path,)), timeout)
        if data is None:
            raise FragmentError("unavailable", f"{holder.peer_id} did not deliver over {path}")
        return data

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._codec_worker.shutdown(wait=True)  # publishes already handed over still go out
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self._call(self._stop(), timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> NetworkTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- loop plumbing

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    def _reject(self, reason: str, detail: str) -> None:
        self.stats.rejected[reason] += 1
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.warning(
                "rejected (%s): %s; further rejections for this reason are only counted", reason, detail
            )

    # ---------------------------------------------------------------- start and stop

    async def _start(self) -> None:
        config = self.config
        with tempfile.TemporaryDirectory() as key_dir:
            identity_path = config.identity_path
            if identity_path is None:
                identity_path = os.path.join(key_dir, "identity.key")
                with open(identity_path, "wb") as key_file:
                    key_file.write(self.identity.libp2p_identity)
            self.p2p = await P2P.create(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) if config.announce_maddrs else None,
                identity_path=identity_path,
                check_if_identity_free=False,
                use_relay=config.use_relay,
                use_auto_relay=config.client_mode,
                dht_mode="client" if config.client_mode else "server",
            )
        if self.p2p.peer_id.to_base58() != self.peer_id:
            raise RuntimeError("libp2p identity and signing key disagree")
        validator = CompositeValidator(
            [schema_validator(config.run_id, config.num_fragments), self.identity.signature_validator]
        )
        self.dht_node = await DHTNode.create(
            p2p=self.p2p,
            initial_peers=list(config.initial_peers) or None,
            record_validator=validator,
            client_mode=config.client_mode,
        )
        await self.p2p.add_protobuf_handler(
            FETCH_HANDLER, self._serve_libp2p, pb.FetchRequest, stream_output=True
        )
        await self.p2p.add_protobuf_handler(
            STATE_HANDLER, self._serve_state_libp2p, pb.StateRequest, stream_output=True
        )
        if config.grpc_listen is not None:
            self._grpc_server = grpc.aio.server()
            # no response serializers: the handlers yield messages already serialized
            fetch = grpc.unary_stream_rpc_method_handler(
                self._serve_grpc, request_deserializer=pb.FetchRequest.FromString
            )
            state = grpc.unary_stream_rpc_method_handler(
                self._serve_state_grpc, request_deserializer=pb.StateRequest.FromString
            )
            self._grpc_server.add_generic_rpc_handlers(
                [grpc.method_handlers_generic_handler(_SERVICE, {"Fetch": fetch, "DownloadState": state})]
            )
            port = self._grpc_server.add_insecure_port(config.grpc_listen)
            if port == 0:
                raise RuntimeError(f"cannot listen for gRPC on {config.grpc_listen}")
            await self._grpc_server.start()
            host = config.grpc_announce_host or config.grpc_listen.rsplit(":", 1)[0]
            self.grpc_endpoint = f"{host}:{port}"
        self._spawn(self._poll_forever())
        self._spawn(self._refresh_forever())

    async def _stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=None)
        for channel in self._channels.values():
            await channel.close()
        if self.dht_node is not None:
            await self.dht_node.shutdown()
        if self.p2p is not None:
            await self.p2p.shutdown()
        # hivemind leaves helper tasks behind; end them here rather than at loop.close()
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    # ---------------------------------------------------------------- announcing

    def _header(self, key: FragmentKey, offer: Offer) -> pb.FragmentHeader:
        return pb.FragmentHeader(
            run_id=key.run_id,
            fragment=key.fragment,
            base_version=key.base_version,
            publisher=key.publisher,
            tokens=offer.tokens,
            kind=_KIND_TO_PB[key.kind],
            shape=[offer.numel],
            dtype="float32",
            codec=offer.codec,
            content_hash=offer.content_hash,
            byte_length=offer.byte_length,
        )

    async def _add_and_announce(self, entry: StoredFragment) -> None:
        self.store.put(entry)
        self._attempted[entry.header.content_hash] = (entry.header.fragment, entry.header.base_version)
        await self._announce(entry.header.fragment)

    async def _announce(self, fragment: int) -> None:
        offers = self.store.offers(fragment)
        if not offers or self.dht_node is None:
            return
        holdings = Holdings(peer_id=self.peer_id, grpc=self.grpc_endpoint, offers=offers)
        stored = await self.dht_node.store(
            fragment_key(self.config.run_id, fragment),
            holdings.dict(),
            get_dht_time() + self.config.record_ttl,
            subkey=self.identity.owner_subkey,
        )
        if not stored:
            logger.debug("announcing fragment %d reached no DHT peer", fragment)

    async def _store_progress(self) -> None:
        if self.dht_node is None:
            return
        progress = self._progress.copy(update={"time": get_dht_time(), "grpc": self.grpc_endpoint})
        self._live[self.peer_id] = progress
        await self.dht_node.store(
            progress_key(self.config.run_id),
            progress.dict(),
            get_dht_time() + self.config.liveness_ttl,
            subkey=self.identity.owner_subkey,
        )

    async def _refresh_forever(self) -> None:
        """Keep this peer's records alive: progress (its heartbeat) and its holdings."""
        period = min(self.config.liveness_ttl, self.config.record_ttl) / 3
        while True:
            await self._store_progress()
            for fragment in range(self.config.num_fragments):
                await self._announce(fragment)
            await asyncio.sleep(period)

    # ---------------------------------------------------------------- serving

    async def _stream_out(
        self, header: pb.FragmentHeader, data: bytes | bytearray, offset: int, serialized: bool
    ) -> AsyncIterator[pb.FetchResponse | bytes]:
        """Header and chunks, within this peer's upload rate."""
        stream = serialized_response_stream if serialized else response_stream
        rate = self.config.upload_bytes_per_s
        started = self.loop.time()
        position = offset
        for index, message in enumerate(stream(header, data, offset)):
            yield message
            if index == 0:
                continue  # the header
            size = min(CHUNK_BYTES, len(data) - position)
            position += size
            self.stats.bytes_sent += size
            if rate:
                await asyncio.sleep(max(0.0, started + (position - offset) / rate - self.loop.time()))

    @staticmethod
    def _refusal(reason: str, serialized: bool) -> pb.FetchResponse | bytes:
        message = pb.FetchResponse(error=reason)
        return message.SerializeToString() if serialized else message

    async def _serve(
        self, request: pb.FetchRequest, serialized: bool
    ) -> AsyncIterator[pb.FetchResponse | bytes]:
        entry = self.store.get(request.content_hash)
        if entry is None:
            yield self._refusal("not held here", serialized)
            return
        offset = min(request.offset, len(entry.data))
        async for message in self._stream_out(entry.header, entry.data, offset, serialized):
            yield message

    async def _serve_state(
        self, request: pb.StateRequest, serialized: bool
    ) -> AsyncIterator[pb.FetchResponse | bytes]:
        """This peer's state blob. ``StateResponse`` mirrors ``FetchResponse`` field for field,
        so the fragment stream writer (and reader) serve it unchanged."""
        # Served whatever run the asker names: the blob says which run, model and tokenizer it
        # holds, so a peer that dialled the wrong swarm learns exactly what differs.
        provider = self._state_provider
        if provider is None:
            yield self._refusal("no state served here", serialized)
            return
        try:
            blob = await self.loop.run_in_executor(None, provider)
        except Exception as error:
            logger.exception("the state provider failed")
            yield self._refusal(f"state unavailable: {error}", serialized)
            return
        header = pb.FragmentHeader(
            run_id=self.config.run_id,
            publisher=self.peer_id,
            kind=pb.PARAMS,
            codec="state",
            content_hash=content_hash(blob),
            byte_length=len(blob),
        )
        async for message in self._stream_out(header, blob, 0, serialized):
            yield message

    async def _serve_grpc(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for message in self._serve(request, serialized=True):
            yield message

    async def _serve_libp2p(
        self, request: pb.FetchRequest, context: P2PContext
    ) -> AsyncIterator[pb.FetchResponse]:
        async for message in self._serve(request, serialized=False):
            yield message

    async def _serve_state_grpc(
        self, request: pb.StateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for message in self._serve_state(request, serialized=True):
            yield message

    async def _serve_state_libp2p(
        self, request: pb.StateRequest, context: P2PContext
    ) -> AsyncIterator[pb.FetchResponse]:
        async for message in self._serve_state(request, serialized=False):
            yield message

    # ---------------------------------------------------------------- finding and choosing

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("polling the DHT failed; retrying")
            await asyncio.sleep(self.config.poll_interval)

    async def _poll_once(self) -> None:
        assert self.dht_node is not None
        run_id = self.config.run_id
        interest = dict(self._interest)
        keys = [fragment_key(run_id, f) for f in interest] + [progress_key(run_id)]
        found = await self.dht_node.get_many(keys, sufficient_expiration_time=float("inf"))

        progress_entry = found.get(progress_key(run_id))
        if progress_entry is not None and isinstance(progress_entry.value, dict):
            live: dict[str, Progress] = {}
            for owner, item in progress_entry.value.items():
                try:
                    progress = parse_progress(owner, item.value)
                except FragmentError as error:
                    self._reject_record(error, ("progress", owner, item.expiration_time))
                    continue
                live[progress.peer_id] = progress
            live.setdefault(self.peer_id, self._progress)
            self._live = live

        for fragment, numel in interest.items():
            entry = found.get(fragment_key(run_id, fragment))
            if entry is None or not isinstance(entry.value, dict):
                continue
            holdings: list[Holdings] = []
            for owner, item in entry.value.items():
                try:
                    holdings.append(parse_holdings(owner, item.value))
                except FragmentError as error:
                    self._reject_record(error, (fragment, owner, item.expiration_time))
            for candidate in self._choose(fragment, numel, holdings):
                self._spawn(self._fetch(candidate))
        self._forget_old()

    def _forget_old(self) -> None:
        """Bound the bookkeeping: versions beyond the horizon are refused unseen anyway, and a
        record judged longer ago than two lifetimes has expired from the DHT."""
        old = self._too_old
        self._delivered = {k: v for k, v in self._delivered.items() if not old(k.fragment, k.base_version)}
        self._attempted = {h: fb for h, fb in self._attempted.items() if not old(*fb)}
        for round_key in [k for k in self._chosen if old(k[0], k[2])]:
            del self._chosen[round_key]
        oldest = get_dht_time() - 2 * self.config.record_ttl
        self._judged = {identity: when for identity, when in self._judged.items() if when > oldest}

    def _too_old(self, fragment: int, base: int) -> bool:
        # Measured against this peer's own version, never against what others announce: a
        # record claiming a far-future version must not make honest offers look stale.
        versions = self._progress.versions
        own = versions[fragment] if fragment < len(versions) else 0
        return base < own - self.config.history_versions

    def _reject_record(self, error: FragmentError, identity: tuple) -> None:
        if identity not in self._judged:
            self._judged[identity] = get_dht_time()
            self._reject(error.reason, error.detail)

    def _choose(self, fragment: int, numel: int, holdings: list[Holdings]) -> list[_Candidate]:
        """New origin offers worth fetching, with their holders, within the fan-in cap."""
        by_hash: dict[bytes, list[Holdings]] = defaultdict(list)
        for holder in holdings:
            for offer in holder.offers:
                by_hash[offer.content_hash].append(holder)
        fresh: dict[tuple[int, Kind, int], list[_Candidate]] = defaultdict(list)
        for holder in holdings:
            for offer in holder.offers:
                if offer.publisher != holder.peer_id or offer.publisher == self.peer_id:
                    continue  # only a publisher's own record vouches for content
                if self._too_old(fragment, offer.base_version):
                    continue  # far too old to matter to any outer step
                kind = Kind(offer.kind)
                key = FragmentKey(self.config.run_id, fragment, offer.base_version, offer.publisher, kind)
                delivered_hash = self._delivered.get(key)
                if delivered_hash is not None:
                    if delivered_hash != offer.content_hash and kind is Kind.DELTA:
                        self._reject_record(
                            FragmentError("replay", f"{key} again with other bytes"),
                            ("replay", offer.content_hash),
                        )
                    continue
                if offer.content_hash in self._attempted:
                    continue
                problem = self._check_offer(offer, numel)
                if problem is not None:
                    self._attempted[offer.content_hash] = (fragment, offer.base_version)
                    self._reject(problem.reason, f"{key}: {problem.detail}")
                    continue
                others = [h for h in by_hash[offer.content_hash] if h.peer_id != offer.publisher]
                random.shuffle(others)
                fresh[(fragment, kind, offer.base_version)].append(_Candidate(key, offer, [*others, holder]))
        chosen: list[_Candidate] = []
        for round_key, candidates in fresh.items():
            taken = self._chosen[round_key]
            random.shuffle(candidates)
            for candidate in candidates:
                if candidate.key.publisher in taken:
                    continue
                self._attempted[candidate.offer.content_hash] = (fragment, candidate.key.base_version)
                if len(taken) >= self.config.fan_in:
                    self.fan_in_skipped += 1
                    continue
                taken.add(candidate.key.publisher)
                chosen.append(candidate)
        return chosen

    @staticmethod
    def _check_offer(offer: Offer, numel: int) -> FragmentError | None:
        """What can be refused from the signed record alone, before any byte moves."""
        if offer.numel != numel:
            return FragmentError("bad_shape", f"{offer.numel} values, expected {numel}")
        try:
            expected = encoded_size(numel, offer.codec)
        except ValueError:
            return FragmentError("unknown_codec", offer.codec)
        if offer.byte_length > expected:
            return FragmentError(
                "oversized", f"{offer.byte_length} bytes for {numel} values in {offer.codec}"
            )
        if offer.byte_length != expected:
            return FragmentError("bad_length", f"{offer.byte_length} bytes, expected {expected}")
        return None

    # ---------------------------------------------------------------- fetching

    async def _fetch(self, candidate: _Candidate) -> None:
        offer = candidate.offer
        assembler = ChunkAssembler(offer.content_hash, offer.byte_length)
        self._transfers[candidate.key] = assembler
        data: bytearray | None = None
        try:
            async with asyncio.timeout(self.config.fetch_timeout):
                for holder in candidate.holders:
                    data = await self._fetch_from(holder, assembler)
                    if data is not None:
                        break
        except TimeoutError:
            logger.debug("fetching %s took longer than %.0f s", candidate.key, self.config.fetch_timeout)
        finally:
            del self._transfers[candidate.key]
        if data is None:
            self._reject("unavailable", f"no holder delivered {candidate.key}")
            return
        await self._accept(candidate, data)

    async def _fetch_from(
        self, holder: Holdings, assembler: ChunkAssembler, paths: Sequence[str] | None = None
    ) -> bytearray | None:
        """Bytes from one holder over the first path that works, resuming where a previous holder
        or stream stopped; None when this holder could not deliver."""
        for path in paths or self.config.paths:
            if path == "grpc" and holder.grpc is None:
                continue
            fruitless = 0
            while fruitless < 2:
                received_before = assembler.received
                try:
                    await self._drain(self._open_fetch(path, holder, assembler), assembler)
                    if assembler.received == assembler.byte_length:
                        return assembler.finish()
                    # libp2p reports a dropped connection as a clean end of stream: resume
                    logger.debug("stream from %s over %s ended early", holder.peer_id, path)
                except FragmentError as error:
                    if error.reason == "bad_hash":
                        self._reject("bad_hash", f"from {holder.peer_id}: {error.detail}")
                        assembler.restart()
                        return None  # the holder is lying or broken: no other path to it helps
                    logger.debug("holder %s over %s: %s", holder.peer_id, path, error)
                    break
                except Exception as error:  # gRPC, socket, timeout and hivemind P2P errors share no base
                    logger.debug("holder %s over %s failed: %r", holder.peer_id, path, error)
                    break
                finally:
                    self.bytes_by_path[path] += assembler.received - received_before
                fruitless = 0 if assembler.received > received_before else fruitless + 1
        return None

    async def _open_grpc(self, endpoint: str, method: str, request: Message) -> AsyncIterator[bytes]:
        """Serialized response messages: ``_drain`` reads chunks out of them in place."""
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint)
        await asyncio.wait_for(channel.channel_ready(), self.config.connect_timeout)
        call = channel.unary_stream(method, request_serializer=type(request).SerializeToString)(request)
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()

    async def _open_libp2p(
        self, peer_id: str, handler: str, request: Message, response_type: type[Message]
    ) -> AsyncIterator[Message]:
        assert self.p2p is not None
        stream = await asyncio.wait_for(
            self.p2p.iterate_protobuf_handler(PeerID.from_base58(peer_id), handler, request, response_type),
            self.config.connect_timeout,
        )
        try:
            async for message in stream:
                yield message
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _open_fetch(
        self, path: str, holder: Holdings, assembler: ChunkAssembler
    ) -> AsyncIterator[Message | bytes]:
        request = pb.FetchRequest(content_hash=assembler.expected_hash, offset=assembler.received)
        if path == "grpc":
            assert holder.grpc is not None
            return self._open_grpc(holder.grpc, GRPC_FETCH, request)
        return self._open_libp2p(holder.peer_id, FETCH_HANDLER, request, pb.FetchResponse)

    async def _drain(
        self, stream: AsyncIterator[Message | bytes], assembler: ChunkAssembler | None
    ) -> ChunkAssembler:
        """Read a header-then-chunks stream into ``assembler``; without one (a state download,
        which has no signed record), the stream's own header says what to expect."""
        iterator = aiter(stream)
        first = True
        try:
            while True:
                try:
                    item = await asyncio.wait_for(anext(iterator), self.config.chunk_timeout)
                except StopAsyncIteration:
                    break
                if isinstance(item, bytes):
                    piece = None if first else split_chunk(item)
                    if piece is not None:
                        assert assembler is not None
                        assembler.add_slice(*piece)
                        continue
                    message = parse(pb.FetchResponse, item)  # StateResponse has the same fields
                else:
                    message = item
                part = message.WhichOneof("part")
                if first:
                    if part != "header":
                        raise FragmentError(
                            "bad_header", message.error or "stream did not start with a header"
                        )
                    assembler = assembler or self._assembler_for(message.header)
                    assembler.check_header(message.header)
                    first = False
                elif part == "chunk":
                    assert assembler is not None
                    assembler.add(message.chunk)
                else:
                    raise FragmentError("bad_chunk", f"unexpected {part} inside a transfer")
        finally:
            with contextlib.suppress(Exception):
                await iterator.aclose()
        if assembler is None:
            raise FragmentError("truncated", "the stream ended before its header")
        return assembler

    def _assembler_for(self, header: pb.FragmentHeader) -> ChunkAssembler:
        if header.byte_length > self.config.max_state_bytes:
            raise FragmentError("oversized", f"state of {header.byte_length} bytes")
        if len(header.content_hash) != 32:
            raise FragmentError("bad_header", "no sha256 in the header")
        return ChunkAssembler(header.content_hash, header.byte_length)

    # ---------------------------------------------------------------- state for joining peers

    def serve_state(self, provider: Callable[[], bytes]) -> None:
        """Serve this peer's state to peers that join or fall behind: ``provider`` is called on a
        worker thread for each request and returns the bytes to send."""
        self._state_provider = provider

    def download_state(self, peer_id: str, timeout: float = 120.0) -> bytearray:
        """The state blob a peer serves, checked against the sha256 its stream announces (the
        trust is in the peer chosen, as there is no signed record for state). Tries the peer's
        direct gRPC endpoint from its progress record, then libp2p; ``FragmentError`` when both
        fail."""
        progress = self._live.get(peer_id)
        endpoint = progress.grpc if progress is not None else None
        return self._call(self._download_state(peer_id, endpoint), timeout)

    async def _download_state(self, peer_id: str, endpoint: str | None) -> bytearray:
        request = pb.StateRequest(run_id=self.config.run_id)
        failures = []
        for path in self.config.paths:
            if path == "grpc" and endpoint is None:
                continue
            stream = (
                self._open_grpc(endpoint, GRPC_STATE, request)
                if path == "grpc"
                else self._open_libp2p(peer_id, STATE_HANDLER, request, pb.StateResponse)
            )
            try:
                assembler = await self._drain(stream, None)
                data = assembler.finish()
            except FragmentError as error:
                failures.append(f"{path}: {error}")
                continue
            except Exception as error:  # gRPC, socket, timeout and hivemind P2P errors share no base
                failures.append(f"{path}: {error!r}")
                continue
            self.bytes_by_path[path] += len(data)
            self.stats.bytes_received += len(data)
            return data
        raise FragmentError("unavailable", f"no state from {peer_id}: {'; '.join(failures) or 'no path'}")

    async def _accept(self, candidate: _Candidate, data: bytearray) -> None:
        """Decode and validate off the loop; deliver; offer the bytes onward."""
        key, offer = candidate.key, candidate.offer
        try:
            decoding = self.loop.run_in_executor(
                self._codec_worker, self._decode_and_check, data, offer.numel
            )
        except RuntimeError:  # closing: the codec worker takes no more work
            return
        try:
            tensor = await decoding
        except FragmentError as error:
            self._reject(error.reason, f"{key} from {key.publisher}: {error.detail}")
            return
        if key in self._delivered:  # a second announcement of the same key raced this fetch
            if key.kind is Kind.DELTA:
                self._reject("replay", f"{key} delivered already")
            return
        self._delivered[key] = offer.content_hash
        with self._inbox_lock:
            self._inbox[(key.fragment, key.kind)].append(
                Fragment(key=key, tensor=tensor, tokens=offer.tokens)
            )
        self.stats.received += 1
        self.stats.bytes_received += len(data)
        self.store.put(StoredFragment(self._header(key, offer), data, offer, own=False))
        await self._announce(key.fragment)

    def _decode_and_check(self, data: bytearray, numel: int) -> torch.Tensor:
        tensor = decode(data)
        if tensor.dim() != 1 or tensor.numel() != numel:
            raise FragmentError("bad_shape", f"shape {tuple(tensor.shape)}, expected ({numel},)")
        if not tensor.is_floating_point():
            raise FragmentError("bad_dtype", str(tensor.dtype))
        tensor = tensor.float()
        if self.config.max_norm is not None:
            norm = float(torch.linalg.vector_norm(tensor))
            if not norm <= self.config.max_norm:
                raise FragmentError("norm_too_large", f"norm {norm:.4g} > {self.config.max_norm:.4g}")
        return tensor
