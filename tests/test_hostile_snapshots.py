"""Finite but hostile snapshots (issue 27, holes 3 and 7): what a joiner checks against what it
knows itself, which snapshot it tries first, how far a source's later claim moves it, and how long
a slow holder can hold it. The outer state's checks run on the real outer loop and optimizers;
the joiner's choices with real hivemind peers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from _netswarm import RUN, make_transport, wait_for  # tests/ is on sys.path under pytest

from cgad.node.config import JoinConfig, OuterOptions
from cgad.node.daemon.checkpoint import pack
from cgad.node.daemon.joining import StateSync, state_timeout
from cgad.node.member.outer import OuterLoop
from cgad.node.sim.memory import VirtualNetwork
from cgad.protocol import FragmentError
from cgad.protocol.records import PROTOCOL_VERSION, Holdings, Offer
from cgad.protocol.selection import Candidate
from cgad.protocol.transport import FragmentKey, Kind
from cgad.protocol.wire import response_stream, serialized_response_stream

SWARM = {"run_id": RUN, "model": "m", "tokenizer": "t", "optimizer": "cga", "fragments": 1}
LOCAL = 0.5  # the joiner's own φ (a model of its own seed, in the swarm's neighbourhood)


# ------------------------------------------------------------------ the outer state's checks


def _stepped_loop(optimizer: str) -> OuterLoop:
    """A loop that has taken two outer steps, so its optimizer holds state of every kind."""
    me = VirtualNetwork().join("me")
    loop = OuterLoop([torch.zeros(8)], _options(optimizer), me, "run")
    for _ in range(2):
        loop.theta[0].add_(0.1)
        loop.publish(0, tokens=10)
        loop.apply(0)
    return loop


def _options(optimizer: str) -> OuterOptions:
    # CGA with momentum, so that it holds state to forge (without it, CGA keeps none)
    return OuterOptions(optimizer=optimizer, outer_lr=0.5, cga_momentum=0.5)


def _fresh_loop(optimizer: str) -> OuterLoop:
    return OuterLoop([torch.zeros(8)], _options(optimizer), VirtualNetwork().join("j"), "run")


def _forged(optimizer: str, name: str, value: object) -> dict:
    state = _stepped_loop(optimizer).state_dict()
    [entry] = state["optimizer"]["state"].values()
    entry[name] = value
    return state


@pytest.mark.parametrize(
    ("optimizer", "name", "value", "says"),
    [
        # broadcast into φ's shape at the first outer step, which ended the daemon
        ("cga", "momentum", torch.tensor(1.0), "shape"),
        ("cga", "momentum", torch.ones(1), "shape"),
        ("cga", "steps", -1, "steps"),
        ("cga", "steps", 10**9, "steps"),  # a count no version explains
        ("cga", "sum", torch.full((8,), 1e30), "not an outer optimizer's"),  # added in as it is
        ("cgad", "exp_avg_sq", torch.full((8,), -1.0), "negative"),  # φ went NaN
        ("cgad", "step", torch.tensor(-1.0), "step"),  # ZeroDivisionError in the bias correction
        ("cgad", "step", torch.tensor(1.5), "step"),
        ("cgad", "step", torch.ones(8), "step"),
    ],
)
def test_an_optimizer_state_no_outer_optimizer_keeps_is_refused(
    optimizer: str, name: str, value: object, says: str
) -> None:
    loop = _fresh_loop(optimizer)
    with pytest.raises(ValueError, match=says):
        loop.load_state_dict(_forged(optimizer, name, value))
    assert loop.versions == [0] and not loop.optimizer.state  # left as it was
    loop.theta[0].add_(0.1)  # and its next outer step runs
    loop.publish(0, tokens=10)
    loop.apply(0)
    assert torch.isfinite(loop.phi[0]).all()


@pytest.mark.parametrize("optimizer", ["cga", "cgad", "nesterov", "delayed-nesterov"])
def test_a_sound_state_of_every_method_is_taken_and_steps_on(optimizer: str) -> None:
    loop = _fresh_loop(optimizer)
    loop.load_state_dict(_stepped_loop(optimizer).state_dict())
    assert loop.versions == [2]
    loop.theta[0].add_(0.1)
    loop.publish(0, tokens=10)
    loop.apply(0)
    assert loop.versions == [3] and torch.isfinite(loop.phi[0]).all()


# ------------------------------------------------------------------ the joiner's choices


def _snapshot(version: int, phi: torch.Tensor, reported_round: int | None = None) -> bytes:
    with make_transport() as scratch:
        outer = _sync(scratch).loop.state_dict()
    outer["phi"] = [phi.clone()]
    outer["versions"] = [version]
    swarm = {**SWARM, "protocol": PROTOCOL_VERSION}
    return pack(
        {"swarm": swarm, "outer": outer, "round": version if reported_round is None else reported_round}
    )


def _sync(transport, peers: list[str] | None = None, **config: object) -> StateSync:
    options = JoinConfig(run_id=RUN, peers=peers or [], **config)
    loop = OuterLoop([torch.full((4,), LOCAL)], options, transport, RUN)
    swarm = {**SWARM, "protocol": PROTOCOL_VERSION}
    return StateSync(options, transport, loop, swarm, threading.Lock(), threading.Event())


def test_a_finite_phi_plus_huge_noise_is_refused_and_a_sound_one_adopted() -> None:
    """Phi + noise x1e30 is finite in float32: it passed every check, was adopted, trained to NaN
    and was served onward. It is now held against the joiner's own φ."""
    with (
        make_transport() as honest,
        make_transport(peers=honest.maddrs()) as poisoner,
        make_transport(peers=honest.maddrs()) as joiner,
    ):
        honest.report_progress([3], 50, 0.0)
        poisoner.report_progress([3], 50, 0.0)
        honest.publish_state(_snapshot(2, torch.full((4,), 0.6)), [2])
        poisoned = torch.full((4,), 0.6) + torch.randn(4) * 1e30
        assert torch.isfinite(poisoned).all()
        poisoner.publish_state(_snapshot(3, poisoned), [3])  # at the swarm's version: tried first
        wait_for(lambda: len(joiner.state_offers()) == 2, what="two offers")
        sync = _sync(joiner, honest.maddrs())
        wait_for(lambda: len(sync.reports()) == 2, what="both reports")
        assert sync.sync(required=True) == (honest.peer_id, 2)
        assert torch.allclose(sync.loop.phi[0], torch.full((4,), 0.6))
        assert joiner.stats.rejected["bad_state"] == 1


