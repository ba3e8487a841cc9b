"""NetworkTransport with real hivemind peers on 127.0.0.1 (one of them in another process):
every codec and path, big fragments, snapshots, killed publishers, fetch scheduling.
The shared swarm is described in tests/_netswarm.py; hostile peers are in test_network_hostile.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from _netswarm import (  # tests/ is on sys.path under pytest
    BIG,
    HUGE,
    KILLED,
    NUM_FRAGMENTS,
    RUN,
    SMALL,
    collect,
    key,
    make_transport,
    settle,
    wait_for,
)

from cgad.protocol import FragmentError, polling
from cgad.protocol.codec import Codec, decode, encode, encoded_size
from cgad.protocol.config import NetworkOptions
from cgad.protocol.fetching import RETRY_SECONDS
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import Holdings
from cgad.protocol.transport import Fragment, FragmentKey, Kind
from cgad.protocol.wire import content_hash

pytestmark = pytest.mark.integration  # real hivemind peers (p2pd processes) on loopback


@pytest.mark.timeout(90)
def test_every_codec_over_both_paths(netswarm: list[NetworkTransport]) -> None:
    p0, p1, p2, _ = netswarm
    for base, codec in enumerate(Codec):
        x = torch.randn(BIG) * 0.01
        p0.publish(Fragment(key(p0, 0, base), x, tokens=1000 + base), codec=codec)
        expected = decode(encode(x, codec))  # first use of a codec: no error-feedback residual
        for fetcher in (p1, p2):
            [got] = collect(fetcher, 0, 1)
            assert got.key == key(p0, 0, base)
            assert got.tokens == 1000 + base
            assert torch.equal(got.tensor, expected), f"{codec} via {fetcher.options.paths}"
    # each fetcher pulled every byte over its one path
    total = sum(encoded_size(BIG, codec) for codec in Codec)
    assert p1.bytes_by_path["grpc"] == total and p1.bytes_by_path["libp2p"] == 0
    assert p2.bytes_by_path["libp2p"] == total and p2.bytes_by_path["grpc"] == 0
    assert p0.receive(0) == []  # never one's own
    assert not p1.stats.rejected and not p2.stats.rejected
    # what the DHT cost, counted: each peer's own looks (one per poll) and what it answered others
    assert all(p.stats.dht_lookups >= p.polls > 0 for p in netswarm)
    assert sum(p.stats.dht_served["find"] for p in netswarm) > 0
    assert (
        sum(p.stats.dht_served["store"] for p in netswarm)
        >= sum(sum(p.stats.records_stored.values()) for p in netswarm)
        > 0
    )  # every store lands on at least one other peer's replica here


@pytest.mark.timeout(120)
def test_a_fragment_of_over_100_mb_flows_on_both_paths(netswarm: list[NetworkTransport]) -> None:
    p0, p1, p2, _ = netswarm
    x = torch.randn(HUGE)
    p0.publish(Fragment(key(p0, 14, 0), x), codec="fp32")
    for fetcher in (p1, p2):
        [got] = collect(fetcher, 14, 1, timeout=90)
        assert torch.equal(got.tensor, x)
    del x, got


@pytest.mark.timeout(60)
def test_parameters_travel_as_their_own_kind_in_fp32(netswarm: list[NetworkTransport]) -> None:
    p0, p1, _, _ = netswarm
    params = torch.randn(SMALL)
    p0.publish(Fragment(key(p0, 13, 4, Kind.PARAMS), params))
    got: list[Fragment] = []
    wait_for(lambda: got.extend(p1.receive(13, Kind.PARAMS)) or got, what="parameters")
    assert got[0].key.kind is Kind.PARAMS
    assert torch.equal(got[0].tensor, params)  # the default parameter codec is exact
    assert p1.receive(13) == []


@pytest.mark.timeout(60)
def test_versions_far_behind_this_peer_are_ignored(netswarm: list[NetworkTransport]) -> None:
    p0, p1, _, _ = netswarm
    versions = [0] * NUM_FRAGMENTS
    versions[15] = 100
    p1.report_progress(versions, inner_step=0, tokens_per_second=0.0)
    try:
        p0.publish(Fragment(key(p0, 15, 100 - 65), torch.randn(SMALL)))  # beyond the 64-version horizon
        recent = torch.randn(SMALL)
        p0.publish(Fragment(key(p0, 15, 100 - 64), recent), codec="fp32")
        [got] = collect(p1, 15, 1)
        assert got.key.base_version == 36 and torch.equal(got.tensor, recent)
        settle(p1)
        assert p1.receive(15) == []
    finally:
        p1.report_progress([0] * NUM_FRAGMENTS, inner_step=0, tokens_per_second=0.0)


@pytest.mark.timeout(60)
def test_download_from_a_chosen_holder_over_a_chosen_path(netswarm: list[NetworkTransport]) -> None:
    p0, _, _, p3 = netswarm
    data = encode(torch.randn(SMALL), "fp16")
    p0.publish_encoded(key(p0, 4, 77), data, codec=Codec.FP16, numel=SMALL, tokens=0)
    wait_for(lambda: p0.store.get(content_hash(data)) is not None, what="the publisher's store")
    holder = Holdings(peer_id=p0.peer_id, grpc=p0.grpc_endpoint, offers=[])
    for path in ("grpc", "libp2p"):
        assert bytes(p3.download(holder, content_hash(data), len(data), path)) == data
    with pytest.raises(FragmentError) as info:
        p3.download(holder, bytes(32), len(data), "grpc")  # nobody holds these bytes
    assert info.value.reason == "unavailable"


@pytest.mark.timeout(60)
def test_a_holder_that_libp2p_routing_does_not_know_is_dialed_at_its_records_addresses() -> None:
    holder_node, fetcher = make_transport(), make_transport()  # two swarms' first nodes: never met
    try:
        data = encode(torch.randn(SMALL), "fp16")
        holder_node.publish_encoded(key(holder_node, 4, 1), data, codec=Codec.FP16, numel=SMALL, tokens=0)
        wait_for(lambda: holder_node.store.get(content_hash(data)) is not None, what="the holder's store")
        unknown = Holdings(peer_id=holder_node.peer_id, grpc=None, offers=[])
        with pytest.raises(FragmentError) as info:
            fetcher.download(unknown, content_hash(data), len(data), "libp2p")
        assert info.value.reason == "unavailable"  # "routing: not found": no address to dial
        bare = [a.removesuffix(f"/p2p/{holder_node.peer_id}") for a in holder_node.maddrs()]
        located = Holdings(peer_id=holder_node.peer_id, grpc=None, offers=[], maddrs=bare)
        assert bytes(fetcher.download(located, content_hash(data), len(data), "libp2p")) == data
        assert fetcher.bytes_by_path["libp2p"] == len(data)
    finally:
        holder_node.close()
        fetcher.close()


@pytest.mark.timeout(90)
def test_polls_look_at_the_snapshots_on_offer_only_while_someone_reads_them(
    netswarm: list[NetworkTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    p0, _, p2, _ = netswarm
    monkeypatch.setattr(polling, "STATE_WANTED", 1.0)  # no read of the offers for a second: unwanted
    monkeypatch.setattr(polling, "STATE_REFRESH", 3600.0)
    # p0 level with the furthest report (a peer trailing the swarm looks at the offers each poll)
    saved = p0._progress
    furthest = max((v for p in p0.swarm_progress().values() for v in p.versions), default=0)
    p0.report_progress([furthest] * NUM_FRAGMENTS, saved.inner_step, saved.tokens_per_second)
    try:
        p2.publish_state(os.urandom(1 << 16), [40] * NUM_FRAGMENTS)
        time.sleep(1.5)
        looked, lookups = p0._poller.states_looked_at, p0.stats.dht_lookups
        wait_for(lambda: p0.stats.dht_lookups >= lookups + 3, what="three polls")
        assert p0._poller.states_looked_at == looked  # none of them named the snapshots' key
        # a re-sync's single read: it wakes the poller and waits for a look made after it asked
        offers = p0.state_offers(fresh=10.0)
        assert p0._poller.states_looked_at > looked
        assert any(c.key.publisher == p2.peer_id and c.key.base_version == 40 for c in offers)
    finally:
        p0.report_progress(saved.versions, saved.inner_step, saved.tokens_per_second)


@pytest.mark.timeout(60)
def test_a_fresh_read_of_the_offers_comes_at_once_and_never_waits_on_a_closed_transport() -> None:
    node = make_transport()
    try:
        started = time.monotonic()
        node.state_offers(fresh=10.0)  # wakes the poller: the next look is made now
        assert node._poller.states_looked_at >= started and time.monotonic() - started < 5.0
    finally:
        node.close()
    started = time.monotonic()
    assert node.state_offers(fresh=10.0) == [] and time.monotonic() - started < 1.0  # no look coming


@pytest.mark.timeout(90)
def test_state_snapshots_are_offered_fetched_over_each_path_and_served_onward(
    netswarm: list[NetworkTransport],
) -> None:
    p0, p1, p2, p3 = netswarm
    blob = os.urandom(3 * (1 << 20) + 5)
    p1.publish_state(blob, [7] * NUM_FRAGMENTS)

    def offered(transport: NetworkTransport, version: int, holders: int = 1) -> list:
        return [
            c
            for c in transport.state_offers()
            if c.key.publisher == p1.peer_id and c.key.base_version == version and len(c.holders) == holders
        ]

    wait_for(lambda: offered(p0, 7) and offered(p2, 7), what="the snapshot's record")
    [candidate] = offered(p0, 7)
    assert candidate.offer.byte_length == len(blob) and candidate.key.kind is Kind.STATE
    # the record names where p1's libp2p daemon listens (a fetcher whose routing does not know it
    # dials there), without p1's own id
    port = p1.maddrs()[0].split("/tcp/")[1].split("/")[0]
    assert any(f"/tcp/{port}" in a for a in candidate.holders[0].maddrs)
    assert not any(p1.peer_id in a for a in candidate.holders[0].maddrs)
    assert bytes(p0.fetch_state(candidate, timeout=30)) == blob  # gRPC first
    assert bytes(p2.fetch_state(offered(p2, 7)[0], timeout=30)) == blob  # libp2p only
    # p0 serves it onward: the next joiner finds two holders, the re-server first
    p0.reserve_state(candidate, blob)
    wait_for(lambda: offered(p3, 7, holders=2), what="p0 as a second holder")
    [two] = offered(p3, 7, holders=2)
    assert [h.peer_id for h in two.holders] == [p0.peer_id, p1.peer_id]
    assert bytes(p3.fetch_state(two, timeout=30)) == blob
    # newer snapshots are offered first; the publisher keeps its two newest
    for version in (8, 9):
        p1.publish_state(os.urandom(1 << 20), [version] * NUM_FRAGMENTS)
    wait_for(lambda: offered(p3, 9), what="the newer snapshots")
    assert [c.key.base_version for c in p3.state_offers() if c.key.publisher == p1.peer_id][:2] == [9, 8]
    # version 7 was just downloaded: it outlives the newer two while a download may resume it
    # (tests/test_store.py); once that grace is over it goes, as discarding it here does
    assert p1.store.get(candidate.offer.content_hash) is not None
    p1.store.discard(candidate.offer.content_hash)
    # nobody left who holds it: the error says how far the download got, and from how many; a
    # holder that answers "not held" is not asked again (busy ones are, STATE_PASSES times,
    # RETRY_SECONDS apart)
    gone = type(candidate)(candidate.key, candidate.offer, [candidate.holders[-1]])
    started = time.monotonic()
    with pytest.raises(FragmentError, match=r"no holder keeps it any more at 0.0 of 3.1 MB") as err:
        p3.fetch_state(gone, timeout=30)
    assert err.value.reason == "unavailable" and time.monotonic() - started < RETRY_SECONDS


@pytest.mark.timeout(90)
def test_a_state_download_has_the_downlink_to_itself() -> None:
    publisher = make_transport(upload_limit=2e6)  # 2 MB/s per stream: transfers take seconds
    joiner = make_transport(peers=publisher.maddrs())
    other = make_transport(peers=publisher.maddrs())  # (a snapshot's server holds its own back)
    try:
        publisher.publish(Fragment(key(publisher, 0, 0), torch.randn(BIG)), codec="fp32")  # 8 MiB
        wait_for(lambda: any(got > 0 for got, _ in joiner.transfers().values()), what="the fragment fetch")
        blob = os.urandom(16 << 20)
        publisher.publish_state(blob, [0] * NUM_FRAGMENTS)
        wait_for(lambda: joiner.state_offers(), what="the snapshot's record")
        received_by_the_end: list[int] = []

        def download() -> None:
            assert bytes(joiner.fetch_state(joiner.state_offers()[0], timeout=30)) == blob
            received_by_the_end.append(joiner.stats.received)

        downloading = threading.Thread(target=download)
        downloading.start()
        time.sleep(0.5)  # a fragment announced while the 8 s download runs waits for its end
        other.publish(Fragment(key(other, 5, 0), torch.randn(SMALL)))
        downloading.join()
        assert joiner.stats.skipped["for_state"] == 1  # the fragment fetch under way was stopped
        assert received_by_the_end == [0]
        [late] = collect(joiner, 5, 1)  # and it is fetched once the state is in
        assert late.key == key(other, 5, 0)

    finally:
        other.close()
        joiner.close()
        publisher.close()


@pytest.mark.timeout(90)
def test_a_state_download_is_metered_over_its_own_time() -> None:
    """The downlink meter (what --codec auto and the fetch queue plan with) counts a snapshot's
    bytes over the seconds they took: at 2 MB/s it reads about that (the bytes used to land in
    the meter with no busy time, for a first reading of the whole blob per second)."""
    run = "net-test-meter"
    publisher = make_transport(run_id=run, upload_limit=2e6)
    joiner = make_transport({}, run_id=run, peers=publisher.maddrs())
    try:
        blob = os.urandom(6 << 20)
        publisher.publish_state(blob, [0] * NUM_FRAGMENTS)
        wait_for(lambda: joiner.state_offers(), what="the snapshot's record")
        assert bytes(joiner.fetch_state(joiner.state_offers()[0], timeout=30)) == blob
        assert joiner.downlink_rate is not None and 1e6 < joiner.downlink_rate < 3e6, joiner.downlink_rate
    finally:
        joiner.close()
        publisher.close()


@pytest.mark.timeout(90)
def test_the_upload_limit_holds_for_all_streams_together() -> None:
    """Two fetchers of 4 MiB each from a peer limited to 2 MB/s: 8.4 MB take 4 s or more
    (paced per stream, as before, both were done in about 2 s)."""
    run = "net-test-uplink"
    publisher = make_transport(run_id=run, upload_limit=2e6)
    fetchers = [make_transport({2: 1 << 20}, run_id=run, peers=publisher.maddrs()) for _ in range(2)]
    try:
        wait_for(lambda: all(len(f.live_peers()) >= 1 for f in fetchers), what="the fetchers in the swarm")
        started = time.monotonic()
        fragment = Fragment(FragmentKey(run, 2, 0, publisher.peer_id), torch.randn(1 << 20))
        publisher.publish(fragment, codec="fp32")
        for fetcher in fetchers:
            collect(fetcher, 2, 1, timeout=60)
        assert time.monotonic() - started >= 4.0
        assert publisher.stats.bytes_sent >= 2 * 4 * (1 << 20)
    finally:
        for transport in (*fetchers, publisher):
            transport.close()


@pytest.mark.timeout(60)
def test_publishing_nan_fails_at_once(netswarm: list[NetworkTransport]) -> None:
    p0 = netswarm[0]
    bad = torch.randn(SMALL)
    bad[3] = float("nan")
    with pytest.raises(FragmentError) as info:
        p0.publish(Fragment(key(p0, 4, 900), bad))
    assert info.value.reason == "non_finite"


@pytest.mark.timeout(60)
def test_live_peers_and_progress(netswarm: list[NetworkTransport]) -> None:
    p0, p1, p2, p3 = netswarm
    wait_for(lambda: set(p0.live_peers()) == {p1.peer_id, p2.peer_id, p3.peer_id}, what="live peers")
    assert p0.peer_id not in p0.live_peers()
    p1.report_progress([3] * NUM_FRAGMENTS, inner_step=120, tokens_per_second=4096.0)
    wait_for(lambda: p0.swarm_progress().get(p1.peer_id, None) is not None, what="p1's progress")
    wait_for(lambda: p0.swarm_progress()[p1.peer_id].inner_step == 120, what="p1's report")
    assert p0.swarm_progress()[p1.peer_id].versions == [3] * NUM_FRAGMENTS


@pytest.mark.timeout(60)
def test_the_first_node_learns_its_reach_from_its_first_peers(netswarm: list[NetworkTransport]) -> None:
    """The swarm's first node had nobody to ask at start; once peers are live one dials it back."""
    p0 = netswarm[0]
    wait_for(lambda: p0.reachability.public is not None, timeout=40, what="the first node's dial-back")
    reach = p0.reach()
    assert reach["public"] is True and reach["line"].startswith("reachable at /ip4/"), reach
    assert reach["checked_by"] in {p.peer_id for p in netswarm[1:]}


