"""Factored mixing's blocking step: the engine's consensus step every K rounds, a member whose
group did not form going on alone, the simulator's group finding on its virtual clock, and a
swarm whose members' φ stay together with it."""

from __future__ import annotations

import pytest
import torch

from cgad.node.config import JoinConfig, OuterOptions
from cgad.node.member.consensus import RADIUS, ConsensusStep, GroupMean, matchmaking
from cgad.node.member.engine import Member, MemberHooks, Schedule
from cgad.node.member.outer import OuterLoop
from cgad.node.sim.config import SimConfig
from cgad.node.sim.groups import GroupFinder
from cgad.node.sim.memory import Delay, VirtualNetwork


class _Alone:
    """A swarm view with no peers: every block ends on time, every step is taken at once."""

    def live_peers(self) -> list[str]:
        return []

    def arrived(self, index: int, base_version: int) -> int:
        return 0

    def reports(self) -> dict[str, list[int]]:
        return {}


class _Behind(_Alone):
    """A swarm whose peers report versions two rounds past the member's (``ahead``)."""

    def __init__(self) -> None:
        self.member: Member | None = None

    def reports(self) -> dict[str, list[int]]:
        assert self.member is not None
        return {peer: [v + 2 for v in self.member.loop.versions] for peer in ("p", "q", "r")}


class _Hooks(MemberHooks):
    def __init__(self) -> None:
        self.due: list[int] = []

    def group_due(self, round_: int) -> None:
        self.due.append(round_)


def _member(every: int, value: float = 1.0, swarm=None) -> tuple[Member, _Hooks, list[torch.Tensor]]:
    theta = [torch.full((3,), value), torch.full((2,), value)]
    loop = OuterLoop(theta, OuterOptions(optimizer="sgd", outer_lr=1.0), VirtualNetwork().join("me"), "run")
    hooks = _Hooks()
    schedule = Schedule(fragments=1, inner_steps=2, apply_delay=0, consensus_every=every)
    return Member(loop, swarm or _Alone(), schedule, hooks=hooks), hooks, theta


def _run_round(member: Member, theta: list[torch.Tensor], steps: int) -> int:
    """Two inner steps that each move θ by −0.1; the round's outer step is taken at the second."""
    for _ in range(2):
        with torch.no_grad():
            for t in theta:
                t.sub_(0.1)
        steps += 1
        member.after_inner_step(steps)
    return steps


def test_the_step_is_due_every_k_rounds_and_the_member_awaits_its_group():
    member, hooks, theta = _member(every=2)
    steps = 0
    for _ in range(6):
        steps = _run_round(member, theta, steps)
        if member.awaiting_group is not None:
            member.join_group(None)
    assert hooks.due == [2, 4, 6]
    assert member.consensus.alone == 3 and member.consensus.averaged == 0
    off, off_hooks, off_theta = _member(every=0)
    for _ in range(4):
        _run_round(off, off_theta, 2 * _)
    assert off_hooks.due == [] and off.awaiting_group is None


def test_the_step_sets_phi_to_the_groups_mean_and_moves_theta_with_it():
    member, _, theta = _member(every=1)
    _run_round(member, theta, 0)
    assert member.awaiting_group == 1
    phi = member.group_phi()
    assert torch.allclose(phi, torch.full((5,), 0.8))  # 1 − 2 × 0.1: averaging alone is θ
    with torch.no_grad():
        theta[0].add_(0.05)  # inner progress carried past the outer step stays on θ
    other = torch.tensor([0.0, 0.2, 0.4, 0.6, 1.0])
    assert member.join_group(GroupMean((phi + other) / 2, members=2), waited_s=1.5)
    assert member.awaiting_group is None
    expected = (torch.full((5,), 0.8) + other) / 2
    assert torch.allclose(torch.cat([p.detach().flatten() for p in member.loop.phi]), expected)
    assert torch.allclose(theta[0], expected[:3] + 0.05) and torch.allclose(theta[1], expected[3:])
    assert member.consensus.summary() == {
        "every": 1, "averaged": 1, "alone": 0, "group_sizes": {"2": 1}, "waited_s": 1.5, "clipped": 0
    }  # fmt: skip


def test_a_non_finite_group_mean_moves_nothing():
    member, _, theta = _member(every=1)
    _run_round(member, theta, 0)
    before = member.group_phi()
    for bad in (float("nan"), float("inf")):
        mean = before.clone()
        mean[2] = bad
        assert member.join_group(GroupMean(mean, members=3)) and torch.equal(member.group_phi(), before)
        _run_round(member, theta, 2)
        before = member.group_phi()
    assert member.consensus.clipped == 2 and torch.isfinite(torch.cat([t.flatten() for t in theta])).all()


