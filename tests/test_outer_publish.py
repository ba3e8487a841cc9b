"""What a peer keeps to itself: a block published with ``share=False`` (the daemon's first round
after adopting a state) reaches no peer and no outer step: the peers' deltas move φ as they move
the peers' own, and θ restarts from there."""

import copy

import pytest
import torch

from cgad.node.config import OuterOptions
from cgad.node.daemon.checkpoint import pack, unpack
from cgad.node.member.outer import OuterLoop
from cgad.node.member.outer_state import Phi0
from cgad.node.sim.memory import VirtualNetwork
from cgad.protocol.codec import encoded_size
from cgad.protocol.scheduling import AUTO_LINK_SHARE
from cgad.protocol.transport import Fragment, FragmentKey, Kind


def test_an_unshared_block_is_discarded_and_the_next_one_is_shared():
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    loop = OuterLoop([torch.zeros(8)], OuterOptions(optimizer="sgd", outer_lr=1.0), me, "run")
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10, share=False)
    peer.publish(Fragment(FragmentKey("run", 0, 0, "peer"), torch.full((8,), -3.0), tokens=10))
    loop.apply(0)
    # the peer's Δ alone, as the peer takes it; this node's own block is gone, θ restarts at φ
    assert torch.equal(loop.phi[0], torch.full((8,), 3.0)) and torch.equal(loop.theta[0], loop.phi[0])
    assert peer.receive(0, Kind.DELTA) == [] and loop.counters.published == 0
    assert loop.counters.discarded == 1
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    [got] = peer.receive(0, Kind.DELTA)
    assert got.key.publisher == "me" and got.key.base_version == 1 and loop.counters.published == 1


def _behind_by_one(swarm_version: int | None) -> OuterLoop:
    """A peer at version 0 whose two peers sent their deltas of versions 0 and 1 (the round it
    missed while its snapshot downloaded, and the round the swarm is in)."""
    network = VirtualNetwork()
    me = network.join("me")
    peers = [network.join(name) for name in ("a", "b")]
    loop = OuterLoop([torch.zeros(8)], OuterOptions(optimizer="sgd", outer_lr=1.0), me, "run")
    loop.theta[0].add_(1.0)  # its own Δ (−1s): the yardstick the peers' deltas are judged by
    loop.publish(0, tokens=10, share=False)  # the block after adopting: kept to itself
    for peer in peers:
        for version, delta in ((0, -1.0), (1, -2.0)):
            key = FragmentKey("run", 0, version, peer.peer_id)
            peer.publish(Fragment(key, torch.full((8,), delta), tokens=10))
    loop.apply(0, swarm_version=swarm_version)
    return loop


def test_a_peer_behind_replays_the_versions_it_missed_up_to_the_swarms() -> None:
    caught_up = _behind_by_one(swarm_version=1)
    # two steps, as the peers took them: −(−1) then −(−2)
    assert torch.equal(caught_up.phi[0], torch.full((8,), 3.0)) and caught_up.versions == [2]
    assert caught_up.counters.replayed == 1 and caught_up.counters.applied == 4
    # without the swarm's word (or with a swarm still at 0, whatever one peer claims) this step
    # takes version 0's deltas only; version 1's are held for the next step, where they are fresh
    for swarm_version in (None, 0):
        held = _behind_by_one(swarm_version)
        assert torch.equal(held.phi[0], torch.full((8,), 1.0)) and held.versions == [1]
        assert held.counters.replayed == 0 and held.counters.held_ahead == 2
        held.theta[0].copy_(held.phi[0] + 2.0)  # its own Δ of version 1 (−2s), like the peers'
        held.publish(0, tokens=10)
        held.apply(0)
        assert torch.equal(held.phi[0], torch.full((8,), 3.0)) and held.versions == [2]
        assert held.counters.held_ahead == 2 and held.counters.applied_by_age == {0: 4}


def test_held_deltas_that_an_adopted_state_has_passed_are_dropped() -> None:
    loop = _behind_by_one(None)  # version 1's two deltas held
    state = loop.state_dict()
    state["versions"] = [2]  # a peer's state that has taken version 1 already
    loop.load_state_dict(state)
    loop.theta[0].copy_(loop.phi[0] + 1.0)
    loop.publish(0, tokens=10)
    loop.apply(0)
    # only its own Δ (−1s): the held deltas of version 1 are in the adopted state already
    assert torch.equal(loop.phi[0], torch.full((8,), 2.0)) and loop.counters.applied_by_age == {0: 2}


