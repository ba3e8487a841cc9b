"""What a peer keeps to itself: a block published with ``share=False`` (the daemon's first round
after adopting a state) reaches no peer and no outer step: the peers' deltas move φ as they move
the peers' own, and θ restarts from there."""

import torch

from cgad.node.config import OuterOptions
from cgad.node.outer import OuterLoop
from cgad.protocol.memory import VirtualNetwork
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
