"""Reading a holder's stream: a holder that trickles bytes is dropped, and what it sent is kept for
the next holder to resume from."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import pytest

from cgad.protocol import FragmentError, fetching
from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.config import NetworkOptions
from cgad.protocol.fetching import Fetcher
from cgad.protocol.transport import TransportStats
from cgad.protocol.wire import ChunkAssembler

DATA = bytes(range(256)) * 64  # 16 KiB


async def _stream(pieces: int, pause: float) -> AsyncIterator[pb.FetchResponse]:
    header = pb.FragmentHeader(content_hash=hashlib.sha256(DATA).digest(), byte_length=len(DATA))
    yield pb.FetchResponse(header=header)
    step = len(DATA) // pieces
    for offset in range(0, len(DATA), step):
        await asyncio.sleep(pause)
        yield pb.FetchResponse(chunk=pb.Chunk(offset=offset, data=DATA[offset : offset + step]))


def _drain(pieces: int, pause: float) -> ChunkAssembler:
    fetcher = Fetcher(NetworkOptions(run_id="t"), TransportStats(), lambda reason, detail, *_: None)
    assembler = ChunkAssembler(hashlib.sha256(DATA).digest(), len(DATA))
    asyncio.run(fetcher._drain(_stream(pieces, pause), assembler, (time.monotonic(), 0)))
    return assembler


def test_a_stream_at_a_fair_rate_is_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetching, "MIN_RATE_GRACE", 0.2)
    monkeypatch.setattr(fetching, "MIN_TRANSFER_RATE", 1_000.0)
    assembler = _drain(pieces=16, pause=0.05)  # ~20 kB/s
    assert bytes(assembler.finish()) == DATA


def test_a_trickling_holder_is_dropped_after_the_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetching, "MIN_RATE_GRACE", 0.3)
    monkeypatch.setattr(fetching, "MIN_TRANSFER_RATE", 1_000.0)
    fetcher = Fetcher(NetworkOptions(run_id="t"), TransportStats(), lambda reason, detail, *_: None)
    assembler = ChunkAssembler(hashlib.sha256(DATA).digest(), len(DATA))
    with pytest.raises(FragmentError, match="B/s over") as caught:
        stream = _stream(pieces=len(DATA) // 16, pause=0.05)  # 320 B/s
        asyncio.run(fetcher._drain(stream, assembler, (time.monotonic(), 0)))
    assert caught.value.reason == "too_slow"
    # what arrived is kept: the next holder resumes from there, not from zero
    assert 0 < assembler.received < len(DATA)


def test_the_rate_floor_counts_from_the_holders_first_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder that sends a little per stream and ends it, to be asked again, is judged by
    its rate since its first stream, not each stream's: its next stream is dropped at once."""
    monkeypatch.setattr(fetching, "MIN_RATE_GRACE", 0.3)
    monkeypatch.setattr(fetching, "MIN_TRANSFER_RATE", 1_000.0)
    fetcher = Fetcher(NetworkOptions(run_id="t"), TransportStats(), lambda reason, detail, *_: None)
    assembler = ChunkAssembler(hashlib.sha256(DATA).digest(), len(DATA))
    first_stream = (time.monotonic() - 1.0, 0)  # a second ago, and nothing received since
    with pytest.raises(FragmentError) as caught:
        asyncio.run(fetcher._drain(_stream(pieces=16, pause=0.0), assembler, first_stream))
    assert caught.value.reason == "too_slow" and assembler.received == 0


def test_grpc_channels_to_holders_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every record names an endpoint; channels to the least recently used are closed beyond
    ``MAX_CHANNELS`` (a peer restarting on a new port, or a liar naming many, left them open)."""
    monkeypatch.setattr(fetching, "MAX_CHANNELS", 3)
    options = NetworkOptions(run_id="t", connect_timeout=0.05)
    fetcher = Fetcher(options, TransportStats(), lambda reason, detail, *_: None)

    async def dial(port: int) -> None:
        request = pb.FetchRequest(content_hash=bytes(32), offset=0)
        with pytest.raises(TimeoutError):  # nothing listens there
            async for _ in fetcher._open_grpc(f"127.0.0.1:{port}", None, "/x/y", request):
                pass

    async def main() -> list[str]:
        for port in (1, 2, 3, 4, 2, 5):
            await dial(port)
        ports = [endpoint.rsplit(":", 1)[1] for endpoint, _ in fetcher._channels]
        await fetcher.close()
        return ports

    assert asyncio.run(main()) == ["4", "2", "5"]  # 1 and 3 closed; 2 kept by its second use


def test_an_endpoint_that_did_not_answer_is_left_to_libp2p_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder announcing an address nobody can dial (behind NAT, a container's private address)
    costs one ``connect_timeout``, not one per fetch: its gRPC path is skipped for
    ``UNANSWERED_FOR`` seconds, and tried again after."""
    import socket

    from cgad.protocol.records import Holdings

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never speaks HTTP/2
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
    holder = Holdings(peer_id="QmHo1derABCDEFGH9", grpc=endpoint, offers=[])
    fetcher = Fetcher(NetworkOptions(run_id="t", connect_timeout=0.5), TransportStats(), lambda *_: None)

    async def attempt() -> float:
        assembler = ChunkAssembler(hashlib.sha256(DATA).digest(), len(DATA))
        started = time.monotonic()
        assert await fetcher.fetch_from(holder, assembler, paths=["grpc"]) is None
        return time.monotonic() - started

    async def main() -> list[float]:
        waited = [await attempt(), await attempt()]
        monkeypatch.setattr(fetching, "UNANSWERED_FOR", 0.0)  # its time is up: asked again
        fetcher._unanswered[endpoint, None] = time.monotonic()
        waited.append(await attempt())
        await fetcher.close()
        return waited

    try:
        first, second, later = asyncio.run(main())
    finally:
        silent.close()
    assert first >= 0.45 and later >= 0.45  # dialed, and waited out the timeout
    assert second < 0.1  # not dialed: left to the next path
