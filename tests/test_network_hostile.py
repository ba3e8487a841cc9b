"""NetworkTransport against hostile peers, with real hivemind peers on 127.0.0.1: tampered
bytes, forged records, the fan-in cap, fragments that decode to garbage, bare DHT values.
The shared swarm is described in tests/_netswarm.py.
"""

from __future__ import annotations

import asyncio
import os
import struct
import zlib

import pytest
import torch
from _netswarm import (  # tests/ is on sys.path under pytest
    RUN,
    SMALL,
    collect,
    key,
    settle,
    wait_for,
)
from hivemind.utils import get_dht_time

from cgad.protocol.codec import Codec, encode, encoded_size
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import Holdings, Offer, fragment_key, parse_holdings, read_records
from cgad.protocol.transport import Fragment
from cgad.protocol.wire import content_hash

pytestmark = pytest.mark.integration  # real hivemind peers (p2pd processes) on loopback


@pytest.mark.timeout(90)
def test_reserved_bytes_verify_by_hash_and_tampered_are_refused(netswarm: list[NetworkTransport]) -> None:
    p0, p1, p2, p3 = netswarm
    x2, x3 = torch.randn(1 << 20), torch.randn(1 << 20)
    p0.publish(Fragment(key(p0, 2, 1), x2), codec="fp32")
    p0.publish(Fragment(key(p0, 3, 1), x3), codec="fp32")
    for fetcher in (p1, p2):
        collect(fetcher, 2, 1)
        collect(fetcher, 3, 1)
    digest2 = content_hash(encode(x2, "fp32"))
    digest3 = content_hash(encode(x3, "fp32"))
    wait_for(
        lambda: all(p.store.get(d) for p in (p1, p2) for d in (digest2, digest3)), what="re-served copies"
    )
    # re-servers announce what they fetched a poll interval later, all of it at once
    reservers = {p1.peer_id, p2.peer_id}
    wait_for(lambda: reservers <= _holders(p3, 2, digest2) and reservers <= _holders(p3, 3, digest3),
             what="the re-servers' announcements")  # fmt: skip

    # The publisher no longer holds fragment 2: the bytes can only come from the re-servers.
    p0.store.discard(digest2)
    p3.expect(2, 1 << 20)
    [got] = collect(p3, 2, 1)
    assert torch.equal(got.tensor, x2)

    # Both re-servers' copies of fragment 3 are tampered with: p3 tries them first (re-servers
    # before the publisher), refuses both by hash, and gets the true bytes from the publisher.
    for peer in (p1, p2):
        entry = peer.store.get(digest3)
        assert entry is not None
        entry.data[5000] ^= 0xFF
    before = p3.stats.rejected["bad_hash"]
    p3.expect(3, 1 << 20)
    [got] = collect(p3, 3, 1)
    assert torch.equal(got.tensor, x3)
    assert p3.stats.rejected["bad_hash"] - before == 2


