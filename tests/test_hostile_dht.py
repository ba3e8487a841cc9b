"""A bloated DHT key against real hivemind peers on 127.0.0.1 (issue 27, hole 1): what one key
may hold on a node is bounded, and a lookup answered by a node holding bloated keys still
arrives, so the asker keeps that node in its routing table.

The records are put straight into the node's storage, as a swarm of that many owners would
have stored them through the validators (each owner may sign one subkey per key; minting a
few hundred RSA keys would only make the test slow).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from _netswarm import wait_for  # tests/ is on sys.path under pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from cgad.protocol.dhtbounds import (
    MAX_FIND_REPLY_BYTES,
    MAX_KEY_BYTES,
    MAX_KEY_RECORDS,
    BoundedLocalStorage,
    trim_find_response,
)
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import Identity, fragment_key, peer_id_of_owner, progress_key, state_key

pytestmark = pytest.mark.integration  # real hivemind peers (p2pd processes) on loopback

RUN = "net-test"  # tests/_netswarm.py's run


def _owner(index: int) -> bytes:
    return b"[owner:ssh-rsa AAAAB3NzaC1yc2E" + str(index).encode() + b"]"


def _fill(transport: NetworkTransport, key: str, count: int, size: int) -> int:
    """Store ``count`` records of ``size`` bytes under ``key`` in ``transport``'s local storage;
    how many it took."""
    assert transport.dht_node is not None
    storage = transport.dht_node.protocol.storage
    key_id = DHTID.generate(source=key)
    expiration = get_dht_time() + 60

    value = DHTProtocol.serializer.dumps(bytes(size))  # well-formed, as the validators admit

    async def fill() -> int:
        return sum(storage.store_subkey(key_id, _owner(i), value, expiration) for i in range(count))

    return asyncio.run_coroutine_threadsafe(fill(), transport.loop).result(30)


def _held(transport: NetworkTransport, key: str) -> DictionaryDHTValue:
    assert transport.dht_node is not None
    item = transport.dht_node.protocol.storage.get(DHTID.generate(source=key))
    assert item is not None and isinstance(item.value, DictionaryDHTValue)
    return item.value


@pytest.mark.timeout(60)
def test_a_key_holds_a_bounded_number_of_records_and_bytes(netswarm: list[NetworkTransport]) -> None:
    p0 = netswarm[0]
    # a thousand owners of small records: the count bound
    _fill(p0, state_key(RUN), 1000, 200)
    assert len(_held(p0, state_key(RUN)).data) == MAX_KEY_RECORDS
    # few owners of records of 24 KiB: the byte bound
    _fill(p0, fragment_key(RUN, 9), 300, 24 << 10)
    held = _held(p0, fragment_key(RUN, 9))
    assert sum(len(s) + len(v.value) for s, v in held.items()) <= MAX_KEY_BYTES
    assert len(held.data) >= MAX_KEY_BYTES // (25 << 10)  # filled up to the bound, not short of it


def test_an_owner_may_refresh_its_record_in_a_full_key() -> None:
    storage = BoundedLocalStorage(max_records=3, max_bytes=1 << 20)
    key, now = DHTID.generate(source="k"), get_dht_time()
    assert all(storage.store_subkey(key, _owner(i), b"v", now + 10) for i in range(3))
    assert not storage.store_subkey(key, _owner(3), b"v", now + 10)  # full: a newcomer waits
    assert storage.store_subkey(key, _owner(1), b"newer", now + 20)  # a standing owner refreshes
    for _ in range(1000):  # refused refreshes (older) do not grow the expiration heap
        storage.store_subkey(key, _owner(1), b"old", now + 5)
    held = storage.get(key).value
    assert held.get(_owner(1)).value == b"newer"
    assert len(held.expiration_heap) < 100


def test_live_throwaway_identities_with_bloated_records_keep_no_newcomer_out() -> None:
    """A hundred live identities (they keep reporting: the node cannot call them dead) with
    records of 22 KB fill a key to its last byte; a newcomer's record of honest size still lands,
    in the room of the largest, and one as bloated as theirs does not. A key closes to newcomers
    only when owners of records within the fair share fill it (170 of 12 KiB) or hold all its
    subkeys: what throwaway identities can take is bounded by their number, not by the bytes each
    signs."""
    storage = BoundedLocalStorage(evictable=lambda key, subkey, value: False)  # every record live
    key, expires = DHTID.generate(source="k"), get_dht_time() + 60
    bloated = DHTProtocol.serializer.dumps(bytes(22_000))
    taken = sum(storage.store_subkey(key, _owner(i), bloated, expires) for i in range(100))

    def room() -> int:
        return MAX_KEY_BYTES - sum(len(s) + len(v.value) for s, v in storage.get(key).value.items())

    assert taken < 100 and room() < 23_000  # full of them: fewer than a hundred fit
    assert storage.store_subkey(key, _owner(999), bytes(room() - 100), expires)  # to the last byte
    assert room() < 1_500 and storage.evicted == 0
    assert storage.store_subkey(key, _owner(1000), DHTProtocol.serializer.dumps(bytes(1_500)), expires)
    assert _owner(1000) in storage.get(key).value.data and storage.evicted == 1
    assert not storage.store_subkey(key, _owner(1001), bloated, expires)  # no room made for its like
    # honest-sized live records of MAX_KEY_RECORDS owners: full for good, and none displaced
    small = BoundedLocalStorage(evictable=lambda key, subkey, value: False)
    record = DHTProtocol.serializer.dumps(bytes(1_500))
    assert all(small.store_subkey(key, _owner(i), record, expires) for i in range(MAX_KEY_RECORDS))
    assert not small.store_subkey(key, _owner(MAX_KEY_RECORDS), record, expires)
    assert small.evicted == 0


@pytest.mark.timeout(90)
def test_a_lookup_survives_keys_bloated_past_a_message(netswarm: list[NetworkTransport]) -> None:
    p0, _, _, p3 = netswarm
    keys = [fragment_key(RUN, f) for f in (10, 11, 12)]
    for key in keys:  # 3 x ~1.9 MiB: what three keys may each hold, over p2pd's 4 MiB together
        _fill(p0, key, 80, 24 << 10)
    polls = p0.polls  # the node holding them goes on looking keys up (it polls 9-12 too)
    wait_for(lambda: p0.polls >= polls + 2, what="two polls by the node holding bloated keys")
    assert p3.dht_node is not None
    protocol = p3.dht_node.protocol
    # the raw RPC: whether the reply arrives at all (the records here are not signed, so
    # hivemind's call_find would refuse their content; a real swarm's would be)
    request = dht_pb2.FindRequest(
        keys=[DHTID.generate(source=key).to_bytes() for key in keys], peer=protocol.node_info
    )
    stub = protocol.get_stub(PeerID.from_base58(p0.peer_id))
    call = stub.rpc_find(request, timeout=20)
    response = asyncio.run_coroutine_threadsafe(call, p3.loop).result(30)
    assert response.ByteSize() <= MAX_FIND_REPLY_BYTES
    for result in response.results:
        assert result.type == dht_pb2.FOUND_DICTIONARY
        held = DHTProtocol.serializer.loads(result.value)
        assert 0 < len(held.data) < 80  # trimmed to its share, not dropped


def test_a_trimmed_reply_keeps_the_smallest_records_within_the_budget() -> None:
    held = DictionaryDHTValue()
    now = get_dht_time()
    for i in range(200):
        held.store(_owner(i), bytes(20_000 if i % 2 else 500), now + 60)
    value = DHTProtocol.serializer.dumps(held)
    response = dht_pb2.FindResponse(
        results=[dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=value, expiration_time=now + 60)] * 2
    )
    budget = 1 << 20
    assert response.ByteSize() > budget
    trimmed = trim_find_response(response, budget, random.Random(0))
    assert trimmed.ByteSize() <= budget <= MAX_FIND_REPLY_BYTES
    kept = DHTProtocol.serializer.loads(trimmed.results[0].value)
    sizes = [len(item.value) for _, item in kept.items()]
    assert sizes.count(500) == 100  # every small record, then the large ones that fit


@pytest.mark.timeout(90)
def test_dead_progress_records_never_keep_a_live_one_out(netswarm: list[NetworkTransport]) -> None:
    """Throwaway identities' progress records dated two hours back (about 22 KB each) fill the
    progress key of a node's storage to its last byte; a live peer's report (a real one, signed,
    as it reached this node) still lands, in the room of dead ones, and a dead newcomer does not
    displace them. All in one turn of the node's event loop: no store from the swarm interleaves."""
    p0 = netswarm[0]
    ids = {peer.peer_id for peer in netswarm}
    try:
        wait_for(lambda: p0.dht_node is not None and set(p0.swarm_progress()) == ids, what="live reports")
    except AssertionError:  # which reports were missing, and how old the ones seen were
        now = get_dht_time()
        seen = {peer[-6:]: round(now - p.time, 1) for peer, p in p0.swarm_progress().items()}
        raise AssertionError(f"p0 sees {seen} of {sorted(i[-6:] for i in ids)}; polls {p0.polls}") from None
    assert p0.dht_node is not None
    storage = p0.dht_node.protocol.storage
    key_id = DHTID.generate(source=progress_key(RUN))
    serializer = DHTProtocol.serializer
    dead = serializer.dumps({"peer_id": "squatter", "time": get_dht_time() - 7200.0, "pad": bytes(22_000)})
    dead += b"[signature:" + bytes(64).hex().encode() + b"]"

    async def squat() -> tuple[bool, bool, int, int]:
        held = storage.get(key_id).value
        live = [(s, item) for s, item in held.items()]
        (subkey, report), *others = live
        for s, _ in live:  # the live reports out; the others go back first, then the key fills
            del held[s]
        for s, item in others:
            assert storage.store_subkey(key_id, s, item.value, item.expiration_time)
        expires = get_dht_time() + 3000
        for i in range(400):  # ~22 KB records, then small ones to the last byte (all dead)
            storage.store_subkey(key_id, _owner(i), dead if i < 200 else dead[-80:], expires)
        full = sum(len(s) + len(item.value) for s, item in held.items())
        evicted = storage.evicted
        late_dead = storage.store_subkey(key_id, _owner(999), dead, expires)  # a dead newcomer
        back = storage.store_subkey(key_id, subkey, report.value, report.expiration_time)
        assert all(s in held.data for s, _ in others)  # the live ones held all along stayed
        return late_dead, back, full, storage.evicted - evicted

    late_dead, back, full, evicted = asyncio.run_coroutine_threadsafe(squat(), p0.loop).result(30)
    assert full > MAX_KEY_BYTES - 1000  # full of the dead: no report fits beside them
    assert not late_dead  # a dead record displaces none
    assert back and evicted >= 1  # the live report took the room of the dead
    # a report is judged as the poll takes it: dated ahead or long back, or not its owner's, dead
    held = storage.get(key_id).value
    squatters = {_owner(i) for i in range(1000)}
    live_owner, report = next((s, item.value) for s, item in held.items() if s not in squatters)
    record = serializer.loads(report.split(b"[signature:")[0])

    def dated(shift: float, owner: bytes = live_owner, **changes: object) -> bool:
        value = serializer.dumps({**record, "time": get_dht_time() + shift, **changes}) + b"[signature:00]"
        return p0._poller.evictable(key_id, owner, value)

    ttl = 30.0  # the swarm's liveness TTL (its default)
    assert not dated(0.0) and not dated(-1.5 * ttl)  # live, and within the grace of a stall
    assert dated(-3 * ttl) and dated(+3600.0)  # long back; ahead of any clock
    other = next(s for s in held.data if s not in squatters and s != live_owner)
    assert dated(0.0, owner=other)  # another owner's report in this one's name: forged
    # at a fragment key, a holder is dead where it has no live report (throwaway owners), even a
    # readable owner key of a peer that never reported
    fragment_id = DHTID.generate(source=fragment_key(RUN, 0))
    assert not p0._poller.evictable(fragment_id, live_owner, b"holdings")
    assert p0._poller.evictable(fragment_id, _owner(5), b"holdings")
    stranger = Identity()
    assert peer_id_of_owner(stranger.owner_subkey) == stranger.peer_id  # readable: dead for not being live
    assert p0._poller.evictable(fragment_id, stranger.owner_subkey, b"holdings")
