"""The encoded fragments a peer serves: its own recent versions and others' it re-serves; and
state snapshots (kind STATE): its own latest and the one it adopted, which it re-serves.

Threads: a ``FragmentStore`` is shared. The event-loop thread ("cgad-net-*") puts fragments in
and reads them to serve and announce; the trainer's thread (and tools) may read or discard. Its
lock guards the index; a ``StoredFragment`` is never changed once stored.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.records import MAX_OFFERS, Offer
from cgad.protocol.transport import FragmentKey, Kind

__all__ = ["FragmentStore", "StoredFragment", "fragment_header"]

_KIND_TO_PB = {Kind.DELTA: pb.DELTA, Kind.PARAMS: pb.PARAMS, Kind.STATE: pb.STATE}


@dataclass
class StoredFragment:
    header: pb.FragmentHeader  # what a fetcher receives first
    data: bytes | bytearray  # the encoded bytes, whose sha256 is ``header.content_hash``
    offer: Offer  # what this peer announces for it
    own: bool  # published by this peer (else fetched, and re-served)


def fragment_header(key: FragmentKey, offer: Offer) -> pb.FragmentHeader:
    """The header a holder sends ahead of an offer's bytes."""
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


class FragmentStore:
    """Encoded fragments by content hash, bounded per fragment: the newest ``keep_own`` own
    versions per fragment and kind, and the newest ``keep_reserved`` others'. Of state
    snapshots (the size of the model), the two newest own ones and one other."""

    def __init__(self, keep_own: int, keep_reserved: int) -> None:
        self.keep_own = keep_own
        self.keep_reserved = keep_reserved
        self._by_hash: dict[bytes, StoredFragment] = {}
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> StoredFragment | None:
        with self._lock:
            return self._by_hash.get(digest)

    def put(self, entry: StoredFragment) -> None:
        """Store ``entry``, dropping the oldest base versions of its group beyond the bound."""
        header = entry.header
        state = header.kind == pb.STATE
        with self._lock:
            self._by_hash[header.content_hash] = entry
            if state:
                group = [
                    e for e in self._by_hash.values() if e.own == entry.own and e.header.kind == pb.STATE
                ]
                # own: the newest and the one before, which a joiner may have seen a poll ago
                keep = 2 if entry.own else 1
            elif entry.own:
                group = [
                    e
                    for e in self._by_hash.values()
                    if e.own and e.header.fragment == header.fragment and e.header.kind == header.kind
                ]
                keep = self.keep_own
            else:
                group = [
                    e
                    for e in self._by_hash.values()
                    if not e.own and e.header.fragment == header.fragment and e.header.kind != pb.STATE
                ]
                keep = self.keep_reserved
            group.sort(key=lambda e: e.header.base_version)
            for old in group[: max(0, len(group) - keep)]:
                del self._by_hash[old.header.content_hash]

    def discard(self, digest: bytes) -> None:
        with self._lock:
            self._by_hash.pop(digest, None)

    def offers(self, fragment: int | None) -> list[Offer]:
        """What to announce for a fragment (None: for state snapshots): own versions first,
        newest first, at most ``MAX_OFFERS`` (what a record may carry)."""
        with self._lock:
            if fragment is None:
                entries = [e for e in self._by_hash.values() if e.header.kind == pb.STATE]
            else:
                entries = [
                    e
                    for e in self._by_hash.values()
                    if e.header.fragment == fragment and e.header.kind != pb.STATE
                ]
        entries.sort(key=lambda e: (not e.own, -e.header.base_version))
        return [e.offer for e in entries[:MAX_OFFERS]]
