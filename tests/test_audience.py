"""A member alone encodes for nobody: past the cutoff without a live peer or a request, its Δ is
neither encoded nor owed, and its own step still takes it whole; a peer or a request brings it back."""

import torch

from cgad.node.config import OuterOptions
from cgad.node.member.outer import OuterLoop
from cgad.node.sim.memory import VirtualNetwork
from cgad.protocol.transport import Kind

NUMEL = 4096


def _block(loop: OuterLoop, generator: torch.Generator) -> torch.Tensor:
    """One block's worth of inner progress on θ; θ as it ends (what an SGD step at lr 1 lands on)."""
    loop.theta[0].add_(torch.randn(NUMEL, generator=generator), alpha=1e-2)
    return loop.theta[0].detach().clone()


def _loop(network: VirtualNetwork, heard: bool = True) -> OuterLoop:
    options = OuterOptions(optimizer="sgd", outer_lr=1.0, cutoff=2)
    return OuterLoop([torch.zeros(NUMEL)], options, network.join("me"), "run", codec="sparse", heard=heard)


def test_a_member_alone_stops_encoding_after_the_cutoff_and_its_own_step_is_whole():
    network = VirtualNetwork()
    loop, generator = _loop(network), torch.Generator().manual_seed(0)
    for round_ in range(5):
        ended = _block(loop, generator)
        loop.sync(0, tokens=10)
        # the own Δ taken whole whether it went out or not: φ lands where θ ended
        assert torch.allclose(loop.phi[0], ended, atol=1e-6), round_
    # two rounds (the cutoff) with an audience it started with, then none
    assert loop.counters.published == 2 and loop.counters.unheard == 3
    assert sum(loop.counters.sent_as.values()) == 2
    # nothing owed to nobody: the residual (2 bytes a parameter) is gone
    assert loop.sender._unsent == {} and loop.sender._sent == {}


def test_a_peer_that_appears_or_asks_brings_the_deltas_back_at_the_next_round():
    network = VirtualNetwork()
    loop, generator = _loop(network, heard=False), torch.Generator().manual_seed(1)
    _block(loop, generator)
    loop.sync(0, tokens=10)
    assert loop.counters.published == 0 and loop.counters.unheard == 1  # the first of a swarm: nobody yet
    # a joiner asks for a snapshot (not live yet: no progress record): the next Δ goes out
    loop.transport.stats.asked += 1
    _block(loop, generator)
    loop.sync(0, tokens=10)
    assert loop.counters.published == 1
    # and keeps going out for the cutoff after the last sign, then stops
    for _ in range(3):
        _block(loop, generator)
        loop.sync(0, tokens=10)
    assert loop.counters.published == 3 and loop.counters.unheard == 2
    # a live peer: published again, and it gets it
    peer = network.join("peer")
    _block(loop, generator)
    loop.sync(0, tokens=10)
    assert loop.counters.published == 4
    [got] = peer.receive(0, Kind.DELTA)
    assert got.key.publisher == "me" and got.key.base_version == 5


def test_with_fragments_the_cutoff_counts_each_fragments_publish():
    """Two fragments, cutoff 1.5: an audience outlasts its last sign by ceil(1.5 x 2) = 3 shared
    publishes, whichever fragments they are."""
    network = VirtualNetwork()
    options = OuterOptions(optimizer="sgd", outer_lr=1.0, cutoff=1.5, fragments=2)
    params = [torch.zeros(NUMEL), torch.zeros(NUMEL)]
    loop = OuterLoop(params, options, network.join("me"), "run", codec="sparse")
    for turn in range(6):
        f = turn % 2
        loop.theta[f].add_(0.01)
        loop.sync(f, tokens=10)
    assert loop.audience.turns == 3
    assert loop.counters.published == 3 and loop.counters.unheard == 3


def test_with_an_encoder_thread_a_send_under_way_ends_before_the_residual_is_dropped():
    """A daemon encodes on a thread of its own: going quiet waits for the send under way, and a
    peer that appears later gets the next Δ encoded there."""
    from concurrent.futures import ThreadPoolExecutor

    network = VirtualNetwork()
    options = OuterOptions(optimizer="sgd", outer_lr=1.0, cutoff=1)
    with ThreadPoolExecutor(1) as encoder:
        loop = OuterLoop(
            [torch.zeros(NUMEL)], options, network.join("me"), "run", codec="sparse", encoder=encoder
        )
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            ended = _block(loop, generator)
            loop.sync(0, tokens=10)
            assert torch.allclose(loop.phi[0], ended, atol=1e-6)
        assert loop.counters.published == 1 and loop.counters.unheard == 2
        assert not loop.sending(0) and loop.sender._unsent == {}
        peer = network.join("peer")
        _block(loop, generator)
        loop.sync(0, tokens=10)
        assert loop.counters.published == 2
        [got] = peer.receive(0, Kind.DELTA)
        assert got.key.base_version == 3
