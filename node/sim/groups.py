"""Finding a consensus group on the simulator's virtual clock (factored mixing's blocking step).

At the end of every K-th round a member offers its φ to its group and waits, idle. The groups of
a round are a random partition of the workers into groups of ``group_size`` (drawn from the run's
seed and the round, the same for every member, as a shared matchmaking key would be). The group's
all-reduce runs over the same virtual network that delays the deltas: the copy of j's φ reaches m
after j offered it plus a delay drawn from the network's ``Delay`` (in rounds, each round
``round_seconds`` of virtual time: a blocking wait lets no round pass), or never when the network
drops it. The all-reduce is over once every present member (one away or finished is not waited
for) has offered and every copy between them has landed; then each member takes the group's mean
φ, at the same instant, as a collective ends. A member whose deadline, ``timeout`` after its own
offer, comes first goes on alone then: it never waits for ever.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection

import torch
from torch import Tensor

from cgad.node.member.consensus import GroupMean
from cgad.protocol.memory import Delay

__all__ = ["GroupFinder"]


class GroupFinder:
    """The consensus groups of one simulated swarm.

    Args:
        workers: how many workers the swarm has (indices 0..workers-1).
        group_size: members per group.
        timeout: virtual seconds a member waits after its offer before it goes on.
        delay: the network's delay, in rounds, for each copy of φ.
        drop: the chance a copy is lost.
        round_seconds: virtual seconds one round of delay takes.
        seed: the partition's and the draws' seed.
    """

    def __init__(
        self,
        workers: int,
        group_size: int,
        timeout: float,
        delay: Delay,
        drop: float,
        round_seconds: float,
        seed: int,
    ) -> None:
        self.workers = workers
        self.group_size = group_size
        self.timeout = timeout
        self.delay = delay
        self.drop = drop
        self.round_seconds = round_seconds
        self.seed = seed
        self.rng = random.Random(seed)  # the copies' delays and losses, apart from the deltas'
        self._groups: dict[int, list[list[int]]] = {}  # per round, its partition
        self._offers: dict[tuple[int, int], tuple[float, Tensor]] = {}  # (round, worker): (time, φ)
        self._landing: dict[tuple[int, int, int], float] = {}  # (round, from, to): when it lands
        self._waiting: dict[int, tuple[int, float]] = {}  # worker: (round, deadline)
        self.wait_seconds = [0.0] * workers

    def group_of(self, worker: int, round_: int) -> list[int]:
        """The members of ``worker``'s group at ``round_``, itself included."""
        if round_ not in self._groups:
            order = list(range(self.workers))
            random.Random(self.seed * 1_000_003 + round_).shuffle(order)
            size = self.group_size
            self._groups[round_] = [sorted(order[i : i + size]) for i in range(0, len(order), size)]
        return next(g for g in self._groups[round_] if worker in g)

    def offer(self, worker: int, round_: int, now: float, phi: Tensor) -> None:
        """``worker`` ended ``round_`` at ``now`` and offers ``phi``; it waits from now on."""
        self._offers[(round_, worker)] = (now, phi)
        self._waiting[worker] = (round_, now + self.timeout)

    def waiting(self, worker: int) -> bool:
        return worker in self._waiting

    def wake_time(self, worker: int, present: Collection[int]) -> float:
        """When ``worker``'s wait ends: its group's last φ lands, or its deadline, the earlier.

        Args:
            worker: a waiting worker.
            present: the workers taking part now (not away, not finished).
        """
        round_, deadline = self._waiting[worker]
        return min(self._complete_at(worker, round_, present), deadline)

    def resolve(self, worker: int, now: float, present: Collection[int]) -> GroupMean | None:
        """``worker``'s wait is over at ``now``: the group's mean φ if its all-reduce is over,
        else None (its deadline came first, or nobody else is there).

        Args:
            worker: a waiting worker.
            now: the virtual time.
            present: the workers taking part now.
        """
        round_, _ = self._waiting[worker]
        done = self._complete_at(worker, round_, present) <= now
        del self._waiting[worker]
        offered_at, _ = self._offers[(round_, worker)]
        self.wait_seconds[worker] += now - offered_at
        members = [j for j in self.group_of(worker, round_) if (round_, j) in self._offers]
        if not done or len(members) < 2:
            return None
        return GroupMean(
            torch.stack([self._offers[(round_, j)][1] for j in members]).mean(dim=0), len(members)
        )

    def _complete_at(self, worker: int, round_: int, present: Collection[int]) -> float:
        """When the all-reduce of ``worker``'s group is over: every present member has offered
        and every copy between those that offered has landed (inf while one present member has
        not offered yet; a copy's delay is drawn once)."""
        members = []
        for j in self.group_of(worker, round_):
            if (round_, j) in self._offers:
                members.append(j)
            elif j in present:
                return math.inf  # not there yet: it may still come before the deadline
        complete = self._offers[(round_, worker)][0]
        for sender in members:
            for receiver in members:
                if sender != receiver:
                    complete = max(complete, self._lands(round_, sender, receiver))
        return complete

    def _lands(self, round_: int, sender: int, receiver: int) -> float:
        key = (round_, sender, receiver)
        if key not in self._landing:
            sent = self._offers[(round_, sender)][0]
            lost = self.rng.random() < self.drop
            self._landing[key] = math.inf if lost else sent + self.delay.draw(self.rng) * self.round_seconds
        return self._landing[key]

    def forget_before(self, round_: int) -> None:
        """Drop the offers and draws of rounds before ``round_`` (nobody waits on them any more)."""
        self._offers = {k: v for k, v in self._offers.items() if k[0] >= round_}
        self._landing = {k: v for k, v in self._landing.items() if k[0] >= round_}
        self._groups = {r: g for r, g in self._groups.items() if r >= round_}