def test_cga_momentum_follows_the_share_of_live_peers_whose_delta_came_fresh() -> None:
    """Two live peers, one delivers this round's Δ on time: share 1/2, freshness 0 → 0.25; a
    version replayed from peers ahead (no own Δ in it) leaves the freshness alone."""
    network = VirtualNetwork()
    me, a, _ = network.join("me"), network.join("a"), network.join("b")
    options = OuterOptions(optimizer="cga", cga_momentum=0.5)
    loop = OuterLoop([torch.zeros(8)], options, me, "run")
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    a.publish(Fragment(FragmentKey("run", 0, 0, "a"), torch.full((8,), -1.0), tokens=10))
    a.publish(Fragment(FragmentKey("run", 0, 1, "a"), torch.full((8,), -1.0), tokens=10))
    loop.apply(0, swarm_version=2)
    assert loop.counters.replayed == 1 and loop.versions[0] == 2
    assert loop.optimizer.param_groups[0]["freshness"] == 0.25


def test_a_float16_snapshot_carries_phi_in_float16_and_the_momentum_in_bfloat16() -> None:
    network = VirtualNetwork()
    options = OuterOptions(optimizer="cga", cga_momentum=0.5)
    torch.manual_seed(0)
    loop = OuterLoop([torch.zeros(4096)], options, network.join("me"), "run")
    peer = network.join("peer")  # heard fresh: the momentum starts (alone it would never)
    loop.theta[0].add_(torch.randn(4096) / 3)
    loop.publish(0, tokens=10)
    peer.publish(Fragment(FragmentKey("run", 0, 0, "peer"), torch.randn(4096) / 3, tokens=10))
    loop.apply(0)
    full, compact = loop.state_dict(), loop.state_dict("fp16")
    [momentum] = [s["momentum"] for s in full["optimizer"]["state"].values()]
    [kept] = [s["momentum"] for s in compact["optimizer"]["state"].values()]
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, momentum.to(torch.bfloat16))
    assert compact["phi"][0].dtype == torch.float16
    assert torch.allclose(compact["phi"][0].float(), loop.phi[0], rtol=2**-11, atol=0)
    assert len(pack(compact)) < 0.55 * len(pack(full))  # φ 16 kB + momentum 16 kB → 8 kB + 8 kB
    joiner = OuterLoop([torch.zeros(4096)], options, network.join("joiner"), "run")
    joiner.load_state_dict(compact)
    [adopted] = [joiner.optimizer.state[p]["momentum"] for p in joiner.phi]
    assert adopted.dtype == torch.float32 and torch.allclose(adopted, momentum, rtol=2**-8)
    assert joiner.phi[0].dtype == torch.float32 and torch.equal(joiner.phi[0], compact["phi"][0].float())
    # a φ float16 cannot hold is sent whole
    with torch.no_grad():
        loop.phi[0][0] = 1e6
    assert loop.state_dict("fp16")["phi"][0].dtype == torch.float32


def test_an_int8_snapshot_is_phi_minus_phi0_in_a_byte_per_value_and_rebuilds_the_momentum() -> None:
    """The default snapshot: φ − φ₀ as int8 blocks (φ₀ regenerated from the seed it names), no
    momentum; the error stays within half a step of each block's scale, and is far below what
    quantizing φ itself would cost; a state naming a seed the joiner cannot regenerate, or bytes
    that are not the codec's, is refused whole."""
    network = VirtualNetwork()
    options = OuterOptions(optimizer="cga", cga_momentum=0.5)
    torch.manual_seed(0)
    initial = torch.randn(1 << 14)
    loop = OuterLoop([initial.clone()], options, network.join("me"), "run")
    loop.theta[0].add_(torch.randn(1 << 14) / 100)
    loop.publish(0, tokens=10)
    loop.apply(0)
    phi0 = Phi0(7, [initial])
    regenerate = lambda seed: phi0 if seed == 7 else Phi0(seed, [torch.zeros_like(initial)])  # noqa: E731
    snapshot = loop.state_dict("int8", reference=phi0)
    assert snapshot["optimizer"]["state"] == {} and snapshot["reference_seed"] == 7
    packed = pack(snapshot)
    assert len(packed) < 1.03 * initial.numel() + 2048  # vs 4 bytes per value in fp32 alone
    joiner = OuterLoop([torch.zeros(1 << 14)], options, network.join("joiner"), "run")
    joiner.load_state_dict(unpack(packed), reference=regenerate)
    moved = (loop.phi[0] - phi0.tensor(0)).detach()
    error = (joiner.phi[0] - loop.phi[0]).detach().abs()
    step = moved.abs().view(-1, 256).amax(1) / 127  # int8's step per block of 256
    assert (error.view(-1, 256) <= step[:, None] / 2 + 1e-6).all()
    plain = loop.state_dict("int8")  # no reference: φ itself quantized
    direct = OuterLoop([torch.zeros(1 << 14)], options, network.join("other"), "run")
    direct.load_state_dict(plain)
    assert float(error.max()) < float((direct.phi[0] - loop.phi[0]).detach().abs().max()) / 20
    assert joiner.optimizer.state.get(joiner.phi[0], {}).get("momentum") is None  # rebuilt by its steps
    assert joiner.versions == loop.versions
    # refused whole, the joiner left as it was
    before = joiner.phi[0].clone()
    for bad in (
        {**snapshot, "reference_seed": -1},
        {**snapshot, "reference_seed": 2.5},
        {**snapshot, "phi": [snapshot["phi"][0][:-1]]},
        {**snapshot, "phi": [torch.zeros(100, dtype=torch.uint8)]},
        {**snapshot, "phi_codec": "int4"},
    ):
        with pytest.raises(ValueError):
            joiner.load_state_dict(bad, reference=regenerate)
    with pytest.raises(ValueError):  # a seed, but nothing here regenerates φ₀
        joiner.load_state_dict(snapshot)
    assert torch.equal(joiner.phi[0], before)


