"""The inner first moment shared beside each delta (``node/member/moments.py``): two real outer
loops on the virtual network, each with a real AdamW over its θ. After the outer step each
member's m is the mean of its own m as sent and its peers' fresh ones, judged around its own; a
member alone, a late m, or ``--moments own`` leaves m as it was."""

from __future__ import annotations

import torch

from cgad.node.config import OuterOptions
from cgad.node.member.moments import CODEC, REACH
from cgad.node.member.outer import OuterLoop
from cgad.node.member.scoring import DataScore
from cgad.node.sim.memory import VirtualNetwork
from cgad.optim import staleness_weight
from cgad.protocol.codec import Codec, decode, encode
from cgad.protocol.transport import Fragment, FragmentKey, Kind

NUMEL = 512


def _member(
    network: VirtualNetwork, name: str, seed: int, score: DataScore | None = None, **options: object
) -> tuple[OuterLoop, torch.optim.AdamW]:
    torch.manual_seed(seed)
    theta = [torch.nn.Parameter(torch.zeros(NUMEL)), torch.nn.Parameter(torch.zeros(8))]
    loop = OuterLoop(theta, OuterOptions(**options), network.join(name), "run", score=score)
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


def _within_reach(optimizer: torch.optim.AdamW, m: torch.Tensor) -> torch.Tensor:
    """|m| ≤ REACH·κ·√v, κ = (1 − β1) / √((1 − β2)(1 − β1²/β2)): what Adam's m can be beside its v."""
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    kappa = REACH * (1 - beta1) / ((1 - beta2) * (1 - beta1**2 / beta2)) ** 0.5
    v = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in optimizer.param_groups[0]["params"]])
    return torch.maximum(torch.minimum(m, kappa * v.sqrt()), -kappa * v.sqrt())


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
    # m ← m + mean(own as sent, peer's as sent) − own as sent, within Adam's reach of the own v
    want_a = _within_reach(opt_a, m_a + (_as_sent(m_b) - _as_sent(m_a)) / 2)
    want_b = _within_reach(opt_b, m_b + (_as_sent(m_a) - _as_sent(m_b)) / 2)
    assert torch.allclose(_m(opt_a), want_a, atol=1e-6) and torch.allclose(_m(opt_b), want_b, atol=1e-6)
    assert a.counters.moments_mixed == 1 and b.counters.moments_mixed == 1
    assert a.counters.moments_sent == 1 and a.counters.moments_received == 1
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


def test_a_peers_first_moment_moves_no_coordinate_past_adams_reach() -> None:
    """A row this member never trained (its v and m 0: an embedding row of tokens it never saw)
    takes no first moment from a peer: the next step would move it by lr·m/ε (a row moved by 45
    at lr 1e-3 before the bound). Rows it trained take the mean, within κ·√v."""
    network = VirtualNetwork()
    (a, opt_a), (b, _) = _member(network, "a", 0), _member(network, "b", 1)
    theta = opt_a.param_groups[0]["params"][0]
    opt_a.state[theta]["exp_avg"][:32] = 0.0  # 32 values it never saw a gradient for
    opt_a.state[theta]["exp_avg_sq"][:32] = 0.0
    a.publish(0, tokens=10)
    b.publish(0, tokens=10)
    a.apply(0)
    m = opt_a.state[theta]["exp_avg"]
    assert torch.equal(m[:32], torch.zeros(32)) and a.counters.moments_mixed == 1
    before = theta.detach().clone()
    theta.grad = torch.zeros_like(theta)
    opt_a.step()
    assert float((theta.detach() - before)[:32].abs().max()) < 1e-6  # not lr·m/ε


def test_a_peers_first_moment_a_version_late_weighs_as_a_delta_of_that_age() -> None:
    """Daemons a version apart in phase: a peer's m of the version before this step's is taken at
    σ(1), as its delta would be (without it, two nodes a version apart never mix)."""
    network = VirtualNetwork()
    a, opt_a = _member(network, "a", 0)
    a.publish(0, tokens=10)
    a.apply(0)  # now at version 1
    m_a = _m(opt_a)
    theirs = m_a + 0.01 * torch.randn_like(m_a)
    key = FragmentKey("run", 0, 0, "b", Kind.MOMENTS)  # the peer's m of version 0: a version late
    network.join("b").publish_encoded(
        key, encode(theirs, CODEC), codec=CODEC, numel=theirs.numel(), tokens=10
    )
    a.publish(0, tokens=10)
    a.apply(0)
    w = staleness_weight(1, OuterOptions().alpha, OuterOptions().cutoff)
    own = _as_sent(m_a)
    want = _within_reach(opt_a, m_a + w * (_as_sent(theirs) - own) / (w + 1))
    assert a.counters.moments_mixed == 1 and torch.allclose(_m(opt_a), want, atol=1e-6)


