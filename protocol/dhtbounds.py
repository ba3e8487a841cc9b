"""Bounds on what this node's DHT holds for one key and sends in one reply.

hivemind's local storage keeps any number of subkeys under a key, and its ``rpc_find`` answers
with everything it holds for every key asked: a key bloated past p2pd's 4 MiB message limit made
each reply that named it fail to send, and the asker then dropped the answering node from its
routing table. One subkey per owner and key, and values of at most ``records.MAX_RECORD_BYTES``,
are checked by every node's validator (``records.RunKeysValidator``); this module bounds the
rest, where the records are held and answered:

- ``BoundedLocalStorage``: at most ``MAX_KEY_RECORDS`` subkeys and ``MAX_KEY_BYTES`` bytes under
  one key; a new subkey beyond either takes the room of records the node calls dead
  (``evictable``: a progress record older than the liveness TTL, a holder that is not live), the
  largest first, then, where the newcomer's record is within its fair share (12 KiB, above any
  honest record), of live records larger than that share, the largest first; it is refused where
  they are not enough (an owner refreshing or withdrawing its record always may), so dead records
  never keep a live one out, and live identities keep a newcomer of honest size out only by
  holding the key with records of at most the fair share (about 170 of them), however large
  theirs are beyond it; its expiration heaps are compacted, so refreshes of the same records do
  not grow them.
- ``search_beam``: the nodes a poll's search keeps asking, the replicas' number (a store's, twice).
- ``budget_find_replies``: one ``rpc_find`` reply stays under ``MAX_FIND_REPLY_BYTES`` whatever the
  number of keys asked: a dictionary over its share keeps its smallest records (ties drawn at
  random), so a lookup of any key survives a bloated one.

Threads: both run on the transport's event-loop thread, where hivemind touches its storage.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Awaitable, Callable

from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID, BinaryDHTValue, Subkey
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import DHTExpiration, TimedStorage

__all__ = [
    "MAX_FIND_REPLY_BYTES", "MAX_KEY_BYTES", "MAX_KEY_RECORDS", "BoundedLocalStorage", "bound_dht",
    "budget_find_replies", "count_served", "search_beam", "trim_find_response",
]  # fmt: skip

MAX_KEY_RECORDS = 512  # subkeys under one key: a record per peer of a swarm of up to 512
MAX_KEY_BYTES = 2 << 20  # bytes under one key (subkeys and values): far below p2pd's 4 MiB
MAX_FIND_REPLY_BYTES = 3 << 20  # one reply, all keys together, leaving room for neighbours
# a record no larger than this is never displaced by a live newcomer: above every honest record
# (a full holdings record, 32 offers, a certificate, 4 relay addresses and a 4096-bit owner key,
# is under 9 KB), and half a record's cap, so that 170 live owners at most fill a key with it
FAIR_RECORD_BYTES = 12 << 10
_RESULT_OVERHEAD = 4096  # a result's neighbour ids and framing, besides its value


def search_beam(node: DHTNode, store: bool = False) -> int:
    """The beam a poll's search keeps (``store``: a store's search for the nodes to store on):
    as many nodes as a record is stored on (hivemind's ``num_replicas``, 5), twice that for a
    store, so that a store whose nearest nodes left still finds live ones to hold the record (a
    poll that misses a replica polls again within the round). hivemind's default is a bucket
    (20): in a swarm of up to 20 every store and every poll then asked every node, and each node
    answered finds per round in proportion to N (bench/dht_load.py)."""
    return node.num_replicas * (2 if store else 1)


def _compact(storage: TimedStorage) -> None:
    """Drop the heap entries of records replaced or gone: every store pushes one, even a refused
    refresh, and they otherwise stay until their expiration time comes round (an hour)."""
    if len(storage.expiration_heap) > 2 * len(storage.data) + 64:
        storage.expiration_heap = [storage.key_to_heap[key] for key in storage.data]
        heapq.heapify(storage.expiration_heap)


def _record_bytes(subkey: Subkey, value: BinaryDHTValue) -> int:
    return (len(subkey) if isinstance(subkey, bytes | str) else 64) + len(value)


# whether a held record (key, serialized subkey, signed value as stored) may give its room to a
# new one: the node's own judgement of what is dead (``polling.Poller.evictable``)
Evictable = Callable[[DHTID, Subkey, BinaryDHTValue], bool]


class BoundedLocalStorage(DHTLocalStorage):
    """hivemind's ``DHTLocalStorage`` with a bound on each key: ``max_records`` subkeys and
    ``max_bytes`` bytes (a plain value counts its bytes too).

    Args:
        maxsize: the most keys held (None: no bound but the validators', which admit only the
            run's keys), as in hivemind.
        max_records: subkeys one key may hold.
        max_bytes: bytes of subkeys and values one key may hold.
        evictable: which held records a new subkey of a full key may displace (None: none).
    """

    def __init__(
        self,
        maxsize: int | None = None,
        *,
        max_records: int = MAX_KEY_RECORDS,
        max_bytes: int = MAX_KEY_BYTES,
        evictable: Evictable | None = None,
    ) -> None:
        super().__init__(maxsize)
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.evictable = evictable
        self.evicted = 0  # held records that gave their room to a new one

    def store(
        self, key: DHTID, value: BinaryDHTValue, expiration_time: DHTExpiration, subkey: Subkey | None = None
    ) -> bool:
        if subkey is None and isinstance(value, bytes) and len(value) > self.max_bytes:
            return False
        stored = super().store(key, value, expiration_time, subkey)
        _compact(self)
        return stored

    def store_subkey(
        self, key: DHTID, subkey: Subkey, value: BinaryDHTValue, expiration_time: DHTExpiration
    ) -> bool:
        size = _record_bytes(subkey, value)
        if size > self.max_bytes:
            return False
        held = self.get(key)
        if held is not None and isinstance(held.value, DictionaryDHTValue):
            entries = held.value
            previous = entries.get(subkey)
            total = sum(_record_bytes(s, item.value) for s, item in entries.items())
            if previous is None:
                if len(entries.data) >= self.max_records or total + size > self.max_bytes:
                    if not self._make_room(key, subkey, value, entries, total, size):
                        return False  # a new subkey: the key is full of live records, or it is dead
            elif total - _record_bytes(subkey, previous.value) + size > self.max_bytes:
                return False
            stored = super().store_subkey(key, subkey, value, expiration_time)
            _compact(entries)
        else:
            stored = super().store_subkey(key, subkey, value, expiration_time)
        _compact(self)
        return stored

    def _make_room(
        self, key: DHTID, subkey: Subkey, value: BinaryDHTValue, entries: DictionaryDHTValue, total: int,
        size: int,
    ) -> bool:  # fmt: skip
        """Drop records of a full key until a new live one of ``size`` bytes fits: dead ones (the
        largest first), then, for a newcomer within its fair share of the key's bytes
        (``FAIR_RECORD_BYTES``, 12 KiB), live ones over that share (the largest first), so that
        live identities with bloated records fill no more than their share each; nothing is
        dropped for a dead newcomer, or where all that may go would not make room."""
        evictable = self.evictable
        if evictable is None or evictable(key, subkey, value):
            return False
        dead = [(_record_bytes(s, e.value), s) for s, e in entries.items() if evictable(key, s, e.value)]
        dead.sort(key=lambda pair: pair[0], reverse=True)  # the largest first
        fair = FAIR_RECORD_BYTES
        if size <= fair:
            gone = {s for _, s in dead}
            sizes = ((_record_bytes(s, e.value), s) for s, e in entries.items() if s not in gone)
            bloated = [(n, s) for n, s in sizes if n > fair]
            dead += sorted(bloated, key=lambda pair: pair[0], reverse=True)
        count, drop = len(entries.data), []
        for record_bytes, subkey in dead:
            if count < self.max_records and total + size <= self.max_bytes:
                break
            drop.append(subkey)
            count, total = count - 1, total - record_bytes
        if count >= self.max_records or total + size > self.max_bytes:
            return False
        for subkey in drop:
            del entries[subkey]
        self.evicted += len(drop)
        return True


def bound_dht(
    protocol: DHTProtocol, served: Counter[str] | None = None, evictable: Evictable | None = None
) -> None:
    """Replace ``protocol``'s storage and cache by bounded ones holding what they held (within the
    bounds), and budget its ``rpc_find`` replies. Call on the event-loop thread, right after the
    DHT node starts (no await between the copy and the swap: nothing is stored in between).

    Args:
        protocol: a running node's ``DHTProtocol`` (``DHTNode.protocol``).
        served: where to count the requests it answers, by kind (``count_served``).
        evictable: which held records a new subkey of a full key may displace.
    """
    for name in ("storage", "cache"):
        old: DHTLocalStorage = getattr(protocol, name)
        maxsize = None if old.maxsize == float("inf") else int(old.maxsize)
        new = BoundedLocalStorage(maxsize, evictable=evictable)
        for key, item in list(old.items()):
            if isinstance(item.value, DictionaryDHTValue):
                for subkey, entry in item.value.items():
                    new.store_subkey(key, subkey, entry.value, entry.expiration_time)
            else:
                new.store(key, item.value, item.expiration_time)
        setattr(protocol, name, new)
    budget_find_replies(protocol)
    if served is not None:
        count_served(protocol, served)


def count_served(protocol: DHTProtocol, served: Counter[str]) -> None:
    """Count each ``rpc_find`` and ``rpc_store`` that ``protocol`` answers into ``served``, by kind:
    those that passed the allowlist and swarm-key checks, which wrap the handlers outside this
    (pings are not counted: hivemind's find and store handlers call ``rpc_ping`` themselves).

    Args:
        protocol: the node's ``DHTProtocol``.
        served: the counter.
    """
    for kind in ("find", "store"):
        handler = getattr(protocol, f"rpc_{kind}")

        async def counted(request, context, handler=handler, kind=kind):  # type: ignore[no-untyped-def]
            served[kind] += 1
            return await handler(request, context)

        setattr(protocol, f"rpc_{kind}", counted)


def budget_find_replies(protocol: DHTProtocol, budget: int = MAX_FIND_REPLY_BYTES) -> None:
    """Wrap ``protocol.rpc_find`` so that each reply it makes fits ``budget`` bytes
    (``trim_find_response``). hivemind's handler wrapper looks the method up at every call, and
    signs the reply (a private swarm's ticket) after this trims it.

    Args:
        protocol: the node's ``DHTProtocol``.
        budget: the most bytes one reply may take.
    """
    find: Callable[[dht_pb2.FindRequest, P2PContext], Awaitable[dht_pb2.FindResponse]] = protocol.rpc_find

    async def rpc_find(request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        return trim_find_response(await find(request, context), budget)

    protocol.rpc_find = rpc_find  # type: ignore[method-assign]


def trim_find_response(
    response: dht_pb2.FindResponse, budget: int, rng: random.Random | None = None
) -> dht_pb2.FindResponse:
    """``response`` within ``budget`` bytes: each result gets an equal share; a dictionary over
    its share keeps its smallest records (ties in random order) that fit, a plain value over it
    becomes "not found".

    Args:
        response: a reply of hivemind's ``rpc_find``.
        budget: the most bytes the reply may take.
        rng: the draw among records of equal size (a fresh one by default).
    """
    if response.ByteSize() <= budget or not response.results:
        return response
    rng = rng or random.Random()
    share = max(0, budget // len(response.results) - _RESULT_OVERHEAD)
    serializer = DHTProtocol.serializer
    for result in response.results:
        if len(result.value) <= share:
            continue
        if result.type == dht_pb2.FOUND_DICTIONARY:
            held = serializer.loads(result.value)
            items = [
                (len(subkey) + len(item.value), rng.random(), subkey, item) for subkey, item in held.items()
            ]
            items.sort(key=lambda entry: entry[:2])
            kept = DictionaryDHTValue()
            room = share - 64  # the dictionary's own framing
            for size, _, subkey, item in items:
                if size + 16 > room:
                    break
                room -= size + 16  # msgpack's framing of one entry and its expiration
                kept.store(subkey, item.value, item.expiration_time)
            result.value = serializer.dumps(kept)
        else:
            result.type = dht_pb2.NOT_FOUND
            result.value = b""
            result.expiration_time = 0
    return response