def test_a_snapshot_near_the_swarms_median_comes_before_the_highest_claim() -> None:
    """The attacker claims the highest version the ceiling allows (median + cutoff); the joiner
    tries the snapshot at the swarm's low median first."""
    with (
        make_transport() as honest,
        make_transport(peers=honest.maddrs()) as second,
        make_transport(peers=honest.maddrs()) as claimer,
        make_transport(peers=honest.maddrs()) as joiner,
    ):
        for peer in (honest, second, claimer):
            peer.report_progress([5], 50, 0.0)
        honest.publish_state(_snapshot(5, torch.full((4,), 0.6)), [5])
        claimer.publish_state(_snapshot(5 + 4, torch.full((4,), 0.7)), [5 + 4])
        wait_for(lambda: len(joiner.state_offers()) == 2, what="two offers")
        sync = _sync(joiner, honest.maddrs())
        wait_for(lambda: len(sync.reports()) == 3, what="three reports")
        order = [c.key.publisher for c in sync._worth_adopting(at_least_ours=True)]
        assert order == [honest.peer_id, claimer.peer_id]
        assert sync.sync(required=True) == (honest.peer_id, 5) and sync.loop.versions == [5]


def test_a_sources_later_claim_of_many_versions_does_not_carry_the_joiner_ahead() -> None:
    """After the joiner adopted a sound snapshot, its source's progress record says +64
    versions: counting on to it left the joiner far ahead of the swarm for good."""
    with (
        make_transport() as source,
        make_transport(peers=source.maddrs()) as other,
        make_transport(peers=source.maddrs()) as joiner,
    ):
        source.report_progress([66], 50, 0.0)
        other.report_progress([2], 50, 0.0)
        source.publish_state(_snapshot(2, torch.full((4,), 0.6)), [2])
        wait_for(lambda: len(joiner.state_offers()) == 1, what="the offer")
        sync = _sync(joiner, source.maddrs())
        wait_for(lambda: len(sync.reports()) == 2, what="both reports")
        assert sync.sync(required=True) is not None
        assert sync.loop.versions == [2]  # the swarm's low median, not the source's 66


