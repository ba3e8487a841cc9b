"""Factored mixing's blocking step in a daemon: real hivemind averagers on 127.0.0.1 average a
group's φ, a member with no group goes on without it, and the daemon's step moves φ to the mean."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from cgad.node.daemon.consensus import join_group
from cgad.node.daemon.joining import IncompatibleSwarm, check_compatible
from cgad.node.member.consensus import ConsensusStep
from cgad.protocol.allreduce import AveragerSettings, GroupAverager
from cgad.protocol.auth import SwarmKey
from cgad.protocol.records import Identity

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _averager(group: int, wait: float, timeout: float) -> GroupAverager:
    return GroupAverager(1000, AveragerSettings("t", group, wait, timeout))


class _Member:
    """What ``join_group`` asks of the engine: the φ offered and the group's result."""

    def __init__(self, phi: torch.Tensor) -> None:
        self.phi, self.awaiting_group, self.joined, self.waited = phi, 3, [], []
        self.consensus = ConsensusStep(every=1)

    def group_phi(self) -> torch.Tensor:
        return self.phi.clone()

    def join_group(self, group, waited_s: float) -> bool:
        self.joined.append(group)
        self.waited.append(waited_s)
        return group is not None


def _step_all(members: list[_Member], averagers: list[GroupAverager], late: dict[int, float]) -> None:
    """Each member's blocking step at once on threads, member i ``late[i]`` seconds after the others."""

    def step(i: int) -> None:
        time.sleep(late.get(i, 0.0))
        join_group(members[i], averagers[i])

    threads = [threading.Thread(target=step, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_group_averages_its_phi_and_a_member_alone_goes_on_without_it() -> None:
    averagers = [_averager(group=3, wait=2.0, timeout=20) for _ in range(3)]
    try:
        averagers[0].start([], LOOPBACK)
        for averager in averagers[1:]:
            averager.start(averagers[0].maddrs(), LOOPBACK)
        members = [_Member(torch.randn(1000, generator=torch.Generator().manual_seed(i))) for i in range(3)]
        _step_all(members, averagers, late={})
        mean = sum(m.phi for m in members) / 3
        for member, averager in zip(members, averagers, strict=True):
            (group,) = member.joined
            assert group is not None and group.members == 3 and averager.groups == {3: 1}
            assert torch.allclose(group.mean, mean, atol=1e-6)  # fp32 on the wire
        # rounds of 12 s: a new group gathers for a round, and a member 8 s late (past a third of
        # the 20 s timeout, the window at short rounds, when the other two would start without it)
        # still joins theirs
        for member, averager in zip(members, averagers, strict=True):
            averager.finished_at = time.monotonic() - 12.0
            member.consensus.rounds_since = 1
        _step_all(members, averagers, late={2: 8.0})
        assert [m.joined[1] and m.joined[1].members for m in members] == [3, 3, 3]
        assert members[0].waited[1] >= 7.0  # it waited for the late one
        lone = _averager(group=2, wait=1.0, timeout=3)
        averagers.append(lone)
        lone.start(averagers[0].maddrs(), LOOPBACK)
        alone = _Member(torch.ones(1000))
        join_group(alone, lone)  # nobody else averages now: no group within the search
        assert alone.joined == [None] and lone.groups == {1: 1}
        # the time it was blocked is its cost: at least the window, at most the search and slack
        assert 1.0 <= alone.waited[0] <= 3.0 + 5.0, alone.waited
    finally:
        for averager in averagers:
            averager.close()


def test_a_swarm_with_another_consensus_schedule_is_refused() -> None:
    ours = {"run_id": "r", "consensus_every": 4}
    with pytest.raises(IncompatibleSwarm, match="blocking consensus step"):
        check_compatible(ours, {"run_id": "r"}, "peer")  # stated by a node without the step: 0
    check_compatible({"run_id": "r", "consensus_every": 0}, {"run_id": "r"}, "peer")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_two_daemons_take_the_blocking_step_beside_the_exchange(daemons) -> None:
    from _daemons import FRESH_LOSS, NodeProcess  # tests/ is on sys.path under pytest

    workdir, started = daemons
    mode = ["--consensus-every", "1", "--consensus-group", "2", "--consensus-timeout", "20"]
    first = NodeProcess("first", workdir, [], mode)
    started.append(first)
    second = NodeProcess("second", workdir, first.maddrs(), mode)
    started.append(second)

    def averaged_twice(status: dict) -> bool:  # and the exchange went on beside: a peer's delta applied
        return (status["consensus"] or {}).get("group_sizes", {}).get("2", 0) >= 2 and status["applied"] > 0

    statuses = [
        node.wait(averaged_twice, "two blocking steps in a group", timeout=400) for node in (first, second)
    ]
    for status in statuses:
        assert status["consensus"]["every"] == 1 and status["applied"] > 0  # the exchange goes on beside
        assert status["consensus"]["outsiders"] == 0  # no allowlist: every group is taken
        assert status["consensus"]["waited_s"] > 0  # the time the trainer was blocked for its groups
        assert status["eval_loss"] < FRESH_LOSS - 0.5, status["eval_history"]
    # Ctrl-C still stops it: hivemind's averager start sets SIGINT to ignored in its parent
    second.proc.send_signal(signal.SIGINT)
    assert second.proc.wait(timeout=120) == 0, second.log.read_text()[-3000:]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_an_averager_without_the_swarm_key_is_never_in_a_private_swarms_group() -> None:
    """Two members of a private swarm and an outsider bootstrapping from them step together: the
    members average with each other alone, and the outsider's φ is in no group (without the key
    it had joined theirs, its share in their mean)."""
    key = SwarmKey.generate()
    members_ = [GroupAverager(1000, AveragerSettings("t", 3, 2.0, 15, swarm_key=key)) for _ in range(2)]
    outsider = _averager(group=3, wait=2.0, timeout=15)
    averagers = [*members_, outsider]
    try:
        members_[0].start([], LOOPBACK)
        members_[1].start(members_[0].maddrs(), LOOPBACK)
        try:
            outsider.start(members_[0].maddrs(), LOOPBACK)
        except Exception:  # its DHT could not bootstrap from the members' (refused): nothing to step
            averagers.pop()
        members = [_Member(torch.full((1000,), float(i))) for i in range(len(averagers))]
        _step_all(members, averagers, late={})
        for member in members[:2]:
            (group,) = member.joined
            assert group is not None and group.members == 2, group
            assert torch.allclose(group.mean, torch.full((1000,), 0.5))  # the two members' φ alone
        if len(members) == 3:
            assert members[2].joined == [None]
    finally:
        for averager in averagers:
            averager.close()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_with_an_allowlist_a_group_with_an_outsider_is_not_taken() -> None:
    """Two members listing each other (``--allow``) and an outsider they did not list, all in one
    averager DHT, step together: the outsider gets into the group (the all-reduce cannot keep it
    out), and each member takes no mean from that group (without the list it took the outsider's
    share in its mean). The averagers run under their nodes' identities, so a member is known by
    its node's peer id."""
    identities = [Identity() for _ in range(3)]
    allowed = frozenset(i.peer_id for i in identities[:2])

    def averager(identity: Identity, listed: frozenset[str] | None) -> GroupAverager:
        settings = AveragerSettings("t", 3, 2.0, 15, identity=identity, allowed=listed)
        return GroupAverager(1000, settings)

    averagers = [averager(identities[0], allowed), averager(identities[1], allowed)]
    averagers.append(averager(identities[2], None))
    try:
        averagers[0].start([], LOOPBACK)
        for other in averagers[1:]:
            other.start(averagers[0].maddrs(), LOOPBACK)
        assert [a.peer_id for a in averagers] == [i.peer_id for i in identities]
        members = [_Member(torch.full((1000,), float(i))) for i in range(3)]
        _step_all(members, averagers, late={})
        outsider = members[2].joined[0]
        assert outsider is not None and outsider.members == 3  # the outsider was in their group
        for member, listed in zip(members[:2], averagers[:2], strict=True):
            assert member.joined == [None], member.joined  # and its mean was not taken
            assert listed.outsiders == 1
    finally:
        for a in averagers:
            a.close()
