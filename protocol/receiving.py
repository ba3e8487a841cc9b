"""Receiving: fetch the queued offers, decode and check what arrives, deliver it, offer it onward.

The poller (``polling``) queues the offers worth fetching; a ``Receiver`` starts their fetches
youngest first, at most ``max_fetches`` at a time, passing over those that could no longer count
(``scheduling``), pulls the bytes (``fetching``), decodes and validates them on the codec worker,
puts what passes into the inbox and the store, and has this peer announced as one more holder. A
snapshot download has the downlink to itself: fragment fetches stop and wait for its end.

Threads: a ``Receiver`` lives on the transport's event-loop thread. The closing thread sets
``closed`` once; ``progress`` returns a reference that the trainer's thread replaces whole.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import torch

from cgad.protocol.codec import Codec, decode, kept_in
from cgad.protocol.config import NetworkOptions
from cgad.protocol.errors import FragmentError
from cgad.protocol.event_thread import EventLoopThread
from cgad.protocol.fetching import Fetcher
from cgad.protocol.multisource import fetch_from_many
from cgad.protocol.records import Progress
from cgad.protocol.scheduling import FetchQueue, LinkMeter, VersionClock
from cgad.protocol.selection import Candidate, OfferSelector
from cgad.protocol.store import FragmentStore, StoredFragment, fragment_header
from cgad.protocol.transport import Fragment, FragmentKey, Inbox, Kind, TransportStats

__all__ = ["STATE_PASSES", "Receiver", "decode_and_check"]

STATE_PASSES = 5  # a snapshot's holders are tried this many times over (busy ones free up)


def decode_and_check(data: bytearray, numel: int, max_norm: float | None) -> torch.Tensor:
    """The fp32 tensor in ``data``, refused (``FragmentError``) unless it is 1-D with ``numel``
    finite floating-point values and, with ``max_norm``, an L2 norm no larger."""
    tensor = decode(data)
    if tensor.dim() != 1 or tensor.numel() != numel:
        raise FragmentError("bad_shape", f"shape {tuple(tensor.shape)}, expected ({numel},)")
    if not tensor.is_floating_point():
        raise FragmentError("bad_dtype", str(tensor.dtype))
    tensor = tensor.float()
    # on the final values: a finite payload can still overflow in the widening cast or the
    # block scaling, and nothing non-finite may reach an outer step
    norm = float(torch.linalg.vector_norm(tensor))
    if not math.isfinite(norm):
        raise FragmentError("non_finite", "the decoded values hold NaN or Inf")
    if max_norm is not None:
        if not norm <= max_norm:
            raise FragmentError("norm_too_large", f"norm {norm:.4g} > {max_norm:.4g}")
    return tensor


class Receiver:
    """The fetch queue, the fetches in flight, and what becomes of their bytes. ``progress``
    returns this peer's latest own report (its versions judge what may still count), ``reject``
    counts a refusal (blaming the publisher named, if any), and ``announce`` re-announces this
    peer's holdings of a fragment. ``stale_after`` is ``NetworkTransport``'s: the age (in versions
    of this peer's own fragment) from which a delivery no longer counts; None: every age counts."""

    def __init__(
        self,
        options: NetworkOptions,
        *,
        stats: TransportStats,
        store: FragmentStore,
        inbox: Inbox,
        fetcher: Fetcher,
        selector: OfferSelector,
        version_clock: VersionClock,
        runner: EventLoopThread,
        codec_worker: Executor,
        progress: Callable[[], Progress],
        reject: Callable[[str, str, str | None], None],
        announce: Callable[[int], None],
        stale_after: int | None,
    ) -> None:
        self.options = options
        self.stats = stats
        self.store = store
        self.closed = False  # set by the transport's close: no fetch starts after it
        self._inbox = inbox
        self._fetcher = fetcher
        self._selector = selector
        self._version_clock = version_clock
        self._runner = runner
        self._codec_worker = codec_worker
        self._progress = progress
        self._reject = reject
        self._announce = announce
        self._queue = FetchQueue(stale_after)
        self._downlink = LinkMeter()
        self._in_flight: dict[FragmentKey, tuple[asyncio.Task, Candidate]] = {}
        self._metered = (0, False)  # bytes fetched and whether a fetch ran, at the last reading
        self._fetching_state = False  # set while a snapshot downloads
        # deliveries per (publisher, path): "direct" when the publisher was the only holder
        # listed, "re-served" when peers that hold its bytes were listed (and tried) first
        self.paths: Counter[tuple[str, str]] = Counter()

    @property
    def downlink_rate(self) -> float | None:
        """Bytes per second the downlink carried while fetching (None before it is measured)."""
        return self._downlink.rate

    @property
    def waiting(self) -> int:
        """Offers queued for a fetch slot."""
        return len(self._queue)

    # ---------------------------------------------------------------- what the poller hands over

    def enqueue(self, candidate: Candidate) -> None:
        """Queue an offer to fetch (a full queue drops its oldest, counted ``queue_full``)."""
        dropped = self._queue.push(candidate)
        if dropped is not None:
            self.stats.skipped["queue_full"] += 1
            self._selector.release(dropped)

    def cancel_stale(self, versions: Sequence[int]) -> None:
        """Cancel the fetches in flight whose fragment could no longer count when it lands."""
        for task, candidate in list(self._in_flight.values()):
            if self._queue.is_stale(candidate, versions):
                task.cancel()
                self.stats.skipped["stale_in_flight"] += 1

    def dispatch(self) -> None:
        """Start queued fetches, youngest first, while fewer than ``max_fetches`` run (none while
        a state download runs)."""
        if self.closed or self._fetching_state:
            return
        self._meter()
        versions = self._progress().versions
        while len(self._in_flight) < self.options.max_fetches:
            now = time.monotonic()
            ahead = sum(a.byte_length - a.received for a in list(self._fetcher.transfers.values()))
            candidate, passed = self._queue.pop(
                versions,
                link_rate=self._downlink.current(now, idle=not self._in_flight),
                seconds_per_version=self._version_clock.seconds_per_version,
                bytes_ahead=ahead,
            )
            for item in passed:
                self.stats.skipped[item.reason] += 1
                self._selector.release(item.candidate)
            if candidate is None:
                break
            task = self._runner.spawn(self._fetch(candidate))
            self._in_flight[candidate.key] = (task, candidate)
            self._metered = (self._metered[0], True)

    # ---------------------------------------------------------------- fetching and accepting

    def _meter(self) -> None:
        """Feed the downlink meter what arrived since its last reading."""
        fetched, was_busy = self._metered
        self._downlink.update(time.monotonic(), self._fetcher.bytes_in - fetched, was_busy)
        self._metered = (self._fetcher.bytes_in, bool(self._in_flight))

    async def _fetch(self, candidate: Candidate) -> None:
        try:
            data = await self._fetcher.fetch(candidate)
        except FragmentError as error:
            # bytes that never came are no proof against the publisher (a slow link, a holder
            # that left, a crowd of false holders): only what it vouched for and was refused is
            blame = None if error.reason == "unavailable" else candidate.key.publisher
            self._reject(error.reason, f"from {candidate.key.publisher}: {error.detail}", blame)
            if error.reason == "unavailable":  # a publisher behind NAT: its re-servers may come
                self._selector.retry_later(candidate)
            else:
                self._selector.release(candidate)
            return
        except asyncio.CancelledError:  # stale, or a state download took the link
            self._selector.release(candidate)
            raise
        finally:
            self._in_flight.pop(candidate.key, None)
            self.dispatch()
        direct = [h.peer_id for h in candidate.holders] == [candidate.key.publisher]
        self.paths[(candidate.key.publisher, "direct" if direct else "re-served")] += 1
        await self._accept(candidate, data)

    async def _accept(self, candidate: Candidate, data: bytearray) -> None:
        """Decode and validate off the loop; deliver; offer the bytes onward."""
        key, offer = candidate.key, candidate.offer
        try:
            decoding = self._runner.loop.run_in_executor(
                self._codec_worker, decode_and_check, data, offer.numel, self.options.max_norm
            )
        except RuntimeError:  # closing: the codec worker takes no more work
            return
        try:
            tensor = await decoding
        except FragmentError as error:
            self._reject(error.reason, f"{key} from {key.publisher}: {error.detail}", key.publisher)
            self._selector.release(candidate)
            return
        if not self._selector.deliver(key, offer.content_hash):  # a second announcement raced this
            if key.kind is Kind.DELTA:
                self._reject("replay", f"{key} delivered already", None)
            return
        kept = kept_in(data) if offer.codec == Codec.SPARSE else None
        self._inbox.put(Fragment(key=key, tensor=tensor, tokens=offer.tokens, kept=kept))
        self.stats.received += 1
        self.stats.bytes_received += len(data)
        self.store.put(StoredFragment(fragment_header(key, offer), data, offer, own=False))
        self._announce(key.fragment)

    # ---------------------------------------------------------------- a snapshot

    async def fetch_state(self, candidate: Candidate, timeout: float) -> bytearray:
        """A snapshot's bytes, verified against its publisher's record."""
        # The state is what this peer needs before anything else: no fragment fetch shares the
        # downlink with it (a 1 Mbit joiner's download ran at a quarter of its link beside them),
        # and those under way stop; fragments fetched now would be of versions it is leaving.
        self._meter()  # what came before; the download's bytes count as busy time on the link
        self._metered = (self._metered[0], True)
        self._fetching_state = True
        for task, _ in list(self._in_flight.values()):
            task.cancel()
            self.stats.skipped["for_state"] += 1
        before = self._fetcher.bytes_in
        try:
            return await fetch_from_many(self._fetcher, candidate, timeout, STATE_PASSES)
        finally:
            self.stats.bytes_received += self._fetcher.bytes_in - before  # what crossed the wire for it
            self._fetching_state = False
            self.dispatch()
