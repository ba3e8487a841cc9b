"""CGA, cosine-gated averaging: one outer SGD step on the age-weighted mean of a round's deliveries.

Each pseudo-gradient Δ_i of a round (held in ``p.grad`` when ``accumulate`` is called) has an age
τ_i and a weight w_i (the tokens behind it). With s_i = w_i·σ(τ_i):

    Δ̄ = Σ_i s_i·Δ_i / Σ_i s_i              (deliveries with σ = 0 are dropped: in neither sum)
    b ← μ'·b + Δ̄;   u = Δ̄ + μ'·b (Nesterov) or Δ̄ (μ = 0)
    φ ← φ − lr·u

At lr 1 and μ = 0 this is averaging, DiLoCo's outer step without momentum. The normalisation is
by Σ s_i, not Σ w_i: a stale delivery loses its share of the mean to the fresh ones instead of
shrinking the whole step, so a peer whose fellows' deliveries are all gated out continues from its
own θ exactly (training alone, never worse), and with every delivery fresh it is plain averaging.
``merge`` (``cgad.optim.merging``) is the other normalisation, which the Adam family uses.

Momentum helps where a round's deliveries are fresh and hurts where they come late: asynchrony
already acts as momentum (a delivery τ rounds old repeats a direction the step took before), and
the two compound into overshoot. So μ' follows how fresh the rounds are. A step given
``fresh_share`` (the share of the peers it could take whose Δ of this round arrived at age 0)
updates a running freshness r ← ρ·r + (1 − ρ)·share, and every step takes μ' = μ·r. r starts at
``freshness`` (1: μ' = μ for as long as no share is given; the daemon starts at 0: no momentum
before any peer has been seen on time, and none for a peer alone). The buffer b is made at the
first step with μ' > 0, from zero: while μ' = 0 it would hold only the last Δ̄.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .defaults import DEFAULT_ALPHA, DEFAULT_CUTOFF
from .staleness import check_age, staleness_weight

__all__ = ["CGA", "cga_update", "cga_update_from", "running_freshness"]

FRESHNESS_DECAY = 0.5  # ρ: the running freshness is half this round's share, half the past's


def running_freshness(freshness: float, fresh_share: float, decay: float = FRESHNESS_DECAY) -> float:
    """r ← ρ·r + (1 − ρ)·share: the running share of peers heard fresh that μ' = μ·r follows."""
    return decay * freshness + (1 - decay) * fresh_share


def cga_update(
    params: list[Tensor], means: list[Tensor], momenta: list[Tensor] | None, *, lr: float, mu: float
) -> None:
    """One CGA step in place: b ← μ'·b + Δ̄ and φ ← φ − lr·(Δ̄ + μ'·b) for each tensor, or
    φ ← φ − lr·Δ̄ without momenta.

    Args:
        params: φ, the tensors to step (any float dtype).
        means: Δ̄ per tensor, the round's age-weighted mean (float32).
        momenta: the momentum buffer per tensor (float32, updated in place), or None.
        lr: the outer learning rate (1: averaging).
        mu: the momentum this step takes, μ' = μ·r.
    """
    cga_update_from(params, [means], [1.0], momenta, lr=lr, mu=mu)


