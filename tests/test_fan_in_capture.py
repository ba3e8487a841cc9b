"""Fan-in capture by throwaway identities (issue 27, hole 4), against the real selection policy
and fetch queue: identities that announce versions ahead of this peer, and send nothing (or
nothing that verifies), must not take the slots of the honest publishers."""

from __future__ import annotations

import hashlib
import random

import pytest

from cgad.protocol.codec import encoded_size
from cgad.protocol.records import Holdings, Identity, Offer
from cgad.protocol.scheduling import FetchQueue
from cgad.protocol.selection import MAX_PENDING_PER_PUBLISHER, Candidate, OfferSelector
from cgad.protocol.transport import FragmentKey, Kind

pytestmark = pytest.mark.timeout(60)

RUN = "capture-test"
NUMEL = 1000
LENGTH = encoded_size(NUMEL, "fp32")
# RSA key generation is slow: real peer ids, made once for the module
ME, *_PEERS = (Identity().peer_id for _ in range(9))
ATTACKERS, HONEST = _PEERS[:4], _PEERS[4:]
OWN = 10  # this peer's version of the fragment


def _offer(publisher: str, base: int, content: bytes = b"") -> Offer:
    return Offer(
        publisher=publisher,
        base_version=base,
        kind=str(Kind.DELTA),
        tokens=10,
        codec="fp32",
        numel=NUMEL,
        content_hash=hashlib.sha256(f"{publisher}/{base}/".encode() + content).digest(),
        byte_length=LENGTH,
    )


def _record(publisher: str, bases: range, content: bytes = b"") -> Holdings:
    return Holdings(peer_id=publisher, grpc=None, offers=[_offer(publisher, b, content) for b in bases])


def _selector(fan_in: int = 4, seed: int = 0) -> OfferSelector:
    return OfferSelector(
        RUN, ME, fan_in=fan_in, history_versions=64, record_ttl=120.0, max_ahead=4, rng=random.Random(seed)
    )


def _poll(selector: OfferSelector, records: list[Holdings], now: float, own: int = OWN) -> list[Candidate]:
    """One look at the records; what is chosen is fetched: an attacker's fetch brings nothing
    (``retry_later``, as the receiver calls it), an honest one brings bytes that verify."""
    chosen = selector.choose(0, NUMEL, records, own, now, swarm=own).candidates
    for candidate in chosen:
        if candidate.key.publisher in ATTACKERS:
            selector.retry_later(candidate)
        else:
            assert selector.deliver(candidate.key, candidate.offer.content_hash)
    return chosen


@pytest.mark.parametrize("seed", range(4))
def test_identities_announcing_ahead_and_sending_nothing_do_not_take_the_honest_slots(seed: int) -> None:
    """Four identities announce versions OWN+1..OWN+4 before anyone else; then four honest
    peers publish theirs. Before, the cap was spent when an offer was chosen, so all 16 honest
    offers were skipped as `fan_in` for good. Now a slot is spent on bytes that verified."""
    selector = _selector(seed=seed)
    ahead = range(OWN + 1, OWN + 5)
    attackers = [_record(a, ahead) for a in ATTACKERS]
    first = selector.choose(0, NUMEL, attackers, OWN, 0.0, swarm=OWN).candidates
    # per publisher, at most MAX_PENDING_PER_PUBLISHER unverified offers of a fragment at once,
    # and an ahead version fills at most half its slots before this peer gets there
    assert all(sum(c.key.publisher == a for c in first) <= MAX_PENDING_PER_PUBLISHER for a in ATTACKERS)
    for base in ahead:
        assert sum(c.key.base_version == base for c in first) <= 2
    records = attackers + [_record(h, ahead) for h in HONEST]
    for candidate in first:  # the throwaway identities serve nothing
        selector.retry_later(candidate)
    taken: list[Candidate] = []
    for poll in range(1, 12):
        taken += _poll(selector, records, now=float(poll))
    for own in ahead:  # this peer reaches each version in turn
        for poll in range(3):
            taken += _poll(selector, records, now=100.0 + own * 10 + poll, own=own)
    delivered = {(c.key.publisher, c.key.base_version) for c in taken if c.key.publisher in HONEST}
    assert delivered == {(h, b) for h in HONEST for b in ahead}  # 16 of 16 honest offers
    # the cap still holds per version: at most fan_in verified publishers
    for base in ahead:
        assert len(selector.slots.verified[(0, Kind.DELTA, base)]) == 4


def test_a_slot_held_by_bytes_that_never_verify_is_freed_after_the_pending_time() -> None:
    """A publisher whose bytes arrive but fail the checks (the receiver blames it, and never calls
    back) holds its slot only until ``pending_seconds`` have passed."""
    selector = OfferSelector(RUN, ME, fan_in=1, history_versions=64, record_ttl=120.0, pending_seconds=30.0)
    records = [_record(p, range(OWN, OWN + 1)) for p in _PEERS[:2]]
    [first] = selector.choose(0, NUMEL, records, OWN, 0.0, swarm=OWN).candidates
    assert selector.choose(0, NUMEL, records, OWN, 10.0, swarm=OWN).candidates == []
    [second] = selector.choose(0, NUMEL, records, OWN, 31.0, swarm=OWN).candidates
    assert second.key.publisher != first.key.publisher


