"""Nine peers, more than the nodes a DHT record is stored on (hivemind's ``num_replicas``, 5):
every peer finds every other one's progress record, and still does once the five nodes nearest
the progress key, the ones holding its records, are gone."""

from __future__ import annotations

import pytest
from _netswarm import SMALL, make_transport, wait_for
from hivemind.dht.routing import DHTID

from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import progress_key

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
        # its next poll's lookup (every peer may have listed the others from polls made before the
        # recording began)
        wait_for(lambda: beams["lookup"], 30, "a lookup of peer 1's while recorded")
        # with the replicas' beam, not hivemind's bucket of 20 (in a swarm this size: every node)
        replicas = peers[1].dht_node.num_replicas
        assert beams["store"] and set(beams["store"]) == {2 * replicas}, beams
        assert beams["lookup"] and set(beams["lookup"]) == {replicas}, beams

        # the replicas lost: the nodes nearest the progress key leave, and the rest go on finding
        # each other's heartbeats (new stores land on live nodes and lookups reach them; with four
        # left, any beam of four would: this keeps the replicas' loss, not the beam's width)
        key = DHTID.generate(source=progress_key("beam-test"))
        by_distance = sorted(peers, key=lambda p: p.dht_node.node_id.xor_distance(key))
        nearest, rest = by_distance[:replicas], by_distance[replicas:]
        assert any(p.dht_node.protocol.storage.get(key) is not None for p in nearest)  # they held it
        for peer in nearest:
            peer.close()
        for n, peer in enumerate(rest):
            peer.report_progress([2], 1000 + n, 1.0)

        def heard_after() -> bool:
            return all(
                all(p.swarm_progress().get(o.peer_id) and p.swarm_progress()[o.peer_id].inner_step >= 1000
                    for o in rest)
                for p in rest
            )  # fmt: skip

        wait_for(heard_after, 90, "the survivors' new heartbeats, the progress key's nearest nodes gone")
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