def cga_update_from(
    params: list[Tensor],
    deliveries: Sequence[Sequence[Tensor]],
    shares: Sequence[float],
    momenta: list[Tensor] | None,
    *,
    lr: float,
    mu: float,
) -> None:
    """``cga_update`` with Δ̄ = Σ_i share_i·Δ_i never written out: each delivery is added into φ
    (and into the momentum) where it lies, so a step holds no model-sized sum beside the
    deliveries (4 bytes a parameter at the step's peak, what a daemon's memory is sized by).

    Args:
        params: φ, the tensors to step (float32 takes each delivery in place; another float
            dtype takes the update once, from a float32 sum per tensor).
        deliveries: each delivery's Δ_i per tensor, aligned with ``params`` (float32).
        shares: each delivery's s_i / Σ s (they sum to 1 for a mean).
        momenta: the momentum buffer per tensor (float32, updated in place), or None.
        lr: the outer learning rate (1: averaging).
        mu: the momentum this step takes, μ' = μ·r.
    """
    if len(deliveries) != len(shares):
        raise ValueError(f"{len(deliveries)} deliveries for {len(shares)} shares")

    def add_mean(target: Tensor, i: int, scale: float) -> None:  # target += scale·Σ share·Δ_i
        for delta, share in zip(deliveries, shares, strict=True):
            target.add_(delta[i], alpha=scale * share)

    for i, p in enumerate(params):
        if momenta is not None:
            add_mean(momenta[i].mul_(mu), i, 1.0)
        # φ of lower precision takes the whole update at once (a per-tensor float32 scratch):
        # added a delivery at a time, each small share would round away on its own
        target = p if p.dtype == torch.float32 else torch.zeros_like(p, dtype=torch.float32)
        scale = -lr if target is p else 1.0
        if momenta is not None and mu:
            target.add_(momenta[i], alpha=scale * mu)
        add_mean(target, i, scale)
        if target is not p:
            p.add_(target.to(p.dtype), alpha=-lr)