@pytest.mark.parametrize("target", [10.0, 1e30])
def test_a_share_aimed_at_a_chosen_model_moves_phi_no_further_than_its_own_steps_allow(target: float):
    """A member of a group of three sends 3·target − own − other, so that the mean is the model of
    its choosing (a share of 1e30 was taken too): the member's φ moves toward it at most RADIUS
    times as far as its own outer steps moved φ since the last step (one round: 0.2 per value)."""
    member, _, theta = _member(every=1)
    _run_round(member, theta, 0)
    phi = member.group_phi()
    other = phi + 0.05  # an honest member, close by
    share = 3 * torch.full((5,), target) - phi - other
    mean = (phi + other + share) / 3
    assert member.join_group(GroupMean(mean, members=3))
    moved = float(torch.linalg.vector_norm(member.group_phi() - phi))
    room = RADIUS * 0.2 * 5**0.5
    assert moved == pytest.approx(room, rel=1e-4)  # along the mean's direction, cut to the room
    assert member.consensus.clipped == 1 and member.consensus.moved == 0.0
    assert torch.isfinite(member.group_phi()).all()
    # the next step's room is the next round's movement again
    _run_round(member, theta, 2)
    assert member.consensus.moved == pytest.approx(0.2 * 5**0.5, rel=1e-3)


def test_an_honest_groups_mean_is_taken_whole():
    member, _, theta = _member(every=1)
    _run_round(member, theta, 0)
    phi = member.group_phi()
    mean = phi + 0.1  # the group a little off: within the room of one round's movement
    assert member.join_group(GroupMean(mean, members=2))
    assert torch.allclose(member.group_phi(), mean) and member.consensus.clipped == 0


def test_a_member_whose_group_did_not_form_goes_on_alone():
    member, _, theta = _member(every=1)
    _run_round(member, theta, 0)
    before = member.group_phi()
    assert not member.join_group(None)
    assert torch.equal(member.group_phi(), before)
    assert member.consensus.alone == 1 and member.awaiting_group is None
    # a "group" of itself alone is no group either
    step = ConsensusStep(every=1)
    assert not step.close(member.loop, GroupMean(torch.zeros(5), members=1))
    assert torch.equal(member.group_phi(), before)


def _finder(**overrides) -> GroupFinder:
    settings = dict(
        timeout=10.0, window=5.0, retry=2.0, allreduce_timeout=6.0, delay=Delay(0), drop=0.0,
        round_seconds=5.0, seed=0,
    )  # fmt: skip
    return GroupFinder(4, overrides.pop("group_size", 2), **{**settings, **overrides})


def test_a_group_forms_from_whoever_offers_within_its_window_and_averages_their_phi():
    """As hivemind's matchmaking: a full group starts at once; with no delay the all-reduce is
    over as it starts."""
    finder = _finder()
    finder.offer(0, now=1.0, phi=torch.zeros(2))
    assert finder.wake_time(0) == 11.0  # alone so far: when its search ends
    finder.offer(1, now=4.0, phi=torch.full((2,), 2.0))  # the group is full: it starts now
    assert finder.wake_time(0) == finder.wake_time(1) == 4.0
    group = finder.resolve(0, 4.0)
    assert group is not None and group.members == 2 and torch.equal(group.mean, torch.ones(2))
    assert finder.wait_seconds[0] == 3.0 and finder.waiting(1) and not finder.waiting(0)
    # a group with room starts when the window its second member came in ends
    three = _finder(group_size=3)
    three.offer(0, now=0.0, phi=torch.zeros(2))
    three.offer(1, now=1.0, phi=torch.ones(2))
    assert three.wake_time(0) == 5.0


def test_a_member_that_comes_as_or_after_its_peers_group_starts_waits_alone():
    """What kept one testbed node from every group when steps were keyed by its own round."""
    finder = _finder(group_size=3)
    finder.offer(0, now=0.0, phi=torch.zeros(2))
    finder.offer(1, now=1.0, phi=torch.ones(2))  # starts at 5.0, the window's end
    finder.offer(2, now=5.0, phi=torch.ones(2))  # at the start: too late for it
    assert finder.wake_time(2) == 15.0 and finder.resolve(2, 15.0) is None
    assert finder.resolve(0, 5.0).members == 2
    # one alone looks on, a retry window at a time, until its search ends
    patient = _finder(group_size=3)
    patient.offer(0, now=0.0, phi=torch.zeros(2))
    patient.offer(1, now=7.5, phi=torch.ones(2))  # in 0's retry window 7-9
    assert patient.wake_time(0) == patient.wake_time(1) == 9.0
    short = _finder(group_size=3)
    short.offer(0, now=0.0, phi=torch.zeros(2))
    short.offer(1, now=9.5, phi=torch.ones(2))  # 0's last window is cut short at its search's end
    assert short.wake_time(0) == short.wake_time(1) == 10.0
    gone = _finder(group_size=3)
    gone.offer(0, now=0.0, phi=torch.zeros(2))
    gone.offer(1, now=10.0, phi=torch.ones(2))  # 0 stopped looking: 1 is alone
    assert gone.wake_time(0) == 10.0 and gone.wake_time(1) == 20.0


