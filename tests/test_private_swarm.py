"""Private swarms, with real hivemind peers on 127.0.0.1: members who hold the swarm key trade
fragments; a peer without it (or with another key) can neither read nor write the swarm's DHT
records, nor fetch, nor learn who a member is; the gRPC path is TLS, its certificate pinned by
the signed records. And the key file itself; and an allowlist of peer ids (``--allow``)."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import stat
from pathlib import Path

import grpc
import pytest
import torch
from _netswarm import RUN, SMALL, collect, key, make_transport, settle, wait_for
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from cgad.protocol import FragmentError
from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.auth import CLOCK_SKEW, FETCH_PURPOSE, NonceLedger, SwarmKey, SwarmKeyError
from cgad.protocol.config import NetworkOptions
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import Holdings, Identity, fragment_key
from cgad.protocol.tls import TLS_NAME, ServerCertificate
from cgad.protocol.transport import Fragment

FRAGMENTS = {4: SMALL}


def test_a_swarm_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    created = SwarmKey.create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert SwarmKey.load(path).fingerprint == created.fingerprint
    with pytest.raises(SwarmKeyError, match="exists already"):
        SwarmKey.create(path)
    assert SwarmKey.load(path).fingerprint == created.fingerprint  # untouched


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\x89PNG\x00\xff", "not text"),
        (b"hello\n" + b"00" * 32 + b"\n", "first line should be"),
        (b"cgad swarm key v1\nzz" + b"00" * 31 + b"\n", "not hexadecimal"),
        (b"cgad swarm key v1\n" + b"00" * 16 + b"\n", "16 bytes of key, not 32"),
    ],
)
def test_a_corrupt_key_file_says_what_is_wrong(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "swarm.key"
    path.write_bytes(content)
    with pytest.raises(SwarmKeyError, match=says):
        SwarmKey.load(path)
    with pytest.raises(SwarmKeyError, match="keygen --swarm-key"):
        SwarmKey.load(tmp_path / "missing.key")


def test_a_key_file_others_can_read_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "swarm.key"
    SwarmKey.create(path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        SwarmKey.load(path)
    assert "can be read by other users" in caplog.text


def test_tickets_prove_the_key_for_one_message_once() -> None:
    ours, theirs = SwarmKey.generate(), SwarmKey.generate()
    request = pb.FetchRequest(content_hash=b"h" * 32, offset=5)
    ours.stamp(request, request.ticket, FETCH_PURPOSE)
    nonces = NonceLedger()
    assert not theirs.check(request, request.ticket, FETCH_PURPOSE)  # another swarm's key
    assert not ours.check(request, request.ticket, b"describe")  # a ticket for another request kind
    tampered = pb.FetchRequest.FromString(request.SerializeToString())
    tampered.offset = 0
    assert not ours.check(tampered, tampered.ticket, FETCH_PURPOSE)  # bound to the whole request
    assert ours.check(request, request.ticket, FETCH_PURPOSE, nonces)
    assert not ours.check(request, request.ticket, FETCH_PURPOSE, nonces)  # a replay
    stale = pb.FetchRequest(content_hash=b"h" * 32)
    ours.stamp(stale, stale.ticket, FETCH_PURPOSE)
    stale.ticket.time -= CLOCK_SKEW + 1
    stale.ticket.signature = ours.sign(stale, stale.ticket, FETCH_PURPOSE)
    assert not ours.check(stale, stale.ticket, FETCH_PURPOSE)  # too old, even rightly signed


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_members_trade_and_an_outsider_gets_nothing(tmp_path: Path) -> None:
    secret, other = tmp_path / "swarm.key", tmp_path / "other.key"
    SwarmKey.create(secret)
    SwarmKey.create(other)
    with make_transport(FRAGMENTS, swarm_key=str(secret)) as alice:
        with make_transport(FRAGMENTS, swarm_key=str(secret), peers=alice.maddrs()) as bob:
            alice.publish(Fragment(key(alice, 4, 0), torch.randn(SMALL), 10))
            [got] = collect(bob, 4, 1)
            assert got.key.publisher == alice.peer_id
            assert bob.bytes_by_path["grpc"] > 0  # the direct path, encrypted: it is the only gRPC there is
            asked = alice.stats.asked  # a member's requests are signs that someone may fetch from alice
            assert bob.describe(alice.peer_id)[0] == RUN
            assert alice.stats.asked == asked + 1
            [offer] = alice.store.offers(4)
            certificate = alice._server.certificate
            assert certificate is not None
            pem = certificate.certificate_pem
            holder = Holdings(peer_id=alice.peer_id, grpc=alice.grpc_endpoint, tls=pem, offers=[offer])
            _assert_tls_only(alice.grpc_endpoint, certificate.certificate_pem)
            # a holder record naming another certificate (a man in the middle's): no bytes over gRPC
            forged = holder.copy(update={"tls": ServerCertificate.create().certificate_pem})
            with pytest.raises(FragmentError, match="did not deliver"):
                bob.download(forged, offer.content_hash, offer.byte_length, "grpc", timeout=20)
            # nor from a record without one: a private swarm's gRPC bytes are never plaintext
            with pytest.raises(FragmentError, match="did not deliver"):
                bob.download(holder.copy(update={"tls": None}), offer.content_hash, offer.byte_length, "grpc")

            for outsider_key in (None, str(other)):  # no key; another swarm's key
                # it cannot join the swarm's DHT: no member answers its requests
                with pytest.raises(ConnectionError, match="is this node's key its key"):
                    make_transport(FRAGMENTS, swarm_key=outsider_key, peers=alice.maddrs())
                # on its own, dialling alice directly over libp2p
                with make_transport(FRAGMENTS, swarm_key=outsider_key) as eve:
                    assert eve.p2p is not None and alice.p2p is not None
                    addrs = [Multiaddr(a.split("/p2p/")[0]) for a in alice.maddrs()]
                    eve._runner.call(eve.p2p._client.connect(alice.p2p.peer_id, addrs), 10)
                    # it cannot read the swarm's records
                    assert eve.dht_node is not None
                    assert eve._runner.call(eve.dht_node.get(fragment_key(RUN, 4), latest=True), 20) is None
                    # nor learn who a member is, nor fetch what it holds, even knowing the hash
                    asked = alice.stats.asked
                    with pytest.raises(FragmentError, match="private"):
                        eve.describe(alice.peer_id)
                    assert alice.stats.asked == asked  # an outsider's refused request is no sign
                    refused = alice.stats.rejected["unauthorized"]
                    for path in ("grpc", "libp2p"):
                        with pytest.raises(FragmentError, match="did not deliver"):
                            eve.download(holder, offer.content_hash, offer.byte_length, path, timeout=20)
                    assert alice.stats.rejected["unauthorized"] >= refused + 2  # one per path
            # the members carry on
            alice.publish(Fragment(key(alice, 4, 1), torch.randn(SMALL), 10))
            [got] = collect(bob, 4, 1)
            assert got.key.base_version == 1


def _assert_tls_only(endpoint: str, certificate_pem: str) -> None:
    """The endpoint answers a TLS handshake with exactly this certificate, and nothing in clear."""
    host, port = endpoint.rsplit(":", 1)
    presented = ssl.get_server_certificate((host, int(port)), timeout=10)
    assert ssl.PEM_cert_to_DER_cert(presented) == ssl.PEM_cert_to_DER_cert(certificate_pem)
    context = ssl.create_default_context(cadata=certificate_pem)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=TLS_NAME) as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")  # verified against the pinned certificate
    with grpc.insecure_channel(endpoint) as plaintext:  # a client in clear never gets a channel
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(plaintext).result(timeout=3)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_grpc_tls_on_request_in_a_public_swarm() -> None:
    with make_transport(FRAGMENTS, grpc_tls=True) as alice:
        with make_transport(FRAGMENTS, peers=alice.maddrs(), paths=["grpc"]) as bob:
            assert alice._server.certificate is not None and bob._server.certificate is None
            alice.publish(Fragment(key(alice, 4, 0), torch.randn(SMALL), 10))
            [got] = collect(bob, 4, 1)  # bob follows alice's signed record: TLS to her
            assert got.key.publisher == alice.peer_id and bob.bytes_by_path["grpc"] > 0
            _assert_tls_only(alice.grpc_endpoint, alice._server.certificate.certificate_pem)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_an_allowlist_ignores_and_refuses_every_other_peer(tmp_path: Path) -> None:
    bob_key = tmp_path / "bob.key"
    bob_id = Identity.load_or_create(str(bob_key)).peer_id
    with make_transport(FRAGMENTS, allow=[bob_id]) as alice:
        assert alice.grpc_endpoint is None  # gRPC callers are anonymous: libp2p only
        with pytest.raises(ConnectionError, match="no peer at --peers answered"):
            make_transport(FRAGMENTS, peers=alice.maddrs())  # alice's DHT does not answer eve
        with (
            make_transport(FRAGMENTS, identity=str(bob_key), peers=alice.maddrs()) as bob,
            make_transport(FRAGMENTS, peers=bob.maddrs()) as eve,  # bob, with no allowlist, does
        ):
            assert bob.peer_id == bob_id
            eve.publish(Fragment(key(eve, 4, 0), torch.randn(SMALL), 10))
            bob.publish(Fragment(key(bob, 4, 0), torch.randn(SMALL), 10))
            [got] = collect(alice, 4, 1)
            assert got.key.publisher == bob_id
            settle(alice)
            settle(alice)
            assert alice.receive(4) == []  # eve's fragment never reached alice's outer step
            assert alice.stats.rejected["not_allowed"] >= 1  # eve's records, counted
            assert eve.peer_id not in alice.live_peers() and bob_id in alice.live_peers()
            # alice's own fragment reaches bob, and eve cannot fetch it from her, on any path
            alice.publish(Fragment(key(alice, 4, 1), torch.randn(SMALL), 10))
            publishers: set[str] = set()  # bob, with no allowlist, takes eve's too

            def alices_arrived() -> bool:
                publishers.update(f.key.publisher for f in bob.receive(4))
                return alice.peer_id in publishers

            wait_for(alices_arrived, what="alice's fragment at bob")
            [offer] = [o for o in alice.store.offers(4) if o.publisher == alice.peer_id]
            holder = Holdings(peer_id=alice.peer_id, grpc=None, offers=[offer])
            refused = alice.stats.rejected["not_allowed"]
            with pytest.raises(FragmentError, match="did not deliver"):
                eve.download(holder, offer.content_hash, offer.byte_length, "libp2p", timeout=20)
            assert alice.stats.rejected["not_allowed"] > refused
            with pytest.raises(FragmentError):
                eve.describe(alice.peer_id)
            # nor get an answer from alice's DHT; bob does (a refusal by alice's record validator
            # for a store under a key no run uses: False, where eve gets no answer at all, None)
            refused = alice.stats.rejected["not_allowed"]
            assert _store_junk(eve, alice.peer_id) is None and _find(eve, alice.peer_id) is None
            assert alice.stats.rejected["not_allowed"] >= refused + 2
            assert _store_junk(bob, alice.peer_id) == [False] and _find(bob, alice.peer_id) is not None


def _store_junk(caller: NetworkTransport, peer_id: str) -> list[bool] | None:
    """Ask peer_id's DHT to keep bytes under a key no run uses: what each DHT node answers."""
    assert caller.dht_node is not None
    store = caller.dht_node.protocol.call_store(
        PeerID.from_base58(peer_id), [DHTID.generate(source="junk")], [b"junk"], get_dht_time() + 60
    )
    return caller._runner.call(store, timeout=20)


def _find(caller: NetworkTransport, peer_id: str) -> dict | None:
    assert caller.dht_node is not None
    find = caller.dht_node.protocol.call_find(PeerID.from_base58(peer_id), [DHTID.generate(source="junk")])
    return caller._runner.call(find, timeout=20)


def test_an_allowlist_entry_that_is_no_peer_id_names_itself() -> None:
    with pytest.raises(ValueError, match="'bob' is not a peer id"):
        NetworkOptions(allow=["bob"])
