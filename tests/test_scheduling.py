"""When chosen offers are fetched, without any peer: youngest first, and only what the measured
link can deliver before it is too old to count."""

from __future__ import annotations

import hashlib

import pytest

from cgad.protocol.codec import Codec, encoded_size
from cgad.protocol.config import SPARSE_KEPT, SPARSE_MAX_KEPT
from cgad.protocol.records import Holdings, Identity, Offer
from cgad.protocol.scheduling import (
    AUTO_KEPT,
    AUTO_LINK_SHARE,
    AUTO_MIN_KEPT,
    FetchQueue,
    LinkMeter,
    VersionClock,
    auto_codec,
    poll_pause,
    round_budget,
)
from cgad.protocol.selection import Candidate
from cgad.protocol.transport import FragmentKey, Kind

pytestmark = pytest.mark.timeout(60)

PUBLISHER = Identity().peer_id
LENGTH = 1_000_000


def _candidate(base: int, fragment: int = 0, kind: Kind = Kind.DELTA, length: int = LENGTH) -> Candidate:
    offer = Offer(
        publisher=PUBLISHER,
        base_version=base,
        kind=str(kind),
        tokens=10,
        codec="fp32",
        numel=length // 4,
        content_hash=hashlib.sha256(f"{fragment}/{base}/{kind}".encode()).digest(),
        byte_length=length,
    )
    key = FragmentKey("sched-test", fragment, base, PUBLISHER, kind)
    return Candidate(key, offer, [Holdings(peer_id=PUBLISHER, grpc=None, offers=[offer])])


def _pop(queue: FetchQueue, versions: list[int], rate=None, per_version=None, ahead=0):
    return queue.pop(versions, link_rate=rate, seconds_per_version=per_version, bytes_ahead=ahead)


def test_youngest_delta_first_each_with_its_moments_then_params():
    """A version's MOMENTS right before its DELTAs (of use only in that version's step, which
    starts once the DELTAs are in), before older versions'; PARAMS after all."""
    queue = FetchQueue(stale_after=None)
    pushed = (_candidate(3), _candidate(7, kind=Kind.PARAMS), _candidate(7, kind=Kind.MOMENTS), _candidate(5),
              _candidate(7), _candidate(5, kind=Kind.MOMENTS))  # fmt: skip
    for c in pushed:
        queue.push(c)
    order = []
    while (item := _pop(queue, [8])[0]) is not None:
        order.append((item.key.base_version, item.key.kind))
    assert order == [(7, Kind.MOMENTS), (7, Kind.DELTA), (5, Kind.MOMENTS), (5, Kind.DELTA), (3, Kind.DELTA),
                     (7, Kind.PARAMS)]  # fmt: skip


def test_stale_offers_are_passed_over_and_counted():
    queue = FetchQueue(stale_after=4)
    queue.push(_candidate(10))  # age 4 at version 14: counts for nothing
    queue.push(_candidate(11))  # age 3
    candidate, passed = _pop(queue, [14])
    assert candidate is not None and candidate.key.base_version == 11
    assert passed == []  # the younger one came first; the stale one waits
    candidate, passed = _pop(queue, [14])
    assert candidate is None and [p.reason for p in passed] == ["stale"]


def test_an_offer_the_link_cannot_deliver_in_time_is_passed_over():
    queue = FetchQueue(stale_after=4)
    queue.push(_candidate(12))  # age 2 now
    # 1 MB at 100 kB/s with 1 MB ahead of it: 20 s, 2 versions at 10 s each: age 4 on arrival
    candidate, passed = _pop(queue, [14], rate=100_000, per_version=10.0, ahead=LENGTH)
    assert candidate is None and [p.reason for p in passed] == ["too_late"]
    queue.push(_candidate(12))
    # with nothing ahead it lands at age 3: fetched
    candidate, _ = _pop(queue, [14], rate=100_000, per_version=10.0, ahead=0)
    assert candidate is not None


def test_without_measurements_or_a_gate_nothing_is_passed_over_for_time():
    gated = FetchQueue(stale_after=4)
    gated.push(_candidate(13))
    assert _pop(gated, [14], rate=None, per_version=10.0, ahead=10 * LENGTH)[0] is not None
    ungated = FetchQueue(stale_after=None)
    ungated.push(_candidate(1))
    assert _pop(ungated, [14], rate=1.0, per_version=1.0, ahead=10 * LENGTH)[0] is not None


def test_a_full_queue_evicts_its_oldest_offer():
    queue = FetchQueue(stale_after=None, limit=2)
    assert queue.push(_candidate(5)) is None
    assert queue.push(_candidate(9)) is None
    evicted = queue.push(_candidate(7))
    assert evicted is not None and evicted.key.base_version == 5 and len(queue) == 2


def test_link_meter_counts_only_busy_time():
    meter = LinkMeter(window=1.0, half_life=10.0)
    meter.update(0.0, 0, busy=False)
    meter.update(100.0, 0, busy=False)  # a long idle stretch says nothing about the link
    assert meter.rate is None
    meter.update(102.0, 2_000_000, busy=True)  # 2 MB in 2 busy seconds
    assert meter.rate == pytest.approx(1_000_000)
    meter.update(104.0, 500_000, busy=True)  # the link slowed to 250 kB/s: the mean moves toward it
    assert 250_000 < meter.rate < 1_000_000


