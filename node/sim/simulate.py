"""The virtual swarm: W members in one process, each the daemon's member engine on a virtual clock.

Each worker is what a daemon is: a model replica, an inner AdamW trainer on its own data shard, an
``OuterLoop`` driven by the same ``Member`` engine (node/member/engine.py) that drives a daemon,
and a transport, here a ``MemoryTransport`` with injected delay, loss, bandwidth, stragglers and
churn; the last ``attackers`` workers forge what they publish (``node/sim/attacks.py``), and the
swarm is judged by the others. What differs from a daemon is only the clock and the network: an
inner step costs ``step_time × speed factor`` virtual seconds, the swarm's progress reports are
the other workers' versions as they are, and a state is adopted from a live peer's memory.

Time advances in inner steps. At each virtual instant every worker due then takes its step and,
at the end of a block, publishes; what was sent at that instant lands only then, and then each
takes its outer step if it is due (``Member.step_if_due``: the apply delay, ended early once every
live peer's fragment is in). So with equal speeds and no delay the swarm is exactly synchronous
DiLoCo, and a delay of τ rounds shows up as an age of exactly τ.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cgad.node.member.consensus import matchmaking
from cgad.node.member.engine import Member, MemberHooks, Schedule
from cgad.node.member.ledger import Delivery, strided_fragments, summed_totals
from cgad.node.member.outer import OuterLoop, inner_lr_scale
from cgad.node.member.outer_state import Phi0
from cgad.node.member.scoring import data_score
from cgad.node.member.swarm import snapshot_ceiling, snapshot_order
from cgad.node.sim.attacks import Attack, ForgingTransport, edge_targets
from cgad.node.sim.config import SimConfig
from cgad.node.sim.groups import GroupFinder
from cgad.node.sim.memory import Delay, MemoryTransport, VirtualNetwork
from cgad.node.training.data import BatchIterator, TokenDataset
from cgad.node.training.model import build_model, parameter_count
from cgad.node.training.trainer import InnerTrainer, evaluate
from cgad.protocol.fan_in import fan_in_for

__all__ = ["simulate", "worker_batches"]


@dataclass
class _Worker:
    index: int
    trainer: InnerTrainer
    transport: MemoryTransport
    loop: OuterLoop
    speed: float
    member: Member = field(init=False)
    clock: float = 0.0
    compute_seconds: float = 0.0
    down_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)  # held-out loss after each round
    away_since: float | None = None  # virtual time it left, while away (churn)
    hostile: bool = False  # forges what it publishes (--attackers); never judged, never adopted
    event: int = 0  # its latest event in the heap: an earlier one still there is stale
    wake_at: float | None = None  # while it awaits its consensus group: when the wait ends

    @property
    def present(self) -> bool:
        return self.transport.alive and self.away_since is None


class _PeersInMemory(MemberHooks):
    """One worker's view of the others (``SwarmView``) and its engine's hooks: what a daemon
    reads from progress records and inboxes, and how it adopts a snapshot, here in memory."""

    def __init__(
        self, wk: _Worker, workers: list[_Worker], c: SimConfig, eval_batches: list, initial: Phi0
    ) -> None:
        self.wk, self.workers, self.c, self.eval_batches = wk, workers, c, eval_batches
        self.initial = initial  # φ₀: what a snapshot's int8 blocks are the difference to

    def _others(self) -> list[_Worker]:
        return [o for o in self.workers if o is not self.wk and o.present]

    def live_peers(self) -> list[str]:
        return [o.transport.peer_id for o in self._others()]

    def arrived(self, index: int, base_version: int) -> int:
        return self.wk.transport.arrived(index, base_version)

    def reports(self) -> dict[str, list[int]]:
        # an attacker's report counts too, as a daemon's progress record would
        return {o.transport.peer_id: list(o.loop.versions) for o in self._others()}

    def adopt_state(self, required: bool) -> tuple[str, int] | None:
        """A snapshot ahead of this worker and within the ceiling, chosen as a daemon chooses one
        (``swarm.snapshot_order``: nearest the swarm's low median, each worker's state held by
        itself alone), from a trusted live worker (an attacker's is never adopted), sent as a
        daemon sends it (φ − φ₀ in int8 blocks, no outer momentum). The rounds it skips count
        at the loss of the state it adopted."""
        wk = self.wk
        mine = min(wk.loop.versions)
        ceiling = snapshot_ceiling(self.reports(), wk.loop.versions, self.c.cutoff)
        offers = [
            o for o in self._others()
            if not o.hostile and mine < min(o.loop.versions) <= ceiling
        ]  # fmt: skip
        if not offers:
            return None
        median = ceiling - self.c.cutoff
        source = min(offers, key=lambda o: (snapshot_order(min(o.loop.versions), 1, 0, median, 1), o.index))
        snapshot = source.loop.state_dict("int8", reference=self.initial)
        source.transport.stats.asked += 1  # a request of the source, as a daemon's download is
        wk.loop.load_state_dict(snapshot, reference=lambda seed: self.initial)
        skipped = min(source.member.round, self.c.rounds) - wk.member.round
        if skipped > 0:
            wk.losses.extend([evaluate(wk.trainer.model, self.eval_batches)] * skipped)
        return source.transport.peer_id, source.member.round

    def round_ended(self, round_: int) -> None:
        self.wk.losses.append(evaluate(self.wk.trainer.model, self.eval_batches))

    def diverged(self, fragment: int) -> None:
        self.wk.trainer.optimizer.state.clear()  # θ went back to φ: the inner moments restart, as a daemon's


def _workers(
    c: SimConfig,
    dataset: TokenDataset,
    network: VirtualNetwork,
    base_model: torch.nn.Module,
    attack: Attack | None,
) -> list[_Worker]:
    """The swarm's workers, each a daemon's parts on the virtual network: a copy of the same
    initial model, its own batches, its outer loop (the last ``attackers`` forging what they
    publish) and its inner trainer at the lr the loop's count sets."""
    speeds = c.stragglers or [1.0] * c.workers
    transports = [network.join(f"worker-{w}") for w in range(c.workers)]
    workers: list[_Worker] = []
    for w in range(c.workers):
        model = copy.deepcopy(base_model)  # DiLoCo: every worker starts from the same weights
        batches = worker_batches(dataset, c, w)
        hostile = attack is not None and w >= c.workers - c.attackers  # the last K workers
        targets = None  # edge:NAME: where that parameter lies in each fragment
        if hostile and attack.target is not None:
            named = [(n, p.numel()) for n, p in model.named_parameters()]
            targets = edge_targets(named, strided_fragments(len(named), c.fragments), attack.target)
        transport = (
            ForgingTransport(
                transports[w], attack, seed=c.seed * 17 + w, direction_seed=c.seed, targets=targets
            )
            if hostile
            else transports[w]
        )
        params = list(model.parameters())
        loop = OuterLoop(
            params,
            c,
            transport,
            "sim",
            seed=c.seed * 31 + w,
            codec=c.codec,
            sparse_keep=c.sparse_keep,
            error_feedback=c.error_feedback,
            link_budget=transports[w].round_budget,
            score=data_score(c, model, dataset, seed=c.seed * 31 + w),
        )
        trainer = InnerTrainer(
            model, batches, lr=c.inner_lr, warmup_steps=c.warmup_steps, lr_scale=inner_lr_scale(c, loop)
        )
        loop.moments.attach(trainer.optimizer)
        workers.append(_Worker(w, trainer, transports[w], loop, speeds[w], hostile=hostile))
    return workers


def simulate(
    config: SimConfig,
    dataset: TokenDataset,
    vocab_size: int,
    progress: Callable[[int], None] | None = None,
    on_round: Callable[[int, float], None] | None = None,
) -> dict:
    """Run one simulated swarm to the end; returns its record (see the module doc for the keys).
    ``progress`` hears of inner steps as they are done; ``on_round`` of each round the whole
    swarm has finished, with the held-out loss of its workers' mean parameters."""
    base_model = build_model(config.model, vocab_size, seed=config.seed)
    # the fan-in a daemon of this model runs with (``--fan-in auto``: what its memory holds)
    c = config.model_copy(update={"fan_in": fan_in_for(config.fan_in, parameter_count(base_model))})
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    network = VirtualNetwork(
        delay=Delay.parse(c.delay),
        drop=c.drop,
        bandwidth=c.bandwidth,  # the members' senders encode: the wire carries their bytes
        fan_in=c.fan_in,
        seed=c.seed * 7919 + 1,
    )
    eval_batches = dataset.eval_batches(c.eval_batches, c.batch_size, c.seq_len)
    initial_loss = evaluate(base_model, eval_batches)
    attack = Attack.parse(c.attack) if c.attackers else None
    workers = _workers(c, dataset, network, base_model, attack)
    # a delay in whole rounds is lateness, not a phase offset: nudging blocks against it would only
    # lengthen every block (the daemons' phases are what the cross-check measures, at delay 0)
    schedule = Schedule.of(c, align_phase=Delay.parse(c.delay).rounds == 0)
    initial = Phi0(c.seed, base_model.parameters())  # φ₀ of every worker's snapshots
    for wk in workers:
        peers = _PeersInMemory(wk, workers, c, eval_batches, initial)
        wk.member = Member(wk.loop, peers, schedule, hooks=peers)
    honest = [wk for wk in workers if not wk.hostile]

    def step_seconds(wk: _Worker) -> float:
        return c.step_time * wk.speed

    events: list[tuple[float, int, int]] = []

    def schedule(wk: _Worker, at: float) -> None:
        wk.event += 1  # one live event per worker: what was scheduled before is stale now
        heapq.heappush(events, (at, wk.index, wk.event))

    for wk in workers:
        schedule(wk, step_seconds(wk))
    # factored mixing's blocking step: groups found on the virtual clock, over the same delays
    # (the daemon's windows and timeouts, its round the nominal one: H inner steps of ``step_time``)
    window, search = matchmaking(c.consensus_timeout, c.inner_steps * c.step_time)
    groups = (
        GroupFinder(
            c.workers, c.consensus_group, timeout=search, window=window, retry=c.consensus_timeout / 3,
            allreduce_timeout=c.consensus_timeout, delay=Delay.parse(c.delay), drop=c.drop,
            round_seconds=c.inner_steps * c.step_time, seed=c.seed * 104_729 + 3,
        )
        if c.consensus_every
        else None
    )  # fmt: skip
    offer_order = random.Random(c.seed * 7_919 + 5)  # who meets whom among those looking at once

    def rewake(now: float) -> None:
        """(Re)schedule each waiting worker's end of wait: offers and departures move it."""
        if groups is None:
            return
        for o in workers:
            if groups.waiting(o.index):
                wake = max(now, groups.wake_time(o.index))
                if wake != o.wake_at:
                    o.wake_at = wake
                    schedule(o, wake)

    delivered: list[Delivery] = []
    momenta: list[float] = []  # the momentum each honest outer step went on with (cga's follows freshness)
    swarm = _DriftMeter(copy.deepcopy(base_model), eval_batches)
    started = time.perf_counter()
    while events:
        now = events[0][0]
        due: list[_Worker] = []
        offering: list[_Worker] = []
        while events and events[0][0] == now:
            _, index, event = heapq.heappop(events)
            wk = workers[index]
            if event != wk.event:
                continue  # rescheduled since
            if groups is not None and groups.waiting(wk.index):
                before = groups.wait_seconds[wk.index]  # idle until now: not computing
                group = groups.resolve(wk.index, now)
                wk.member.join_group(group, groups.wait_seconds[wk.index] - before)
                wk.clock, wk.wake_at = now, None
                schedule(wk, now + step_seconds(wk))
                continue
            if groups is not None and wk.member.awaiting_group is not None:  # its blocking step: it looks
                offering.append(wk)
                continue
            if wk.away_since is None:
                due.append(wk)
                continue
            _rejoin(wk, now)  # back from churn; its next step follows
            schedule(wk, wk.clock + step_seconds(wk))
        if groups is not None and offering:  # hivemind pairs those looking at once by chance
            offer_order.shuffle(offering)
            for wk in offering:
                groups.offer(wk.index, now, wk.member.group_phi())
        network.hold()  # what is published at this instant lands once all due have published
        blocked_before: dict[int, float] = {}
        for wk in due:  # the inner step that ends now, and the block's publish if it is over
            wk.clock = now
            wk.transport.advance(now, wk.member.round)
            wk.trainer.step()
            wk.compute_seconds += step_seconds(wk)
            blocked_before[wk.index] = wk.transport.blocked_seconds
            wk.member.end_block_if_over(wk.trainer.steps)
        network.flush()  # the receivers draw their fan-in: only then is each uplink's time known
        for wk in due:
            wk.clock += wk.transport.blocked_seconds - blocked_before[wk.index]
        if progress and due:
            progress(len(due))
        for wk in due:
            wk.transport.advance(wk.clock, wk.member.round)
            round_before = wk.member.round
            deliveries = wk.member.step_if_due(wk.trainer.steps)
            if deliveries is not None and not wk.hostile:
                delivered.extend(deliveries)
                momentum = wk.loop.method.momentum_now(wk.loop.optimizer)
                if momentum is not None:
                    momenta.append(momentum)
            if wk.member.done:
                wk.transport.set_alive(False)  # it leaves: peers stop waiting for it
                continue
            if groups is not None and wk.member.awaiting_group is not None:
                schedule(wk, wk.clock)  # it offers at its own clock (past ``now`` after a blocked upload)
                continue  # then idle until its group is found or its search ends (``rewake``)
            if wk.member.round > round_before and c.churn and rng.random() < c.churn:
                # away for 1-4 rounds: neither sending nor receiving; back via a rejoin event
                wk.transport.set_alive(False)
                wk.away_since = wk.clock
                back = wk.clock + rng.randint(1, 4) * c.inner_steps * c.step_time
                schedule(wk, back)
                continue
            schedule(wk, wk.clock + step_seconds(wk))
        rewake(now)
        # the slowest honest worker has finished another round, and no honest worker awaits that
        # round's consensus group any more: the round's synchronisation, both steps, is over
        while len(swarm.consensus) < min(len(wk.losses) for wk in honest) and not any(
            wk.member.awaiting_group == len(swarm.consensus) + 1 for wk in honest
        ):
            swarm.snapshot(honest, now)
            if on_round:
                on_round(len(swarm.consensus), swarm.mean_phi_losses[-1])

    return _record(c, workers, attack, initial_loss, swarm, groups, delivered, momenta, started)


def _record(
    c: SimConfig,
    workers: list[_Worker],
    attack: Attack | None,
    initial_loss: float,
    swarm: _DriftMeter,
    groups: GroupFinder | None,
    delivered: list[Delivery],
    momenta: list[float],
    started: float,
) -> dict:
    """The run's record (the module doc lists its keys): the honest workers' losses, the swarm's
    drift, the loop's counts as a daemon's status has them, time and bytes."""
    # the swarm is judged by its honest workers (all of them when nobody attacks)
    honest = [wk for wk in workers if not wk.hostile]
    rounds_losses = [sum(wk.losses[r] for wk in honest) / len(honest) for r in range(c.rounds)]
    final_loss = rounds_losses[-1]
    virtual_seconds = max(wk.clock for wk in workers)
    busy = sum(wk.compute_seconds for wk in workers)
    present = sum(wk.clock - wk.down_seconds for wk in workers)
    stats = [wk.transport.stats for wk in workers]
    rejected = sum((wk.loop.counters.rejected for wk in honest), Counter())
    return {
        "optimizer": c.optimizer,
        "delay": c.delay,
        "seed": c.seed,
        "outer_lr": workers[0].loop.method.lr(c),
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        "losses": rounds_losses,
        "worker_final_losses": [wk.losses[-1] for wk in honest],
        "attack": str(attack) if attack else None,
        "attackers": c.attackers,
        "aggregation": c.aggregation,
        "rejected": dict(rejected),
        # the swarm as a whole, each time its slowest worker finished a round: how far the
        # workers' outer parameters are apart, and how good their average would be
        "consensus": swarm.consensus,
        "mean_phi_losses": swarm.mean_phi_losses,
        "final_mean_phi_loss": swarm.mean_phi_losses[-1],
        "round_seconds": swarm.seconds,  # the virtual time of each of those measurements
        # the blocking consensus step (--consensus-every): what it did, and the time it kept workers idle
        "consensus_step": _consensus_record(workers, groups),
        "diverged": not math.isfinite(final_loss) or final_loss > initial_loss,
        "bytes_sent": sum(s.bytes_sent for s in stats),
        "virtual_seconds": virtual_seconds,
        "utilization": busy / present if present else 0.0,
        # the loop's counts as a daemon's status has them (``Counters.totals``), the honest workers'
        **summed_totals(wk.loop.counters for wk in honest),
        "dropped_in_flight": sum(s.rejected["dropped_in_flight"] for s in stats),
        "resyncs": sum(wk.member.resyncs for wk in workers),
        # the codec each own delta went out in (``--codec auto`` chooses per round from the link)
        "sent_as": dict(sum((wk.loop.counters.sent_as for wk in workers), Counter())),
        "mean_age": _mean([d.age for d in delivered if not d.own]),
        "mean_outer_momentum": _mean(momenta) if momenta else None,
        "age_counts": _age_counts([d for d in delivered if not d.own]),
        "wall_seconds": time.perf_counter() - started,
        "config": c.model_dump(),  # as it ran: ``--fan-in auto`` cut to the model
    }


class _DriftMeter:
    """How far the workers drifted apart: the consensus distance, mean_i ‖φ_i − φ̄‖ / ‖φ̄‖ over all
    parameters, and the held-out loss of φ̄: what tells drift from progress in a swarm without a
    barrier."""

    def __init__(self, scratch: torch.nn.Module, eval_batches: list) -> None:
        self.scratch = scratch
        self.eval_batches = eval_batches
        self.consensus: list[float] = []
        self.mean_phi_losses: list[float] = []
        self.seconds: list[float] = []

    @torch.no_grad()
    def snapshot(self, workers: list[_Worker], now: float) -> None:
        self.seconds.append(now)
        phis = [torch.cat([p.detach().flatten() for p in wk.loop.phi]) for wk in workers]
        mean = torch.stack(phis).mean(dim=0)
        norm = float(torch.linalg.vector_norm(mean)) or 1.0
        self.consensus.append(sum(float(torch.linalg.vector_norm(p - mean)) for p in phis) / len(phis) / norm)
        offset = 0
        for p in self.scratch.parameters():
            p.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.mean_phi_losses.append(evaluate(self.scratch, self.eval_batches))


def _rejoin(wk: _Worker, now: float) -> None:
    """Back from churn: a member that fell more than the cutoff behind adopts a live peer's
    state (the engine's re-sync rule, as a daemon that comes back)."""
    assert wk.away_since is not None
    wk.down_seconds += now - wk.away_since
    wk.away_since = None
    wk.clock = now
    wk.transport.set_alive(True)
    wk.member.sync_if_behind()


def _consensus_record(workers: list[_Worker], groups: GroupFinder | None) -> dict | None:
    if groups is None:
        return None
    steps = [wk.member.consensus for wk in workers]
    sizes = sum((s.group_sizes for s in steps), Counter())
    return {
        "every": steps[0].every,
        "averaged": sum(s.averaged for s in steps),
        "alone": sum(s.alone for s in steps),
        "group_sizes": {str(n): k for n, k in sorted(sizes.items())},
        "wait_seconds": sum(groups.wait_seconds),
        "clipped": sum(s.clipped for s in steps),  # group means further off than a member's room
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _age_counts(delivered: list[Delivery]) -> dict[str, int]:
    return dict(Counter(str(d.age) for d in delivered))


def worker_batches(dataset: TokenDataset, c: SimConfig, w: int) -> BatchIterator:
    """Worker w's training batches: its own contiguous shard (``--data-split disjoint``), or the
    whole corpus with a stream of its own (``shared``, what each daemon does)."""
    if c.data_split == "shared":
        return dataset.shard(0, 1).batches(c.batch_size, c.seq_len, seed=c.seed * 1_000_003 + w)
    return dataset.shard(w, c.workers).batches(c.batch_size, c.seq_len, seed=c.seed)
