"""The outer methods, one object each: its name, its default lr, whether it weighs deliveries by
age, the optimizer it keeps, and how it takes one fragment's step from a round's deliveries.

``OuterLoop`` asks the method; it never compares names. Adding a method is one class and one
line in ``METHODS`` (and its name in ``cgad.node.config.OptimizerName``, which checks flags
without importing torch).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from cgad.node.config import OPTIMIZERS, OuterOptions
from cgad.optim import (
    AUTO_LR_SCALE,
    CGA,
    CGAD,
    PACGAD,
    DelayedNesterov,
    NoLoCo,
    OuterNesterov,
    merge,
    staleness_weight,
)
from cgad.protocol.transport import Kind

__all__ = ["METHODS", "Contribution", "OuterMethod", "UsableVersions", "method"]


@dataclass(frozen=True)
class Contribution:
    """One pseudo-gradient an outer step takes: its values, the tokens behind it, its age in
    rounds, its age scale (σ(τ) for the age-aware methods, else 1), and who published it."""

    delta: Tensor
    tokens: int
    age: int
    scale: float
    publisher: str
    own: bool
    clipped: bool = False  # cut to the clip radius: taken, but not counted as a member averaged


def _gate_age(options: OuterOptions) -> int:
    """The first whole age the cosine gate weighs at 0 (the cutoff is finite by validation)."""
    return math.ceil(options.cutoff)


@dataclass(frozen=True)
class StepInput:
    """What one outer step on fragment ``fragment`` takes, and nothing that points back at the
    loop that runs it.

    Args:
        params: fragment f's φ tensors, as the optimizer holds them (stepped in place).
        fragment: f.
        fragments: F, how many fragments the model has.
        taken: the round's deliveries, the own Δ among them (``own``), each with its age scale.
        peer_phi: peers' newest φ_f (flat) that arrived, by publisher (NoLoCo averages with one).
        hold_phi: a peer's φ_f as this member may mix it in (within the clip radius of its own).
        live_peers: how many peers this member sees live now.
        takeable_peers: how many of them it may take a Δ from this round (the fan-in caps it).
        rng: this member's random stream (NoLoCo's partner).
    """

    params: list[Tensor]
    fragment: int
    fragments: int
    taken: Sequence[Contribution]
    peer_phi: Mapping[str, Tensor] = field(default_factory=dict)
    hold_phi: Callable[[Tensor], Tensor] = lambda theirs: theirs
    live_peers: int = 0
    takeable_peers: int = 0
    rng: random.Random = field(default_factory=random.Random)


def set_grads(params: Sequence[Tensor], flat: Tensor) -> None:
    """Put a flat pseudo-gradient into ``params``' ``.grad``, in their order."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p)
        offset += n


def unflatten(params: Sequence[Tensor], flat: Tensor) -> list[Tensor]:
    """A flat tensor cut into views shaped as ``params``."""
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


class OuterMethod:
    """A method that merges the round's deliveries (``cgad.optim.merge``) and takes one step."""

    name: str = ""
    default_lr: float = 0.7
    age_aware = False  # scales each delivery by σ(τ); a scale of 0 drops it as stale
    mixes_params = False  # averages with peers' φ itself: needs them every round; no gossip on top
    shares = True  # publishes its pseudo-gradients and takes its peers'
    averages = True  # its step takes the round's mean: the inner lr may follow how many it averages

    @property
    def family(self) -> str:
        """What peers must agree on to train together: methods that compute the same share it."""
        return self.name

    def scale(self, age: int, options: OuterOptions) -> float:
        return 1.0

    def stale_after(self, options: OuterOptions) -> int | None:
        """The age from which a delivery counts for nothing (so it is not worth fetching); None
        when every age counts."""
        return None

    def lr(self, options: OuterOptions) -> float:
        return self.auto_lr(options) if options.outer_lr == "auto" else float(options.outer_lr)

    def auto_lr(self, options: OuterOptions) -> float:
        return self.default_lr

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        raise NotImplementedError

    def momentum_now(self, optimizer: Optimizer) -> float | None:
        """The momentum the next step takes where it follows the run (CGA), else None."""
        return None

    def step(self, optimizer: Optimizer, step: StepInput) -> None:
        """One outer step on ``step.params`` from the round's deliveries: the token- and
        age-weighted mean (``merge``), taken by ``optimizer``. The caller has cleared every
        parameter's ``.grad``."""
        taken = step.taken
        mean = merge([c.delta for c in taken], [c.tokens for c in taken], [c.scale for c in taken])
        if mean is None:
            return
        set_grads(step.params, mean)
        self.step_optimizer(optimizer, step)

    def step_optimizer(self, optimizer: Optimizer, step: StepInput) -> None:
        """The optimizer's step once the merged pseudo-gradient is in the params' ``.grad``."""
        optimizer.step()


