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
        beams = _record_beams(peers[1])
        for n, peer in enumerate(peers):
            peer.report_progress([1], n, 1.0)
        listed = lambda: all(len(p.live_peers()) == PEERS - 1 for p in peers)  # noqa: E731
        wait_for(listed, 90, "every peer listing every other")
        # with the replicas' beam, not hivemind's bucket of 20 (in a swarm this size: every node)
        replicas = peers[1].dht_node.num_replicas
        assert beams["store"] and set(beams["store"]) == {2 * replicas}, beams
        assert beams["lookup"] and set(beams["lookup"]) == {replicas}, beams
    finally:
        for peer in peers:
            peer.close()


def _record_beams(peer: NetworkTransport) -> dict[str, list[int | None]]:
    """The beam each store and lookup of ``peer``'s DHT node asks for, as they happen."""
    node = peer.dht_node
    beams: dict[str, list[int | None]] = {"store": [], "lookup": []}

    def recorded(method, kind):  # type: ignore[no-untyped-def]
        async def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            beams[kind].append(kwargs.get("beam_size"))
            return await method(*args, **kwargs)

        return call

    node.store_many = recorded(node.store_many, "store")  # type: ignore[method-assign]
    node.get_many = recorded(node.get_many, "lookup")  # type: ignore[method-assign]
    return beams