# ------------------------------------------------------------------ a slow snapshot (hole 7)


def test_the_download_time_follows_the_own_link_and_expected_size_not_the_claim() -> None:
    expected = 8e6
    # a claim of 1 GB buys no more time than the size this node expects
    assert state_timeout(1e9, expected, None, 600.0) == state_timeout(expected, expected, None, 600.0)
    fast, slow = (
        state_timeout(expected, expected, 10e6, 600.0),
        state_timeout(expected, expected, None, 600.0),
    )
    assert fast < slow  # a measured fast link expects the bytes sooner
    assert state_timeout(expected, expected, None, 25.0) == 25.0  # never past what is left
    assert state_timeout(1e3, expected, None, 600.0) < slow  # a small snapshot, a short wait


def _trickle(transport, rate: float, chunk: int = 2048) -> None:
    """Make ``transport`` serve every stream at ``rate`` bytes per second in small chunks (a
    hostile holder: steady enough to stay above the fetcher's old 4 kB/s floor, never done)."""

    async def stream_out(header, data, offset, serialized, end=None):
        stream = serialized_response_stream if serialized else response_stream
        for index, message in enumerate(stream(header, data, offset, chunk_bytes=chunk, end=end)):
            if index:
                await asyncio.sleep(chunk / rate)
            yield message

    transport._server._stream_out = stream_out


def _joiner_sync(joiner, peers: list[str], join_timeout: float, numel: int) -> StateSync:
    options = JoinConfig(run_id=RUN, peers=peers, join_timeout=join_timeout)
    loop = OuterLoop([torch.full((numel,), LOCAL)], options, joiner, RUN)
    swarm = {**SWARM, "protocol": PROTOCOL_VERSION}
    return StateSync(options, joiner, loop, swarm, threading.Lock(), threading.Event())


@pytest.mark.timeout(150)
def test_a_slow_holder_costs_the_joiner_seconds_and_join_timeout_holds() -> None:
    """A holder serving at 5 kB/s used to hold a joiner for 60 s + its claimed size at 20 kB/s,
    per offer, and the loop over offers never looked at join_timeout."""
    numel = 600_000
    big = torch.randn(numel) * 0.01 + LOCAL  # 2.4 MB of fp32: 8 minutes at 5 kB/s
    with (
        make_transport() as honest,
        make_transport(peers=honest.maddrs()) as slow,
        make_transport(peers=honest.maddrs()) as joiner,
    ):
        _trickle(slow, 5_000.0)
        for peer in (honest, slow):
            peer.report_progress([3], 50, 0.0)
        slow.publish_state(_snapshot(3, big), [3])  # at the median: tried first
        wait_for(lambda: len(joiner.state_offers()) == 1, what="the slow offer")
        # alone, it is given up within join_timeout
        sync = _joiner_sync(joiner, honest.maddrs(), 15.0, numel)
        started = time.monotonic()
        with pytest.raises(ConnectionError):
            sync.sync(required=True)
        assert time.monotonic() - started < 15.0 + 10.0
        # beside an honest holder of an older version, it costs seconds, not minutes
        honest.publish_state(_snapshot(2, big + 0.001), [2])
        wait_for(lambda: len(joiner.state_offers()) == 2, what="both offers")
        sync = _joiner_sync(joiner, honest.maddrs(), 100.0, numel)
        started = time.monotonic()
        assert sync.sync(required=True) == (honest.peer_id, 2)
        assert time.monotonic() - started < 40.0


