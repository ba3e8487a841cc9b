"""Centered clipping around the own pseudo-gradient, against a float64 reference, and in the
outer loop: a scaled delivery moves φ no further than an honest one could."""

from __future__ import annotations

import pytest
import torch

from cgad.node.config import OuterOptions
from cgad.node.outer import OuterLoop
from cgad.optim import clip_around
from cgad.protocol.memory import VirtualNetwork
from cgad.protocol.transport import Fragment, FragmentKey

pytestmark = pytest.mark.timeout(60)


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


def test_bad_arguments_are_refused():
    own = torch.ones(4)
    with pytest.raises(ValueError, match="radius"):
        clip_around(own, own, radius=-1.0)
    with pytest.raises(ValueError, match="shapes"):
        clip_around(own, torch.ones(5), radius=1.0)
    with pytest.raises(ValueError, match="finite"):
        clip_around(own, torch.full((4,), float("inf")), radius=1.0)


def _step(aggregation: str, attack: float) -> torch.Tensor:
    """φ after one round in which the own Δ is −1s and one peer sends its honest −1s × attack."""
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    loop = OuterLoop(
        [torch.zeros(8)], OuterOptions(optimizer="sgd", outer_lr=1.0, aggregation=aggregation), me, "run"
    )
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    peer.publish(Fragment(FragmentKey("run", 0, 0, "peer"), torch.full((8,), -1.0) * attack, tokens=10))
    loop.apply(0)
    return loop.phi[0], loop


def test_one_scaled_peer_moves_the_mean_but_not_the_clipped_step():
    honest, _ = _step("clip", 1.0)
    assert torch.allclose(honest, torch.ones(8))  # both Δs agree: φ moves by 1
    mean, _ = _step("mean", 1e6)
    assert float(mean.abs().max()) > 1e5  # the attack has teeth without clipping
    clipped, loop = _step("clip", 1e6)
    # the peer's Δ is held within 2‖Δ_own‖ of Δ_own: φ moves at most (1 + 2)/2 of an honest step
    assert float(clipped.abs().max()) <= 2.0 + 1e-5 and loop.counters.clipped == 1
