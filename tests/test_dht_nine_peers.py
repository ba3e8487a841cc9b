"""Nine peers, more than the nodes a DHT record is stored on (hivemind's ``num_replicas``, 5):
every peer finds every other one's progress record."""

from __future__ import annotations

import pytest
from _netswarm import SMALL, make_transport, wait_for

from cgad.protocol.network import NetworkTransport

pytestmark = pytest.mark.integration  # real hivemind peers (p2pd processes) on loopback

PEERS = 9  # beyond hivemind's num_replicas (5): no record is on every node


def test_nine_peers_each_list_every_other() -> None:
    peers: list[NetworkTransport] = []
    try:
        peers.append(make_transport({0: SMALL}, run_id="beam-test"))
        initial = peers[0].maddrs()
        peers += [make_transport({0: SMALL}, run_id="beam-test", peers=initial) for _ in range(PEERS - 1)]
        assert peers[0].dht_node is not None and peers[0].dht_node.num_replicas < PEERS - 1
        for n, peer in enumerate(peers):
            peer.report_progress([1], n, 1.0)
        listed = lambda: all(len(p.live_peers()) == PEERS - 1 for p in peers)  # noqa: E731
        wait_for(listed, 90, "every peer listing every other")
    finally:
        for peer in peers:
            peer.close()
