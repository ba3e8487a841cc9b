"""FragmentStore: what a peer keeps to serve, and what it announces, stays bounded."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol import serving
from cgad.protocol.config import NetworkOptions
from cgad.protocol.records import MAX_OFFERS, Offer
from cgad.protocol.serving import FragmentServer
from cgad.protocol.store import (
    RESERVED_BYTES_PER_VALUE,
    RESERVED_VERSIONS,
    STATE_EXTRA,
    STATE_RESUME,
    FragmentStore,
    StoredFragment,
    fragment_header,
)
from cgad.protocol.transport import Fragment, FragmentKey, Inbox, Kind, TransportStats
from cgad.protocol.wire import content_hash

pytestmark = pytest.mark.timeout(60)


def _entry(
    fragment: int,
    base: int,
    own: bool,
    kind: Kind = Kind.DELTA,
    publisher: str = "QmFakePeer",
    bytes_per_value: int = 1,
    values: int = 64,
    header: int = 0,
) -> StoredFragment:
    data = os.urandom(values * bytes_per_value + header)
    offer = Offer(
        publisher=publisher,
        base_version=base,
        kind=str(kind),
        tokens=0,
        codec="fp32",
        numel=values,
        content_hash=content_hash(data),
        byte_length=len(data),
    )
    header = pb.FragmentHeader(
        fragment=fragment,
        base_version=base,
        kind={Kind.DELTA: pb.DELTA, Kind.PARAMS: pb.PARAMS, Kind.STATE: pb.STATE}[kind],
        content_hash=offer.content_hash,
    )
    return StoredFragment(header, data, offer, own)


def _held(store: FragmentStore, entries: list[StoredFragment]) -> list[StoredFragment]:
    return [e for e in entries if store.get(e.offer.content_hash) is not None]


def test_store_keeps_the_newest_versions_per_fragment() -> None:
    store = FragmentStore(keep_own=2, keep_reserved=3)
    own = [_entry(0, base, own=True) for base in range(5)]
    params = _entry(0, 0, own=True, kind=Kind.PARAMS)
    others = [_entry(0, base, own=False) for base in range(5)]
    elsewhere = _entry(1, 0, own=True)
    for entry in [*own, params, *others, elsewhere]:
        store.put(entry)
    held = {
        e.offer.content_hash for e in [*own, params, *others, elsewhere] if store.get(e.offer.content_hash)
    }
    # of one publisher's, its newest RESERVED_VERSIONS (2), within the 3 that keep_reserved allows
    expected = [own[3], own[4], params, others[3], others[4], elsewhere]
    assert held == {e.offer.content_hash for e in expected}
    # announced: own versions first, newest first
    assert [o.base_version for o in store.offers(0)[:3]] == [4, 3, 0]


def test_keep_own_counts_per_fragment_and_kind() -> None:
    store = FragmentStore(keep_own=1, keep_reserved=0)
    deltas = [_entry(0, base, own=True) for base in range(3)]
    params = [_entry(0, base, own=True, kind=Kind.PARAMS) for base in range(3)]
    other_fragment = [_entry(1, base, own=True) for base in range(3)]
    for entries in zip(deltas, params, other_fragment, strict=True):
        for entry in entries:
            store.put(entry)
    assert _held(store, [*deltas, *params, *other_fragment]) == [deltas[2], params[2], other_fragment[2]]


def test_keep_reserved_counts_per_fragment_of_any_kind_and_spares_own() -> None:
    store = FragmentStore(keep_own=1, keep_reserved=2)
    own = _entry(0, 0, own=True)
    store.put(own)
    reserved = [_entry(0, base, own=False, kind=Kind.PARAMS if base % 2 else Kind.DELTA) for base in range(5)]
    elsewhere = [_entry(1, base, own=False) for base in range(2)]
    for entry in [*reserved, *elsewhere]:
        store.put(entry)
    assert _held(store, [own, *reserved, *elsewhere]) == [own, reserved[3], reserved[4], *elsewhere]


def test_each_publishers_newest_two_versions_are_re_served_within_keep_reserved() -> None:
    """Two volunteers behind NAT, one a few versions behind the other: each keeps its two newest
    versions (the lagging one is not pushed out by the other's newer ones), where 8 slots held 4
    of each; and keep_reserved still bounds the whole fragment."""
    store = FragmentStore(keep_own=2, keep_reserved=8)
    assert store.reserved_versions == RESERVED_VERSIONS == 2
    ahead = [_entry(0, base, own=False, publisher="QmAhead") for base in range(4, 10)]
    behind = [_entry(0, base, own=False, publisher="QmBehind") for base in range(0, 6)]
    for pair in zip(ahead, behind, strict=True):
        for entry in pair:
            store.put(entry)
    assert _held(store, [*ahead, *behind]) == [ahead[-2], ahead[-1], behind[-2], behind[-1]]
    crowd = FragmentStore(keep_own=2, keep_reserved=8)
    many = [_entry(0, base, own=False, publisher=f"QmPeer{p + 1}") for base in range(3) for p in range(5)]
    for entry in many:
        crowd.put(entry)
    # 5 publishers x their 2 newest = 10 > 8: the oldest go (base 1 of three publishers)
    held = _held(crowd, many)
    assert len(held) == 8 and all(e.header.base_version >= 1 for e in held)
    assert sum(e.header.base_version == 2 for e in held) == 5


def test_re_served_fragments_hold_at_most_their_bytes_per_value_together() -> None:
    """Peers' φ in float32 (4 bytes a value and a header) fill the byte budget long before
    keep_reserved's 8 slots (32 bytes a value): two of them fit, the oldest go; small deltas
    still fill every slot."""
    assert RESERVED_BYTES_PER_VALUE == 8

    def entry(base: int, publisher: str, bytes_per_value: int, kind: Kind = Kind.PARAMS) -> StoredFragment:
        return _entry(0, base, False, kind, publisher, bytes_per_value, values=1 << 16, header=40)

    store = FragmentStore(keep_own=2, keep_reserved=8)
    own = _entry(0, 0, own=True, kind=Kind.PARAMS, bytes_per_value=4, values=1 << 16, header=40)
    store.put(own)
    phis = [entry(base, f"QmPeer{'abcd'[p]}", 4) for base in range(2) for p in range(4)]
    for e in phis:
        store.put(e)
    assert _held(store, [own, *phis]) == [own, phis[-2], phis[-1]]  # own ones are not counted
    deltas = [entry(5, f"QmPeer{'abcdefgh'[p]}", 1, Kind.DELTA) for p in range(8)]
    for e in deltas:
        store.put(e)
    assert _held(store, [*phis, *deltas]) == deltas
    # a late, old fragment goes itself: it does not push out the newer ones
    late = entry(3, "QmLate", 2, Kind.DELTA)
    store.put(late)
    assert _held(store, [*deltas, late]) == deltas
    huge = entry(6, "QmHuge", 16, Kind.DELTA)
    store.put(huge)
    assert _held(store, [*deltas, huge]) == [huge]  # the newest stays, even alone over the budget


def test_offers_are_own_first_newest_first_and_capped() -> None:
    store = FragmentStore(keep_own=MAX_OFFERS, keep_reserved=MAX_OFFERS)
    own = [_entry(0, base, own=True) for base in range(MAX_OFFERS)]
    newer_reserved = [_entry(0, 100 + base, own=False) for base in range(3)]
    for entry in [*newer_reserved, *own]:
        store.put(entry)
    offers = store.offers(0)
    assert len(offers) == MAX_OFFERS  # what one DHT record may carry
    assert [o.base_version for o in offers] == list(reversed(range(MAX_OFFERS)))
    store.discard(own[0].offer.content_hash)
    store.discard(own[1].offer.content_hash)
    offers = store.offers(0)
    assert [o.base_version for o in offers[-2:]] == [102, 101]  # the reserved follow the own ones
    assert store.offers(1) == []


def test_fragment_header_describes_the_offer() -> None:
    entry = _entry(3, 7, own=True, kind=Kind.PARAMS)
    key = FragmentKey("run", 3, 7, "QmFakePeer", Kind.PARAMS)
    header = fragment_header(key, entry.offer)
    assert (header.run_id, header.fragment, header.base_version, header.publisher) == (
        "run",
        3,
        7,
        "QmFakePeer",
    )
    assert header.kind == pb.PARAMS and list(header.shape) == [64] and header.codec == "fp32"
    assert (header.content_hash, header.byte_length) == (entry.offer.content_hash, 64)


def test_store_keeps_two_own_and_one_adopted_snapshot_apart_from_fragments() -> None:
    store = FragmentStore(keep_own=2, keep_reserved=3)
    fragments = [_entry(0, 5, own=True), _entry(0, 5, own=False)]
    own = [_entry(0, base, own=True, kind=Kind.STATE) for base in (1, 6, 7)]
    adopted = [_entry(0, base, own=False, kind=Kind.STATE) for base in (2, 4)]
    for entry in [*fragments, *own, *adopted]:
        store.put(entry)
    assert _held(store, [*fragments, *own, *adopted]) == [*fragments, own[1], own[2], adopted[1]]
    assert store.offers(None) == [own[2].offer, own[1].offer, adopted[1].offer]  # own first
    assert store.offers(0) == [fragments[0].offer, fragments[1].offer]  # no snapshot among them


def test_the_inbox_counts_publishers_of_a_version_or_newer_and_pops_by_kind() -> None:
    inbox = Inbox()
    for publisher, base in (("a", 4), ("b", 5), ("b", 6), ("c", 3)):
        inbox.put(Fragment(FragmentKey("r", 0, base, publisher, Kind.DELTA), torch.zeros(1), 1))
    inbox.put(Fragment(FragmentKey("r", 0, 9, "d", Kind.PARAMS), torch.zeros(1), 1))
    assert inbox.publishers(0, 4) == 2  # a and b (twice): c's is older, d's is not a delta
    assert inbox.publishers(1, 0) == 0
    assert [f.key.publisher for f in inbox.pop(0, Kind.PARAMS)] == ["d"]
    assert len(inbox.pop(0, Kind.DELTA)) == 4 and inbox.publishers(0, 0) == 0


def test_a_snapshot_being_downloaded_outlives_newer_ones_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FragmentStore(keep_own=2, keep_reserved=3)
    own = [_entry(0, base, own=True, kind=Kind.STATE) for base in range(1, 8)]
    for entry in own[:2]:
        store.put(entry)
    assert store.get(own[0].header.content_hash) is own[0]  # a joiner starts on version 1
    for entry in own[2:5]:
        store.put(entry)
    # the newest two, and version 1 while its download may still resume
    assert _held(store, own[:5]) == [own[0], own[3], own[4]]
    clock = time.monotonic() + STATE_RESUME + 1
    monkeypatch.setattr(time, "monotonic", lambda: clock)
    store.put(own[5])  # long unread: it goes with the rest
    assert _held(store, own[:6]) == [own[4], own[5]]
    busy = FragmentStore(keep_own=2, keep_reserved=3)  # every snapshot read: the newest spared
    for entry in own[:5]:
        busy.put(entry)
        busy.get(entry.header.content_hash)
    assert _held(busy, own[:5]) == own[5 - 2 - STATE_EXTRA : 5]


def test_a_snapshot_stream_read_too_slowly_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that holds one of the few snapshot slots (and the fragment streams behind it)
    while reading almost nothing is cut off after the grace period; a fast one is not."""
    monkeypatch.setattr(serving, "STATE_SERVE_GRACE", 0.3)
    monkeypatch.setattr(serving, "MIN_STATE_SERVE_RATE", 1e8)
    data = bytes(8 << 20)
    header = pb.FragmentHeader(kind=pb.STATE, byte_length=len(data))

    async def read(pause: float) -> int:
        server = FragmentServer(NetworkOptions(run_id="t"), FragmentStore(2, 2), TransportStats(), "QmMe")
        messages = 0
        async for _ in server._stream_out(header, data, 0, serialized=False):
            messages += 1
            await asyncio.sleep(pause)
        return messages

    chunks = -(-len(data) // serving.CHUNK_BYTES)
    assert asyncio.run(read(0.0)) == 1 + chunks  # the header and every chunk
    assert asyncio.run(read(0.1)) < 1 + chunks


def test_a_snapshot_stays_while_its_stream_reads_it_past_the_resume_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A download longer than ``STATE_RESUME`` keeps its blob: each chunk served notes the read,
    so a break after two newer snapshots came can still resume (it used to be noted only when
    the stream began)."""
    store = FragmentStore(keep_own=2, keep_reserved=3)
    own = [_entry(0, base, own=True, kind=Kind.STATE) for base in (1, 2, 3, 4)]
    store.put(own[0])
    first = store.get(own[0].header.content_hash)  # a joiner starts on version 1
    assert first is not None
    server = FragmentServer(NetworkOptions(run_id="t"), store, TransportStats(), "QmMe")
    now = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])

    async def serve_slowly() -> None:  # three chunks, read at 17 kB/s: slow, not too slow
        blob = bytes(3 * serving.CHUNK_BYTES)
        async for message in server._stream_out(first.header, blob, 0, serialized=False):
            if message.WhichOneof("part") == "chunk":
                now[0] += STATE_RESUME / 2

    asyncio.run(serve_slowly())
    for entry in own[1:]:  # three newer snapshots while the download ran
        store.put(entry)
    assert store.get(own[0].header.content_hash) is first
