"""The member engine: one peer's round, whoever's clock it runs on.

A member trains inner steps and tells the engine after each one (``after_inner_step``). The
engine owns everything the round decides:

- **block turns**: fragment f = blocks mod F publishes its pseudo-gradient when its block of
  H/F inner steps is over (``OuterLoop.publish``);
- **the apply delay**: the outer step waits up to ``apply_delay`` inner steps (auto: half a
  block, ended early once every live peer's fragment of the same version is in), training on
  meanwhile, and carries those steps over the step; the wait keeps block ends in phase with the
  peers' (``pacing.phase_nudge``);
- **the block after adopting a state**: kept from the peers and the own step (it warms up the
  inner optimizer), and ended when the peers end theirs (``pacing.adopted_block_over``);
- **replay and hold-ahead**: each outer step passes the swarm's version (``swarm.swarm_versions``,
  raised to the adopted source's own report for the first step after an adoption), up to which
  the loop replays peers' deltas of versions it missed;
- **the re-sync rule**: at the end of a round, a member more than the cutoff behind the swarm
  (``swarm.behind``) adopts a peer's state again;
- **the round count** and ``max_rounds``;
- **the blocking consensus step** every K rounds (``consensus.py``): the member awaits its group
  (``awaiting_group``, ``MemberHooks.group_due``) and takes the group's mean φ (``join_group``).

What differs between a daemon and the simulator comes in from outside: the ``SwarmView`` (the
network's progress records and inbox, or the virtual network's), and ``MemberHooks`` (how a
state is fetched and adopted, what happens at the end of a round: evaluation, checkpoints,
snapshots, metrics, the console). The engine reads no clock.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from cgad.node.member.consensus import ConsensusStep, GroupMean, flat_phi
from cgad.node.member.ledger import Delivery
from cgad.node.member.outer import OuterLoop
from cgad.node.member.pacing import Turn, adopted_block_over, phase_nudge
from cgad.node.member.swarm import SwarmView, behind, rounds_behind, swarm_versions
from cgad.protocol.fan_in import takeable

__all__ = ["Member", "MemberHooks", "Schedule"]


class MemberHooks:
    """What a driver does at the engine's moments; each does nothing unless overridden."""

    def adopt_state(self, required: bool) -> tuple[str, int] | None:
        """Fetch a peer's outer state ahead of this member and load it into the loop; its source
        and the round it was at, or None when none was adopted (``required``: a fresh member that
        has nothing to train from yet)."""
        return None

    def diverged(self, fragment: int) -> None:
        """The block of ``fragment`` diverged locally and was discarded (θ back to φ)."""

    def applied(self, fragment: int) -> None:
        """The outer step on ``fragment`` was just taken, before the round's bookkeeping (a daemon
        reports its new versions here, so that peers do not wait on its evaluation)."""

    def round_ended(self, round_: int) -> None:
        """The member finished round ``round_`` (its last fragment's outer step was taken)."""

    def stepped(self, fragment: int, deliveries: list[Delivery], round_ended: bool) -> None:
        """An outer step was taken on ``fragment`` (and the round's bookkeeping done)."""

    def group_due(self, round_: int) -> None:
        """Round ``round_`` ends in the blocking consensus step (``Member.awaiting_group``): a
        driver that may block (a daemon) runs its group's exchange here and hands the result to
        ``Member.join_group``; one on a virtual clock (the simulator) does so when its group is
        found, the member idle meanwhile."""