def test_a_group_whose_all_reduce_outlasts_its_timeout_goes_on_alone():
    finder = _finder(delay=Delay(2))  # each φ takes 2 rounds of 5 s: past the all-reduce's 6 s
    finder.offer(0, now=0.0, phi=torch.zeros(2))
    finder.offer(1, now=0.0, phi=torch.ones(2))
    assert finder.wake_time(0) == 6.0
    assert finder.resolve(0, 6.0) is None and finder.resolve(1, 6.0) is None
    in_time = _finder(delay=Delay(1))  # 5 s: within it
    in_time.offer(0, now=0.0, phi=torch.zeros(2))
    in_time.offer(1, now=0.0, phi=torch.ones(2))
    assert in_time.wake_time(0) == 5.0 and in_time.resolve(0, 5.0).members == 2
    lost = _finder(drop=0.999)
    lost.offer(0, now=0.0, phi=torch.zeros(2))
    lost.offer(1, now=0.0, phi=torch.ones(2))
    assert lost.wake_time(0) == 6.0 and lost.resolve(0, 6.0) is None
    with pytest.raises(ValueError, match="window"):
        _finder(window=20.0)


def test_the_window_covers_a_round_and_the_search_its_timeout_beyond():
    assert matchmaking(30.0, None) == (10.0, 30.0)
    assert matchmaking(30.0, 5.0) == (10.0, 30.0)
    assert matchmaking(30.0, 25.0) == (25.0, 45.0)
    assert matchmaking(30.0, 300.0) == (30.0, 50.0)  # a round past the timeout: the timeout


def test_a_member_two_rounds_behind_its_peers_takes_the_step_with_them():
    swarm = _Behind()
    member, hooks, theta = _member(every=4, swarm=swarm)
    swarm.member = member
    steps = 0
    for _ in range(8):
        steps = _run_round(member, theta, steps)
        if member.awaiting_group is not None:
            member.join_group(None)
    assert hooks.due == [2, 6]  # the swarm's rounds 4 and 8


def test_a_member_behind_the_swarm_steps_with_it():
    """Keyed by the swarm's round where it is further on: a member two rounds behind steps when
    the swarm reaches the mark, and not again at its own; a claim far ahead moves it by one step."""
    step = ConsensusStep(every=4)
    assert step.due(1) is None and step.due(2, lag=2) == 4
    step.open(2, 4)
    assert [step.due(r) for r in (3, 4, 5, 6, 7, 8)] == [None, None, None, None, None, 8]
    liar = ConsensusStep(every=4)
    assert liar.due(1) is None and liar.due(2, lag=1000) == 4  # the lag counts up to K
    resumed = ConsensusStep(every=4)
    assert resumed.due(37) is None and resumed.due(38) is None and resumed.due(40) == 40
    # a member that adopts a state jumps rounds: the jump is no crossing (nobody else steps there)
    adopting = ConsensusStep(every=4)
    adopting.open(8, adopting.due(8) or 8)
    adopting.restart()
    assert adopting.due(19) is None and adopting.due(20) == 20


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(consensus_every=2, optimizer="local"), "trains alone"),
        (dict(consensus_every=-1), "greater than or equal to 0"),
        (dict(consensus_group=1), "greater than or equal to 2"),
        (dict(consensus_timeout=0), "greater than 0"),
    ],
)
def test_bad_consensus_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(**kwargs)


def test_the_blocking_step_and_the_all_reduce_exclude_each_other():
    with pytest.raises(ValueError, match="no --consensus-every"):
        JoinConfig(sync="allreduce", mixing="none", optimizer="nesterov", consensus_every=4)
    assert JoinConfig(consensus_every=4).consensus_every == 4


@pytest.fixture(scope="module")
def corpus():
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    return tokenizer, load_dataset(tokenizer)


def test_every_round_keeps_the_members_phi_much_closer_than_never(corpus):
    from cgad.node.sim.simulate import simulate

    tokenizer, dataset = corpus
    base = dict(
        workers=4, inner_steps=3, rounds=5, batch_size=2, seq_len=16, eval_batches=1, inner_lr=1e-3,
        delay="random:4", seed=1,
    )  # fmt: skip
    off = simulate(SimConfig(**base), dataset, tokenizer.vocab_size)
    every = simulate(
        SimConfig(**base, consensus_every=1, consensus_group=4, consensus_timeout=1000.0),
        dataset,
        tokenizer.vocab_size,
    )
    assert off["consensus_step"] is None
    record = every["consensus_step"]
    assert record["averaged"] == 4 * 4 and record["alone"] == 0  # every round but the last, whole groups
    assert record["group_sizes"] == {"4": 16} and record["wait_seconds"] > 0
    assert every["utilization"] < off["utilization"] == 1.0  # the waits are time not computing
    # measured once each round's synchronisation is over (the last round has no blocking step)
    late, tight = sum(off["consensus"][:-1]) / 4, sum(every["consensus"][:-1]) / 4
    assert tight < late / 5, (tight, late)
