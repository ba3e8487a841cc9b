"""The offer-selection policy, without any peer: which offers a node fetches, from whom, and why
it refuses the others."""

from __future__ import annotations

import hashlib
import random

import pytest

from cgad.protocol.codec import SPARSE_MAX_KEPT, encoded_size
from cgad.protocol.records import Holdings, Identity, Offer
from cgad.protocol.selection import (
    MAX_RESERVERS,
    Candidate,
    OfferSelector,
    Rejection,
    Selection,
    check_offer,
    swarm_version,
)
from cgad.protocol.transport import FragmentKey, Kind

pytestmark = pytest.mark.timeout(60)

RUN = "sel-test"
NUMEL = 1000
LENGTH = encoded_size(NUMEL, "fp32")
RECORD_TTL = 120.0
# RSA key generation is slow: real peer ids, made once for the module
ME, *PEERS = (Identity().peer_id for _ in range(7))
ALICE, BOB, CAROL, DAVE, ERIN, FRANK = PEERS


def _offer(
    publisher: str,
    base: int = 5,
    content: bytes = b"x",
    *,
    kind: Kind = Kind.DELTA,
    numel: int = NUMEL,
    codec: str = "fp32",
    length: int = LENGTH,
) -> Offer:
    return Offer(
        publisher=publisher,
        base_version=base,
        kind=str(kind),
        tokens=10,
        codec=codec,
        numel=numel,
        content_hash=hashlib.sha256(f"{publisher}/{base}/{kind}/".encode() + content).digest(),
        byte_length=length,
    )


def _own(offer: Offer) -> Holdings:
    """The publisher's own record of an offer."""
    return Holdings(peer_id=offer.publisher, grpc=None, offers=[offer])


def _selector(
    fan_in: int = 4, history: int = 64, seed: int = 0, max_ahead: int | None = None
) -> OfferSelector:
    return OfferSelector(
        RUN, ME, fan_in=fan_in, history_versions=history, record_ttl=RECORD_TTL, max_ahead=max_ahead,
        rng=random.Random(seed),
    )  # fmt: skip


def _choose(selector: OfferSelector, holdings: list[Holdings], own: int = 5, now: float = 0.0) -> Selection:
    return selector.choose(0, NUMEL, holdings, own, now)


def _publishers(selection: Selection) -> set[str]:
    return {c.key.publisher for c in selection.candidates}


def test_fan_in_caps_publishers_per_fragment_kind_and_base_version_drawn_at_random() -> None:
    records = [_own(_offer(p)) for p in PEERS]
    drawn = set()
    for seed in range(8):
        selector = _selector(fan_in=4, seed=seed)
        selection = _choose(selector, records)
        assert len(selection.candidates) == 4 and selection.fan_in_skipped == 2
        assert not selection.rejections
        drawn.add(frozenset(_publishers(selection)))
        # the next poll sees the same records: nothing new, nothing skipped twice
        again = _choose(selector, records)
        assert again.candidates == [] and again.fan_in_skipped == 0
    assert len(drawn) > 1  # the draw is random, and the seed decides it

    selector = _selector(fan_in=2)
    first_five = PEERS[:5]
    assert len(_choose(selector, [_own(_offer(p)) for p in first_five]).candidates) == 2
    # another base version, or the other kind, has a cap of its own
    assert len(_choose(selector, [_own(_offer(p, base=6)) for p in first_five], own=6).candidates) == 2
    params = _choose(selector, [_own(_offer(p, kind=Kind.PARAMS)) for p in first_five])
    assert [c.key.kind for c in params.candidates] == [Kind.PARAMS] * 2
    # a publisher that appears later finds the round full
    late = _choose(selector, [_own(_offer(FRANK))])
    assert late.candidates == [] and late.fan_in_skipped == 1


