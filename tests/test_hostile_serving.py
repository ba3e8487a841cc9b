"""An outsider holding the snapshot slots (issue 27, hole 6): one asker gets one snapshot stream
at a time, and the rate a snapshot stream must keep up rises with the time it holds its slot, so
a reader just above the old fixed floor no longer keeps a slot for ever.
"""

from __future__ import annotations

import asyncio

import pytest

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol import serving
from cgad.protocol.config import NetworkOptions
from cgad.protocol.records import Offer
from cgad.protocol.serving import FragmentServer
from cgad.protocol.store import FragmentStore, StoredFragment
from cgad.protocol.transport import TransportStats
from cgad.protocol.wire import content_hash

pytestmark = pytest.mark.timeout(60)


def _server_with_snapshot(size: int) -> tuple[FragmentServer, bytes]:
    data = bytes(size)
    digest = content_hash(data)
    header = pb.FragmentHeader(kind=pb.STATE, byte_length=size, content_hash=digest, base_version=1)
    offer = Offer(
        publisher="QmMe", base_version=1, kind="state", tokens=0, codec="state", numel=size,
        content_hash=digest, byte_length=size,
    )  # fmt: skip
    store = FragmentStore(2, 2)
    store.put(StoredFragment(header=header, data=data, offer=offer, own=True))
    return FragmentServer(NetworkOptions(run_id="t"), store, TransportStats(), "QmMe"), digest


def test_one_asker_holds_one_snapshot_slot_at_a_time() -> None:
    server, digest = _server_with_snapshot(4 << 20)
    request = pb.FetchRequest(content_hash=digest)

    async def first_message(asker: str):
        stream = server._fetch(request, serialized=False, asker=asker)
        return stream, await anext(stream)

    async def scenario() -> None:
        held, header = await first_message("QmOutsider")
        assert header.WhichOneof("part") == "header"
        _, refusal = await first_message("QmOutsider")  # its second stream, while the first runs
        assert refusal.WhichOneof("part") == "error" and "busy" in refusal.error
        other, header = await first_message("QmJoiner")  # another asker gets the second slot
        assert header.WhichOneof("part") == "header"
        await held.aclose()  # the first stream ends: the asker may stream again
        again, header = await first_message("QmOutsider")
        assert header.WhichOneof("part") == "header"
        await other.aclose()
        await again.aclose()

    asyncio.run(scenario())
    assert server.stats.rejected["state_slots"] == 1
    assert server.state_streams == 0 and not server._state_askers


def test_a_steady_reader_above_the_fixed_floor_is_ended_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader at 3x the floor: the old fixed floor served it to the end; the rising one ends it
    after about 3 grace periods. A reader with no pause reads everything."""
    pause, grace = 0.05, 0.3
    rate = serving.CHUNK_BYTES / pause  # what the slow reader takes, at most
    monkeypatch.setattr(serving, "STATE_SERVE_GRACE", grace)
    monkeypatch.setattr(serving, "MIN_STATE_SERVE_RATE", rate / 3)
    data = bytes(64 * serving.CHUNK_BYTES)  # 64 chunks: 3.2 s at that rate
    header = pb.FragmentHeader(kind=pb.STATE, byte_length=len(data))

    async def read(delay: float) -> int:
        server = FragmentServer(NetworkOptions(run_id="t"), FragmentStore(2, 2), TransportStats(), "QmMe")
        messages = 0
        async for _ in server._stream_out(header, data, 0, serialized=False):
            messages += 1
            await asyncio.sleep(delay)
        return messages

    assert asyncio.run(read(0.0)) == 65  # the header and every chunk
    assert asyncio.run(read(pause)) < 40  # ended near 3 x grace (~0.9 s, ~18 chunks)


def test_snapshot_slots_go_round_when_askers_reopen_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two identities that hold both slots and reopen the moment a stream closes (issue 46, item 6):
    a joiner turned away is served before the squatter that reopens, and before any new identity;
    the askers that wait are served in the order they came; an asker alone reopens at once (the
    next range of its download), and one already streaming waits for no turn."""
    monkeypatch.setattr(serving, "WAITING_SECONDS", 0.3)
    server, digest = _server_with_snapshot(4 << 20)
    request = pb.FetchRequest(content_hash=digest)

    async def first_message(asker: str):
        stream = server._fetch(request, serialized=False, asker=asker)
        return stream, await anext(stream)

    async def refused(asker: str) -> bool:
        _, message = await first_message(asker)
        return message.WhichOneof("part") == "error"

    async def scenario() -> None:
        a, _ = await first_message("QmSquatterA")
        b, _ = await first_message("QmSquatterB")
        assert await refused("QmJoiner")  # both slots held: it waits
        assert await refused("QmSquatterB")  # streaming already: refused, and no place in the wait
        await a.aclose()
        assert await refused("QmSquatterA")  # at once: the joiner has waited longer
        assert await refused("QmFreshIdentity")  # a new identity waits its turn too
        joiner, header = await first_message("QmJoiner")
        assert header.WhichOneof("part") == "header"
        await joiner.aclose()
        assert await refused("QmJoiner")  # its next range: the squatter waited before it
        assert await refused("QmFreshIdentity")
        a, header = await first_message("QmSquatterA")  # the longest wait
        assert header.WhichOneof("part") == "header"
        await a.aclose()
        await b.aclose()
        fresh, header = await first_message("QmFreshIdentity")  # it came before the joiner's retry
        assert header.WhichOneof("part") == "header"
        joiner, header = await first_message("QmJoiner")
        assert header.WhichOneof("part") == "header"
        await fresh.aclose()
        await joiner.aclose()
        await asyncio.sleep(0.4)  # every wait is old: an asker alone is served at once, again and again
        for _ in range(2):
            again, header = await first_message("QmJoiner")
            assert header.WhichOneof("part") == "header"
            await again.aclose()

    asyncio.run(scenario())
    assert server.stats.rejected["state_turn"] == 4 and server.stats.rejected["state_slots"] == 1
    assert server.state_streams == 0 and not server._state_askers