class CGAMethod(OuterMethod):
    """Cosine-gated averaging (``cgad.optim.CGA``): the round's deliveries weighted by tokens and
    σ(τ), renormalised by their scaled weights, taken as one outer SGD step (lr 1: averaging)."""

    name = "cga"
    default_lr = 1.0
    age_aware = True

    def scale(self, age: int, options: OuterOptions) -> float:
        return staleness_weight(age, options.alpha, options.cutoff)

    def stale_after(self, options: OuterOptions) -> int | None:
        return _gate_age(options)

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        return CGA(
            groups,
            lr=self.lr(options),
            momentum=options.cga_momentum,
            alpha=options.alpha,
            cutoff=options.cutoff,
            restart_every=options.restart_every,
            freshness=0.0,
        )

    def momentum_now(self, optimizer: Optimizer) -> float | None:
        assert isinstance(optimizer, CGA)
        return optimizer.momentum_now()

    def step(self, optimizer: Optimizer, step: StepInput) -> None:
        assert isinstance(optimizer, CGA)
        # each delivery added where it lies: no model-sized sum beside the deliveries at the step
        optimizer.step_deliveries(
            step.params,
            [unflatten(step.params, c.delta) for c in step.taken],
            ages=[c.age for c in step.taken],
            weights=[max(c.tokens, 1) for c in step.taken],
            fresh_share=fresh_share(step.taken, step.takeable_peers),
        )


def fresh_share(taken: Sequence[Contribution], peers: int) -> float | None:
    """The share of ``peers`` whose Δ of this round arrived at age 0; None for a step without the
    own Δ (a replayed version: peers' deltas relabelled as fresh, not a round this node saw).

    CGA's momentum follows it over the peers this member may take a Δ from (the fan-in caps them:
    with 15 live peers and a fan-in of 4, a share over all 15 held the momentum at 0.27 of its
    setting, 16 testbed nodes all fresh); late mixing follows it over every live peer (members
    that each take another 4 of 7 peers' deltas drift apart as delayed ones do, and the mixing
    this share sets off removes that drift). At bench/defence_tax.py's setting (8 workers without
    delay, seed 0), on an earlier tree, one share against min(live, fan-in) for both ended at 3.938
    and one over every live peer for both at 3.609; the split, against the latter on the same
    tree, 3.609 against 3.618 (docs/RESULTS.md).

    Args:
        taken: the round's deliveries, the own Δ among them.
        peers: the peers the share is of.
    """
    if not any(c.own for c in taken):
        return None
    fresh = len({c.publisher for c in taken if not c.own and c.age == 0})
    expected = max(peers, fresh)
    return fresh / expected if expected else 0.0


class _AdamFamily(OuterMethod):
    age_aware = True
    gated = True  # the cosine gate reaches 0 at the cutoff
    decays = True  # e^(−α·τ)

    def auto_lr(self, options: OuterOptions) -> float:
        """AUTO_LR_SCALE × H × inner lr: Adam moves every coordinate by about lr per outer step,
        so lr must follow how far the inner steps move a coordinate in a round."""
        steps, inner_lr = getattr(options, "inner_steps", None), getattr(options, "inner_lr", None)
        if steps is None or inner_lr is None:
            raise ValueError(f"outer_lr auto for {self.name} needs inner_steps and inner_lr; give outer_lr")
        return AUTO_LR_SCALE * steps * inner_lr

    def scale(self, age: int, options: OuterOptions) -> float:
        if not self.decays:
            return 1.0
        return staleness_weight(age, options.alpha, options.cutoff if self.gated else math.inf)

    def stale_after(self, options: OuterOptions) -> int | None:
        return _gate_age(options) if self.gated and self.decays else None

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        # σ is applied while merging the round's deliveries, so the optimizer itself sees age 0
        return CGAD(
            groups,
            lr=self.lr(options),
            betas=(options.beta1, options.beta2),
            restart_every=options.restart_every,
        )


class CGADMethod(_AdamFamily):
    name = "cgad"


class AdamDecayMethod(_AdamFamily):
    name = "adam-decay"
    gated = False


class AdamMethod(_AdamFamily):
    """Outer Adam that takes every delivery at full weight, however old."""

    name = "adam"
    decays = False


class PACGADMethod(_AdamFamily):
    """PA-CGAD: CGAD under a streaming schedule (``--fragments`` F >= 2), each fragment with its
    own version, age and Adam step count. The outer loop keeps those per fragment for every
    method, so ``cgad`` with F >= 2 computes the same steps: the two share a family, and
    ``pa-cgad`` is the name that insists on F >= 2."""

    name = "pa-cgad"
    family = "cgad"  # type: ignore[assignment]

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        return PACGAD(
            groups,
            lr=self.lr(options),
            betas=(options.beta1, options.beta2),
            restart_every=options.restart_every,
        )

    def step_optimizer(self, optimizer: Optimizer, step: StepInput) -> None:
        optimizer.step(ages=[0 if g == step.fragment else None for g in range(step.fragments)])