def test_a_delivered_key_with_other_bytes_is_a_replay_counted_once() -> None:
    selector = _selector()
    first = _offer(ALICE, content=b"first")
    [candidate] = _choose(selector, [_own(first)]).candidates
    assert selector.deliver(candidate.key, first.content_hash)
    assert not selector.deliver(candidate.key, first.content_hash)  # at most once per key

    # the same bytes announced again: nothing to do, nothing wrong
    assert _choose(selector, [_own(first)], now=1.0) == Selection()
    # the same key with other bytes: a replay, counted once however often it is polled
    replay = _own(_offer(ALICE, content=b"second"))
    selection = _choose(selector, [replay], now=2.0)
    assert selection.candidates == []
    assert [r.reason for r in selection.rejections] == ["replay"]
    assert str(candidate.key) in selection.rejections[0].detail
    assert _choose(selector, [replay], now=3.0) == Selection()


def test_parameters_may_change_under_a_delivered_key_without_a_replay() -> None:
    selector = _selector()
    first = _offer(ALICE, content=b"first", kind=Kind.PARAMS)
    [candidate] = _choose(selector, [_own(first)]).candidates
    selector.deliver(candidate.key, first.content_hash)
    assert _choose(selector, [_own(_offer(ALICE, content=b"second", kind=Kind.PARAMS))]) == Selection()


def test_offers_far_behind_this_peers_own_version_are_ignored_unseen() -> None:
    selector = _selector(history=64)
    stale, recent = _offer(ALICE, base=100 - 65), _offer(BOB, base=100 - 64)
    selection = _choose(selector, [_own(stale), _own(recent)], own=100)
    assert _publishers(selection) == {BOB} and not selection.rejections
    assert stale.content_hash not in selector.attempted  # ignored, not refused


def test_a_far_future_claim_does_not_make_honest_offers_look_stale() -> None:
    selector = _selector(history=64)
    boast = _own(_offer(ALICE, base=10**9))
    honest = _own(_offer(BOB, base=0))
    selection = _choose(selector, [boast, honest], own=0)
    assert _publishers(selection) == {BOB}
    assert [r.reason for r in selection.rejections] == ["future"]  # past the horizon ahead: refused
    selector.forget([0], now=0.0)  # the horizon is this peer's own version, 0
    assert {k[2] for k in selector.chosen} == {0}
    assert honest.offers[0].content_hash in selector.attempted


def test_only_the_publishers_own_record_vouches_for_an_offer() -> None:
    selector = _selector()
    hearsay = Holdings(peer_id=BOB, grpc="10.0.0.2:1", offers=[_offer(ALICE)])
    assert _choose(selector, [hearsay]) == Selection()
    mine = _own(_offer(ME))  # never one's own
    assert _choose(selector, [mine]) == Selection()
    forged = Holdings(peer_id=BOB, grpc=None, offers=[_offer(ALICE, content=b"forged")])
    assert _choose(selector, [forged, hearsay]) == Selection()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"numel": NUMEL + 1}, "bad_shape"),
        ({"codec": "zstd"}, "unknown_codec"),
        ({"length": LENGTH + 1}, "oversized"),
        ({"length": LENGTH - 1}, "bad_length"),
    ],
)
def test_offers_the_record_shows_unusable_are_refused_once(changes: dict, reason: str) -> None:
    selector = _selector()
    bad = _offer(ALICE, **changes)
    assert check_offer(bad, NUMEL) is not None and check_offer(bad, NUMEL).reason == reason
    selection = _choose(selector, [_own(bad)])
    assert selection.candidates == []
    [rejection] = selection.rejections
    key = FragmentKey(RUN, 0, 5, ALICE, Kind.DELTA)
    assert rejection.reason == reason and rejection.detail.startswith(f"{key}: ")
    assert _choose(selector, [_own(bad)]) == Selection()  # refused once, not every poll
    # and it does not take a fan-in place
    assert _publishers(_choose(selector, [_own(_offer(BOB))])) == {BOB}


def test_check_offer_passes_a_well_formed_offer() -> None:
    for codec in ("fp32", "fp16", "int8", "4bit", "2bit", "sparse"):
        assert check_offer(_offer(ALICE, codec=codec, length=encoded_size(NUMEL, codec)), NUMEL) is None
    assert check_offer(_offer(ALICE), NUMEL - 1) == Rejection(
        "bad_shape", f"{NUMEL} values, expected {NUMEL - 1}"
    )