def test_a_resync_downloads_off_the_trainers_thread_and_adopts_at_a_later_call() -> None:
    """A node behind the swarm re-syncs at the end of a round (on the trainer's thread): the
    download runs on a thread of its own, and the state is adopted, checked, at the next call."""
    with make_transport() as holder, make_transport(peers=holder.maddrs(), upload_limit=None) as node:
        holder.report_progress([20], 50, 0.0)
        holder.publish_state(_snapshot(20, torch.full((4,), 0.6)), [20])
        wait_for(lambda: len(node.state_offers()) == 1, what="the offer")
        sync = _sync(node, holder.maddrs())
        wait_for(lambda: len(sync.reports()) == 1, what="the report")
        started = time.monotonic()
        # the member's re-sync (the node's first sync, at its start, waits: nothing trains yet)
        assert sync.sync(required=False, wait=False) is None  # the download has started, elsewhere
        assert time.monotonic() - started < 1.0 and sync.loop.versions == [0]
        adopted = None
        deadline = time.monotonic() + 30.0
        while adopted is None and time.monotonic() < deadline:
            time.sleep(0.2)
            adopted = sync.sync(required=False)
        assert adopted == (holder.peer_id, 20) and sync.loop.versions == [20]


def test_a_failed_download_counts_against_the_holders_at_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46, item 6: a re-server that lies made the download fail and the honest publisher
    took the blame (its snapshots tried later). A holder whose own bytes failed the hash is left
    out of the sync's later downloads and spares the publisher the miss; a failure that proves
    nobody wrong (a timeout, a holder too slow: slowness proves nothing) counts against the
    publisher; its own bytes failing its own hash refuse it for the sync."""
    liar, slow, publisher = "QmLiarABCDEFGHJK9", "QmS1owABCDEFGHJK9", "QmPub1isherABCDE9"
    offer = Offer(
        publisher=publisher, base_version=3, kind="state", tokens=0, codec="state", numel=1,
        content_hash=bytes(32), byte_length=1000,
    )  # fmt: skip
    holders = [Holdings(peer_id=p, grpc=None, offers=[]) for p in (liar, slow, publisher)]
    candidate = Candidate(FragmentKey(RUN, 0, 3, publisher, Kind.STATE), offer, holders)
    asked: list[list[str]] = []
    blame: dict[str, str] = {}

    def fetch_state(candidate: Candidate, timeout: float) -> bytearray:
        asked.append([h.peer_id for h in candidate.holders])
        raise FragmentError("unavailable", "every holder failed", blame)

    with make_transport() as joiner:
        monkeypatch.setattr(joiner, "fetch_state", fetch_state)
        sync = _sync(joiner)
        blame.update({liar: "bad_hash", slow: "slow"})
        assert sync._download(candidate, 30.0, []) is None
        assert sync._misses == {} and sync._refused_from == set()  # a re-server lied
        blame.clear()
        blame.update({slow: "slow"})  # the liar left out; the slow one is asked again
        assert sync._download(candidate, 30.0, []) is None
        assert asked[1] == [slow, publisher] and sync._misses == {publisher: 1}
        blame.clear()  # a timeout with nobody named
        assert sync._download(candidate, 30.0, []) is None
        assert sync._misses == {publisher: 2}
        blame.update({publisher: "bad_hash"})  # its own bytes fail its own hash
        assert sync._download(candidate, 30.0, []) is None
        assert sync._refused_from == {publisher} and sync._misses == {publisher: 2}
        assert asked[0] == [liar, slow, publisher] and len(asked) == 4


def test_a_snapshot_larger_than_expected_comes_after_the_others() -> None:
    """Issue 46, item 7: a holder claiming a snapshot at the size cap had a joiner buffer it whole
    before the hash check. A claim past the size this node expects of its model's snapshot is
    tried after every other offer, however near the swarm's median its version."""
    with (
        make_transport() as honest,
        make_transport(peers=honest.maddrs()) as liar,
        make_transport(peers=honest.maddrs()) as joiner,
    ):
        for peer in (honest, liar):
            peer.report_progress([5], 50, 0.0)
        honest.publish_state(_snapshot(4, torch.full((4,), 0.6)), [4])
        padded = _snapshot(5, torch.full((4,), 0.7)) + bytes(3 << 20)  # past 6 B a value + 1 MiB
        liar.publish_state(padded, [5])  # at the median: it would come first by version
        wait_for(lambda: len(joiner.state_offers()) == 2, what="two offers")
        sync = _sync(joiner, honest.maddrs())
        wait_for(lambda: len(sync.reports()) == 2, what="two reports")
        assert len(padded) > sync._expected_bytes()
        order = [c.key.publisher for c in sync._worth_adopting(at_least_ours=False)]
        assert order == [honest.peer_id, liar.peer_id]
