"""The virtual swarm: W workers in one process, the daemon's outer loop over an in-memory network.

Each worker is what a daemon is: a model replica, an inner AdamW trainer on its own data shard, an
``OuterLoop`` and a transport, here a ``MemoryTransport`` with injected delay, loss, bandwidth,
stragglers and churn; the last ``attackers`` workers forge what they publish
(``protocol/attacks.py``), and the swarm is judged by the others. Time is virtual: an inner step
costs ``step_time × speed factor`` seconds.

Workers advance in sync events ordered by virtual time. At each sync time, every worker due then
first runs its inner steps and publishes, and only then do they all apply what arrived, so with
equal speeds and no delay the swarm is exactly synchronous DiLoCo, and a delay of τ rounds shows
up as an age of exactly τ.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cgad.node.config import SimConfig
from cgad.node.member.outer import Delivery, OuterLoop
from cgad.node.training.data import BatchIterator, TokenDataset
from cgad.node.training.model import build_model
from cgad.node.training.trainer import InnerTrainer, evaluate
from cgad.protocol.attacks import Attack, ForgingTransport
from cgad.protocol.memory import Delay, MemoryTransport, VirtualNetwork

__all__ = ["simulate", "worker_batches"]


@dataclass
class _Worker:
    index: int
    trainer: InnerTrainer
    transport: MemoryTransport
    loop: OuterLoop
    speed: float
    clock: float = 0.0
    compute_seconds: float = 0.0
    down_seconds: float = 0.0
    round: int = 0
    block: int = 0  # sync events completed
    losses: list[float] = field(default_factory=list)
    resyncs: int = 0
    away_since: float | None = None  # virtual time it left, while away (churn)
    unshared: int = 0  # blocks still to keep from peers after adopting a state (as the daemon does)
    carried: int = 0  # inner steps of the block under way taken before the last outer step
    hostile: bool = False  # forges what it publishes (--attackers); never judged, never adopted


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
    c = config
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    network = VirtualNetwork(
        delay=Delay.parse(c.delay),
        drop=c.drop,
        bandwidth=c.bandwidth,
        codec=c.codec,
        sparse_keep=c.sparse_keep,
        seed=c.seed * 7919 + 1,
    )
    eval_batches = dataset.eval_batches(c.eval_batches, c.batch_size, c.seq_len)
    base_model = build_model(c.model, vocab_size, seed=c.seed)
    initial_loss = evaluate(base_model, eval_batches)
    speeds = c.stragglers or [1.0] * c.workers
    transports = [network.join(f"worker-{w}") for w in range(c.workers)]
    attack = Attack.parse(c.attack) if c.attackers else None
    workers = []
    for w in range(c.workers):
        model = copy.deepcopy(base_model)  # DiLoCo: every worker starts from the same weights
        batches = worker_batches(dataset, c, w)
        trainer = InnerTrainer(model, batches, lr=c.inner_lr, warmup_steps=c.warmup_steps)
        hostile = attack is not None and w >= c.workers - c.attackers  # the last K workers
        transport = (
            ForgingTransport(transports[w], attack, seed=c.seed * 17 + w) if hostile else transports[w]
        )
        params = list(model.parameters())
        loop = OuterLoop(
            params, c, transport, "sim", seed=c.seed * 31 + w, codec=c.codec, sparse_keep=c.sparse_keep
        )
        workers.append(_Worker(w, trainer, transports[w], loop, speeds[w], hostile=hostile))
    honest = [wk for wk in workers if not wk.hostile]

    block_steps = c.inner_steps // c.fragments
    blocks_per_round = c.fragments
    events = [(block_steps * c.step_time * wk.speed, wk.index) for wk in workers]
    heapq.heapify(events)
    delivered: list[Delivery] = []
    momenta: list[float] = []  # the momentum each honest outer step went on with (cga's follows freshness)
    swarm = _SwarmView(copy.deepcopy(base_model), eval_batches)
    started = time.perf_counter()
    while events:
        now = events[0][0]
        due = []
        while events and events[0][0] == now:
            wk = workers[heapq.heappop(events)[1]]
            if wk.away_since is None:
                due.append(wk)
                continue
            _rejoin(wk, workers, now, c, eval_batches)  # back from churn; its next block follows
            heapq.heappush(events, (wk.clock + block_steps * c.step_time * wk.speed, wk.index))
        for wk in due:  # clocks first: a delivery's due round counts from the receiver's round now
            wk.clock = now
            wk.transport.advance(now, wk.round)
        for wk in due:  # inner steps, then publish: nobody applies before everyone due has published
            _train(wk, block_steps - wk.carried, c, progress)
            blocked_before = wk.transport.blocked_seconds
            tokens = block_steps * c.batch_size * c.seq_len
            wk.loop.publish(wk.block % blocks_per_round, tokens=tokens, share=wk.unshared == 0)
            wk.unshared = max(0, wk.unshared - 1)
            wk.clock += wk.transport.blocked_seconds - blocked_before
        for wk in due:
            f = wk.block % blocks_per_round
            # training on while the round's fragments arrive, then carried over the outer step
            # (the daemon's --apply-delay); the run's last block carries nothing: equal compute
            last = wk.round == c.rounds - 1 and f == blocks_per_round - 1
            wk.carried = 0 if last else c.apply_delay
            _train(wk, wk.carried, c, progress)
            wk.transport.advance(wk.clock, wk.round)
            deliveries = wk.loop.apply(f, carry=wk.carried > 0, swarm_version=_swarm_version(wk, workers, f))
            if not wk.hostile:
                delivered.extend(deliveries)
                momentum = wk.loop.method.momentum_now(wk.loop.optimizer)
                if momentum is not None:
                    momenta.append(momentum)
            wk.block += 1
            if f == blocks_per_round - 1:
                wk.round += 1
                wk.losses.append(evaluate(wk.trainer.model, eval_batches))
                _catch_up(wk, workers, c, eval_batches)  # as a daemon re-syncs when far behind
                if wk.round < c.rounds and c.churn and rng.random() < c.churn:
                    # away for 1-4 rounds: neither sending nor receiving; back via a rejoin event
                    wk.transport.set_alive(False)
                    wk.away_since = wk.clock
                    back = wk.clock + rng.randint(1, 4) * c.inner_steps * c.step_time
                    heapq.heappush(events, (back, wk.index))
                    continue
            if wk.round < c.rounds:
                heapq.heappush(events, (wk.clock + block_steps * c.step_time * wk.speed, wk.index))
        while len(swarm.consensus) < min(wk.round for wk in honest):
            swarm.snapshot(honest)  # the slowest honest worker has finished another round
            if on_round:
                on_round(len(swarm.consensus), swarm.mean_phi_losses[-1])

    # the swarm is judged by its honest workers (all of them when nobody attacks)
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
        "diverged": not math.isfinite(final_loss) or final_loss > initial_loss,
        "bytes_sent": sum(s.bytes_sent for s in stats),
        "virtual_seconds": virtual_seconds,
        "utilization": busy / present if present else 0.0,
        "applied": sum(wk.loop.counters.applied for wk in workers),
        "dropped_stale": sum(wk.loop.counters.dropped_stale for wk in workers),
        "dropped_in_flight": sum(s.rejected["dropped_in_flight"] for s in stats),
        "resyncs": sum(wk.resyncs for wk in workers),
        "replayed": sum(wk.loop.counters.replayed for wk in workers),
        "mixed": sum(wk.loop.counters.mixed for wk in workers),
        "clipped": sum(wk.loop.counters.clipped for wk in honest),
        "tokens_capped": sum(wk.loop.counters.tokens_capped for wk in honest),
        "clipped_params": sum(wk.loop.counters.clipped_params for wk in honest),
        "mean_age": _mean([d.age for d in delivered if not d.own]),
        "mean_outer_momentum": _mean(momenta) if momenta else None,
        "age_counts": _age_counts([d for d in delivered if not d.own]),
        "wall_seconds": time.perf_counter() - started,
        "config": c.model_dump(),
    }


def _train(wk: _Worker, steps: int, c: SimConfig, progress: Callable[[int], None] | None) -> None:
    for _ in range(steps):
        wk.trainer.step()
    if progress and steps:
        progress(steps)
    wk.compute_seconds += steps * c.step_time * wk.speed


class _SwarmView:
    """Consensus distance, mean_i ‖φ_i − φ̄‖ / ‖φ̄‖ over all parameters, and the held-out loss
    of φ̄: what tells drift from progress in a swarm without a barrier."""

    def __init__(self, scratch: torch.nn.Module, eval_batches: list) -> None:
        self.scratch = scratch
        self.eval_batches = eval_batches
        self.consensus: list[float] = []
        self.mean_phi_losses: list[float] = []

    @torch.no_grad()
    def snapshot(self, workers: list[_Worker]) -> None:
        phis = [torch.cat([p.detach().flatten() for p in wk.loop.phi]) for wk in workers]
        mean = torch.stack(phis).mean(dim=0)
        norm = float(torch.linalg.vector_norm(mean)) or 1.0
        self.consensus.append(sum(float(torch.linalg.vector_norm(p - mean)) for p in phis) / len(phis) / norm)
        offset = 0
        for p in self.scratch.parameters():
            p.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.mean_phi_losses.append(evaluate(self.scratch, self.eval_batches))


def _catch_up(wk: _Worker, workers: list[_Worker], c: SimConfig, eval_batches: list) -> bool:
    """A daemon re-syncs when its versions trail the median of its live peers' by more than the
    cutoff (``StateSync.behind``): a straggler adopts the most advanced live peer's outer state,
    and the rounds it skips count at the loss of the state it adopted."""
    if not wk.loop.method.shares or wk.round >= c.rounds:
        return False
    live = _trusted_live(wk, workers)
    if not live:
        return False
    median = statistics.median_low(min(o.loop.versions) for o in live)
    if median - min(wk.loop.versions) <= c.cutoff:
        return False
    _adopt_leader(wk, max(live, key=lambda o: min(o.loop.versions)), c, eval_batches)
    return True


def _rejoin(wk: _Worker, workers: list[_Worker], now: float, c: SimConfig, eval_batches: list) -> None:
    """Back from churn: if it fell more than the cutoff behind the most advanced live peer, it
    adopts that peer's outer state (as a daemon does when it rejoins); rounds it skipped count
    at the loss of the state it adopted."""
    assert wk.away_since is not None
    wk.down_seconds += now - wk.away_since
    wk.away_since = None
    wk.clock = now
    wk.transport.set_alive(True)
    live = _trusted_live(wk, workers)
    if not live or not wk.loop.method.shares:  # a worker training alone adopts nobody's state
        return
    leader = max(live, key=lambda o: min(o.loop.versions))
    if min(leader.loop.versions) - min(wk.loop.versions) > c.cutoff and leader.round < c.rounds:
        _adopt_leader(wk, leader, c, eval_batches)


def _swarm_version(wk: _Worker, workers: list[_Worker], f: int) -> int | None:
    """Fragment f's version in the swarm as a daemon sees it (``StateSync.swarm_versions``): the
    median (low) of the other live workers' versions, up to which a worker behind replays the
    deltas it holds from ahead; None with no other worker up."""
    live = [o.loop.versions[f] for o in _live_others(wk, workers)]  # an attacker's report too, as a daemon's
    return statistics.median_low(live) if live else None


def _live_others(wk: _Worker, workers: list[_Worker]) -> list[_Worker]:
    """The other workers up now (not away after churn)."""
    return [o for o in workers if o is not wk and o.transport.alive and o.away_since is None]


def _trusted_live(wk: _Worker, workers: list[_Worker]) -> list[_Worker]:
    """The other workers up now whose state ``wk`` may adopt (an attacker's never)."""
    return [o for o in _live_others(wk, workers) if not o.hostile]


def _adopt_leader(wk: _Worker, leader: _Worker, c: SimConfig, eval_batches: list) -> None:
    """A re-sync: ``wk`` takes ``leader``'s outer state and its place in the fragment schedule;
    the rounds it skips count at the loss of what it adopted."""
    wk.loop.load_state_dict(copy.deepcopy(leader.loop.state_dict()))
    wk.unshared = len(wk.loop.fragments)  # a round discarded (inner warm-up), as a daemon does after adopting
    skipped = min(leader.round, c.rounds) - wk.round
    if skipped > 0:
        loss = evaluate(wk.trainer.model, eval_batches)
        wk.losses.extend([loss] * skipped)
        wk.round += skipped
        wk.block = leader.block
    wk.resyncs += 1


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