@pytest.mark.timeout(90)
def test_a_holder_that_sends_a_wrong_start_and_leaves_spoils_one_transfer_not_the_fetch(
    netswarm: list[NetworkTransport],
) -> None:
    """The hash covers the whole, so a transfer resumed from another holder cannot tell whose
    part was wrong: the holder that completed it sends it again alone (the publisher here, which
    the old code blamed and gave up on)."""
    p0, p1, p2, p3 = netswarm
    x = torch.randn(SMALL)
    p0.publish(Fragment(key(p0, 9, 5), x), codec="fp32")
    for reserver in (p1, p2):
        collect(reserver, 9, 1)
    digest = content_hash(encode(x, "fp32"))
    wait_for(
        lambda: {p1.peer_id, p2.peer_id} <= _holders(p3, 9, digest), what="the re-servers' announcements"
    )
    for reserver in (p1, p2):  # a wrong byte early on, and nothing after the first half
        entry = reserver.store.get(digest)
        assert entry is not None
        entry.data[100] ^= 0xFF
        del entry.data[len(entry.data) // 2 :]
    before = p3.stats.rejected["bad_hash"]
    p3.expect(9, SMALL)  # p3 has not looked at fragment 9 before: it fetches now, re-servers first
    [got] = collect(p3, 9, 1)
    assert torch.equal(got.tensor, x)
    assert p3.stats.rejected["bad_hash"] - before == 1  # the mixed transfer; the publisher's copy passed


def _holders(transport: NetworkTransport, fragment: int, digest: bytes) -> set[str]:
    """The peers whose records in the DHT (as ``transport`` reads them) offer these bytes."""
    assert transport.dht_node is not None
    found = transport.dht_node.get(fragment_key(RUN, fragment), latest=True)
    entry = asyncio.run_coroutine_threadsafe(found, transport.loop).result(10)
    records = read_records(entry, parse_holdings, lambda *_: None)
    return {r.peer_id for r in records if any(o.content_hash == digest for o in r.offers)}


def _store_as(transport: NetworkTransport, fragment: int, value: dict, owner: bytes) -> bool:
    assert transport.dht_node is not None
    store = transport.dht_node.store(fragment_key(RUN, fragment), value, get_dht_time() + 60, subkey=owner)
    return asyncio.run_coroutine_threadsafe(store, transport.loop).result(10)


@pytest.mark.timeout(60)
def test_forged_records_are_refused(netswarm: list[NetworkTransport]) -> None:
    p0, p1, p2, _ = netswarm
    data = encode(torch.randn(SMALL), "fp32")
    offer = Offer(
        publisher=p0.peer_id,
        base_version=4,
        kind="delta",
        tokens=1,
        codec="fp32",
        numel=SMALL,
        content_hash=content_hash(data),
        byte_length=len(data),
    )
    forged = Holdings(peer_id=p0.peer_id, grpc=p2.grpc_endpoint, offers=[offer]).dict()
    # p2 cannot write under p0's subkey: no DHT node accepts the unsigned record
    assert not _store_as(p2, 4, forged, p0.identity.owner_subkey)
    # p2 can write its own subkey, but a record that claims to be p0's is refused as forged
    before = p1.stats.rejected["forged"]
    assert _store_as(p2, 4, forged, p2.identity.owner_subkey)
    wait_for(lambda: p1.stats.rejected["forged"] > before, what="forged record counted")
    settle(p1)  # several more polls see the same record: it is counted once
    assert p1.stats.rejected["forged"] == before + 1
    # and an offer naming p0 as publisher in p2's own, honest record vouches for nothing
    honest_but_hearsay = Holdings(peer_id=p2.peer_id, grpc=p2.grpc_endpoint, offers=[offer]).dict()
    assert _store_as(p2, 5, honest_but_hearsay, p2.identity.owner_subkey)
    settle(p1)
    assert p1.receive(4) == [] and p1.receive(5) == []


@pytest.mark.timeout(60)
def test_fan_in_cap_is_honoured(netswarm: list[NetworkTransport]) -> None:
    p0, p1, p2, p3 = netswarm
    publishers = (p0, p1, p2)
    for peer in publishers:
        peer.publish(Fragment(key(peer, 6, 9), torch.randn(SMALL)))
    p3.expect(6, SMALL)
    got = collect(p3, 6, 2)
    wait_for(lambda: p3.stats.skipped["fan_in"] >= 1, what="the third publisher to be passed over")
    settle(p3)
    got += p3.receive(6)
    assert len(got) == 2
    assert {g.key.publisher for g in got} < {p.peer_id for p in publishers}


@pytest.mark.timeout(60)
def test_hostile_fragments_are_rejected_and_counted(netswarm: list[NetworkTransport]) -> None:
    _, p1, p2, _ = netswarm
    before = p1.stats.rejected.copy()

    def rejected(reason: str) -> int:
        return p1.stats.rejected[reason] - before[reason]

    # wrong length for the fragment: refused from the record, before any byte moves
    p2.publish(Fragment(key(p2, 7, 1), torch.randn(SMALL + 1)), codec="fp32")
    # a norm beyond the bound
    p2.publish(Fragment(key(p2, 8, 1), torch.full((SMALL,), 1e4)), codec="fp32")
    # garbage whose hash the record does match
    garbage = os.urandom(encoded_size(SMALL, "fp32"))
    p2.publish_encoded(key(p2, 9, 1), garbage, codec=Codec.FP32, numel=SMALL, tokens=1)
    # NaN in a well-formed, correctly checksummed payload
    nan = bytearray(encode(torch.ones(SMALL), "fp32"))
    nan[-4:] = struct.pack("<f", float("nan"))
    payload_offset = len(nan) - SMALL * 4
    crc = zlib.crc32(bytes(nan[payload_offset:]), zlib.crc32(bytes(nan[: payload_offset - 4])))
    nan[payload_offset - 4 : payload_offset] = struct.pack("<I", crc)
    p2.publish_encoded(key(p2, 10, 1), bytes(nan), codec=Codec.FP32, numel=SMALL, tokens=1)
    # more bytes than the codec needs for this many values
    padded = encode(torch.ones(SMALL), "fp32") + b"\0" * 64
    p2.publish_encoded(key(p2, 11, 1), padded, codec=Codec.FP32, numel=SMALL, tokens=1)
    # a replay: the same (peer, fragment, base) delta again, with other bytes
    first = torch.randn(SMALL)
    p2.publish(Fragment(key(p2, 12, 1), first), codec="fp32")
    [got] = collect(p1, 12, 1)
    assert torch.equal(got.tensor, first)
    p2.publish(Fragment(key(p2, 12, 1), torch.randn(SMALL)), codec="fp32")

    expected = {
        "bad_shape": 1,
        "norm_too_large": 1,
        "garbage": 1,
        "non_finite": 1,
        "oversized": 1,
        "replay": 1,
    }
    wait_for(lambda: all(rejected(r) >= n for r, n in expected.items()), what=f"rejections {expected}")
    settle(p1)
    assert {r: rejected(r) for r in expected} == expected
    assert all(p1.receive(f) == [] for f in (7, 8, 9, 10, 11, 12))
    # and the peer keeps working
    fine = torch.randn(SMALL)
    p2.publish(Fragment(key(p2, 7, 2), fine), codec="fp32")
    [got] = collect(p1, 7, 1)
    assert torch.equal(got.tensor, fine)


@pytest.mark.timeout(60)
def test_a_bare_value_cannot_wipe_the_records_of_a_fragment(netswarm: list[NetworkTransport]) -> None:
    p0, p1, _, p3 = netswarm
    x = torch.randn(SMALL)
    p1.publish(Fragment(key(p1, 6, 1), x), codec="fp32")
    wait_for(lambda: p1.store.offers(6), what="p1's announcement")
    assert p0.dht_node is not None
    wiped = p0._runner.call(p0.dht_node.store(fragment_key(RUN, 6), None, get_dht_time() + 60), timeout=20)
    assert not wiped  # every DHT node refuses an ownerless value at a run's key
    p3.expect(6, SMALL)
    [got] = collect(p3, 6, 1)
    assert got.key == key(p1, 6, 1) and torch.equal(got.tensor, x)
