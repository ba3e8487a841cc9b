"""Serving what this peer holds: fragments by content hash, and its state blob to joining peers.

The same calls on both paths: a gRPC server on ``NetworkOptions.grpc_listen`` (unless that is
none, behind NAT) and libp2p protobuf handlers. Each stream is a header, then the bytes from the
requested offset in ``CHUNK_BYTES`` chunks, paced to ``upload_limit`` bytes per second (a
volunteer's uplink is usually the scarcest thing it lends). gRPC gets the messages pre-serialized
(``serialized_response_stream``), libp2p as messages.

Threads: a ``FragmentServer`` runs on the transport's event-loop thread ("cgad-net-*"), as do all
its handlers; ``stats.bytes_sent`` is counted there. The state provider is set from the trainer's
thread (a plain attribute swap) and called on the loop's default executor threads, once per
request. The store it serves from has its own lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from hivemind.p2p import P2P, P2PContext

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.config import NetworkOptions
from cgad.protocol.store import FragmentStore
from cgad.protocol.transport import TransportStats
from cgad.protocol.wire import (
    CHUNK_BYTES,
    LIBP2P_FETCH,
    LIBP2P_STATE,
    SERVICE,
    content_hash,
    response_stream,
    serialized_response_stream,
)

__all__ = ["FragmentServer"]

logger = logging.getLogger(__name__)

Outgoing = AsyncIterator[pb.FetchResponse | bytes]


class FragmentServer:
    """Serves ``store`` and the state of ``state_provider`` (bytes, called per request; None:
    no state served)."""

    def __init__(
        self, options: NetworkOptions, store: FragmentStore, stats: TransportStats, peer_id: str
    ) -> None:
        self.options = options
        self.store = store
        self.stats = stats
        self.peer_id = peer_id
        self.state_provider: Callable[[], bytes] | None = None
        self.grpc_endpoint: str | None = None  # host:port others dial, once the server runs
        self._grpc_server: grpc.aio.Server | None = None

    async def start(self, p2p: P2P) -> None:
        """Answer on libp2p, and on gRPC unless ``grpc_listen`` is none."""
        await p2p.add_protobuf_handler(LIBP2P_FETCH, self._fetch_libp2p, pb.FetchRequest, stream_output=True)
        await p2p.add_protobuf_handler(LIBP2P_STATE, self._state_libp2p, pb.StateRequest, stream_output=True)
        listen = self.options.grpc_listen
        if listen is None:
            return
        self._grpc_server = grpc.aio.server()
        # no response serializers: the handlers yield messages already serialized
        fetch = grpc.unary_stream_rpc_method_handler(
            self._fetch_grpc, request_deserializer=pb.FetchRequest.FromString
        )
        state = grpc.unary_stream_rpc_method_handler(
            self._state_grpc, request_deserializer=pb.StateRequest.FromString
        )
        self._grpc_server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {"Fetch": fetch, "DownloadState": state})]
        )
        port = self._grpc_server.add_insecure_port(listen)
        if port == 0:
            raise RuntimeError(f"cannot listen for gRPC on {listen}")
        await self._grpc_server.start()
        host = self.options.grpc_announce_host or listen.rsplit(":", 1)[0]
        self.grpc_endpoint = f"{host}:{port}"

    async def stop(self) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=None)

    async def _stream_out(
        self, header: pb.FragmentHeader, data: bytes | bytearray, offset: int, serialized: bool
    ) -> Outgoing:
        """Header and chunks, within this peer's upload rate."""
        stream = serialized_response_stream if serialized else response_stream
        rate = self.options.upload_limit
        loop = asyncio.get_running_loop()
        started = loop.time()
        position = offset
        for index, message in enumerate(stream(header, data, offset)):
            yield message
            if index == 0:
                continue  # the header
            size = min(CHUNK_BYTES, len(data) - position)
            position += size
            self.stats.bytes_sent += size
            if rate:
                await asyncio.sleep(max(0.0, started + (position - offset) / rate - loop.time()))

    @staticmethod
    def _refusal(reason: str, serialized: bool) -> pb.FetchResponse | bytes:
        message = pb.FetchResponse(error=reason)
        return message.SerializeToString() if serialized else message

    async def _fetch(self, request: pb.FetchRequest, serialized: bool) -> Outgoing:
        entry = self.store.get(request.content_hash)
        if entry is None:
            yield self._refusal("not held here", serialized)
            return
        offset = min(request.offset, len(entry.data))
        async for message in self._stream_out(entry.header, entry.data, offset, serialized):
            yield message

    async def _state(self, request: pb.StateRequest, serialized: bool) -> Outgoing:
        """This peer's state blob. ``StateResponse`` mirrors ``FetchResponse`` field for field,
        so the fragment stream writer (and reader) serve it unchanged."""
        # Served whatever run the asker names: the blob says which run, model and tokenizer it
        # holds, so a peer that dialled the wrong swarm learns exactly what differs.
        provider = self.state_provider
        if provider is None:
            yield self._refusal("no state served here", serialized)
            return
        try:
            blob = await asyncio.get_running_loop().run_in_executor(None, provider)
        except Exception as error:
            logger.exception("the state provider failed")
            yield self._refusal(f"state unavailable: {error}", serialized)
            return
        header = pb.FragmentHeader(
            run_id=self.options.run_id,
            publisher=self.peer_id,
            kind=pb.PARAMS,
            codec="state",
            content_hash=content_hash(blob),
            byte_length=len(blob),
        )
        async for message in self._stream_out(header, blob, 0, serialized):
            yield message

    async def _fetch_grpc(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> Outgoing:
        async for message in self._fetch(request, serialized=True):
            yield message

    async def _fetch_libp2p(self, request: pb.FetchRequest, context: P2PContext) -> Outgoing:
        async for message in self._fetch(request, serialized=False):
            yield message

    async def _state_grpc(self, request: pb.StateRequest, context: grpc.aio.ServicerContext) -> Outgoing:
        async for message in self._state(request, serialized=True):
            yield message

    async def _state_libp2p(self, request: pb.StateRequest, context: P2PContext) -> Outgoing:
        async for message in self._state(request, serialized=False):
            yield message
