"""Factored mixing's blocking step: every K rounds, a member's φ becomes the mean of its group's.

The non-blocking exchange (pseudo-gradients every round, and gossip) never waits for a peer, so
members drift apart where deliveries come late or not at all. The blocking step tightens
agreement: at the end of a round in which its round, or the swarm's, reached a multiple of K
(``--consensus-every K``) the member stops training, finds a group of up to ``--consensus-group``
peers, and sets φ to the group's mean φ (the Factored Gossip seed's blocking mix; torchft's
``LocalSGD`` averages parameters the same way, every ``sync_every`` steps). A member whose group
does not form within its search (``matchmaking``: a window of a third of ``--consensus-timeout``
or a round, and two thirds of the timeout) or does not finish within the timeout goes on without
it: the step never blocks for ever. The time spent waiting is time not training:
K is the knob between utilisation (large K, or 0: never) and agreement (small K).

The group's mean is a claim of its members: a member sending 3·target − 2·own would set its
peers' φ to a model of its choosing. So a member moves at most ``RADIUS`` times as far as its own
outer steps moved φ since its last step with a group (honest members' φ drift apart no faster
than their steps move them, and the mean lies among them): a mean further off is taken only that
far along its direction (counted ``clipped``).

The step's state is explicit (``ConsensusStep``): when it is due, the round that awaits its
group, how far φ moved since the last step, and what the steps so far did. Who the group is and
how its φ travel is the driver's: a daemon averages over the network (hivemind's all-reduce,
``protocol/allreduce.py``), the simulator finds the group on its virtual clock
(``node/sim/groups.py``); either hands the group's mean to ``Member.join_group``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cgad.node.member.outer import OuterLoop

__all__ = ["RADIUS", "ConsensusStep", "GroupMean", "flat_phi", "matchmaking", "move_phi"]

# how far a group's mean may move φ, in units of how far this member's own outer steps moved it
# since its last step with a group: the honest members' φ are at most about twice that apart
RADIUS = 2.0


@dataclass(frozen=True)
class GroupMean:
    """What a group's exchange gave a member.

    Args:
        mean: the group's mean φ, flat, in the order of ``OuterLoop.phi``.
        members: how many members' φ it is the mean of, this member's included.
    """

    mean: Tensor
    members: int


@dataclass
class ConsensusStep:
    """The blocking step's schedule and record.

    Args:
        every: K, rounds between steps; 0: never.
    """

    every: int = 0
    pending: int | None = None  # the round whose step awaits its group (the member is blocked)
    last_mark: int | None = None  # the multiple of K the last step was for (None: not looked yet)
    rounds_since: int | None = None  # rounds between the step awaited and the one before (None: first)
    averaged: int = 0  # steps taken with a group
    alone: int = 0  # steps whose group did not form in time: the member went on without it
    group_sizes: Counter[int] = field(default_factory=Counter)  # members per averaged step
    waited_s: float = 0.0  # seconds blocked awaiting groups, on the driver's clock (wall or virtual)
    last_round: int | None = None  # the round the last step was taken at
    moved: float = 0.0  # how far the outer steps moved φ since the last step with a group (L2, summed)
    clipped: int = 0  # steps whose group mean lay further than ``RADIUS`` × ``moved``: cut to it

    def due(self, round_: int, lag: int = 0) -> int | None:
        """The mark (a multiple of K) whose step round ``round_``, just ended, ends in; None when
        none is due. A step is due when this member's round, or the swarm's where it is ``lag``
        rounds further on, reaches a multiple of K past the last step's. Groups form from whoever
        looks at the same time (hivemind's matchmaking window), so a member a round or two behind
        that stepped at its own multiples would look after its peers' group had formed, every
        time, and wait each step out alone (seen on the testbed); keyed by the swarm's round it
        looks with them, a round late at most (reports lag one). The lag counts up to K: peers'
        reports are their claim, and a claim far ahead moves this member's steps by one at most.

        Args:
            round_: this member's round, just ended.
            lag: how many rounds the swarm's versions are past this member's (``Member.behind``).
        """
        if self.every <= 0 or round_ <= 0:
            return None
        ahead = min(max(lag, 0), self.every)
        if self.last_mark is None:  # the first look (a start, a resume): only a crossing from here on
            self.last_mark = (round_ - 1 + ahead) // self.every * self.every
        mark = (round_ + ahead) // self.every * self.every
        return mark if mark > self.last_mark else None

    def restart(self) -> None:
        """Count crossings from the next look on (after adopting a state whose round jumped past
        a multiple of K: a step there would look for a group nobody else is in)."""
        self.last_mark = self.last_round = self.rounds_since = None

    def open(self, round_: int, mark: int) -> None:
        """Round ``round_`` awaits the group of the step at ``mark``."""
        self.rounds_since = round_ - self.last_round if self.last_round is not None else None
        self.last_round = round_
        self.pending = round_
        self.last_mark = mark

    def close(self, loop: OuterLoop, group: GroupMean | None, waited_s: float = 0.0) -> bool:
        """The group's exchange is over: move φ (and θ with it) to the group's mean, or, with no
        group (None, or a group of one), leave them alone. Whether φ moved.

        Args:
            loop: the member's outer loop.
            group: what the exchange gave, or None when no group formed in time.
            waited_s: seconds the member was blocked for it (the step's cost in time).
        """
        self.pending = None
        self.waited_s += waited_s
        if group is None or group.members < 2:
            self.alone += 1
            return False
        self.clipped += move_phi(loop, group.mean, RADIUS * self.moved)
        self.moved = 0.0
        self.averaged += 1
        self.group_sizes[group.members] += 1
        return True

    def record_move(self, distance: float) -> None:
        """An outer step moved φ by ``distance`` (L2): the room the next group's mean gets."""
        if math.isfinite(distance):
            self.moved += distance

    def summary(self) -> dict[str, object]:
        """The record a status document or a simulation reports."""
        sizes = {str(n): count for n, count in sorted(self.group_sizes.items())}
        return {
            "every": self.every,
            "averaged": self.averaged,
            "alone": self.alone,
            "group_sizes": sizes,
            "waited_s": round(self.waited_s, 3),
            "clipped": self.clipped,
        }


def matchmaking(timeout: float, round_seconds: float | None) -> tuple[float, float]:
    """How long a new group gathers members before its all-reduce starts, and how long a member
    looks for a group in all: a third of ``--consensus-timeout`` and the timeout, or, where a round
    is longer than that third, a round (the timeout at most) and the timeout's other two thirds
    after it. Members reach a step within a round of each other (``ConsensusStep.due``), so a
    window shorter than a round (H = 50, larger models) would split them into groups of one. A
    group that fills starts at once: only a group short of members waits its window out. Rounds
    longer than the timeout want a longer timeout.

    Args:
        timeout: ``--consensus-timeout``, seconds.
        round_seconds: how long this member's rounds take (None: not known yet).
    """
    window = min(max(timeout / 3, round_seconds or 0.0), timeout)
    return window, window + timeout * 2 / 3


def flat_phi(loop: OuterLoop) -> Tensor:
    """The member's whole φ as one flat fp32 tensor (a copy): what it offers its group."""
    return torch.cat([p.detach().flatten() for p in loop.phi])


@torch.no_grad()
def move_phi(loop: OuterLoop, mean: Tensor, radius: float = math.inf) -> bool:
    """φ ← ``mean``, or, where ``mean`` is further than ``radius`` (L2) from φ, that far along the
    way to it; θ moves by the same amount, so the inner steps carried past the last outer step stay
    on it. The φ kept to measure gossip drift at a common version belong to the trajectory before
    the move (the drift they measure is closed): they are forgotten. Whether the move was cut.

    Args:
        loop: the member's outer loop.
        mean: the group's mean φ, flat.
        radius: the longest move taken.
    """
    if mean.numel() != sum(p.numel() for p in loop.phi):
        raise ValueError(f"a group mean of {mean.numel()} values for {len(loop.phi)} tensors of φ")
    distance = math.sqrt(_distance_sq(loop, mean))
    if not math.isfinite(distance):
        return True  # a mean off the map (NaN or infinite values): no move, counted as cut
    scale = 1.0 if distance <= radius else radius / distance
    offset = 0
    for phi, theta in zip(loop.phi, loop.theta, strict=True):
        target = mean[offset : offset + phi.numel()].view_as(phi).to(phi.dtype)
        offset += phi.numel()
        shift = (target - phi) * scale
        phi.add_(shift)
        theta.add_(shift.to(theta.device, theta.dtype))
    loop.forget_published_phi()
    return scale < 1.0


def _distance_sq(loop: OuterLoop, mean: Tensor, chunk: int = 1 << 20) -> float:
    """‖mean − φ‖², in float64 a chunk at a time (no model-sized copy)."""
    total, offset = 0.0, 0
    for phi in loop.phi:
        flat = phi.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            other = mean[offset + start : offset + start + part.numel()]
            total += float((other.double() - part.double()).square().sum())
        offset += flat.numel()
    return total