@pytest.mark.timeout(60)
def test_what_arrives_together_is_announced_once(netswarm: list[NetworkTransport]) -> None:
    p0, p1, _, p3 = netswarm
    p3.expect(13, SMALL)
    for publisher in (p0, p1):  # p3's fan-in: two publishers per version
        publisher.publish(Fragment(key(publisher, 13, 1), torch.randn(SMALL)), codec="fp32")
    collect(p3, 13, 2)
    settle(p3)
    poll = p3.options.poll_interval
    time.sleep(3 * poll)  # the re-announcement of what it fetched has gone out
    stored = p3.stats.records_stored["holdings"]
    assert stored >= 1 and p3.stats.records_stored["progress"] >= 1

    # five more arrivals of fragment 13 within one poll interval, as a round's deltas come
    p3.loop.call_soon_threadsafe(lambda: [p3._publisher.announce_soon(13) for _ in range(5)])
    wait_for(lambda: p3.stats.records_stored["holdings"] > stored, what="the re-announcement")
    time.sleep(3 * poll)
    assert p3.stats.records_stored["holdings"] == stored + 1


@pytest.mark.timeout(60)
def test_a_peer_that_leaves_says_so(netswarm: list[NetworkTransport]) -> None:
    p0 = netswarm[0]
    leaver = make_transport(peers=p0.maddrs())
    try:
        wait_for(lambda: leaver.peer_id in p0.live_peers(), what="the new peer to be seen")
    finally:
        leaver.close()
    # its last record says it left: gone from the view at the next polls, not after liveness_ttl
    assert p0.options.liveness_ttl >= 30
    wait_for(lambda: leaver.peer_id not in p0.live_peers(), timeout=10, what="the farewell to be seen")


