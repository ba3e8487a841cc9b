"""Centered clipping around the own pseudo-gradient (``AroundOwn``: one float64 pass per delivery,
a chunk at a time, checked against a direct float64 computation), and in the outer loop: a
scaled delivery moves φ no further than an honest one could, and a reversed one is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cgad.node.config import OuterOptions
from cgad.node.member.mixing import held_phi
from cgad.node.member.outer import OuterLoop
from cgad.node.sim.memory import VirtualNetwork
from cgad.optim import AroundOwn, SpreadBound
from cgad.optim.robust import FLOAT64_CHUNK
from cgad.protocol.codec import Codec, decode, encode
from cgad.protocol.transport import Fragment, FragmentKey, Kind

pytestmark = pytest.mark.timeout(60)


def clip_around(reference: torch.Tensor, delivery: torch.Tensor, radius: float) -> tuple[torch.Tensor, bool]:
    _, clipped, was = AroundOwn(reference, radius).judge(delivery)
    return clipped, was


def cosine(reference: torch.Tensor, delivery: torch.Tensor) -> float:
    return AroundOwn(reference, 1.0).judge(delivery)[0]


def _reference_clip(reference: torch.Tensor, delivery: torch.Tensor, radius: float) -> torch.Tensor:
    r, d = reference.double(), delivery.double()
    offset = d - r
    bound = radius * r.norm()
    return (r + offset * min(1.0, float(bound / offset.norm()))).float()


def test_a_delivery_within_the_radius_is_untouched():
    torch.manual_seed(0)
    own = torch.randn(1000)
    peer = own + 0.5 * torch.randn(1000)
    clipped, was = clip_around(own, peer, radius=2.0)
    assert clipped is peer and not was


@pytest.mark.parametrize("scale", [3.0, 1e6, 1e20])
def test_a_scaled_delivery_lands_on_the_radius(scale):
    torch.manual_seed(1)
    own, honest = torch.randn(1000), torch.randn(1000)
    clipped, was = clip_around(own, honest * scale, radius=2.0)
    assert was and torch.isfinite(clipped).all()
    distance = float((clipped.double() - own.double()).norm())
    assert distance == pytest.approx(2.0 * float(own.double().norm()), rel=1e-5)
    torch.testing.assert_close(clipped, _reference_clip(own, honest * scale, 2.0), rtol=1e-5, atol=1e-6)


def test_judging_goes_through_float64_a_chunk_at_a_time_with_the_same_result():
    """Over several ``FLOAT64_CHUNK``s and a partial one: the cosine and the clip of a direct
    float64 computation, and no float64 copy of the reference held (16 bytes per parameter of
    copies at the outer step before)."""
    torch.manual_seed(3)
    numel = 2 * FLOAT64_CHUNK + 12345
    own, honest = torch.randn(numel), torch.randn(numel)
    judge = AroundOwn(own, 2.0)
    held = [v for v in vars(judge).values() if isinstance(v, torch.Tensor)]
    assert held and all(v.dtype == torch.float32 and v.data_ptr() == own.data_ptr() for v in held)
    along = own + 0.1 * honest
    expected = float(torch.dot(along.double(), own.double()) / (along.double().norm() * own.double().norm()))
    got, same, was = judge.judge(along)
    assert got == pytest.approx(expected, rel=1e-12) and same is along and not was
    _, clipped, was = judge.judge(honest * 1e6)
    assert was
    torch.testing.assert_close(clipped, _reference_clip(own, honest * 1e6, 2.0), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    own = torch.ones(4)
    with pytest.raises(ValueError, match="radius"):
        clip_around(own, own, radius=-1.0)
    with pytest.raises(ValueError, match="shapes"):
        clip_around(own, torch.ones(5), radius=1.0)
    with pytest.raises(ValueError, match="finite"):
        clip_around(own, torch.full((4,), float("inf")), radius=1.0)
    with pytest.raises(ValueError, match="finite"):
        clip_around(torch.full((4,), float("nan")), own, radius=1.0)
    with pytest.raises(ValueError, match="scale"):
        AroundOwn(own, 1.0, scale=float("inf"))


def test_the_radius_counts_in_the_given_scale():
    """Around a φ of norm 100, in norms of a Δ of norm 0.5: a φ 2 away is held at 2 × 0.5 = 1."""
    phi = torch.full((4,), 50.0)
    _, held, clipped = AroundOwn(phi, 2.0, scale=0.5).judge(phi + torch.tensor([2.0, 0, 0, 0]))
    assert clipped and torch.allclose(held, phi + torch.tensor([1.0, 0, 0, 0]))


def test_cosine_matches_float64_and_has_no_direction_at_zero():
    a, b = torch.randn(1000), torch.randn(1000)
    expected = float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()))
    assert cosine(a, b) == pytest.approx(expected, abs=1e-12)
    assert cosine(a, -a) == pytest.approx(-1.0) and cosine(a, 3 * a) == pytest.approx(1.0)
    assert cosine(torch.zeros(1000), b) == 1.0  # a zero update opposes nothing
    assert cosine(torch.full((4,), 1e30), torch.full((4,), 1e30)) == pytest.approx(1.0)  # no fp32 overflow
    with pytest.raises(ValueError, match="shapes"):
        cosine(a, torch.ones(5))
    with pytest.raises(ValueError, match="finite"):
        cosine(a, torch.full((1000,), float("inf")))


def _step(aggregation: str, attack: float, **options: object) -> torch.Tensor:
    """φ after one round in which the own Δ is −1s and one peer sends its honest −1s × attack."""
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    config = OuterOptions(optimizer="sgd", outer_lr=1.0, aggregation=aggregation, **options)
    loop = OuterLoop([torch.zeros(8)], config, me, "run")
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    peer.publish(Fragment(FragmentKey("run", 0, 0, "peer"), torch.full((8,), -1.0) * attack, tokens=10))
    loop.apply(0)
    return loop.phi[0].detach(), loop


def test_one_scaled_peer_moves_the_mean_but_not_the_clipped_step():
    honest, _ = _step("clip", 1.0)
    assert torch.allclose(honest, torch.ones(8))  # both Δs agree: φ moves by 1
    mean, _ = _step("mean", 1e6)
    assert float(mean.abs().max()) > 1e5  # the attack has teeth without clipping
    clipped, loop = _step("clip", 1e6)
    # the peer's Δ is held within 2‖Δ_own‖ of Δ_own: φ moves at most (1 + 2)/2 of an honest step
    assert float(clipped.abs().max()) <= 2.0 + 1e-5 and loop.counters.clipped == 1


def test_a_reversed_delivery_is_refused_and_blamed():
    flipped, loop = _step("clip", -1.0)  # the peer sends +1s: exactly against the own Δ
    assert torch.allclose(flipped, torch.ones(8))  # φ moves by the own Δ alone
    assert loop.counters.rejected["opposed"] == 1 and loop.counters.rejected_by_peer["peer"] == 1
    assert loop.counters.applied == 0
    taken, loop = _step("clip", -1.0, min_cosine=-1.0)  # every direction allowed: the mean
    assert torch.allclose(taken, torch.zeros(8)) and loop.counters.applied == 1
    mean, loop = _step("mean", -1.0)  # the plain mean screens nothing
    assert torch.allclose(mean, torch.zeros(8)) and not loop.counters.rejected


# honest peers' deltas of the toy rounds below: beside the own Δ of −1s, each mean −1 and no
# near copy of it or of each other (cosines 0.96 and 0.85: ``sender.NEAR_COPY``)
HONEST = torch.tensor([-1.3, -0.7] * 4)
OTHER = torch.tensor([-0.7, -1.3] * 4)


def _discarded_round(attack: float, diverge: bool = False) -> OuterLoop:
    """A round whose own block is kept from the step (the first after adopting a state, or one
    that diverged): one honest peer sends −1s, an attacker −1s × ``attack`` with a huge token
    claim."""
    network = VirtualNetwork()
    me, honest, attacker = network.join("me"), network.join("honest"), network.join("attacker")
    loop = OuterLoop([torch.zeros(8)], OuterOptions(optimizer="sgd", outer_lr=1.0), me, "run")
    loop.theta[0].add_(float("nan") if diverge else 1.0)
    loop.publish(0, tokens=10, share=False)
    honest.publish(Fragment(FragmentKey("run", 0, 0, "honest"), HONEST, tokens=10))
    forged = Fragment(FragmentKey("run", 0, 0, "attacker"), OTHER * attack, tokens=2**62)
    attacker.publish(forged)
    loop.apply(0)
    return loop


def test_a_discarded_block_still_judges_the_peers_deltas():
    # judged against the peers' own median, the attacker (one of two) would be the yardstick
    loop = _discarded_round(1e6)
    assert float(loop.phi[0].abs().max()) <= 3.0 + 1e-5  # within (1 + radius)·‖Δ_own‖
    assert loop.counters.clipped == 1 and loop.counters.applied == 2
    honest = _discarded_round(1.0)  # both taken, the claim capped at twice the own block's tokens
    assert torch.allclose(honest.phi[0], -(HONEST + 2 * OTHER) / 3)


def test_without_any_block_of_its_own_a_node_takes_no_peer_delta():
    loop = _discarded_round(1e6, diverge=True)
    assert torch.equal(loop.phi[0], torch.zeros(8)) and loop.counters.applied == 0
    assert loop.counters.rejected["no_yardstick"] == 2 and loop.counters.rejected["local_non_finite"] == 1


@pytest.mark.parametrize(("optimizer", "mixing"), [("sgd", "gossip"), ("noloco", "none")])
def test_a_far_off_phi_pulls_no_further_than_an_honest_rounds_drift(optimizer: str, mixing: str) -> None:
    """A mixing partner's φ is held within clip_radius·‖Δ_own‖ of this node's, like its Δ."""

    def mixed(aggregation: str) -> OuterLoop:
        network = VirtualNetwork()
        me, peer = network.join("me"), network.join("peer")
        options = OuterOptions(optimizer=optimizer, outer_lr=1.0, mixing=mixing, aggregation=aggregation)
        loop = OuterLoop([torch.zeros(8)], options, me, "run")
        loop.theta[0].add_(1.0)  # own Δ −1s: ‖Δ‖ = √8, so a φ is held within 2√8 (2 per coordinate)
        loop.publish(0, tokens=10)
        key = FragmentKey("run", 0, 0, "peer")
        peer.publish(Fragment(key, HONEST, tokens=10))  # an honest Δ (its mean −1, no copy of the own)
        peer.publish(Fragment(replace(key, kind=Kind.PARAMS), torch.full((8,), 1e6), tokens=10))
        loop.apply(0)
        return loop

    held, sent = mixed("clip"), mixed("mean")
    assert float(sent.phi[0].detach().abs().max()) > 1e5  # the far-off φ has teeth unheld
    # gossip: φ 1.15 / 0.85 after the step, then pulled half-way to a partner held 2 further: 2.15;
    # NoLoCo: the pair's mean φ and Δ with a unit step: the same
    assert float(held.phi[0].detach().abs().max()) <= 2.15 + 1e-5 and held.counters.clipped_params == 1


def test_the_phi_bound_widens_to_the_peers_recent_spread_and_one_far_off_phi_does_not_widen_it():
    spread = SpreadBound(spread=3.0, window=8, min_seen=4)
    anchor = torch.zeros(4)
    honest = [torch.tensor([5.0, 0, 0, 0]), torch.tensor([0, 4.0, 0, 0]), torch.tensor([0, 0, 6.0, 0])]
    for theirs in [*honest, honest[0]]:  # honest φs 4-6 apart, a fixed bound of 2: all held at first
        held, clipped = held_phi(anchor, theirs, 2.0, spread)
        assert clipped and float(held.norm()) == pytest.approx(2.0)
    assert spread.bound(2.0) == pytest.approx(3.0 * 5.0)  # now the median's 3 times: 15
    held, clipped = held_phi(anchor, honest[1], 2.0, spread)
    assert not clipped and torch.equal(held, honest[1])  # honest drift taken whole
    far = torch.tensor([0, 0, 0, 1e6])
    held, clipped = held_phi(anchor, far, 2.0, spread)
    assert clipped and float(held.norm()) == pytest.approx(15.0)  # held at the spread it met
    assert spread.bound(2.0) == pytest.approx(15.0)  # and one far-off φ among six leaves it there
    for _ in range(2):  # three far-off φs of the eight seen move the median within the honest
        held_phi(anchor, far, 2.0, spread)
    assert spread.bound(2.0) <= 3.0 * 6.0


def _sparse_rounds(my_codec: str, rounds: int) -> tuple[OuterLoop, OuterLoop]:
    """Two nodes, the peer sending sparse deltas, each moving θ by a shared drift and its own
    noise per round; this node sends its Δ in ``my_codec``."""
    torch.manual_seed(0)
    network = VirtualNetwork()
    options = OuterOptions(optimizer="sgd", outer_lr=1.0)
    me = OuterLoop([torch.zeros(4096)], options, network.join("me"), "run", codec=my_codec)
    peer = OuterLoop([torch.zeros(4096)], options, network.join("peer"), "run", codec="sparse")
    drift = torch.randn(4096) * 0.01
    for _ in range(rounds):
        for loop in (me, peer):
            loop.theta[0].add_(drift + torch.randn(4096) * 0.01)
            loop.publish(0, tokens=10)
        for loop in (me, peer):
            loop.apply(0)
    return me, peer


def test_sparse_deltas_are_judged_against_the_own_delta_as_sent() -> None:
    """With the sparse codec a peer's Δ holds 16 values in 256, grown by error feedback over the
    rounds they waited: against a dense own Δ an honest one ends up clipped, against the own Δ
    as sent (sparse too, with its own residual) it passes whole. The own step still takes the
    whole own Δ."""
    torch.manual_seed(1)
    network = VirtualNetwork()
    options = OuterOptions(optimizer="sgd", outer_lr=1.0)
    loop = OuterLoop([torch.zeros(4096)], options, network.join("me"), "run", codec="sparse")
    peer = network.join("peer")
    moved = torch.randn(4096) * 0.01
    loop.theta[0].add_(moved)
    loop.publish(0, tokens=10)
    [mine] = peer.receive(0)
    assert int((mine.tensor != 0).sum()) == 4096 // 256 * 16 and mine.kept == 16  # each block's top 16
    theirs = encode(-moved - torch.randn(4096) * 0.01, "sparse")  # a Δ along the own one
    peer.publish_encoded(FragmentKey("run", 0, 0, "peer"), theirs, codec=Codec.SPARSE, numel=4096, tokens=10)
    loop.apply(0)
    # φ' = φ − (Δ_own + Δ_peer) / 2 with the whole own Δ = −moved
    assert torch.allclose(loop.phi[0], (moved - decode(theirs)) / 2) and loop.counters.clipped == 0
    judged, _ = _sparse_rounds("sparse", rounds=30)
    assert judged.counters.clipped == 0 and judged.counters.applied == 30
    # a node sending 4bit has no residual like the peer's to judge by: most are clipped (the
    # cost of a swarm that mixes dense and sparse rounds, docs/DESIGN.md §4)
    dense, _ = _sparse_rounds("4bit", rounds=30)
    assert dense.counters.clipped > 10 and dense.counters.applied == 30