class NesterovMethod(OuterMethod):
    """DiLoCo's outer step: SGD with Nesterov momentum on the token-weighted mean."""

    name = "nesterov"
    momentum = True

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        momentum = options.momentum if self.momentum else 0.0
        return OuterNesterov(
            groups, lr=self.lr(options), momentum=momentum, restart_every=options.restart_every
        )


class SGDMethod(NesterovMethod):
    """Plain outer SGD; at lr 1 it is averaging."""

    name = "sgd"
    momentum = False


class DelayedNesterovMethod(OuterMethod):
    """Liu et al.'s async baseline: each delivery is one arrival; momentum updates every N."""

    name = "delayed-nesterov"
    averages = False  # each delivery is a step of its own, not a share of a mean

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        # N = the arrivals expected per round: this peer and the peers it sees now
        return DelayedNesterov(groups, lr=self.lr(options), momentum=options.momentum, period=peers + 1)

    def step(self, optimizer: Optimizer, step: StepInput) -> None:
        for group in optimizer.param_groups:
            group["period"] = step.live_peers + 1
        for c in sorted(step.taken, key=lambda c: -c.age):  # oldest first, the own fresh one last
            set_grads(step.params, c.delta)
            optimizer.step()


class NoLoCoMethod(OuterMethod):
    """NoLoCo: a momentum step within a pair, this peer and one random peer of the round whose
    Δ and φ both arrived; alone when none did."""

    name = "noloco"
    mixes_params = True
    averages = False  # a pair's mean, one random peer: the count it would give is not its noise

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        return NoLoCo(groups, lr=self.lr(options), beta=options.noloco_beta)

    def step(self, optimizer: Optimizer, step: StepInput) -> None:
        own = next((c for c in step.taken if c.own), None)
        if own is None:  # the local block was discarded: no own Δ to step with
            return
        deltas = {c.publisher: c for c in step.taken if not c.own}
        set_grads(step.params, own.delta)
        partners = sorted(set(deltas) & set(step.peer_phi))
        if not partners:
            optimizer.step()
            return
        partner = step.rng.choice(partners)
        theirs = unflatten(step.params, step.hold_phi(step.peer_phi[partner]))
        mean_phi = [(a + b) / 2 for a, b in zip(step.params, theirs, strict=True)]
        mine, their_delta = unflatten(step.params, own.delta), unflatten(step.params, deltas[partner].delta)
        mean_delta = [(a + b) / 2 for a, b in zip(mine, their_delta, strict=True)]
        optimizer.step(mean_phi, mean_delta)


class LocalMethod(OuterMethod):
    """The floor: no exchange at all. Each peer continues from its own θ (φ ← θ, an outer SGD step
    at lr 1 on its own Δ), publishes nothing and ignores what arrives: training alone, with the
    same steps and data as a swarm member."""

    name = "local"
    default_lr = 1.0
    shares = False
    averages = False

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        return OuterNesterov(groups, lr=1.0, momentum=0.0)


METHODS: dict[str, OuterMethod] = {
    m.name: m
    for m in (
        CGAMethod(),
        CGADMethod(),
        PACGADMethod(),
        AdamDecayMethod(),
        AdamMethod(),
        NesterovMethod(),
        DelayedNesterovMethod(),
        SGDMethod(),
        NoLoCoMethod(),
        LocalMethod(),
    )
}
if tuple(METHODS) != OPTIMIZERS:
    raise ImportError(f"cgad.node.config.OptimizerName {OPTIMIZERS} and METHODS {tuple(METHODS)} disagree")


def method(name: str) -> OuterMethod:
    """The method called ``name``; ValueError naming the choices otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(METHODS)}") from None


@dataclass(frozen=True)
class UsableVersions:
    """Which of a peer's fragments can count in an outer step: their versions and their kinds.
    The member's step drops what falls outside (a delta further ahead than the cutoff, counted
    ``future``; one aged to a weight of 0); a daemon's transport does not fetch it, so both
    clocks keep one window, and no bytes come for a kind the member never uses.

    Args:
        stale_after: the age from which a delivery counts for nothing (None: every age counts).
        max_ahead: how far ahead of the member's own version a delta may claim to be.
        kinds: the kinds the member uses (``Kind`` values): deltas where the method shares them,
            φ where it or ``--mixing`` mixes them, first moments under ``--moments shared``.
    """

    stale_after: int | None
    max_ahead: float
    kinds: frozenset[str] = frozenset(k.value for k in (Kind.DELTA, Kind.PARAMS, Kind.MOMENTS))

    @classmethod
    def of(cls, options: OuterOptions) -> UsableVersions:
        m = method(options.optimizer)
        uses = {
            Kind.DELTA: m.shares,
            Kind.PARAMS: m.mixes_params or options.mixing != "none",
            Kind.MOMENTS: m.shares and options.moments == "shared",
        }
        kinds = frozenset(k.value for k, used in uses.items() if used)
        return cls(m.stale_after(options), options.cutoff, kinds)

    def too_far_ahead(self, version: int, own: int) -> bool:
        return version > own + self.max_ahead