def _forget(transport: NetworkTransport, other: NetworkTransport) -> None:
    """What a partition leaves behind: every DHT request to ``other`` failed, so it is gone from
    ``transport``'s routing table (run on the transport's loop, which owns the table)."""
    table = transport.dht_node.protocol.routing_table

    async def forget() -> None:
        node_id = table.get(peer_id=other.p2p.peer_id)
        if node_id is not None:
            del table[node_id]

    transport._runner.call(forget(), 10)


@pytest.mark.timeout(90)
def test_peers_that_lost_each_other_find_each_other_again() -> None:
    short = {"liveness_ttl": 4.0, "record_ttl": 4.0}
    a = make_transport(**short)
    b = make_transport(peers=a.maddrs(), **short)
    try:
        wait_for(lambda: a.peer_id in b.live_peers() and b.peer_id in a.live_peers(), what="both live")
        # each stops seeing the other when its last record expires, then pings the peers it knew;
        # the first to notice may ping the other back before the other notices, so either will do.
        # The partition lasts until it shows: a request that one sends between the two forgets
        # (slow on a loaded machine) puts it back in the other's table, as a real link would not
        parted = lambda: a.peer_id not in b.live_peers() or b.peer_id not in a.live_peers()  # noqa: E731
        deadline = time.monotonic() + 15
        while not parted():
            assert time.monotonic() < deadline, "timed out waiting for the partition to show"
            _forget(a, b)
            _forget(b, a)
            time.sleep(0.5)
        both = lambda: a.peer_id in b.live_peers() and b.peer_id in a.live_peers()  # noqa: E731
        wait_for(both, timeout=30, what="the two to find each other again")
    finally:
        b.close()
        a.close()


