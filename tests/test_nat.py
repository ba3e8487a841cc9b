"""Volunteers behind NAT: one public node and two volunteers, each behind a NAT router of its own
(network namespaces, iptables MASQUERADE, nothing in but replies), every network flag at its
default. The volunteers find out by themselves that nobody can dial them, say so, and still
apply each other's fragments (through the public node, which fetched them and serves them
onward). Skipped, with the reason, where namespaces or iptables cannot be had.

Beside it, the dial-back answer's checks and the selector's retry through a re-server, without
processes."""

import shutil
import sys
from pathlib import Path

import pytest

from cgad.protocol.reachability import Reachability, relays_in, tcp_ports
from cgad.protocol.records import Holdings, Offer
from cgad.protocol.selection import OfferSelector
from cgad.protocol.transport import Kind

ROOT = Path(__file__).resolve().parent.parent

from cgad.bench.wan.testbed import available  # noqa: E402


def test_ports_and_relays_are_read_from_multiaddrs():
    maddrs = [
        "/ip4/192.168.1.5/tcp/4001/p2p/QmSelf",
        "/ip4/127.0.0.1/tcp/4001/p2p/QmSelf",
        "/ip4/203.0.113.7/tcp/31337/p2p/QmRelay/p2p-circuit/p2p/QmSelf",
    ]
    assert tcp_ports(maddrs) == [4001]  # the relay's port is not this node's
    assert relays_in(maddrs) == ["QmRelay"]
    behind = Reachability(False, seen_as=["/ip4/198.51.100.2"], checked_by="QmBootstrap12345678")
    assert behind.line([]).startswith("behind NAT: reached through peers that re-serve")
    assert "relay …QmRelay" in behind.line(["QmRelay"])
    assert (
        Reachability(True, ["/ip4/1.2.3.4/tcp/4001"], checked_by="QmB")
        .line([])
        .startswith("reachable at /ip4/1.2.3.4/tcp/4001")
    )


def _holdings(peer: str, offer: Offer) -> Holdings:
    return Holdings(peer_id=peer, offers=[offer], grpc=None)


def test_an_offer_no_holder_delivered_is_fetched_again_from_a_new_holder():
    offer = Offer(publisher="QmNatedPubsher1", kind=Kind.DELTA.value, base_version=3, content_hash=b"h" * 32,
                  byte_length=76, numel=32, codec="4bit", tokens=10)  # fmt: skip
    selector = OfferSelector("run", "QmMe123456789", fan_in=4, history_versions=64, record_ttl=120)
    first = selector.choose(0, 32, [_holdings(offer.publisher, offer)], own=3, now=0.0)
    assert [c.key.publisher for c in first.candidates] == [offer.publisher]
    # the publisher (behind NAT) could not be reached: nothing new, nothing again
    selector.retry_later(first.candidates[0])
    assert not selector.choose(0, 32, [_holdings(offer.publisher, offer)], own=3, now=1.0).candidates
    # a public peer fetched it and serves it onward: tried from there, the publisher left out
    both = [_holdings(offer.publisher, offer), _holdings("QmPubicPeer123", offer)]
    again = selector.choose(0, 32, both, own=3, now=2.0).candidates
    assert [[h.peer_id for h in c.holders] for c in again] == [["QmPubicPeer123"]]
    assert not selector.choose(0, 32, both, own=3, now=3.0).candidates  # once, while it runs


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(available(nat=True) is not None, reason=str(available(nat=True)))
@pytest.mark.timeout(300)
def test_two_volunteers_behind_nat_apply_each_others_fragments(tmp_path, monkeypatch):
    from cgad.bench.wan.run import load_scenario, run

    executable = shutil.which("cgad-node", path=str(Path(sys.executable).parent))
    monkeypatch.setenv("CGAD_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(ROOT / "bench" / "wan" / "scenarios" / "nat-1-public-2.json")
    result = run(scenario, tmp_path, executable)
    failed = [v for v in result["checks"] if not v["ok"]]
    assert not failed, (failed, result["log_tails"])
    final = result["final"]
    ids = {i: final[i]["peer_id"] for i in range(3)}
    # the public (first) node asked its first peers to dial it back
    assert final[0]["reach"]["public"] is True, final[0]["reach"]
    for volunteer, other in ((1, 2), (2, 1)):
        reach = final[volunteer]["reach"]
        assert reach["public"] is False and reach["line"].startswith("behind NAT"), reach
        # in most rounds: each volunteer the other's fragment (re-served), the public node both
        rounds = final[volunteer]["round"]
        assert final[volunteer]["applied_by_peer"].get(ids[other], 0) > rounds / 2, final[volunteer]
        assert final[0]["applied_by_peer"].get(ids[volunteer], 0) > rounds / 2, final[0]
        assert final[volunteer]["reach"]["paths_by_peer"][ids[other]].get("re-served", 0) > 0