class CGA(Optimizer):
    """Accumulate a round's pseudo-gradients with ``accumulate(age=, weight=)``, then ``step()``.

    Only parameters that had a grad at some ``accumulate`` since the last step move, so a
    fragment's parameters step alone. ``restart_every`` = K > 0 clears the momentum every K steps.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1.0,
        momentum: float = 0.0,
        alpha: float = DEFAULT_ALPHA,
        cutoff: float = DEFAULT_CUTOFF,
        restart_every: int = 0,
        freshness: float = 1.0,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not isinstance(restart_every, int) or restart_every < 0:
            raise ValueError(f"restart_every must be an integer >= 0 (0 = never), got {restart_every!r}")
        if not 0.0 <= freshness <= 1.0:
            raise ValueError(f"freshness must be in [0, 1], got {freshness}")
        staleness_weight(0, alpha, cutoff)  # validates alpha and cutoff with their own messages
        defaults = dict(lr=lr, momentum=momentum, alpha=alpha, cutoff=cutoff, restart_every=restart_every)
        defaults["freshness"] = freshness
        super().__init__(params, defaults)

    @torch.no_grad()
    def accumulate(self, *, age: float = 0, weight: float = 1.0) -> bool:
        """Add ``p.grad`` of every parameter that has one, as a delivery of this age and weight;
        False when σ(age) dropped it (nothing changed)."""
        age = check_age(age)
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        taken = False
        for group in self.param_groups:
            scale = weight * staleness_weight(age, group["alpha"], group["cutoff"])
            if scale == 0.0:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros_like(p, dtype=torch.float32)
                    state["total"] = 0.0
                state["sum"].add_(p.grad.float(), alpha=scale)
                state["total"] += scale
                taken = True
        return taken

    def _freshness(self, group: dict[str, Any]) -> float:
        # a state saved before the running freshness existed starts from the constructor's
        return group.setdefault("freshness", self.defaults["freshness"])

    def freshness(self, group: int) -> float:
        """The running freshness r of param group ``group`` (1: every round's peers came fresh)."""
        return self._freshness(self.param_groups[group])

    def momentum_now(self) -> float:
        """The momentum μ' the next step takes without a new share (the mean over groups)."""
        return sum(g["momentum"] * self._freshness(g) for g in self.param_groups) / len(self.param_groups)

    def _begin(
        self, group: dict[str, Any], stepping: list[Tensor], fresh_share: float | None
    ) -> tuple[float, list[Tensor] | None]:
        """A step of ``group``'s ``stepping`` parameters begins: the running freshness takes the
        share, and each parameter's momentum buffer is made, restarted or counted. Its μ' and
        momenta (None without momentum)."""
        if fresh_share is not None:
            group["freshness"] = running_freshness(self._freshness(group), fresh_share)
        mu, restart = group["momentum"] * self._freshness(group), group["restart_every"]
        if not group["momentum"]:
            return mu, None
        # no buffer while μ' = 0 (a peer alone, or none heard fresh yet): b would only hold the
        # last mean, 4 bytes a parameter for nothing; it starts from zero when the momentum does
        held = any("momentum" in self.state[p] for p in stepping)
        momenta = []
        for p in stepping:
            state = self.state[p]
            steps = state.get("steps", 0)
            state["steps"] = steps + 1
            if not held and mu == 0.0:
                continue
            if "momentum" not in state or (restart and steps and steps % restart == 0):
                state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
            momenta.append(state["momentum"])
        return mu, momenta or None

    @staticmethod
    def _check_share(fresh_share: float | None) -> None:
        if fresh_share is not None and not 0.0 <= fresh_share <= 1.0:
            raise ValueError(f"fresh_share must be in [0, 1], got {fresh_share}")

    @torch.no_grad()
    def step(self, closure: Any = None, *, fresh_share: float | None = None) -> Any:
        """Move every parameter with accumulated deliveries by its mean; clear the sums. With
        ``fresh_share`` in [0, 1] the momentum follows the running freshness (module docstring)."""
        self._check_share(fresh_share)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            stepping = [p for p in group["params"] if self.state[p].get("total")]
            if not stepping:  # a fragment that is not this round's keeps its freshness too
                continue
            means = []
            for p in stepping:
                state = self.state[p]
                means.append(state["sum"].div_(state["total"]))
                # the sums live only within a round: dropped, they stay out of the state that
                # checkpoints and joining peers carry (which is then the momentum, if any)
                del state["sum"], state["total"]
            mu, momenta = self._begin(group, stepping, fresh_share)
            cga_update(stepping, means, momenta, lr=group["lr"], mu=mu)
        return loss

    @torch.no_grad()
    def step_deliveries(
        self,
        params: Sequence[Tensor],
        deliveries: Sequence[Sequence[Tensor]],
        ages: Sequence[float],
        weights: Sequence[float],
        *,
        fresh_share: float | None = None,
    ) -> bool:
        """``accumulate`` for each delivery and then ``step``, in one pass and with no sum held:
        each Δ_i is added into φ where it lies (``cga_update_from``). False when σ dropped every
        delivery (nothing moved, the freshness neither).

        Args:
            params: the parameters to step, all of one param group (a fragment's).
            deliveries: each delivery's Δ_i per parameter, aligned with ``params``.
            ages: each delivery's age τ_i in rounds.
            weights: each delivery's weight w_i (> 0: the tokens behind it).
            fresh_share: as in ``step``.
        """
        self._check_share(fresh_share)
        if not len(deliveries) == len(ages) == len(weights):
            raise ValueError(f"{len(deliveries)} deliveries, {len(ages)} ages, {len(weights)} weights")
        params = list(params)
        wanted = {id(p) for p in params}
        group = next((g for g in self.param_groups if wanted <= {id(p) for p in g["params"]}), None)
        if not params or group is None:
            raise ValueError("params must be some of one of this optimizer's param groups")
        taken, scales = [], []
        for delta, age, weight in zip(deliveries, ages, weights, strict=True):
            if not weight > 0:
                raise ValueError(f"weight must be > 0, got {weight}")
            if len(delta) != len(params):
                raise ValueError(f"a delivery of {len(delta)} tensors for {len(params)} parameters")
            scale = weight * staleness_weight(check_age(age), group["alpha"], group["cutoff"])
            if scale > 0.0:
                taken.append(delta)
                scales.append(scale)
        if not taken:
            return False
        total = sum(scales)
        mu, momenta = self._begin(group, params, fresh_share)
        cga_update_from(params, taken, [s / total for s in scales], momenta, lr=group["lr"], mu=mu)
        return True