def _publisher_process(initial_peers: list[str], report: multiprocessing.Queue) -> None:
    transport = make_transport(peers=initial_peers, upload_limit=10e6)
    assert transport.p2p is not None
    report.put((transport.peer_id, transport.p2p._child.pid))
    transport.publish(Fragment(key(transport, 1, 1), torch.randn(KILLED)), codec="fp32")
    time.sleep(600)  # until killed


@pytest.mark.timeout(120)
def test_publisher_killed_mid_transfer(netswarm: list[NetworkTransport]) -> None:
    p0, p1, _, _ = netswarm
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    child = context.Process(target=_publisher_process, args=(p0.maddrs(), report), daemon=True)
    child.start()
    try:
        publisher, daemon_pid = report.get(timeout=60)
        victim = FragmentKey(RUN, 1, 1, publisher)
        before = p1.stats.rejected["unavailable"]
        wait_for(lambda: p1.transfers().get(victim, (0, 0))[0] > 0, 30, "the transfer to start")
        os.kill(child.pid, signal.SIGKILL)
        os.kill(daemon_pid, signal.SIGKILL)  # a killed process leaves its p2pd behind
        wait_for(lambda: victim not in p1.transfers(), 30, "the fetch to give up")
        assert p1.stats.rejected["unavailable"] == before + 1
        assert publisher not in p1.stats.rejected_by_peer  # gone mid-way is no fault of its bytes
        assert p1.receive(1) == []
    finally:
        child.kill()
        child.join(10)
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(daemon_pid, signal.SIGKILL)
    wait_for(lambda: not _alive(daemon_pid), 10, "the killed peer's p2pd to exit")
    # the fetcher keeps working: the next version from a live publisher arrives
    x = torch.randn(KILLED)
    p0.publish(Fragment(key(p0, 1, 2), x), codec="4bit")
    [got] = collect(p1, 1, 1, timeout=30)
    assert got.key == key(p0, 1, 2)