def test_publishers_whose_bytes_verified_before_come_first() -> None:
    """Among new offers of a round, publishers that delivered verified bytes before are drawn
    before identities never seen to deliver (throwaway identities earn nothing by announcing)."""
    for seed in range(6):
        selector = _selector(fan_in=2, seed=seed)
        _poll(selector, [_record(h, range(OWN, OWN + 1)) for h in HONEST[:2]], now=0.0)
        records = [_record(p, range(OWN + 1, OWN + 2)) for p in [*ATTACKERS, *HONEST[:2]]]
        chosen = selector.choose(0, NUMEL, records, OWN + 1, 1.0, swarm=OWN + 1).candidates
        assert {c.key.publisher for c in chosen} == set(HONEST[:2])


def _candidate(base: int) -> Candidate:
    offer = _offer(HONEST[0], base)
    key = FragmentKey(RUN, 0, base, HONEST[0], Kind.DELTA)
    return Candidate(key, offer, [Holdings(peer_id=HONEST[0], grpc=None, offers=[offer])])


def test_the_fetch_queue_takes_offers_at_or_below_the_own_version_before_those_ahead() -> None:
    """Youngest first among the offers this peer can use now; an offer ahead of its own version
    (a claim nobody can check yet) waits behind them, the nearest ahead first."""
    queue = FetchQueue(stale_after=None)
    for base in (14, 9, 11, 10, 13, 8):
        queue.push(_candidate(base))
    order = []
    while (item := queue.pop([10], link_rate=None, seconds_per_version=None, bytes_ahead=0)[0]) is not None:
        order.append(item.key.base_version)
    assert order == [10, 9, 8, 11, 13, 14]


def test_a_fetch_that_leaves_without_its_bytes_frees_its_slot():
    """A chosen offer whose fetch is cancelled (stale, or a state download took the link) or
    dropped from the queue releases its slot: two such once kept a publisher "busy" for the
    pending expiry, and every later offer of it was skipped (volunteers behind NAT never
    exchanged a fragment)."""
    from cgad.protocol.records import Holdings, Offer
    from cgad.protocol.selection import MAX_PENDING_PER_PUBLISHER, OfferSelector
    from cgad.protocol.transport import Kind

    selector = OfferSelector("run", "QmMe123456789", fan_in=4, history_versions=64, record_ttl=120)

    def offer(version: int) -> Holdings:
        o = Offer(publisher="QmPubsher123", kind=Kind.DELTA.value, base_version=version, tokens=10,
                  content_hash=bytes([version]) * 32, byte_length=76, numel=32, codec="4bit")  # fmt: skip
        return Holdings(peer_id=o.publisher, offers=[o], grpc=None)

    chosen = []
    for version in range(MAX_PENDING_PER_PUBLISHER):
        chosen += selector.choose(0, 32, [offer(version + 3)], own=3, now=float(version)).candidates
    assert len(chosen) == MAX_PENDING_PER_PUBLISHER
    version = 3 + MAX_PENDING_PER_PUBLISHER
    assert not selector.choose(0, 32, [offer(version)], own=3, now=5.0).candidates  # busy
    for candidate in chosen:
        selector.release(candidate)
    assert selector.choose(0, 32, [offer(version + 1)], own=3, now=6.0).candidates


def test_only_the_kinds_the_member_uses_are_fetched() -> None:
    """A member with its own first moment (``--moments own``) and no φ mixing takes its peers'
    deltas only: their moments and φ would be bytes it drops (``UsableVersions.kinds``)."""
    from cgad.node.config import OuterOptions
    from cgad.node.member.methods import UsableVersions

    own = UsableVersions.of(OuterOptions(moments="own", mixing="none")).kinds
    assert own == {"delta"}
    assert UsableVersions.of(OuterOptions()).kinds == {"delta", "params", "moments"}  # cga: late mixing
    assert UsableVersions.of(OuterOptions(optimizer="local")).kinds == set()  # the floor takes nothing
    publisher = HONEST[0]
    kinds = ("delta", "params", "moments")
    offers = [_offer(publisher, OWN, kind.encode()).copy(update={"kind": kind}) for kind in kinds]
    record = Holdings(peer_id=publisher, grpc=None, offers=offers)
    selector = OfferSelector(RUN, ME, fan_in=4, history_versions=64, record_ttl=120.0, max_ahead=4, kinds=own)
    chosen = selector.choose(0, NUMEL, [record], OWN, 0.0, swarm=OWN).candidates
    assert [c.key.kind for c in chosen] == [Kind.DELTA]
    everything = _selector().choose(0, NUMEL, [record], OWN, 0.0, swarm=OWN).candidates
    assert {c.key.kind for c in everything} == {Kind.DELTA, Kind.PARAMS, Kind.MOMENTS}
