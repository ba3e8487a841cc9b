"""The encoded fragments a peer serves: its own recent versions and others' it re-serves; and
state snapshots (kind STATE): its own latest and the one it adopted, which it re-serves.

Threads: a ``FragmentStore`` is shared. The event-loop thread ("cgad-net-*") puts fragments in
and reads them to serve and announce; the trainer's thread (and tools) may read or discard. Its
lock guards the index; a ``StoredFragment`` is never changed once stored.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.records import MAX_OFFERS, Offer
from cgad.protocol.transport import FragmentKey, Kind

__all__ = ["FragmentStore", "StoredFragment", "fragment_header"]

_KIND_TO_PB = {Kind.DELTA: pb.DELTA, Kind.PARAMS: pb.PARAMS, Kind.STATE: pb.STATE, Kind.MOMENTS: pb.MOMENTS}
# A snapshot served in the last STATE_RESUME seconds outlives newer ones (at most STATE_EXTRA of
# them): on a slow link a joiner's download spans rounds, and a blob replaced under it cannot be
# resumed (on 2 Mbit a joiner lost 3.1 of 7.7 MB twice that way, then gave up)
STATE_RESUME = 120.0
STATE_EXTRA = 2
# Of a peer's fragments this peer re-serves, the newest versions kept per publisher, fragment and
# kind: a fragment is fetched onward within a round or two of its version (a volunteer behind NAT
# reaches the others only through those that re-serve it), and older ones of the same publisher
# were host memory held for nothing (with two volunteers, 8 slots held 4 versions of each)
RESERVED_VERSIONS = 2
# Others' fragments kept to re-serve hold at most this many bytes per value of the fragment: two
# float32 copies of it (two peers' φ, or fourteen 4bit deltas). Counted in fragments alone, 8
# peers' φ in float32 were 32 bytes a parameter of host memory (1 GB at 26M parameters)
RESERVED_BYTES_PER_VALUE = 8
_HEADER_BYTES = 256  # allowed per kept fragment beyond its values: an encoding's header and shape


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
    versions per fragment and kind, and of others' the newest ``keep_reserved``, at most
    ``reserved_versions`` versions of each publisher and kind among them and at most
    ``RESERVED_BYTES_PER_VALUE`` bytes a value together. Of state snapshots (the size of the
    model), the two newest own ones and one other.

    Args:
        keep_own: own versions kept per fragment and kind.
        keep_reserved: others' fragments kept per fragment, of any publisher and kind.
        reserved_versions: of those, the newest versions kept per publisher and kind.
    """

    def __init__(self, keep_own: int, keep_reserved: int, reserved_versions: int = RESERVED_VERSIONS) -> None:
        self.keep_own = keep_own
        self.keep_reserved = keep_reserved
        self.reserved_versions = reserved_versions
        self._by_hash: dict[bytes, StoredFragment] = {}
        self._state_read: dict[bytes, float] = {}  # a snapshot's last read (monotonic seconds)
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> StoredFragment | None:
        """The entry with this content hash (a snapshot's read is noted: ``STATE_RESUME``)."""
        with self._lock:
            entry = self._by_hash.get(digest)
            if entry is not None and entry.header.kind == pb.STATE:
                self._state_read[digest] = time.monotonic()
            return entry

    def reading(self, digest: bytes) -> None:
        """A snapshot is still being read: a download longer than ``STATE_RESUME`` keeps it too."""
        with self._lock:
            if digest in self._state_read:
                self._state_read[digest] = time.monotonic()

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
            surplus = group[: max(0, len(group) - keep)]
            if not state and not entry.own:
                dropped = {id(e) for e in surplus}
                surplus += self._older_versions([e for e in group if id(e) not in dropped])
                dropped = {id(e) for e in surplus}
                surplus += self._over_budget([e for e in group if id(e) not in dropped], entry)
            if state:
                now = time.monotonic()
                read = [
                    e
                    for e in surplus
                    if now - self._state_read.get(e.header.content_hash, -1e9) < STATE_RESUME
                ]
                spared = {id(e) for e in read[-STATE_EXTRA:]}
                surplus = [e for e in surplus if id(e) not in spared]
            for old in surplus:
                del self._by_hash[old.header.content_hash]
                self._state_read.pop(old.header.content_hash, None)

    def _older_versions(self, entries: list[StoredFragment]) -> list[StoredFragment]:
        """Of others' ``entries`` (sorted by base version), those beyond each publisher's and
        kind's newest ``reserved_versions``."""
        kept: dict[tuple[str, int], int] = {}
        older = []
        for e in reversed(entries):
            source = (e.offer.publisher, e.header.kind)
            kept[source] = kept.get(source, 0) + 1
            if kept[source] > self.reserved_versions:
                older.append(e)
        return older

    def _over_budget(self, entries: list[StoredFragment], stored: StoredFragment) -> list[StoredFragment]:
        """Of others' ``entries`` (sorted by base version), the oldest beyond
        ``RESERVED_BYTES_PER_VALUE`` bytes a value of the fragment (``stored``, just put, says its
        size); the newest version always stays, a late old one goes first."""
        budget = RESERVED_BYTES_PER_VALUE * stored.offer.numel + _HEADER_BYTES * max(self.keep_reserved, 1)
        total = sum(len(e.data) for e in entries)
        over = []
        for e in entries[:-1]:
            if total <= budget:
                break
            over.append(e)
            total -= len(e.data)
        return over

    def discard(self, digest: bytes) -> None:
        with self._lock:
            self._by_hash.pop(digest, None)
            self._state_read.pop(digest, None)

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