def _alive(pid: int) -> bool:
    """Running and not a zombie (p2pd of a killed peer is not our child, so we cannot reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_a_peer_without_a_direct_endpoint_trades_over_libp2p(netswarm: list[NetworkTransport]) -> None:
    p0 = netswarm[0]
    libp2p_before = sum(p.bytes_by_path["libp2p"] for p in netswarm)
    with make_transport({5: SMALL}, peers=p0.maddrs(), client_mode=True, grpc_host="none") as natted:
        assert natted.grpc_endpoint is None
        theirs, ours = torch.randn(SMALL), torch.randn(SMALL)
        p0.publish(Fragment(key(p0, 5, 0), theirs), codec="fp32")  # not far ahead: that would be refused
        natted.publish(Fragment(key(natted, 5, 0), ours), codec="fp32")
        [got] = collect(natted, 5, 1)
        assert torch.equal(got.tensor, theirs)
        got = []
        wait_for(lambda: any(f.key.publisher == natted.peer_id for f in got.extend(p0.receive(5)) or got))
        mine = next(f for f in got if f.key.publisher == natted.peer_id)
        assert torch.equal(mine.tensor, ours)
        # its bytes left it over libp2p (it has no direct endpoint), to whichever peer fetched
        # them first; p0 may then have had them from that peer over gRPC
        pulled = sum(p.bytes_by_path["libp2p"] for p in netswarm) - libp2p_before
        assert pulled >= encoded_size(SMALL, "fp32")


@pytest.mark.timeout(60)
def test_identity_file_gives_a_stable_peer_id(tmp_path: Path) -> None:
    path = str(tmp_path / "peer.key")
    with make_transport({}, identity=path) as first:
        peer_id = first.peer_id
    with make_transport({}, identity=path) as second:
        assert second.peer_id == peer_id
        assert second.p2p is not None and second.p2p.peer_id.to_base58() == peer_id


class _NodeOptions(NetworkOptions):
    """What a node's configuration does: inherit the network options and add its own."""

    checkpoint_dir: str = "checkpoints"


