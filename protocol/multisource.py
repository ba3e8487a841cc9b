"""Downloading a state snapshot from several holders at once.

Every peer that adopted a snapshot serves it on (``reserve_state``), so a popular snapshot has
many holders, and one holder's uplink need not carry every joiner. The snapshot is cut into
ranges of ``PIECE_BYTES``; each holder (up to ``MAX_SOURCES``) takes the next range nobody has
taken, and the ranges arrive side by side. A holder that fails or trickles leaves its range,
resumed where it stopped, to the others, and one slower than its share of the rate the download
needs to finish in its time (``state_min_rate``) is dropped for good after ``MIN_RATE_GRACE``:
a holder trickling at 5 kB/s held joiners for half an hour. The publisher's signed record names
each piece's hash (``wire.piece_hashes``): a piece that fails is fetched again from another
holder, and the one holder that sent it is named (``bad_hash``) and asked for nothing more, so a
lying re-server costs a piece, not a download. A piece two holders filled (one took it over from
the other) and that fails names neither: it is fetched again whole, from one holder. The hash of
the whole is checked once every range is in; bytes that fail it (or a record without piece
hashes) are fetched again the careful way (``Fetcher.fetch``: one holder at a time, which says
who sent them), never a wrong state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from cgad.protocol.errors import FragmentError
from cgad.protocol.fetching import MIN_RATE_GRACE, MIN_TRANSFER_RATE
from cgad.protocol.records import Holdings
from cgad.protocol.selection import Candidate
from cgad.protocol.wire import PIECE_BYTES, RangeAssembler, content_hash, piece_bounds

if TYPE_CHECKING:
    from cgad.protocol.fetching import Fetcher

__all__ = ["MAX_SOURCES", "PIECE_BYTES", "fetch_from_many", "state_min_rate"]

MAX_SOURCES = 4  # holders one download draws from at once
ENDGAME_SECONDS = 2.0  # a range under way this long may be taken over by a holder twice as fast
# a holder must deliver at least this share of its part of the rate that brings the whole in
# within the download's time (honest holders' rates vary; the others take over the rest); one
# holder at a time, most of the whole rate (a holder at 0.6 of it ran the download to its timeout
# before the next holder was tried; the rest is room for a slow start, counted in its average)
HOLDER_RATE_SHARE = 0.5
SEQUENTIAL_RATE_SHARE = 0.8


def _pieces(byte_length: int, hashes: list[bytes]) -> tuple[list[tuple[int, int]], list[bytes]]:
    """The pieces the publisher hashed (``wire.piece_bounds``) with their hashes, or ranges of
    ``PIECE_BYTES`` and no hashes where its record names none (or a count that fits no cut)."""
    if 1 <= len(hashes) <= byte_length:
        bounds = piece_bounds(byte_length, len(hashes))
        if len(bounds) == len(hashes):
            return bounds, list(hashes)
    ranges = [(start, min(start + PIECE_BYTES, byte_length)) for start in range(0, byte_length, PIECE_BYTES)]
    return ranges, []


def state_min_rate(byte_length: int, timeout: float, holders: int) -> float:
    """Bytes per second each of ``holders`` must deliver on average (after ``MIN_RATE_GRACE``):
    ``HOLDER_RATE_SHARE`` of its share of ``byte_length`` over ``timeout``
    (``SEQUENTIAL_RATE_SHARE`` of all of it from one holder at a time), and at least the
    fetcher's floor for any transfer. The timeout is the joiner's own (its link, the size it
    expects), so the floor is too, never the holder's.

    Args:
        byte_length: the snapshot's size (its record's claim: a larger claim only raises it).
        timeout: seconds the whole download may take.
        holders: holders drawn from at once (1: one at a time).
    """
    needed = byte_length / max(timeout, 1e-9) / max(holders, 1)
    return max(MIN_TRANSFER_RATE, (HOLDER_RATE_SHARE if holders > 1 else SEQUENTIAL_RATE_SHARE) * needed)


logger = logging.getLogger(__name__)


class _Progress:
    """What ``Fetcher.transfers`` shows of a download in ranges: bytes in, of how many."""

    def __init__(self, byte_length: int, pieces: list[RangeAssembler]) -> None:
        self.byte_length, self._pieces = byte_length, pieces

    @property
    def received(self) -> int:
        return sum(p.received - p.start for p in self._pieces)


async def fetch_from_many(
    fetcher: Fetcher, candidate: Candidate, timeout: float, passes: int
) -> bytes | bytearray:
    """The candidate's bytes, in ranges from up to ``MAX_SOURCES`` of its holders at once, within
    ``timeout``; from one holder at a time (``Fetcher.fetch``) when it has one holder or one
    range, or when the ranges fail the hash. ``FragmentError("unavailable")`` as ``fetch``.

    Args:
        fetcher: fetches each range (its paths, rate floor and rejections).
        candidate: the snapshot's record and holders.
        timeout: seconds for the whole download.
        passes: times each holder is tried (a busy one may have a slot a moment later).
    """
    offer = candidate.offer
    holders = list(candidate.holders[:MAX_SOURCES])
    if len(holders) < 2 or offer.byte_length <= PIECE_BYTES:
        return await fetcher.fetch(candidate, timeout, passes, state_min_rate(offer.byte_length, timeout, 1))
    min_rate = state_min_rate(offer.byte_length, timeout, len(holders))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    bounds, hashes = _pieces(offer.byte_length, offer.piece_hashes)
    pieces = [RangeAssembler(offer.content_hash, offer.byte_length, start, end) for start, end in bounds]
    filled_by: list[set[str]] = [set() for _ in pieces]  # the holders whose bytes each piece holds
    whole_only: set[int] = set()  # pieces that failed filled by two: never taken over again
    waiting = deque(pieces)  # ranges nobody is fetching now, resumed where they stopped
    gone: dict[str, str] = {}  # holders that no longer keep it, or trickled (why)
    # the range each worker fetches now: (its task, when it began, bytes in then)
    under_way: dict[int, tuple[asyncio.Task, float, int]] = {}
    rates: dict[str, float] = {}  # each holder's rate over its last whole range

    def slowest(rate: float) -> int | None:
        """A range under way that a holder at ``rate`` would finish in less than half the time
        its own holder needs: the endgame, where one slow holder would hold up the whole."""
        now, best = loop.time(), None
        for index, (task, began, at_start) in under_way.items():
            piece, elapsed = pieces[index], now - began
            theirs = (piece.received - at_start) / elapsed if elapsed > 0 else 0.0
            if index in whole_only:
                continue
            if elapsed > ENDGAME_SECONDS and rate > 2 * theirs and task is not asyncio.current_task():
                left = piece.end - piece.received
                best = index if best is None or left > pieces[best].end - pieces[best].received else best
        return best

    verified: set[int] = set()  # complete pieces whose hash was checked (or that have none)
    checking: set[int] = set()  # being hashed now

    def finished() -> bool:
        return len(verified) == len(pieces)

    async def verify(index: int) -> str | None:
        """Check a complete piece against its hash; where it fails, put it back to be fetched
        again and name the one holder that sent it, which is returned (None: sound, or nobody
        to name). Cancelled meanwhile, the piece waits unchecked for the next worker."""
        piece = pieces[index]
        checking.add(index)
        try:
            sound = not hashes or await asyncio.to_thread(piece.digest) == hashes[index]
        finally:
            checking.discard(index)
        if sound:
            verified.add(index)
            return None
        culprits, filled_by[index] = filled_by[index], set()
        piece.restart()
        waiting.appendleft(piece)
        if len(culprits) != 1:  # who sent the wrong part is not known: one holder next time
            whole_only.add(index)
            fetcher.reject("bad_hash", f"{candidate.key}: piece {index} from {sorted(culprits)}")
            return None
        (liar,) = culprits
        gone[liar] = "bad_hash"
        fetcher.reject("bad_hash", f"{candidate.key}: piece {index} from {liar}", liar)
        return liar

    async def pull(holder: Holdings) -> None:
        while not finished() and gone.get(holder.peer_id) != "bad_hash":
            unchecked = [i for i, p in enumerate(pieces) if p.complete and i not in verified | checking]
            if unchecked:  # completed by a worker cancelled before it could check it
                if await verify(unchecked[0]) == holder.peer_id:
                    return
                continue
            if not waiting:
                # every range is taken: help where a holder is far slower than this one, by
                # taking its range over from where it is (its worker ends; it was slow)
                index = slowest(rates.get(holder.peer_id, 0.0))
                if index is not None:
                    under_way[index][0].cancel()
                await asyncio.sleep(ENDGAME_SECONDS / 4)
                continue
            piece = waiting.popleft()
            index = pieces.index(piece)
            before, started = piece.received, loop.time()
            under_way[index] = (asyncio.current_task(), started, before)  # type: ignore[assignment]
            try:
                await fetcher.fetch_from(holder, piece, min_rate=min_rate)
            except FragmentError as error:  # not_held: it keeps none of it any more
                logger.debug("holder %s: %s", holder.peer_id, error)
                gone[holder.peer_id] = "not_held"
            finally:
                del under_way[index]
                if piece.received > before:
                    filled_by[index].add(holder.peer_id)
                if not piece.complete:
                    waiting.appendleft(piece)  # the others take it over from here, cancelled or not
            elapsed = loop.time() - started
            if piece.complete:
                if await verify(index) == holder.peer_id:
                    return
                rates[holder.peer_id] = (piece.received - before) / max(elapsed, 1e-9)
                continue
            if elapsed > MIN_RATE_GRACE and piece.received - before < min_rate * elapsed:
                gone[holder.peer_id] = "slow"  # it trickled: another pass would only trickle again
            return

    fetcher.transfers[candidate.key] = _Progress(offer.byte_length, pieces)  # type: ignore[assignment]
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                for attempt in range(passes):
                    workers = [pull(h) for h in holders if h.peer_id not in gone]
                    # a worker cancelled in the endgame has left its range to a faster one
                    await asyncio.gather(*workers, return_exceptions=True)
                    if finished() or len(gone) == len(holders):
                        break
                    if attempt + 1 < passes:
                        await asyncio.sleep(2.0)
    finally:
        del fetcher.transfers[candidate.key]
    if all(piece.complete for piece in pieces):
        data = b"".join(piece.finish() for piece in pieces)
        if await asyncio.to_thread(content_hash, data) == offer.content_hash:
            return data
        fetcher.reject("bad_hash", f"{candidate.key}: ranges from {len(holders)} holders; fetching it again")
    left = deadline - loop.time()
    blamed = {peer: why for peer, why in gone.items() if why != "not_held"}
    if left <= 0:
        done = sum(p.received - p.start for p in pieces)
        raise FragmentError(
            "unavailable",
            f"{candidate.key}: timed out after {timeout:.0f} s at {done / 1e6:.1f} of"
            f" {offer.byte_length / 1e6:.1f} MB ({len(holders)} holder(s) at once)",
            blamed,
        )
    # what the ranges could not give: one holder at a time, with the blame where it belongs (a
    # holder is judged by the rate the whole download needed, not by what the ranges left), and
    # none of those the ranges found at fault, which stay blamed however the rest ends
    rest = replace(candidate, holders=[h for h in candidate.holders if h.peer_id not in blamed])
    try:
        return await fetcher.fetch(rest, left, passes, state_min_rate(offer.byte_length, timeout, 1))
    except FragmentError as error:
        raise FragmentError(error.reason, error.detail, {**blamed, **error.blamed}) from error