@dataclass(frozen=True)
class Schedule:
    """The round's shape, from the configuration.

    Args:
        fragments: F, fragments synced in turn.
        inner_steps: H, inner steps per round (a block is H / F).
        apply_delay: inner steps the outer step may wait after publishing; "auto": half a block,
            ended early once every live peer's fragment of the version is in.
        fan_in: peers' fragments per fragment and round a member takes at most (what ends the
            wait early); None: every live peer's.
        cutoff: the age at which a delivery stops counting; the re-sync threshold.
        tokens_per_step: tokens one inner step trains on (a delivery's weight).
        max_rounds: rounds to run before ``done`` (0: for ever).
        align_after_adopting: whether the block after adopting a state ends with the peers' (an
            all-reduce group waits for its members itself).
        align_phase: whether blocks are nudged into phase with the peers' (``phase_nudge``); the
            simulator's delays in whole rounds are lateness, not phase, and nudging against them
            would only lengthen every block.
        consensus_every: K, rounds between blocking consensus steps (``consensus.py``); 0: never.
    """

    fragments: int
    inner_steps: int
    apply_delay: int | Literal["auto"] = "auto"
    fan_in: int | None = None
    cutoff: int = 8
    tokens_per_step: int = 1
    max_rounds: int = 0
    align_after_adopting: bool = True
    align_phase: bool = True
    consensus_every: int = 0

    @property
    def block(self) -> int:
        return self.inner_steps // self.fragments

    @property
    def delay(self) -> int:
        """The apply delay in inner steps (auto: half a block)."""
        return self.block // 2 if self.apply_delay == "auto" else int(self.apply_delay)

    @classmethod
    def of(cls, config: Any, **overrides: Any) -> Schedule:
        """The schedule a daemon's or the simulator's configuration sets."""
        fields = {
            "fragments": config.fragments,
            "inner_steps": config.inner_steps,
            "apply_delay": config.apply_delay,
            "fan_in": getattr(config, "fan_in", None),
            "cutoff": config.cutoff,
            "tokens_per_step": config.batch_size * config.seq_len,
            "max_rounds": getattr(config, "max_rounds", 0) or getattr(config, "rounds", 0),
            "consensus_every": getattr(config, "consensus_every", 0),
        }
        return cls(**{**fields, **overrides})