@pytest.mark.timeout(60)
def test_any_subclass_of_the_options_serves_and_only_its_network_fields_are_kept() -> None:
    options = _NodeOptions(run_id=RUN, grpc_host="none", fan_in=3)
    with NetworkTransport(options, num_fragments=NUM_FRAGMENTS, fragment_numel={}) as transport:
        assert type(transport.options) is NetworkOptions
        assert transport.options.fan_in == 3 and transport.grpc_endpoint is None


@pytest.mark.timeout(60)
def test_close_leaves_no_daemon_thread_or_port() -> None:
    transport = make_transport({})
    assert transport.p2p is not None and transport.grpc_endpoint is not None
    daemon_pid = transport.p2p._child.pid
    host, port = transport.grpc_endpoint.rsplit(":", 1)
    transport.close()
    assert not transport._runner.thread.is_alive()
    wait_for(lambda: not _alive(daemon_pid), 10, "p2pd to exit")
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()


@pytest.mark.timeout(120)
def test_fetches_wait_their_turn_youngest_first_and_stop_when_too_old() -> None:
    """One fetch at a time (``max_fetches`` 1) on a slow uplink: the youngest offer goes first,
    and a fetch in flight is cancelled, not finished, once its fragment is too old to count."""
    run = "net-test-sched"
    sizes = {0: 1 << 18, 1: 1 << 18, 2: 1 << 18, 3: 1 << 20}  # 1 MiB each, 4 MiB for fragment 3
    publisher = make_transport(run_id=run, upload_limit=2e6)
    receiver = NetworkTransport(
        NetworkOptions(run_id=run, poll_interval=0.2, connect_timeout=1.0, max_fetches=1,
                       peers=publisher.maddrs()),
        num_fragments=NUM_FRAGMENTS, fragment_numel={}, stale_after=2,
    )  # fmt: skip
    try:
        for fragment, base in ((0, 1), (1, 3), (2, 2)):
            publisher.publish(
                Fragment(FragmentKey(run, fragment, base, publisher.peer_id), torch.randn(sizes[fragment])),
                codec="fp32",
            )
        wait_for(
            lambda: (
                len(publisher.store.offers(0))
                + len(publisher.store.offers(1))
                + len(publisher.store.offers(2))
                == 3
            ),
            what="three announcements",
        )
        receiver.report_progress([3] * NUM_FRAGMENTS, 0, 0.0)
        for fragment in (0, 1, 2):
            receiver.expect(fragment, sizes[fragment])
        seen: list[int] = []  # base versions in the order their transfers were seen
        most = 0
        deadline = time.monotonic() + 30
        while receiver.stats.received < 2 and time.monotonic() < deadline:
            transfers = receiver.transfers()
            most = max(most, len(transfers))
            seen += [k.base_version for k in transfers if k.base_version not in seen]
            time.sleep(0.02)
        # base 1 is age 2 at version 3: it counts for nothing, so it is never fetched
        assert receiver.stats.received == 2 and most == 1 and seen == [3, 2], (seen, most)
        wait_for(lambda: receiver.stats.skipped["stale"] == 1, what="the stale offer to be passed over")
        # a transfer that becomes too old while it runs is cancelled
        big = FragmentKey(run, 3, 3, publisher.peer_id)
        publisher.publish(Fragment(big, torch.randn(sizes[3])), codec="fp32")
        receiver.expect(3, sizes[3])
        wait_for(lambda: receiver.transfers().get(big, (0, 0))[0] > 0, what="the big transfer to start")
        receiver.report_progress([5] * NUM_FRAGMENTS, 0, 0.0)
        wait_for(lambda: receiver.stats.skipped["stale_in_flight"] == 1, what="the cancellation")
        wait_for(lambda: big not in receiver.transfers(), what="the transfer to end")
        assert receiver.receive(3) == []
    finally:
        receiver.close()
        publisher.close()


@pytest.mark.timeout(90)
def test_a_fetcher_that_does_not_opt_in_never_dials_a_loopback_endpoint() -> None:
    """A record's gRPC endpoint on 127.0.0.1 is this machine's own to a fetcher elsewhere: by
    default (no ``--private-endpoints``) the fragment comes over libp2p, and no byte over gRPC."""
    holder_node = make_transport()
    fetcher = make_transport(peers=holder_node.maddrs(), private_endpoints=False, paths=["grpc", "libp2p"])
    try:
        assert holder_node.grpc_endpoint.startswith("127.0.0.1:")
        holder_node.publish(Fragment(key(holder_node, 0, 0), torch.randn(BIG), tokens=7), codec=Codec.FP16)
        [got] = collect(fetcher, 0, 1)
        assert got.key == key(holder_node, 0, 0)
        assert fetcher.bytes_by_path["grpc"] == 0 and fetcher.bytes_by_path["libp2p"] > 0
    finally:
        fetcher.close()
        holder_node.close()
