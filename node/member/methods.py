"""The outer methods, one object each: its name, its default lr, whether it weighs deliveries by
age, the optimizer it keeps, and how it takes one fragment's step from a round's deliveries.

``OuterLoop`` asks the method; it never compares names. Adding a method is one class and one
line in ``METHODS`` (and its name in ``cgad.node.config.OptimizerName``, which checks flags
without importing torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

__all__ = ["METHODS", "Contribution", "OuterMethod", "method"]


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


def _gate_age(options: OuterOptions) -> int:
    """The first whole age the cosine gate weighs at 0 (the cutoff is finite by validation)."""
    return math.ceil(options.cutoff)


class OuterLoop(Protocol):
    """What a method's step reads of the member's outer state (``cgad.node.member.outer``): its
    optimizer, its φ by fragment, and the peers it sees; declared here so that the methods do
    not import the loop that calls them."""

    optimizer: Any
    fragments: list[list[int]]
    rng: Any
    transport: Any

    def set_grad(self, f: int, flat: Tensor) -> None: ...
    def fragment_phi(self, f: int) -> list[Tensor]: ...
    def flat_phi(self, f: int) -> Tensor: ...
    def unflatten(self, f: int, flat: Tensor) -> list[Tensor]: ...
    def numel(self, f: int) -> int: ...
    def held_params(self, f: int, anchor: Tensor, theirs: Tensor) -> Tensor: ...


class OuterMethod:
    """A method that merges the round's deliveries (``cgad.optim.merge``) and takes one step."""

    name: str = ""
    default_lr: float = 0.7
    age_aware = False  # scales each delivery by σ(τ); a scale of 0 drops it as stale
    mixes_params = False  # averages with peers' φ itself: needs them every round; no gossip on top
    shares = True  # publishes its pseudo-gradients and takes its peers'

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

    def freshness(self, optimizer: Optimizer, f: int) -> float:
        """Fragment f's running share of peers heard fresh (CGA keeps it; ``--mixing late``
        follows it)."""
        raise NotImplementedError(f"{self.name} keeps no running freshness")

    def step(
        self, loop: OuterLoop, f: int, taken: Sequence[Contribution], peer_params: Sequence[Any]
    ) -> None:
        mean = merge([c.delta for c in taken], [c.tokens for c in taken], [c.scale for c in taken])
        if mean is None:
            return
        loop.set_grad(f, mean)
        self.step_optimizer(loop, f)

    def step_optimizer(self, loop: OuterLoop, f: int) -> None:
        """The optimizer's step once fragment f's merged pseudo-gradient is in its ``.grad``."""
        loop.optimizer.step()


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

    def freshness(self, optimizer: Optimizer, f: int) -> float:
        assert isinstance(optimizer, CGA)
        return optimizer.freshness(f)

    def step(
        self, loop: OuterLoop, f: int, taken: Sequence[Contribution], peer_params: Sequence[Any]
    ) -> None:
        for c in taken:
            loop.set_grad(f, c.delta)
            loop.optimizer.accumulate(age=c.age, weight=max(c.tokens, 1))
        loop.optimizer.step(fresh_share=fresh_share(taken, len(loop.transport.live_peers())))


def fresh_share(taken: Sequence[Contribution], live_peers: int) -> float | None:
    """The share of the live peers whose Δ of this round arrived at age 0, what CGA's momentum
    follows; None for a step without the own Δ (a replayed version: peers' deltas relabelled as
    fresh, not a round this node saw)."""
    if not any(c.own for c in taken):
        return None
    fresh = len({c.publisher for c in taken if not c.own and c.age == 0})
    expected = max(live_peers, fresh)
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

    def step_optimizer(self, loop: OuterLoop, f: int) -> None:
        loop.optimizer.step(ages=[0 if g == f else None for g in range(len(loop.fragments))])


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

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        # N = the arrivals expected per round: this peer and the peers it sees now
        return DelayedNesterov(groups, lr=self.lr(options), momentum=options.momentum, period=peers + 1)

    def step(
        self, loop: OuterLoop, f: int, taken: Sequence[Contribution], peer_params: Sequence[Any]
    ) -> None:
        for group in loop.optimizer.param_groups:
            group["period"] = len(loop.transport.live_peers()) + 1
        for c in sorted(taken, key=lambda c: -c.age):  # oldest first, the own fresh one last
            loop.set_grad(f, c.delta)
            loop.optimizer.step()


class NoLoCoMethod(OuterMethod):
    """NoLoCo: a momentum step within a pair, this peer and one random peer of the round whose
    Δ and φ both arrived; alone when none did."""

    name = "noloco"
    mixes_params = True

    def build(self, groups: list[dict[str, Any]], options: OuterOptions, peers: int) -> Optimizer:
        return NoLoCo(groups, lr=self.lr(options), beta=options.noloco_beta)

    def step(
        self, loop: OuterLoop, f: int, taken: Sequence[Contribution], peer_params: Sequence[Any]
    ) -> None:
        own = next((c for c in taken if c.own), None)
        if own is None:  # the local block was discarded: no own Δ to step with
            return
        deltas = {c.publisher: c for c in taken if not c.own}
        numel = loop.numel(f)
        newest_phi = {  # each peer's newest φ (sorted by version: later ones overwrite)
            p.key.publisher: p.tensor
            for p in sorted(peer_params, key=lambda p: p.key.base_version)
            if p.tensor.numel() == numel
        }
        loop.set_grad(f, own.delta)
        partners = sorted(set(deltas) & set(newest_phi))
        if not partners:
            loop.optimizer.step()
            return
        partner = loop.rng.choice(partners)
        phi = loop.fragment_phi(f)
        theirs = loop.held_params(f, loop.flat_phi(f), newest_phi[partner])
        mean_phi = [(a + b) / 2 for a, b in zip(phi, loop.unflatten(f, theirs), strict=True)]
        mean_delta = [
            (a + b) / 2
            for a, b in zip(
                loop.unflatten(f, own.delta), loop.unflatten(f, deltas[partner].delta), strict=True
            )
        ]
        loop.optimizer.step(mean_phi, mean_delta)


class LocalMethod(OuterMethod):
    """The floor: no exchange at all. Each peer continues from its own θ (φ ← θ, an outer SGD step
    at lr 1 on its own Δ), publishes nothing and ignores what arrives: training alone, with the
    same steps and data as a swarm member."""

    name = "local"
    default_lr = 1.0
    shares = False

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
