"""What a joining node asks the peers at --peers before it waits for anything (``Describe``), with
real hivemind peers on 127.0.0.1: a peer of another protocol version or another run is refused
at once, with a message that says which."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from _netswarm import RUN, make_transport, wait_for  # tests/ is on sys.path under pytest

from cgad.node.config import JoinConfig
from cgad.node.daemon.checkpoint import pack
from cgad.node.daemon.joining import MAX_ADOPTIONS, IncompatibleSwarm, StateSync, settled
from cgad.node.member.outer import OuterLoop
from cgad.node.member.swarm import swarm_versions
from cgad.protocol.records import PROTOCOL_VERSION, fragment_key, progress_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SWARM = {"run_id": RUN, "model": "m", "tokenizer": "t", "optimizer": "cga", "fragments": 1}


def _sync(transport, peers: list[str]) -> StateSync:
    config = JoinConfig(run_id=RUN, peers=peers)
    # its own φ near the snapshots' (a joiner holds a snapshot's φ against its own)
    loop = OuterLoop([torch.full((4,), 0.5)], config, transport, RUN)
    swarm = {**SWARM, "protocol": PROTOCOL_VERSION}
    return StateSync(config, transport, loop, swarm, threading.Lock(), threading.Event())


@pytest.mark.parametrize(
    ("theirs", "says"),
    [
        ({**SWARM, "protocol": PROTOCOL_VERSION + 1}, f"protocol version {PROTOCOL_VERSION + 1}"),
        (SWARM, "protocol version 1 (it does not say: an older release)"),
        ({**SWARM, "protocol": PROTOCOL_VERSION, "model": "another"}, "different model config"),
    ],
)
def test_a_peer_of_another_protocol_version_or_swarm_is_refused(theirs: dict, says: str) -> None:
    with make_transport() as peer, make_transport(peers=peer.maddrs()) as joiner:
        peer.describe_as(json.dumps(theirs))
        with pytest.raises(IncompatibleSwarm, match=re.escape(says)):
            _sync(joiner, peer.maddrs()).check_bootstrap_peers()


def test_the_same_version_passes_and_its_keys_name_it() -> None:
    with make_transport() as peer, make_transport(peers=peer.maddrs()) as joiner:
        peer.describe_as(json.dumps({**SWARM, "protocol": PROTOCOL_VERSION}))
        _sync(joiner, peer.maddrs()).check_bootstrap_peers()
    # records of two versions never meet: their strict schemas would refuse each other's fields
    assert fragment_key(RUN, 3) == f"{RUN}_v{PROTOCOL_VERSION}_fragment3"
    assert progress_key(RUN) == f"{RUN}_v{PROTOCOL_VERSION}_progress"


def test_a_first_nodes_resync_runs_off_its_trainers_thread() -> None:
    # a node started without --peers never ran a start-up sync: its first sync, once it trails
    # the swarm that grew around it, is a re-sync like any other (on "cgad-resync")
    with make_transport() as first:
        sync = _sync(first, [])
        started = time.monotonic()
        assert sync.sync(required=False) is None
        assert time.monotonic() - started < 2.0 and sync._resync is not None


@pytest.mark.parametrize(
    ("newer", "adoptions", "behind", "moved", "stops"),
    [
        (True, 1, 5, 0, False),  # an old snapshot, downloaded fast: fetch the newer one
        (True, 1, 5, 4, True),  # the download itself took 4 rounds: the next would trail as far
        (True, 1, 1, 0, True),  # close enough
        (False, 1, 5, 0, True),  # nothing newer to have
        (True, MAX_ADOPTIONS, 5, 0, True),  # enough in a row
    ],
)
def test_a_joiner_chases_a_newer_snapshot_only_where_that_helps(
    newer: bool, adoptions: int, behind: int, moved: int, stops: bool
) -> None:
    assert settled(newer, adoptions, behind, moved) is stops


def _snapshot(version: int, value: float, snapshot_round: int | None = None) -> bytes:
    with make_transport() as scratch:
        outer = _sync(scratch, []).loop.state_dict()
    outer["phi"] = [torch.full_like(p, value) for p in outer["phi"]]
    outer["versions"] = [version] * len(outer["versions"])
    snapshot_round = version if snapshot_round is None else snapshot_round
    return pack({"swarm": {**SWARM, "protocol": PROTOCOL_VERSION}, "outer": outer, "round": snapshot_round})


def test_a_peer_whose_snapshot_was_poisoned_is_not_tried_at_its_older_versions() -> None:
    with (
        make_transport() as honest,
        make_transport(peers=honest.maddrs()) as poisoner,
        make_transport(peers=honest.maddrs()) as joiner,
    ):
        # within the cutoff (4) of the peers' progress reports (4), so that every offer is worth
        # trying, the poisoner's nearest the swarm's version: tried first
        honest.report_progress([4], 50, 0.0)
        honest.publish_state(_snapshot(2, 1.0), [2])
        for version in (3, 4):  # the publisher keeps its two newest: both on offer, both NaN
            poisoner.publish_state(_snapshot(version, float("nan")), [version])
        wait_for(lambda: len(joiner.state_offers()) == 3, what="three offers")
        sync = _sync(joiner, honest.maddrs())
        wait_for(lambda: len(sync.reports()) == 1, what="the report")
        adopted = sync.sync(required=True)
        # counted on to the honest source's report (4) once adopted
        assert adopted == (honest.peer_id, 4) and torch.equal(sync.loop.phi[0], torch.ones(4))
        assert joiner.stats.rejected["bad_state"] == 1  # version 4 refused, version 3 never fetched


def test_a_snapshot_a_version_older_from_more_holders_comes_first() -> None:
    """Within a version of the newest, the snapshot that more peers hold is downloaded first
    (from all of them at once; the version it lacks is replayed); older ones stay behind."""
    with (
        make_transport() as publisher,
        make_transport(peers=publisher.maddrs()) as reserver,
        make_transport(peers=publisher.maddrs()) as joiner,
    ):
        held_twice = _snapshot(3, 1.0)
        publisher.publish_state(_snapshot(2, 3.0), [2])
        publisher.publish_state(held_twice, [3])
        wait_for(lambda: len(reserver.state_offers()) == 2, what="two offers")
        [three] = [c for c in reserver.state_offers() if c.key.base_version == 3]
        reserver.reserve_state(three, held_twice)
        publisher.publish_state(_snapshot(4, 2.0), [4])  # newest, one holder
        # the publisher keeps its two newest: 3 (held twice) and 4
        offered = lambda: sorted((c.key.base_version, len(c.holders)) for c in joiner.state_offers())  # noqa: E731
        wait_for(lambda: offered() == [(3, 2), (4, 1)], what="4, and 3 from two holders")
        sync = _sync(joiner, publisher.maddrs())
        order = [(c.key.base_version, len(c.holders)) for c in sync._worth_adopting(at_least_ours=True)]
        assert order == [(3, 2), (4, 1)]
        adopted = sync.sync(required=True)
        assert adopted is not None and torch.equal(sync.loop.phi[0], torch.ones(4))


def _two_fragment_snapshot(versions: list, snapshot_round: int) -> bytes:
    with make_transport() as scratch:
        config = JoinConfig(run_id=RUN, fragments=2)
        outer = OuterLoop([torch.zeros(4), torch.zeros(4)], config, scratch, RUN).state_dict()
    outer["phi"] = [torch.ones_like(p) for p in outer["phi"]]
    outer["versions"] = versions
    swarm = {**SWARM, "fragments": 2, "protocol": PROTOCOL_VERSION}
    return pack({"swarm": swarm, "outer": outer, "round": snapshot_round})


@pytest.mark.parametrize(
    "versions",
    [
        [3, float("inf")],  # int(inf) raised OverflowError, past the refusal, and ended the node
        [3, 3.0],  # not a version: 3.5 would be truncated
        [3, True],
        [3, 3 + 4 + 1],  # one fragment past the ceiling (the cutoff past the reports)
    ],
)
def test_a_snapshot_whose_versions_are_forged_is_refused(versions: list) -> None:
    with (
        make_transport() as honest,
        make_transport(peers=honest.maddrs()) as forger,
        make_transport(peers=honest.maddrs()) as joiner,
    ):
        honest.report_progress([3, 3], 50, 0.0)  # the forger's version is the swarm's: tried first
        honest.publish_state(_two_fragment_snapshot([2, 2], 2), [2, 2])
        forger.publish_state(_two_fragment_snapshot(versions, 3), [3])
        wait_for(lambda: len(joiner.state_offers()) == 2, what="two offers")
        config = JoinConfig(run_id=RUN, peers=honest.maddrs(), fragments=2)
        loop = OuterLoop([torch.full((4,), 0.5), torch.full((4,), 0.5)], config, joiner, RUN)
        swarm = {**SWARM, "fragments": 2, "protocol": PROTOCOL_VERSION}
        sync = StateSync(config, joiner, loop, swarm, threading.Lock(), threading.Event())
        wait_for(lambda: sync._ceiling() == 3 + 4, what="the honest report")
        assert sync.sync(required=True) == (honest.peer_id, 2)
        assert loop.versions == [2, 2] and joiner.stats.rejected["bad_state"] == 1


def test_a_snapshots_round_is_never_past_its_versions_and_one_liar_does_not_raise_the_ceiling() -> None:
    with (
        make_transport() as honest,
        make_transport(peers=honest.maddrs()) as liar,
        make_transport(peers=honest.maddrs()) as joiner,
    ):
        honest.report_progress([3], 50, 0.0)
        liar.report_progress([1000], 50, 0.0)
        # a sound state whose round is forged: it would end a --max-rounds node at once, and
        # spread to the joiners that take their round from this one
        honest.publish_state(_snapshot(3, 1.0, snapshot_round=10**12), [3])
        liar.publish_state(_snapshot(900, 2.0), [900])  # the liar's version: past the ceiling of 3 + 4
        wait_for(lambda: len(joiner.state_offers()) == 2, what="two offers")
        sync = _sync(joiner, honest.maddrs())
        wait_for(lambda: len(sync.reports()) == 2, what="both reports")
        assert sync._ceiling() == 3 + 4  # the low median of 3 and 1000
        assert sync.sync(required=True) == (honest.peer_id, 3) and sync.loop.versions == [3]
        assert joiner.stats.rejected["bad_state"] == 0  # the liar's offer was never fetched


def test_the_swarms_version_is_the_median_and_a_just_adopted_sources_own_report() -> None:
    """At the start the joiners adopt the first node's version 0 while it goes on to 1: they are
    the median's majority, yet the version to catch up to is the source's (it is the state they
    took); no other single peer's claim moves it."""
    with make_transport() as first:
        with (
            make_transport(peers=first.maddrs()) as joiner,
            make_transport(peers=first.maddrs()) as claimer,
            make_transport(peers=first.maddrs()) as me,
        ):
            first.report_progress([1], 60, 0.0)
            joiner.report_progress([0], 10, 0.0)
            claimer.report_progress([900], 10, 0.0)
            me.report_progress([0], 10, 0.0)
            sync = _sync(me, first.maddrs())
            # ``me`` is not counted: the median_low of 0, 1 and 900 (waited for: the records
            # reach ``me`` over the DHT at their own pace)
            wait_for(
                lambda: swarm_versions(sync.reports(), 1) == [1],
                what="the median of the three peers' reports",
            )
            assert swarm_versions(sync.reports(), 1, joiner.peer_id) == [1]
            joiner.report_progress([0], 20, 0.0)
            claimer.report_progress([0], 20, 0.0)  # three honest joiners at 0 now
            first.report_progress([2], 110, 0.0)
            wait_for(
                lambda: swarm_versions(sync.reports(), 1, first.peer_id) == [2],
                what="the source's own report",
            )
            wait_for(lambda: swarm_versions(sync.reports(), 1) == [0], what="the median of 0, 0 and 2")
            assert swarm_versions(sync.reports(), 1, joiner.peer_id) == [0]
