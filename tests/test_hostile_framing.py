"""An outsider's libp2p stream that declares a huge message (issue 27, hole 2), against a real
node on 127.0.0.1 and a raw hivemind P2P as the caller: the frame's length is checked before its
bytes are read, and a caller outside ``--allow`` is refused before anything of its request is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from _netswarm import make_transport, wait_for  # tests/ is on sys.path under pytest
from hivemind.p2p import P2P, PeerID

from cgad.protocol import FragmentError
from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.framing import FrameTooLarge, iterate_capped
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import Holdings
from cgad.protocol.wire import LIBP2P_FETCH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

CLAIMED = 255 << 20  # what the frame says it carries
SENT = 8 << 20  # what the outsider actually pushes (the old reader buffered all of it, waiting)


async def _flood(outsider: P2P, node: str) -> bytes:
    """Open a fetch stream, declare ``CLAIMED`` bytes, push ``SENT``; what the node answered
    before it closed the stream (b"" if nothing; the old code neither answered nor closed)."""
    _, reader, writer = await outsider.call_binary_stream_handler(PeerID.from_base58(node), LIBP2P_FETCH)
    writer.write(P2P.MESSAGE_MARKER + CLAIMED.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
    with contextlib.suppress(ConnectionError):
        for _ in range(SENT >> 16):
            writer.write(bytes(1 << 16))
            await writer.drain()
    answer = b""
    with contextlib.suppress(ConnectionError):  # the node closes the stream, or resets it
        answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def _run(transport: NetworkTransport, outsider: P2P, coroutine_factory):
    return asyncio.run_coroutine_threadsafe(coroutine_factory(), transport.loop).result(60)


@contextlib.contextmanager
def _outsider_of(transport: NetworkTransport):
    outsider = asyncio.run_coroutine_threadsafe(
        P2P.create(initial_peers=transport.maddrs()), transport.loop
    ).result(60)
    try:
        yield outsider
    finally:
        asyncio.run_coroutine_threadsafe(outsider.shutdown(), transport.loop).result(30)


def test_a_huge_declared_request_is_refused_unread() -> None:
    node = make_transport()
    try:
        with _outsider_of(node) as outsider:
            _run(node, outsider, lambda: _flood(outsider, node.peer_id))
            wait_for(lambda: node.stats.rejected["oversized_request"] == 1, 10, "the refusal counted")
    finally:
        node.close()


def test_a_caller_outside_the_allowlist_is_refused_before_its_request_is_read() -> None:
    node = make_transport(allow=["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"])
    try:
        with _outsider_of(node) as outsider:
            _run(node, outsider, lambda: _flood(outsider, node.peer_id))
            assert node.stats.rejected["not_allowed"] >= 1
            assert node.stats.rejected["oversized_request"] == 0  # never read that far
    finally:
        node.close()


def test_a_client_refuses_a_reply_frame_over_its_cap() -> None:
    node = make_transport()
    try:
        with _outsider_of(node) as outsider:

            async def serve(_info, reader, writer) -> None:  # a re-server declaring a huge chunk
                writer.write(P2P.MESSAGE_MARKER + CLAIMED.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
                await writer.drain()
                await asyncio.sleep(5)
                writer.close()

            async def fetch() -> None:
                await outsider.add_binary_stream_handler("hostile.Fetch", serve)
                responses = iterate_capped(
                    node.p2p, outsider.peer_id, "hostile.Fetch", pb.FetchRequest(), pb.FetchResponse, 2 << 20
                )
                with pytest.raises(FrameTooLarge):
                    async for _ in responses:
                        pass

            _run(node, outsider, fetch)
    finally:
        node.close()


def test_a_fetch_from_a_holder_declaring_a_huge_frame_reads_none_of_it(caplog: pytest.LogCaptureFixture):
    """The fetcher's libp2p path reads each response frame through the same cap: a holder that
    declares 255 MiB is a failed holder at once, not 255 MiB buffered."""
    node = make_transport()
    try:
        with _outsider_of(node) as outsider:

            async def serve(_info, reader, writer) -> None:
                writer.write(P2P.MESSAGE_MARKER + CLAIMED.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
                await writer.drain()
                await asyncio.sleep(30)
                writer.close()

            _run(node, outsider, lambda: outsider.add_binary_stream_handler(LIBP2P_FETCH, serve))
            holder = Holdings(peer_id=outsider.peer_id.to_base58(), grpc=None, offers=[])
            started = time.monotonic()
            with caplog.at_level(logging.DEBUG, logger="cgad.protocol.fetching"):
                with pytest.raises(FragmentError) as failed:
                    node.download(holder, bytes(32), 1 << 20, "libp2p", timeout=60)
            assert failed.value.reason == "unavailable" and time.monotonic() - started < 10
            assert "FrameTooLarge" in caplog.text  # refused by its declared length, not timed out
    finally:
        node.close()
