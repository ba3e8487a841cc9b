"""When chosen offers are fetched: newest first, a few at a time, and only what can still count.

A slow link cannot carry every peer's fragment every round. Started all at once, the transfers
share the link and all arrive late, past the age at which the outer step still uses them (the
first testbed runs applied 3-5% of fragments at 2 Mbit with the link full). So fetches wait in a
``FetchQueue`` and at most ``max_fetches`` run at a time; the queue hands out the youngest offer
first (the one that stays useful longest) among those at or below this peer's own version, then
those ahead of it (the nearest first: a claim of a future version is not preferred), passes over
an offer that the measured link would deliver only after it has aged past ``stale_after``
versions, and the transport cancels a fetch in flight once its fragment is that old. The link
carries fewer fragments, in full and in time.

Two measurements feed it: ``LinkMeter``, the bytes per second the downlink carries while any
fetch runs, and ``VersionClock``, the seconds this peer takes per version of a fragment.

The same two size what this peer sends under ``--codec auto`` (``round_budget``, ``auto_codec``):
each round's pseudo-gradients in 4bit where the link carries them to every fetching peer within
a share of the round, else sparse with as many values per block as fit. A slow link then carries
every peer's fragment each round, fresh, instead of a few of them late.

Pure bookkeeping: no I/O, no clock of its own (times come in as arguments), as in ``selection``.

Threads: not thread-safe; the network transport uses all three on its event-loop thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from cgad.protocol.codec import Codec, encoded_size
from cgad.protocol.config import AUTO_DENSE, SPARSE_KEPT
from cgad.protocol.selection import Candidate, own_version
from cgad.protocol.transport import Kind

__all__ = ["FetchQueue", "LinkMeter", "VersionClock", "auto_codec", "poll_pause", "round_budget"]

# --codec auto: the share of a round's link time (at the measured downlink rate) this peer's
# pseudo-gradients may take. A peer's fragment counts fresh only if it lands before the
# receiver's next turn, which comes anywhere within a round of the publish, and peers publish at
# about the same moment, so transfers bunch up. On the testbed (4 nodes, 10 Mbit, docs/WAN.md),
# in shares of the nominal link: 4bit deltas taking 65% at H = 10 arrived at mean age 0.56-0.87,
# 2bit (33%) 0.35-0.53, sparse k = 16 (16%) 0.24-0.34, 4bit at H = 50 (13%) 0.00-0.05. The meter
# reads 0.54-0.70 of the nominal rate there (a fetch shares its holder's uplink with the holder's
# other fetchers), so 0.3 of the measured rate is about a fifth of the link.
AUTO_LINK_SHARE = 0.3
# the values per block auto sends: a few levels, each about 1.4 times the last, so that peers on
# similar links send the same k (a delivery at another k than the own is judged against the own Δ
# picked again at its k: an extra top-k pass per distinct k and round). Never fewer than 4: a
# link measured on small, latency-bound transfers reads slower than it is, and smaller sends
# would read slower still
AUTO_KEPT = (4, 6, 8, 12, 16, 24, 32, 48, 64)
AUTO_MIN_KEPT = AUTO_KEPT[0]


def round_budget(
    link_rate: float | None, seconds_per_round: float | None, fetchers: int, latency: float = 0.0
) -> float | None:
    """Bytes of this peer's pseudo-gradients per round that each of ``fetchers`` peers can get
    in time: ``AUTO_LINK_SHARE`` of what the link carries in a round less ``latency`` (the
    seconds a delivery takes whatever its size: being seen, asked for), split among them. None
    until both the link and the round are measured; infinite with nobody to send to."""
    if fetchers < 1:
        return float("inf")
    if not link_rate or not seconds_per_round:
        return None
    return AUTO_LINK_SHARE * link_rate * max(seconds_per_round - latency, 0.0) / fetchers


def auto_codec(numel: int, budget: float | None) -> tuple[Codec, int]:
    """How ``--codec auto`` sends a pseudo-gradient of ``numel`` values in at most ``budget``
    bytes: ``AUTO_DENSE`` (4bit) when it fits; else ``sparse`` with the most values per block of
    ``AUTO_KEPT`` that fit (at least ``AUTO_MIN_KEPT``). Before anything is measured (None):
    4bit, since the first rounds are where sparse costs most (a coordinate a round leaves out
    waits rounds, and early deltas are the largest: on the testbed a first node that sent sparse
    until its link was measured ended 0.12 above the same swarm in 4bit), and the first fetch
    measures the link. Returns the codec and its values per block (meaningful for sparse only)."""
    if budget is None or encoded_size(numel, AUTO_DENSE) <= budget:
        return Codec(AUTO_DENSE), SPARSE_KEPT
    for kept in reversed(AUTO_KEPT[1:]):
        if encoded_size(numel, Codec.SPARSE, kept=kept) <= budget:
            return Codec.SPARSE, kept
    return Codec.SPARSE, AUTO_MIN_KEPT


class LinkMeter:
    """Bytes per second over the time at least one transfer was running: an exponential mean of
    windows of at least ``window`` seconds, each weighted by its length (``half_life`` seconds of
    busy time halve an old window's weight). None until the first window closes.

    A rate says what the link did while it was measured: one slow first fetch (a dial that took
    seconds, a path since replaced) would otherwise judge every later offer too late to fetch, so
    that nothing is fetched and the rate is never measured again. ``current`` forgets a rate no
    transfer has refreshed in ``remeasure_after`` seconds while the link is idle: the next offer
    is tried, and its window replaces the old rate (at most one such try per that many seconds on
    a link that really is that slow)."""

    def __init__(self, window: float = 1.0, half_life: float = 10.0, remeasure_after: float = 10.0) -> None:
        self.window = window
        self.half_life = half_life
        self.remeasure_after = remeasure_after
        self.rate: float | None = None
        self.measured_at: float | None = None  # when a busy window last closed
        self._busy = 0.0  # busy seconds in the open window
        self._bytes = 0  # bytes in the open window
        self._last: float | None = None

    def current(self, now: float, idle: bool) -> float | None:
        """The rate to judge a new fetch by: None (try it) on an idle link whose rate is older
        than ``remeasure_after`` seconds.

        Args:
            now: the monotonic clock's time.
            idle: no transfer is running.
        """
        if idle and self.measured_at is not None and now - self.measured_at > self.remeasure_after:
            return None
        return self.rate

    def update(self, now: float, new_bytes: int, busy: bool) -> None:
        """``new_bytes`` arrived since the last update; ``busy`` says whether a transfer ran in
        between (idle time says nothing about the link)."""
        if self._last is not None and busy:
            self._busy += max(0.0, now - self._last)
        self._bytes += new_bytes
        self._last = now
        if self._busy >= self.window:
            sample = self._bytes / self._busy
            keep = 0.5 ** (self._busy / self.half_life)
            forgotten = self.measured_at is None or now - self.measured_at > self.remeasure_after
            self.rate = sample if self.rate is None or forgotten else keep * self.rate + (1 - keep) * sample
            self.measured_at = now
            self._busy, self._bytes = 0.0, 0


# A peer announces each fragment once a round: looking 8 times between announcements finds one
# within an eighth of that. On long rounds this is fewer looks than one a second, and every look
# costs each peer's DHT node a request (at H = 50, 10 Mbit, polls were half the network thread's
# CPU). Never slower than 4 intervals: live peers and snapshots are still seen within seconds.
POLLS_PER_ANNOUNCEMENT = 8
SLOWEST_POLL = 4.0


def poll_pause(interval: float, seconds_per_version: float | None, fragments: int) -> float:
    """Seconds until the next look at the DHT: ``interval``, or an eighth of the time between
    announcements (a round over ``fragments``) where that is longer, up to ``SLOWEST_POLL``
    intervals."""
    if not seconds_per_version or fragments < 1:
        return interval
    between = seconds_per_version / fragments
    return min(max(interval, between / POLLS_PER_ANNOUNCEMENT), SLOWEST_POLL * interval)


class VersionClock:
    """Seconds per version of one fragment, from this peer's own progress reports: every fragment
    advances once a round, so ``k`` version steps summed over ``F`` fragments in ``dt`` seconds
    mean ``dt · F / k`` seconds per version. An exponential mean over the last few rounds."""

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing = smoothing
        self.seconds_per_version: float | None = None
        self._last: tuple[float, int] | None = None

    def update(self, now: float, versions: Sequence[int]) -> None:
        total = sum(versions)
        if self._last is not None:
            since, before = self._last
            steps = total - before
            if steps <= 0:
                if steps < 0:  # adopted another peer's state: the count starts again
                    self._last = (now, total)
                return
            sample = (now - since) * len(versions) / steps
            previous = self.seconds_per_version
            self.seconds_per_version = (
                sample if previous is None else (1 - self.smoothing) * previous + self.smoothing * sample
            )
        self._last = (now, total)


@dataclass(frozen=True)
class Passed:
    """An offer the queue let go without fetching it, and why ("too_late" or "stale")."""

    candidate: Candidate
    reason: str


class FetchQueue:
    """Chosen offers waiting for a fetch slot. ``stale_after`` is the age (in versions of this
    peer's own fragment) from which a delivery no longer counts in an outer step; None when every
    age counts (the methods without an age weight), and then only the order matters."""

    def __init__(self, stale_after: int | None, limit: int = 256) -> None:
        self.stale_after = stale_after
        self.limit = limit
        self._heap: list[tuple[tuple[int, int, bool, int], int, Candidate]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, candidate: Candidate) -> Candidate | None:
        """Queue an offer; returns the one that had to leave a full queue (the oldest), if any."""
        key = candidate.key
        # DELTAs and their MOMENTS before PARAMS (what the outer step consumes before what mixing
        # tightens), then the newest base version, a version's MOMENTS before its DELTAs: a
        # quarter of a 16-bit Δ's bytes, of use only in that version's step, which starts as soon
        # as the DELTAs are in; equal ones in arrival order
        outer = 0 if key.kind in (Kind.DELTA, Kind.MOMENTS) else 1
        rank = (outer, -key.base_version, key.kind is not Kind.MOMENTS, key.fragment)
        heapq.heappush(self._heap, (rank, next(self._order), candidate))
        if len(self._heap) > self.limit:
            worst = max(self._heap)
            self._heap.remove(worst)
            heapq.heapify(self._heap)
            return worst[2]
        return None

    def age(self, candidate: Candidate, versions: Sequence[int]) -> int:
        """The candidate's age now, in versions of this peer's own fragment."""
        return own_version(versions, candidate.key.fragment) - candidate.key.base_version

    def is_stale(self, candidate: Candidate, versions: Sequence[int]) -> bool:
        return self.stale_after is not None and self.age(candidate, versions) >= self.stale_after

    def pop(
        self,
        versions: Sequence[int],
        *,
        link_rate: float | None,
        seconds_per_version: float | None,
        bytes_ahead: int,
    ) -> tuple[Candidate | None, list[Passed]]:
        """The next offer to fetch, or None; and the offers passed over on the way. ``bytes_ahead``
        is what the fetches in flight still have to receive: a new fetch shares the link with
        them, so it arrives after about (``bytes_ahead`` + its size) / ``link_rate`` seconds.
        Offers at or below this peer's own version of their fragment come first (youngest
        first); one ahead of it (a claim nobody can use yet, which identities that send nothing
        may make in advance) waits behind them, the nearest first.

        Args:
            versions: this peer's own versions, per fragment.
            link_rate: the measured downlink, bytes per second (None: not measured).
            seconds_per_version: this peer's seconds per version of a fragment (None: not yet).
            bytes_ahead: bytes the fetches in flight still have to receive.
        """
        passed: list[Passed] = []
        while self._heap:
            candidate = self._take_next(versions)
            if self.is_stale(candidate, versions):
                passed.append(Passed(candidate, "stale"))
                continue
            if self._arrives_too_late(candidate, versions, link_rate, seconds_per_version, bytes_ahead):
                passed.append(Passed(candidate, "too_late"))
                continue
            return candidate, passed
        return None, passed

    def _take_next(self, versions: Sequence[int]) -> Candidate:
        """Remove and return the queue's best offer for ``versions`` (a scan: the queue is
        bounded by ``limit``, and which offers are ahead changes as this peer's versions do)."""
        best = min(
            range(len(self._heap)),
            key=lambda i: self._order_now(self._heap[i], versions),
        )
        _, _, candidate = self._heap[best]
        self._heap[best] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)
        return candidate

    @staticmethod
    def _order_now(
        item: tuple[tuple[int, int, bool, int], int, Candidate], versions: Sequence[int]
    ) -> tuple[int, int, int, bool, int]:
        (kind_rank, newest, moments, fragment), order, _ = item
        ahead = -newest - own_version(versions, fragment)  # base version past the own one
        # ahead ones after the rest, the nearest first; among the rest the push order's rank
        return (kind_rank, 1, ahead, moments, order) if ahead > 0 else (kind_rank, 0, newest, moments, order)

    def _arrives_too_late(
        self,
        candidate: Candidate,
        versions: Sequence[int],
        link_rate: float | None,
        seconds_per_version: float | None,
        bytes_ahead: int,
    ) -> bool:
        if self.stale_after is None or not link_rate or not seconds_per_version:
            return False  # nothing measured yet: try it
        seconds = (bytes_ahead + candidate.offer.byte_length) / link_rate
        return self.age(candidate, versions) + seconds / seconds_per_version >= self.stale_after