def test_auto_sends_4bit_on_a_fast_link_and_sparse_with_what_fits_on_a_slow_one() -> None:
    """``--codec auto`` over the virtual wire: each round's codec follows the budget that the
    bandwidth and the seconds per round give; receivers learn each delivery's values per block;
    the error feedback carries over the switches, so no own progress is lost."""
    numel = 1 << 16
    network = VirtualNetwork()
    options = OuterOptions(optimizer="sgd", outer_lr=1.0)
    wire = network.join("me")
    me = OuterLoop([torch.zeros(numel)], options, wire, "run", codec="auto", link_budget=wire.round_budget)
    peer = network.join("peer")
    fast, four_bit = 1e9, encoded_size(numel, "4bit")
    # one fetching peer, 10 s rounds: 4bit fits at 1 GB/s; the slow link holds 13 values per
    # block, and auto sends the level below (12)
    slow = encoded_size(numel, "sparse", kept=13) / (AUTO_LINK_SHARE * 10.0)
    seen, sent_total, moved_total, rounding = [], torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    for round_, bandwidth in enumerate([None, fast, fast, slow, slow, fast]):
        network.bandwidth = bandwidth
        me.transport.advance(10.0 * round_, round_)
        moved = torch.randn(numel) * 0.01
        me.theta[0].add_(moved)
        me.publish(0, tokens=10)
        me.apply(0)
        rounding += me.sender._unsent[0].residual.float().abs() * 2.0**-7  # one bfloat16 step at most
        peer.advance(10.0 * round_ + 1e6, round_)  # the slow link's bytes have landed
        [delivery] = peer.receive(0)
        seen.append(delivery.kept)
        sent_total += delivery.tensor
        moved_total += moved
    # None: unlimited (4bit); then 4bit while it fits; sparse with the k that fits; 4bit again
    assert seen == [None, None, None, 12, 12, None]
    assert four_bit > encoded_size(numel, "sparse", kept=12)
    # the own step took the whole Δ each round (φ moved by all of it)
    assert torch.allclose(me.phi[0].detach(), moved_total, atol=1e-6)
    # what peers got, plus what is still owed, is all of it, up to the owed part's rounding to
    # bfloat16 in each round
    owed = me.sender._unsent[0].residual.float()
    assert bool(((sent_total + owed + moved_total).abs() <= rounding + 1e-5).all())


def _cga_loop_after_a_round(name: str = "me") -> OuterLoop:
    options = OuterOptions(optimizer="cga", cga_momentum=0.5)
    network = VirtualNetwork()
    loop = OuterLoop([torch.zeros(8)], options, network.join(name), "run")
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    # a peer heard fresh: the momentum starts (a loop alone holds none)
    peer = Fragment(FragmentKey("run", 0, 0, "peer"), torch.full((8,), -0.5), tokens=10)
    network.join("peer").publish(peer)
    loop.apply(0)
    assert all("momentum" in s for s in loop.optimizer.state.values())
    return loop


def test_an_outer_state_that_would_break_the_next_step_is_refused_whole() -> None:
    """φ that only float64 holds finite, a NaN or wrong-shaped momentum, versions that are no
    counts: refused before anything changes (a NaN momentum made φ NaN for good; a wrong shape
    ended the daemon at its next outer step; Infinity as a version raised OverflowError)."""
    source = _cga_loop_after_a_round()
    good = source.state_dict()
    [index] = good["optimizer"]["state"]

    def broken(change) -> dict:
        state = copy.deepcopy(good)
        change(state)
        return state

    cases = [
        broken(lambda s: s.update(phi=[torch.full((8,), 1e39, dtype=torch.float64)])),
        broken(lambda s: s.update(phi=[torch.zeros(8, dtype=torch.int64)])),
        broken(lambda s: s["optimizer"]["state"][index].update(momentum=torch.full((8,), float("nan")))),
        broken(lambda s: s["optimizer"]["state"][index].update(momentum=torch.zeros(3))),
        broken(lambda s: s.update(versions=[float("inf")])),
        broken(lambda s: s.update(versions=[True])),
    ]
    target = _cga_loop_after_a_round("target")
    before = copy.deepcopy(target.state_dict())
    for state in cases:
        with pytest.raises(ValueError):
            target.load_state_dict(state)
        after = target.state_dict()
        assert torch.equal(after["phi"][0], before["phi"][0]) and after["versions"] == before["versions"]
        [momentum] = [s["momentum"] for s in after["optimizer"]["state"].values()]
        assert torch.equal(momentum, next(iter(before["optimizer"]["state"].values()))["momentum"])
    target.load_state_dict(good)  # and the sound one is taken
    assert torch.equal(target.phi[0], source.phi[0])


