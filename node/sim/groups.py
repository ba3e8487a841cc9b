"""Finding a consensus group on the simulator's virtual clock (factored mixing's blocking step).

At its blocking step a member offers its φ and waits, idle. Groups form as hivemind's
matchmaking forms them for a daemon: by who is looking at the same time, not by a list drawn in
advance. An offer joins the newest group with room that is still gathering, or opens one whose
first window (``window`` seconds) runs from then. A group starts its all-reduce when it is full,
or when the window its second member came in ends; one member alone goes on looking, a further
``retry`` seconds at a time (hivemind declares itself again for its matchmaking time), until its
search ends ``timeout`` seconds after its offer. A member that offers after its peers' group has
started finds nobody: it waits alone until its own search ends, as a daemon does.

The all-reduce runs over the same virtual network that delays the deltas: from the start, the
copy of j's φ reaches m after a delay drawn from the network's ``Delay`` (in rounds, each
``round_seconds`` of virtual time: a blocking wait lets no round pass), or never when the network
drops it. It is over once every copy between the members has landed; then each member takes the
group's mean φ, at the same instant, as a collective ends. One not over within
``allreduce_timeout`` of its start fails (hivemind's ``allreduce_timeout``): its members go on
alone then.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cgad.node.member.consensus import GroupMean
from cgad.node.sim.memory import Delay

__all__ = ["GroupFinder"]


@dataclass
class _Group:
    opened: float  # when its first member offered
    search_end: float  # when its first member stops looking
    members: list[int] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)  # when each member offered
    phis: list[Tensor] = field(default_factory=list)  # what each member offered
    full_at: float = math.inf  # when its last seat was taken
    delays: dict[tuple[int, int], float] = field(default_factory=dict)  # (from, to): its copy's delay

    def window_end(self, window: float, retry: float, at: float) -> float:
        """The end of the window that holds ``at``: the first, then ``retry`` at a time, the
        last cut short where its first member's search ends."""
        first = self.opened + window
        if at <= first:
            return first
        return min(first + retry * math.ceil((at - first) / retry), self.search_end)

    def start(self, window: float, retry: float) -> float:
        """When its all-reduce starts: full, or the end of the window its second member came
        in (inf while it is one member alone)."""
        if len(self.members) < 2:
            return math.inf
        return min(self.full_at, self.window_end(window, retry, self.offered[1]))


class GroupFinder:
    """The consensus groups of one simulated swarm.

    Args:
        workers: how many workers the swarm has (indices 0..workers-1).
        group_size: members per group, at most.
        timeout: virtual seconds a member looks for a group after its offer.
        window: virtual seconds a new group gathers members before its all-reduce starts.
        retry: virtual seconds of each further window of a member alone.
        allreduce_timeout: virtual seconds a started all-reduce may take.
        delay: the network's delay, in rounds, for each copy of φ.
        drop: the chance a copy is lost.
        round_seconds: virtual seconds one round of delay takes.
        seed: the draws' seed.
    """

    def __init__(
        self,
        workers: int,
        group_size: int,
        *,
        timeout: float,
        window: float,
        retry: float,
        allreduce_timeout: float,
        delay: Delay,
        drop: float,
        round_seconds: float,
        seed: int,
    ) -> None:
        if not 0 < window < timeout or retry <= 0:
            raise ValueError(f"a matchmaking window of {window} s (then {retry}) in a search of {timeout} s")
        self.group_size = group_size
        self.timeout = timeout
        self.window = window
        self.retry = retry
        self.allreduce_timeout = allreduce_timeout
        self.delay = delay
        self.drop = drop
        self.round_seconds = round_seconds
        self.rng = random.Random(seed)  # the copies' delays and losses, apart from the deltas'
        self._waiting: dict[int, _Group] = {}  # worker: the group it awaits
        self._open: list[_Group] = []  # groups that may still take members, oldest first
        self.wait_seconds = [0.0] * workers

    def offer(self, worker: int, now: float, phi: Tensor) -> None:
        """``worker`` reached its blocking step at ``now`` and offers ``phi``; it waits from now on.
        Offers come in the order of their times (the driver's events)."""
        self._open = [g for g in self._open if self._takes(g, now)]
        if self._open:
            group = self._open[-1]
        else:
            group = _Group(opened=now, search_end=now + self.timeout)
            self._open.append(group)
        group.members.append(worker)
        group.offered.append(now)
        group.phis.append(phi)
        if len(group.members) == self.group_size:
            group.full_at = now
        self._waiting[worker] = group

    def waiting(self, worker: int) -> bool:
        return worker in self._waiting

    def wake_time(self, worker: int) -> float:
        """When ``worker``'s wait ends: its group's all-reduce is over or has failed, or, alone,
        its search ends."""
        group = self._waiting[worker]
        start = group.start(self.window, self.retry)
        if math.isinf(start):
            return group.offered[group.members.index(worker)] + self.timeout
        return min(self._over_at(group, start), start + self.allreduce_timeout)

    def resolve(self, worker: int, now: float) -> GroupMean | None:
        """``worker``'s wait is over at ``now``: the group's mean φ if its all-reduce is over,
        else None (it failed, or nobody joined it).

        Args:
            worker: a waiting worker.
            now: the virtual time.
        """
        group = self._waiting.pop(worker)
        self.wait_seconds[worker] += now - group.offered[group.members.index(worker)]
        start = group.start(self.window, self.retry)
        if math.isinf(start):
            return None
        over = self._over_at(group, start)
        if over > now or over > start + self.allreduce_timeout:
            return None
        return GroupMean(torch.stack(group.phis).mean(dim=0), len(group.members))

    def _takes(self, group: _Group, now: float) -> bool:
        """Whether ``group`` takes a member offering at ``now``: it has room, and it is still
        gathering (its all-reduce not started), or it is one member alone still looking."""
        if len(group.members) >= self.group_size:
            return False
        if len(group.members) == 1:
            return now < group.search_end
        return now < group.start(self.window, self.retry)

    def _over_at(self, group: _Group, start: float) -> float:
        """When its all-reduce is over: every copy between its members has landed (inf when a
        copy is lost; each copy's delay is drawn once)."""
        over = start
        for sender in group.members:
            for receiver in group.members:
                if sender != receiver:
                    if (sender, receiver) not in group.delays:
                        lost = self.rng.random() < self.drop
                        delay = self.delay.draw(self.rng) * self.round_seconds
                        group.delays[(sender, receiver)] = math.inf if lost else delay
                    over = max(over, start + group.delays[(sender, receiver)])
        return over
