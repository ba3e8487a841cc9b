"""Factored mixing's blocking step: the engine's consensus step every K rounds, a member whose
group did not form going on alone, the simulator's group finding on its virtual clock, and a
swarm whose members' φ stay together with it."""

from __future__ import annotations

import pytest
import torch

from cgad.node.config import JoinConfig, OuterOptions, SimConfig
from cgad.node.member.consensus import ConsensusStep, GroupMean
from cgad.node.member.engine import Member, MemberHooks, Schedule
from cgad.node.member.outer import OuterLoop
from cgad.node.sim.groups import GroupFinder
from cgad.protocol.memory import Delay, VirtualNetwork


class _Alone:
    """A swarm view with no peers: every block ends on time, every step is taken at once."""

    def live_peers(self) -> list[str]:
        return []

    def arrived(self, index: int, base_version: int) -> int:
        return 0

    def reports(self) -> dict[str, list[int]]:
        return {}


class _Hooks(MemberHooks):
    def __init__(self) -> None:
        self.due: list[int] = []

    def group_due(self, round_: int) -> None:
        self.due.append(round_)


def _member(every: int, value: float = 1.0) -> tuple[Member, _Hooks, list[torch.Tensor]]:
    theta = [torch.full((3,), value), torch.full((2,), value)]
    loop = OuterLoop(theta, OuterOptions(optimizer="sgd", outer_lr=1.0), VirtualNetwork().join("me"), "run")
    hooks = _Hooks()
    schedule = Schedule(fragments=1, inner_steps=2, apply_delay=0, consensus_every=every)
    return Member(loop, _Alone(), schedule, hooks=hooks), hooks, theta


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
        "every": 1, "averaged": 1, "alone": 0, "group_sizes": {"2": 1}, "waited_s": 1.5
    }  # fmt: skip


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
        workers=4, group_size=2, timeout=10.0, delay=Delay(0), drop=0.0, round_seconds=5.0, seed=0
    )
    return GroupFinder(**{**settings, **overrides})


def test_a_group_forms_when_every_present_member_offered_and_averages_their_phi():
    """The all-reduce is over when every copy between the members has landed: b's, offered last."""
    finder = _finder()
    a, b = finder.group_of(0, 3)
    assert finder.group_of(b, 3) == [a, b]  # one partition for everyone
    finder.offer(a, 3, now=1.0, phi=torch.zeros(2))
    assert finder.wake_time(a, present={0, 1, 2, 3}) == 11.0  # its deadline, while b has not offered
    finder.offer(b, 3, now=4.0, phi=torch.full((2,), 2.0))
    assert finder.wake_time(a, present={0, 1, 2, 3}) == 4.0  # no delay: b's φ lands as it is offered
    group = finder.resolve(a, 4.0, present={0, 1, 2, 3})
    assert group is not None and group.members == 2 and torch.equal(group.mean, torch.ones(2))
    assert finder.wait_seconds[a] == 3.0


def test_a_member_whose_group_does_not_form_in_time_goes_on_alone_at_its_deadline():
    finder = _finder(delay=Delay(4), timeout=10.0)  # each φ takes 4 rounds of 5 s: past the deadline
    a, b = finder.group_of(0, 1)
    finder.offer(a, 1, now=0.0, phi=torch.zeros(2))
    finder.offer(b, 1, now=0.0, phi=torch.ones(2))
    assert finder.wake_time(a, present={0, 1, 2, 3}) == 10.0
    assert finder.resolve(a, 10.0, present={0, 1, 2, 3}) is None
    lost = _finder(drop=0.999)
    c, d = lost.group_of(0, 1)
    lost.offer(c, 1, now=0.0, phi=torch.zeros(2))
    lost.offer(d, 1, now=0.0, phi=torch.ones(2))
    assert lost.wake_time(c, present={0, 1, 2, 3}) == 10.0
    assert lost.resolve(c, 10.0, present={0, 1, 2, 3}) is None
    away = _finder()
    e, _ = away.group_of(0, 2)
    away.offer(e, 2, now=0.0, phi=torch.zeros(2))
    assert away.wake_time(e, present={e}) == 0.0  # nobody else present: no wait
    assert away.resolve(e, 0.0, present={e}) is None


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
    # each member's own record of its waits (what a daemon's status reports) adds up to the swarm's
    assert abs(record["members_waited_s"] - record["wait_seconds"]) < 1e-2 * 16
    assert every["utilization"] < off["utilization"] == 1.0  # the waits are time not computing
    # measured once each round's synchronisation is over (the last round has no blocking step)
    late, tight = sum(off["consensus"][:-1]) / 4, sum(every["consensus"][:-1]) / 4
    assert tight < late / 5, (tight, late)