def test_the_running_freshness_is_state_a_resumed_node_keeps() -> None:
    source = _cga_loop_after_a_round()
    source.optimizer.param_groups[0]["freshness"] = 0.75
    resumed = _cga_loop_after_a_round("resumed")
    resumed.load_state_dict(source.state_dict())
    assert resumed.optimizer.param_groups[0]["freshness"] == 0.75
    claimed = source.state_dict()
    claimed["optimizer"]["param_groups"][0]["freshness"] = 1e9  # a peer's claim, held to [0, 1]
    resumed.load_state_dict(claimed)
    assert resumed.optimizer.param_groups[0]["freshness"] == 1.0
    # so is the share of every live peer heard fresh that late mixing follows; a state without it
    # (from before it existed) leaves the resumed node's own
    source.optimizer.param_groups[0]["heard"] = 0.5
    resumed.load_state_dict(source.state_dict())
    assert resumed._lateness(0) == 0.5
    older = source.state_dict()
    del older["optimizer"]["param_groups"][0]["heard"]
    resumed.optimizer.param_groups[0]["heard"] = 0.25
    resumed.load_state_dict(older)
    assert resumed._lateness(0) == 0.75
    older["optimizer"]["param_groups"][0]["heard"] = -3.0  # a claim, held to [0, 1]
    resumed.load_state_dict(older)
    assert resumed._lateness(0) == 1.0


def test_a_diverged_block_resets_every_fragments_non_finite_theta() -> None:
    """One forward pass makes every fragment's θ NaN: resetting only the fragment whose turn it
    was left the others NaN, and every later block diverged again."""
    network = VirtualNetwork()
    options = OuterOptions(optimizer="sgd", outer_lr=1.0, fragments=2)
    loop = OuterLoop([torch.zeros(4), torch.zeros(4)], options, network.join("me"), "run")
    for t in loop.theta:
        t.fill_(float("nan"))
    loop.publish(0, tokens=10)
    assert loop.counters.rejected["local_non_finite"] == 1
    assert all(torch.isfinite(t).all() for t in loop.theta)


def test_phi_kept_for_mixing_is_the_newest_two_versions_and_none_goes_out_with_no_peer_alive() -> None:
    """Each own φ kept to measure drift at is 4 bytes a parameter: a member keeps its two newest
    (a lone daemon had kept up to the cutoff's worth, 5 copies of the model); with no live peer
    no φ goes out at all (it would reach nobody)."""
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="cga", mixing="late"), me, "run")
    for version in range(5):  # no peer's Δ comes: the lateness stays 1, so φ goes out every round
        loop.theta[0].add_(1.0)
        loop.publish(0, tokens=10)
        loop.apply(0)
        assert [p.key.base_version for p in peer.receive(0, Kind.PARAMS)] == [version]
    assert sorted(loop.mixer.published[0]) == [3, 4]
    peer.close()
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    loop.apply(0)
    assert sorted(loop.mixer.published[0]) == [3, 4] and loop.counters.published == 6


@pytest.mark.parametrize("optimizer", ["cga", "sgd", "nesterov"])
def test_no_pseudo_gradient_is_held_on_phi_after_the_step(optimizer: str) -> None:
    """The merged pseudo-gradient (for CGA the own Δ's storage itself) is spent once the step is
    taken: left on φ's ``.grad`` it kept a model-sized buffer alive until the next step, beside
    the next round's own Δ."""
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    loop = OuterLoop([torch.zeros(8), torch.zeros(3)], OuterOptions(optimizer=optimizer), me, "run")
    for p in loop.theta:
        p.add_(1.0)
    loop.publish(0, tokens=10)
    peer.publish(Fragment(FragmentKey("run", 0, 0, "peer"), torch.full((11,), -0.5), tokens=10))
    loop.apply(0)
    assert loop.versions == [1] and not torch.equal(loop.phi[0], torch.zeros(8))  # a step was taken
    assert all(p.grad is None for p in loop.phi)