class Member:
    """One member's round over ``loop`` (``OuterLoop``), against ``swarm``, with ``hooks``.

    ``lock``, when given, is held around every change of the outer state (a daemon serves its
    state to joiners from another thread)."""

    def __init__(
        self,
        loop: OuterLoop,
        swarm: SwarmView,
        schedule: Schedule,
        hooks: MemberHooks | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self.loop = loop
        self.swarm = swarm
        self.schedule = schedule
        self.hooks = hooks or MemberHooks()
        self.lock = lock or contextlib.nullcontext()
        self.round = 0
        self.start_round = 0  # max_rounds counts this run's rounds, not adopted or resumed ones
        self.blocks = 0  # fragment turns taken: the next turn is fragment blocks % F
        self.block_start = 0  # the inner step at which the block under way began
        self.resyncs = 0
        self.phase_nudges: Counter[str] = Counter()  # blocks made longer / shorter
        self.due: Turn | None = None  # the published fragment awaiting its outer step
        self._block_extra = 0  # inner steps added to (or, < 0, taken from) this block: phase
        self._unshared = 0  # blocks still to be kept from peers after adopting a state
        self._adopted_block = False  # the block under way began with an adopted state
        self._adopted_from: str | None = None  # whose state, until the first outer step after
        self.consensus = ConsensusStep(schedule.consensus_every)  # factored mixing's blocking step

    # -- driving it ------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether ``max_rounds`` rounds of this run are over."""
        return bool(self.schedule.max_rounds) and self.round - self.start_round >= self.schedule.max_rounds

    @property
    def fragment(self) -> int:
        """The fragment whose block is under way."""
        return self.blocks % self.schedule.fragments

    def after_inner_step(self, steps: int) -> None:
        """The member has taken inner step number ``steps``: take the waiting outer step when it
        is due, and end the block when it is over (publishing its fragment)."""
        self.step_if_due(steps)
        if self.done:
            return  # right after an outer step: the steps carried past it stay on θ, unpublished
        if self.end_block_if_over(steps):
            self.step_if_due(steps)

    def end_block_if_over(self, steps: int) -> bool:
        """Publish the fragment whose block is over at inner step ``steps``; whether it was."""
        if self.done or not self._block_over(steps):
            return False
        self.end_block(steps)
        return True

    def step_if_due(self, steps: int) -> list[Delivery] | None:
        """Take the waiting outer step if it is due at inner step ``steps``: its latest step has
        come, or every live peer's fragment of the same version is in (at most fan-in of them)
        and the own Δ is on its way (its encoding done: the step waits for it otherwise, and
        the trainer with it), so that waiting longer would gain nothing. The deliveries it
        took, or None."""
        turn = self.due
        if turn is None:
            return None
        if steps < turn.latest and (
            turn.awaited is None
            or self.swarm.arrived(turn.fragment, turn.version) < turn.awaited
            or self.loop.sending(turn.fragment)
        ):
            return None
        return self._take_step(steps)

    def end_block(self, steps: int, leaving: bool = False) -> None:
        """The turn of the fragment whose block just ended (whole, or cut short by leaving):
        publish its pseudo-gradient now, and schedule its outer step for when the peers'
        fragments of the same version are in, at most the apply delay later (they count at age
        0 then, not 1); the steps in between are carried over the outer step."""
        s = self.schedule
        if self.due is not None:
            self._take_step(steps)  # the previous turn's step, if it is still waiting
        fragment = self.fragment
        version = self.loop.versions[fragment]
        tokens = (steps - self.block_start) * s.tokens_per_step
        with self.lock:
            bad_before = self.loop.counters.rejected["local_non_finite"]
            self.loop.publish(fragment, tokens=tokens, share=self._unshared == 0)
            self._unshared = max(0, self._unshared - 1)
            diverged = self.loop.counters.rejected["local_non_finite"] > bad_before
        if diverged:
            self.hooks.diverged(fragment)
        self.blocks += 1
        self.block_start = steps
        self._adopted_block = False
        self._block_extra = 0
        # a member that shares nothing (training alone) has nobody's fragment to wait for
        shares = self.loop.method.shares
        delay = 0 if leaving or (s.apply_delay == "auto" and not shares) else s.delay
        # how many fragments end the wait early, counted once here, not at every inner step
        waits = s.apply_delay == "auto" and delay > 0
        live = len(self.swarm.live_peers())
        awaited = takeable(live, s.fan_in) if waits else None
        early = self.swarm.arrived(fragment, version)
        # taken by the next ``step_if_due``, at once with no delay: a driver that runs several
        # members at one instant publishes all their fragments before any of them steps
        self.due = Turn(fragment, version, steps + delay, awaited, early)

    def finish(self, steps: int, leaving: bool) -> None:
        """Stopping. The waiting outer step is taken; when told to leave, the fragment whose
        block is under way syncs now with the steps it has (one version step, as in a full block,
        so versions keep counting rounds). After ``max_rounds`` the last round is whole."""
        if self.due is not None:
            self._take_step(steps)
        if leaving and steps > self.block_start:
            self.end_block(steps, leaving=True)
            self._take_step(steps)

    # -- the blocking consensus step -------------------------------------------------------

    @property
    def awaiting_group(self) -> int | None:
        """The round whose consensus step awaits its group (the member trains no further until
        ``join_group``), or None."""
        return self.consensus.pending

    def group_phi(self) -> Tensor:
        """What this member offers its group: its whole φ, flat (a copy)."""
        with self.lock:
            return flat_phi(self.loop)

    def join_group(self, group: GroupMean | None, waited_s: float = 0.0) -> bool:
        """The group's exchange is over: φ becomes the group's mean, or stays with no group
        (None). Whether φ moved.

        Args:
            group: the group's mean φ, or None.
            waited_s: seconds this member was blocked awaiting it.
        """
        with self.lock:
            return self.consensus.close(self.loop, group, waited_s)

    # -- adopting a state -------------------------------------------------------------------

    def adopt(self, required: bool) -> str | None:
        """Adopt a peer's state ahead of this member (``MemberHooks.adopt_state``); its source, or
        None. The next block warms up the inner optimizer only (its round reaches no peer and no
        outer step: the inner moments do not travel with a state, and the first steps after an
        adoption are large and noisy), and ends with the peers' blocks; the first outer step then
        catches up with the versions the source went on to meanwhile."""
        adopted = self.hooks.adopt_state(required)
        if adopted is None:
            return None
        source, round_ = adopted
        self.round = max(self.round, round_)
        self.consensus.restart()  # a jump in rounds is no crossing: only those from here on count
        self._adopted_from = source
        self._unshared = self.schedule.fragments
        self._adopted_block = self.schedule.align_after_adopting
        return source

    def sync_if_behind(self) -> bool:
        """The re-sync rule: a member sharing its work whose slowest fragment trails the swarm by
        more than the cutoff adopts a peer's state again. Whether it did."""
        if not self.loop.method.shares or self.behind() <= self.schedule.cutoff:
            return False
        if self.adopt(required=False) is None:
            return False
        self.resyncs += 1
        return True

    def swarm_versions(self) -> list[int] | None:
        """The swarm's version of each fragment as this member's next outer step takes it."""
        return swarm_versions(self.swarm.reports(), len(self.loop.versions), self._adopted_from)

    def behind(self) -> int:
        """How far this member's slowest fragment trails the swarm's."""
        return behind(self.swarm.reports(), self.loop.versions)

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"round": self.round, "blocks": self.blocks, "block_start": self.block_start}

    def load_state_dict(self, state: dict[str, Any], steps: int) -> None:
        """The round and schedule from a checkpoint taken at inner step ``steps`` (checkpoints
        from before the schedule was kept: whole blocks up to that step)."""
        block = self.schedule.block
        self.round = int(state["round"])
        self.blocks = int(state.get("blocks", steps // block))
        self.block_start = int(state.get("block_start", self.blocks * block))

    # -- inside ------------------------------------------------------------------------------

    def _block_over(self, steps: int) -> bool:
        block = self.schedule.block
        taken = steps - self.block_start
        if not self._adopted_block:
            return taken >= block + self._block_extra
        # the peers' fragments of the round they are in now (a joiner a round behind has theirs
        # of the round it missed already: those end nothing, they are replayed)
        fragment = self.fragment
        swarm = self.swarm_versions()
        version = max(self.loop.versions[fragment], swarm[fragment] if swarm else 0)
        peers_in = self.swarm.arrived(fragment, version)
        return adopted_block_over(taken, block, peers_in, bool(self.swarm.live_peers()))

    def _take_step(self, steps: int) -> list[Delivery]:
        """The outer step of the fragment published last, then the round's bookkeeping."""
        turn = self.due
        assert turn is not None
        self.due = None
        fragment = turn.fragment
        swarm = self.swarm_versions()  # read once: the phase nudge and the step both take it
        if turn.awaited and self.schedule.align_phase:
            self._align_phase(turn, self.swarm.arrived(fragment, turn.version), swarm)
        self._adopted_from = None  # caught up with the source once; the median rules after
        with self.lock:  # carrying only when inner steps ran since the publish
            # the consensus step's room is how far the outer steps move φ (a fragment's copy)
            own = self.loop.fragments[fragment] if self.consensus.every else []
            before = [self.loop.phi[i].detach().clone() for i in own]
            deliveries = self.loop.apply(
                fragment, carry=steps > self.block_start, swarm_version=swarm[fragment] if swarm else None
            )
            if own:
                pairs = zip(own, before, strict=True)
                moved = sum(float((self.loop.phi[i].detach() - b).double().square().sum()) for i, b in pairs)
                self.consensus.record_move(moved**0.5)
        self.hooks.applied(fragment)
        round_ended = fragment == self.schedule.fragments - 1
        if round_ended:
            self.round += 1
            self.hooks.round_ended(self.round)
            if not self.done:
                self.sync_if_behind()
                lag = rounds_behind(self.swarm.reports(), self.loop.versions) if self.consensus.every else 0
                mark = self.consensus.due(self.round, lag)
                if mark is not None:
                    self.consensus.open(self.round, mark)
                    self.hooks.group_due(self.round)
        self.hooks.stepped(fragment, deliveries, round_ended)
        return deliveries

    def _align_phase(self, turn: Turn, arrived: int, swarm: list[int] | None) -> None:
        """Lengthen or shorten the block under way (``phase_nudge``, with this member's lead over
        ``swarm``, the swarm's versions), counted."""
        assert turn.awaited is not None
        lead = turn.version - swarm[turn.fragment] if swarm else 0
        self._block_extra = phase_nudge(self.schedule.block, turn.early, arrived, turn.awaited, lead)
        if self._block_extra:
            self.phase_nudges["longer" if self._block_extra > 0 else "shorter"] += 1