def test_a_sparse_offer_may_keep_any_k_up_to_the_largest_and_nothing_between() -> None:
    """The publisher picks its k (--sparse-keep); the length says which, so a receiver takes
    every k from 1 to SPARSE_MAX_KEPT and refuses a length no k gives, or one beyond them all."""
    for kept in (1, 8, 16, SPARSE_MAX_KEPT):
        length = encoded_size(NUMEL, "sparse", kept=kept)
        assert check_offer(_offer(ALICE, codec="sparse", length=length), NUMEL) is None
    between = encoded_size(NUMEL, "sparse", kept=16) + 1
    assert check_offer(_offer(ALICE, codec="sparse", length=between), NUMEL).reason == "bad_length"
    beyond = encoded_size(NUMEL, "sparse", kept=SPARSE_MAX_KEPT + 1)
    assert check_offer(_offer(ALICE, codec="sparse", length=beyond), NUMEL).reason == "oversized"


def test_holders_are_re_servers_in_random_order_then_the_publisher() -> None:
    offer = _offer(ALICE)
    reservers = [Holdings(peer_id=p, grpc=None, offers=[offer]) for p in (BOB, CAROL, DAVE)]
    orders = set()
    for seed in range(12):
        [candidate] = _choose(_selector(seed=seed), [*reservers, _own(offer)]).candidates
        assert isinstance(candidate, Candidate) and candidate.offer == offer
        holders = [h.peer_id for h in candidate.holders]
        assert holders[-1] == ALICE and set(holders[:-1]) == {BOB, CAROL, DAVE}
        orders.add(tuple(holders))
    assert len(orders) > 1
    # a crowd of announced holders costs a fetch at most MAX_RESERVERS tries before the publisher
    crowd = [Holdings(peer_id=f"QmCrowd{chr(ord('a') + n)}", grpc=None, offers=[offer]) for n in range(8)]
    drawn = set()
    for seed in range(6):
        [candidate] = _choose(_selector(seed=seed), [*crowd, _own(offer)]).candidates
        holders = [h.peer_id for h in candidate.holders]
        assert len(holders) == MAX_RESERVERS + 1 and holders[-1] == ALICE
        drawn.update(holders[:-1])
    assert len(drawn) > MAX_RESERVERS  # drawn at random, not always the same ones
    # a re-server of other bytes is no holder of these
    elsewhere = Holdings(peer_id=ERIN, grpc=None, offers=[_offer(FRANK)])
    [candidate] = _choose(_selector(), [elsewhere, _own(offer)]).candidates
    assert [h.peer_id for h in candidate.holders] == [ALICE]


def test_forgetting_bounds_every_ledger() -> None:
    selector = _selector(fan_in=1, history=10, max_ahead=100)
    for base in range(40):
        selection = _choose(selector, [_own(_offer(p, base=base)) for p in (ALICE, BOB)], own=0)
        for candidate in selection.candidates:
            selector.deliver(candidate.key, candidate.offer.content_hash)
    assert selector.judge(("garbage", 1), now=0.0) and not selector.judge(("garbage", 1), now=1.0)
    # the publisher passed over for want of a slot is not attempted: it may have the next free one
    assert len(selector.delivered) == 40 and len(selector.attempted) == 40 and len(selector.chosen) == 40

    selector.forget([30], now=2 * RECORD_TTL - 1)  # keep bases 20 and later
    assert {k.base_version for k in selector.delivered} == set(range(20, 40))
    assert {base for _, base in selector.attempted.values()} == set(range(20, 40))
    assert {k[2] for k in selector.chosen} == set(range(20, 40))
    assert ("garbage", 1) in selector.judged
    selector.forget([30], now=2 * RECORD_TTL + 1)  # a judged record has expired from the DHT since
    assert not selector.judged
    assert selector.judge(("garbage", 1), now=2 * RECORD_TTL + 1)
    # a fragment this peer reports no version of has version 0: nothing of it is too old
    selector.forget([], now=0.0)
    assert len(selector.delivered) == 20


