"""What a peer keeps to itself: a block published with ``share=False`` (the daemon's first round
after adopting a state) moves its own φ and reaches no peer."""

import torch

from cgad.node.config import OuterOptions
from cgad.node.outer import OuterLoop
from cgad.protocol.memory import VirtualNetwork
from cgad.protocol.transport import Kind


def test_an_unshared_block_steps_alone_and_the_next_one_is_shared():
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    loop = OuterLoop([torch.zeros(8)], OuterOptions(optimizer="sgd", outer_lr=1.0), me, "run")
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10, share=False)
    loop.apply(0)
    assert torch.allclose(loop.phi[0], torch.ones(8))  # its own Δ taken whole
    assert peer.receive(0, Kind.DELTA) == [] and loop.counters.published == 0
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    [got] = peer.receive(0, Kind.DELTA)
    assert got.key.publisher == "me" and got.key.base_version == 1 and loop.counters.published == 1
