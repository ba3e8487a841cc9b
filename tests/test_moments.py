"""The inner first moment shared beside each delta (``node/member/moments.py``): two real outer
loops on the virtual network, each with a real AdamW over its θ. After the outer step each
member's m is the mean of its own m as sent and its peers' fresh ones, judged around its own; a
member alone, a late m, or ``--moments own`` leaves m as it was."""

from __future__ import annotations

import torch

from cgad.node.config import OuterOptions
from cgad.node.member.moments import CODEC
from cgad.node.member.outer import OuterLoop
from cgad.node.sim.memory import VirtualNetwork
from cgad.protocol.codec import decode, encode
from cgad.protocol.transport import FragmentKey, Kind

NUMEL = 512


def _member(
    network: VirtualNetwork, name: str, seed: int, **options: object
) -> tuple[OuterLoop, torch.optim.AdamW]:
    torch.manual_seed(seed)
    theta = [torch.nn.Parameter(torch.zeros(NUMEL)), torch.nn.Parameter(torch.zeros(8))]
    loop = OuterLoop(theta, OuterOptions(**options), network.join(name), "run")
    optimizer = torch.optim.AdamW(theta, lr=1e-3)
    loop.moments.attach(optimizer)
    for _ in range(3):  # a block of inner steps on gradients of its own
        for p in theta:
            p.grad = torch.randn_like(p) + 1.0
        optimizer.step()
    return loop, optimizer


def _m(optimizer: torch.optim.AdamW) -> torch.Tensor:
    return torch.cat(
        [optimizer.state[p]["exp_avg"].reshape(-1).clone() for p in optimizer.param_groups[0]["params"]]
    )


def _as_sent(m: torch.Tensor) -> torch.Tensor:
    return decode(encode(m, CODEC)).reshape(-1)


def test_each_member_takes_the_mean_of_its_own_and_its_peers_first_moments() -> None:
    network = VirtualNetwork()
    (a, opt_a), (b, opt_b) = _member(network, "a", 0), _member(network, "b", 1)
    m_a, m_b = _m(opt_a), _m(opt_b)
    a.publish(0, tokens=10)
    b.publish(0, tokens=10)
    a.apply(0)
    b.apply(0)
    # m ← m + mean(own as sent, peer's as sent) − own as sent
    want_a = m_a + (_as_sent(m_b) - _as_sent(m_a)) / 2
    want_b = m_b + (_as_sent(m_a) - _as_sent(m_b)) / 2
    assert torch.allclose(_m(opt_a), want_a, atol=1e-6) and torch.allclose(_m(opt_b), want_b, atol=1e-6)
    assert a.counters.moments_mixed == 1 and b.counters.moments_mixed == 1
    assert not torch.allclose(_m(opt_a), m_a)  # it moved: the test can fail


def test_alone_late_or_own_keeps_the_first_moment_as_it_was() -> None:
    network = VirtualNetwork()
    alone, opt = _member(network, "alone", 0)
    m = _m(opt)
    alone.publish(0, tokens=10)
    alone.apply(0)
    assert torch.equal(_m(opt), m) and alone.counters.moments_mixed == 0

    network = VirtualNetwork()
    (a, opt_a), (b, _) = _member(network, "a", 0), _member(network, "b", 1, moments="own")
    m_a = _m(opt_a)
    b.publish(0, tokens=10)  # --moments own: its m never goes out
    a.publish(0, tokens=10)
    a.apply(0)
    assert torch.equal(_m(opt_a), m_a)
    # a peer's m of another version (late) is drained and counted, never mixed
    late = FragmentKey("run", 0, 7, "b", Kind.MOMENTS)
    network.peers["b"].publish_encoded(
        late, encode(torch.ones(NUMEL + 8), CODEC), codec=CODEC, numel=NUMEL + 8, tokens=10
    )
    a.publish(0, tokens=10)
    a.apply(0)
    assert torch.equal(_m(opt_a), m_a) and a.counters.rejected["moments_late"] == 1


def test_a_forged_first_moment_is_held_around_the_own_or_refused() -> None:
    """A peer's m is judged as a peer's Δ is: one scaled 1e6× moves m at most the clip radius
    (2 × the own m's norm, tensor by tensor); one opposed to the own is refused."""
    network = VirtualNetwork()
    a, opt_a = _member(network, "a", 0)
    m_a = _m(opt_a)
    evil = network.join("evil")
    for forged, seen in ((m_a * 1e6, "held"), (-m_a, "refused")):
        key = FragmentKey("run", 0, a.versions[0], "evil", Kind.MOMENTS)
        evil.publish_encoded(key, encode(forged, CODEC), codec=CODEC, numel=forged.numel(), tokens=10)
        before = _m(opt_a)
        own = _as_sent(before)
        a.publish(0, tokens=10)
        a.apply(0)
        moved = _m(opt_a) - before
        if seen == "held":
            assert 0 < float(moved.norm()) <= 2.0 * float(own.norm()) / 2 * (1 + 1e-4)
        else:
            assert torch.equal(moved, torch.zeros_like(moved)) and a.counters.rejected["moments_opposed"] == 1