def test_the_first_moment_of_a_refused_delta_is_not_mixed() -> None:
    """A peer whose Δ the step refuses (opposed to the own) is not trusted with its m either,
    however well its m passes on its own; the m of a delta taken is mixed."""
    network = VirtualNetwork()
    a, opt_a = _member(network, "a", 0)
    m_a = _m(opt_a)
    evil = network.join("evil")
    version = a.versions[0]
    a.publish(0, tokens=10)
    delta = a._turn[0].tensor  # the own Δ as published: the evil one sends its opposite
    evil.publish(Fragment(FragmentKey("run", 0, version, "evil"), -delta, 10))
    m_key = FragmentKey("run", 0, version, "evil", Kind.MOMENTS)
    evil.publish_encoded(m_key, encode(m_a, CODEC), codec=CODEC, numel=m_a.numel(), tokens=10)
    a.apply(0)
    assert a.counters.rejected["opposed"] == 1 and a.counters.rejected["moments_refused"] == 1
    assert a.counters.moments_mixed == 0 and torch.equal(_m(opt_a), m_a)


def test_a_first_moment_the_budget_cannot_hold_in_4_bits_goes_sparse_and_moves_only_what_it_carries() -> None:
    """At the 10 Mbit testbed's budget (about 0.2 bytes a parameter a round) a 4-bit m never fit
    beside the Δ and none was sent. The Δ now leaves m ``BUDGET_SHARE`` of the budget, m goes out
    sparse within what is left, and a receiver moves only the coordinates it carries."""
    network = VirtualNetwork()
    budget = 0.2 * (NUMEL + 8) + 100  # a round's bytes to each fetcher (the headers' room beside)
    members, wire = [], []
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        theta = [torch.nn.Parameter(torch.zeros(NUMEL)), torch.nn.Parameter(torch.zeros(8))]
        loop = OuterLoop(
            theta, OuterOptions(), network.join(name), "run", codec="auto", link_budget=lambda: budget
        )
        optimizer = torch.optim.AdamW(theta, lr=1e-3)
        loop.moments.attach(optimizer)
        for _ in range(3):
            for p in theta:
                p.grad = torch.randn_like(p) + 1.0
            optimizer.step()
        publish = loop.transport.publish_encoded

        def spy(key: FragmentKey, data: bytes, publish=publish, **named: object) -> None:
            wire.append((key.publisher, key.kind, data, named["codec"]))
            publish(key, data, **named)

        loop.transport.publish_encoded = spy  # type: ignore[method-assign]  # the moments' too: one object
        members.append((loop, optimizer))
    (a, opt_a), (b, _) = members
    m_a = _m(opt_a)
    a.publish(0, tokens=10)
    b.publish(0, tokens=10)
    for member in (a, b):
        sent = [(kind, data, codec) for who, kind, data, codec in wire if who == member.transport.peer_id]
        assert [kind for kind, _, _ in sent] == [Kind.DELTA, Kind.MOMENTS], sent
        assert sent[1][2] is Codec.SPARSE and sum(len(data) for _, data, _ in sent) <= budget
    peer_m = next(
        decode(data) for who, kind, data, _ in wire if kind is Kind.MOMENTS and who == b.transport.peer_id
    )
    carried = peer_m != 0
    assert 0 < int(carried.sum()) < NUMEL // 2  # sparse: a share of the coordinates
    a.apply(0)
    assert a.counters.moments_mixed == 1
    mixed = _m(opt_a)
    assert torch.equal(mixed[~carried], m_a[~carried])  # what it did not carry stays the own
    want = _within_reach(opt_a, m_a + (peer_m - _as_sent(m_a)) / 2)  # the mean of two where carried
    assert torch.allclose(mixed[carried], want[carried], atol=1e-6)
    assert not torch.allclose(mixed[carried], m_a[carried])  # it moved: the test can fail


def test_a_distrusted_peers_first_moment_weighs_as_its_record_weighs_its_delta() -> None:
    """With the data score, a peer whose record weighs its deltas at one half has its m mixed at
    one half too (one weighed at nothing, not at all), not at full weight beside its cut Δ."""
    network = VirtualNetwork()
    score = DataScore(probe=None, windows=lambda n: None, budget=0, seq_len=64)  # type: ignore[arg-type]
    a, opt_a = _member(network, "a", 0, score=score)
    m_a = _m(opt_a)
    score.records.update({"half": 2.0, "none": 3.0})  # weights (3 − 2) / 2 and 0: no probe runs
    version = a.versions[0]
    a.publish(0, tokens=10)
    delta = a._turn[0].tensor
    theirs = {name: m_a + 0.01 * torch.randn_like(m_a) for name in ("half", "none")}
    for name, m in theirs.items():
        peer = network.join(name)
        peer.publish(Fragment(FragmentKey("run", 0, version, name), delta.clone(), 10))
        key = FragmentKey("run", 0, version, name, Kind.MOMENTS)
        peer.publish_encoded(key, encode(m, CODEC), codec=CODEC, numel=m.numel(), tokens=10)
    a.apply(0)
    own = _as_sent(m_a)
    want = _within_reach(opt_a, m_a + 0.5 * (_as_sent(theirs["half"]) - own) / 1.5)
    # the one weighed at nothing: its Δ not taken (distrusted), so neither its m
    assert a.counters.rejected["distrusted"] == 1 and a.counters.rejected["moments_refused"] == 1
    assert a.counters.moments_mixed == 1 and torch.allclose(_m(opt_a), want, atol=1e-6)