def _state(publisher: str, base: int, *, length: int = 5000, codec: str = "state") -> Offer:
    return Offer(
        publisher=publisher,
        base_version=base,
        kind="state",
        tokens=0,
        codec=codec,
        numel=0,
        content_hash=hashlib.sha256(f"state/{publisher}/{base}".encode()).digest(),
        byte_length=length,
    )


def test_state_snapshots_newest_first_with_their_holders():
    selector = _selector()
    old, new, mine = _state(ALICE, 3), _state(BOB, 9), _state(ME, 12)
    records = [
        _own(old),
        _own(new),
        _own(mine),  # this peer's own: never offered back to it
        Holdings(peer_id=CAROL, grpc=None, offers=[new]),  # a re-server of Bob's
        Holdings(peer_id=DAVE, grpc=None, offers=[_state(ERIN, 50)]),  # Erin never vouched for it
    ]
    selection = selector.choose_states(records, max_bytes=10_000, now=0.0)
    assert [(c.key.publisher, c.key.base_version) for c in selection.candidates] == [(BOB, 9), (ALICE, 3)]
    assert [h.peer_id for h in selection.candidates[0].holders] == [CAROL, BOB]
    assert all(c.key.kind is Kind.STATE for c in selection.candidates) and selection.rejections == []
    # a snapshot is no fragment: a state offer in a fragment's record is not fetched as one
    assert _choose(_selector(), [_own(_state(ALICE, 5))]).candidates == []


def test_state_snapshots_too_large_or_foreign_are_refused_unseen_and_counted_once():
    selector = _selector()
    records = [_own(_state(ALICE, 4, length=20_000)), _own(_state(BOB, 4, codec="fp32"))]
    first = selector.choose_states(records, max_bytes=10_000, now=0.0)
    assert first.candidates == []
    assert sorted(r.reason for r in first.rejections) == ["oversized", "unknown_codec"]
    assert selector.choose_states(records, max_bytes=10_000, now=1.0).rejections == []


def test_an_offer_ahead_of_a_peer_that_is_behind_the_swarm_is_not_held_against_its_publisher() -> None:
    """A joiner at version 0 sees the swarm's offers of version 9: refused unfetched (it could not
    use them), but counted as its own lag, not as a fault of the publisher; a claim as far past
    the swarm (the median of live peers' reports) is still a fault."""
    selector = _selector(max_ahead=4)
    honest, claimer = _own(_offer(ALICE, base=9)), _own(_offer(BOB, base=40))
    selection = selector.choose(0, NUMEL, [honest, claimer], own=0, now=0.0, swarm=9)
    assert not selection.candidates and selection.behind == 1
    assert [(r.reason, r.publisher) for r in selection.rejections] == [("future", BOB)]
    assert swarm_version([[9], [8], [1000]], 0) == 9 and swarm_version([[3, 7]], 1) == 7
    assert swarm_version([], 0) is None and swarm_version([[5]], 1) is None


def test_an_offer_far_ahead_is_refused_once_and_taken_once_this_peer_catches_up() -> None:
    selector = OfferSelector(RUN, ME, fan_in=4, history_versions=64, record_ttl=RECORD_TTL, max_ahead=4)
    holdings = [_own(_offer(ALICE, base=1000))]
    first = _choose(selector, holdings, own=10)
    assert not first.candidates and [r.reason for r in first.rejections] == ["future"]
    again = _choose(selector, holdings, own=10, now=1.0)
    assert not again.candidates and not again.rejections  # counted once
    # each version the claimer picks is no new entry in any ledger
    for base in range(2000, 2100):
        assert not _choose(selector, [_own(_offer(ALICE, base=base))], own=10, now=1.5).rejections
    assert len(selector.judged) == 1
    assert not selector.attempted and not selector.delivered  # nothing the attacker picked is kept
    caught_up = _choose(selector, holdings, own=998, now=2.0)  # a re-sync brought this peer there
    assert [c.key.base_version for c in caught_up.candidates] == [1000]