def test_a_rate_measured_long_ago_does_not_keep_an_idle_link_from_trying_again():
    meter = LinkMeter(window=1.0, half_life=10.0, remeasure_after=30.0)
    meter.update(0.0, 0, busy=False)
    meter.update(15.0, 90_000, busy=True)  # one slow first fetch: 6 kB/s
    assert meter.current(15.0, idle=True) == pytest.approx(6_000)
    assert meter.current(40.0, idle=True) == pytest.approx(6_000)  # recent: believed
    # judged by it, every offer since was too late and nothing ran: the idle link tries again
    assert meter.current(46.0, idle=True) is None
    assert meter.current(46.0, idle=False) == pytest.approx(6_000)  # not while a fetch runs
    meter.update(47.0, 0, busy=False)
    meter.update(48.0, 1_000_000, busy=True)  # the try measured the link anew
    assert meter.current(48.0, idle=True) > 100_000
    # the queue's verdict follows: too late at the old rate, tried once the rate is forgotten
    queue = FetchQueue(stale_after=3)
    offer = _candidate(5)
    queue.push(offer)
    assert queue.pop([5, 5], link_rate=6_000.0, seconds_per_version=2.0, bytes_ahead=0)[0] is None
    queue.push(offer)
    assert queue.pop([5, 5], link_rate=None, seconds_per_version=2.0, bytes_ahead=0)[0] is offer


def test_version_clock_from_progress_reports():
    clock = VersionClock(smoothing=0.5)
    clock.update(0.0, [0, 0])
    clock.update(10.0, [1, 0])  # one of two fragments advanced in 10 s: 20 s per version
    assert clock.seconds_per_version == pytest.approx(20.0)
    clock.update(20.0, [1, 0])  # nothing new: no sample
    assert clock.seconds_per_version == pytest.approx(20.0)
    clock.update(30.0, [2, 2])  # three steps in 20 s since the last advance: 13.3 s per version
    smoothed = 0.5 * 20.0 + 0.5 * 20.0 * 2 / 3
    assert clock.seconds_per_version == pytest.approx(smoothed)
    clock.update(31.0, [0, 0])  # a re-sync adopted another state: counting starts again
    clock.update(41.0, [1, 1])
    assert clock.seconds_per_version == pytest.approx(0.5 * smoothed + 0.5 * 10.0)


def test_what_the_node_calls_too_old_follows_its_method():
    from cgad.node.config import OuterOptions
    from cgad.node.member.methods import method

    options = OuterOptions(cutoff=2.5)
    assert method("cga").stale_after(options) == 3  # σ(3) = 0 past a cutoff of 2.5
    assert method("cgad").stale_after(options) == 3
    assert method("adam-decay").stale_after(options) is None  # no gate: every age counts a little
    assert method("sgd").stale_after(options) is None


def test_polls_follow_the_time_between_announcements():
    assert poll_pause(1.0, None, 1) == 1.0  # no round measured yet
    assert poll_pause(1.0, 2.0, 1) == 1.0  # short rounds: never faster than the interval
    assert poll_pause(1.0, 17.0, 1) == 17.0 / 8  # H = 50 on the testbed: 8 looks a round
    assert poll_pause(1.0, 17.0, 4) == 1.0  # four fragments: an announcement every 4.25 s
    assert poll_pause(1.0, 600.0, 1) == 4.0  # and never slower than 4 intervals
    assert poll_pause(0.5, 600.0, 1) == 2.0


def test_auto_sends_4bit_when_it_fits_else_the_most_sparse_values_that_do() -> None:
    numel = 1 << 20
    four_bit = encoded_size(numel, "4bit")
    # a share of the link's round, split among the fetching peers
    assert round_budget(1e6, 10.0, 4) == pytest.approx(AUTO_LINK_SHARE * 1e6 * 10.0 / 4)
    # less the seconds a delivery takes whatever its size
    assert round_budget(1e6, 10.0, 4, latency=2.0) == pytest.approx(AUTO_LINK_SHARE * 1e6 * 8.0 / 4)
    assert round_budget(1e6, 1.0, 4, latency=2.0) == 0.0  # rounds shorter than that: the least
    assert round_budget(None, 10.0, 4) is None and round_budget(1e6, None, 4) is None
    assert round_budget(None, None, 0) == float("inf")  # nobody to send to
    assert auto_codec(numel, float("inf")) == (Codec.FP4, SPARSE_KEPT)
    assert auto_codec(numel, four_bit) == (Codec.FP4, SPARSE_KEPT)
    codec, kept = auto_codec(numel, four_bit - 1)
    assert codec is Codec.SPARSE and kept == SPARSE_MAX_KEPT  # 64 per block is smaller than 4bit
    # the largest level that fits: 20 values per block fit, so 16 go
    assert auto_codec(numel, encoded_size(numel, "sparse", kept=20)) == (Codec.SPARSE, 16)
    assert auto_codec(numel, encoded_size(numel, "sparse", kept=24)) == (Codec.SPARSE, 24)
    assert all(kept in AUTO_KEPT for kept in (auto_codec(numel, b)[1] for b in range(10, four_bit, 9973)))
    assert auto_codec(numel, 10.0) == (Codec.SPARSE, AUTO_MIN_KEPT)  # never fewer
    assert auto_codec(numel, None) == (Codec.FP4, SPARSE_KEPT)  # not measured: dense, as early rounds need
