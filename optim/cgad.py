"""CGAD, Adam-Decay and PA-CGAD: Adam whose input is scaled by the pseudo-gradient's age.

On a pseudo-gradient Δ (held in ``p.grad``, Δ = φ_before − θ_after) of age τ, with s = σ(τ):

    if s == 0: nothing changes (no parameter, no moment, no step count)
    t += 1;  m ← β1·m + (1−β1)·s·Δ;  v ← β2·v + (1−β2)·(s·Δ)²
    φ ← φ − lr · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + ε)

At τ = 0 this is exactly Adam. ``cgad_update`` is the functional core; the classes only keep
state and decide the scale. Moments are kept in float32 for low-precision parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .defaults import DEFAULT_ALPHA, DEFAULT_CUTOFF, DEFAULT_LR
from .staleness import check_age, staleness_weight

__all__ = ["CGAD", "PACGAD", "AdamDecay", "cgad_update"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def cgad_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    scale: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """One Adam step on scale·grad, in place, with foreach kernels.

    All tensors of one call share a device; params may be low precision, in which case grads are
    upcast and the moments are float32. ``scale`` must be > 0 (the caller drops zero-weight input).
    """
    if not params:
        return
    low_precision = params[0].dtype in _LOW_PRECISION
    if low_precision:
        grads = [g.float() for g in grads]
    torch._foreach_add_(steps, 1)
    if scale == 1.0:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    else:
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=(1 - beta1) * scale)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=(1 - beta2) * scale * scale)

    # m̂/(√v̂ + ε) = (m·√bc2/bc1) / (√v + ε·√bc2): folds both bias corrections into two scalars
    # per tensor, saving a full pass over v compared with dividing √v by √bc2.
    step_values = [float(s) for s in steps]
    bc2_sqrt = [math.sqrt(1 - beta2**t) for t in step_values]
    step_sizes = [-lr * b / (1 - beta1**t) for b, t in zip(bc2_sqrt, step_values, strict=True)]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, [eps * b for b in bc2_sqrt])
    if low_precision:
        update = torch._foreach_div(exp_avgs, denom)
        torch._foreach_mul_(update, step_sizes)
        for p, u in zip(params, update, strict=True):
            p.add_(u)
    else:
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


class _AgeWeightedAdam(Optimizer):
    """Shared state handling of CGAD, Adam-Decay and PA-CGAD; subclasses choose the ages."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        alpha: float,
        cutoff: float,
        restart_every: int,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not isinstance(restart_every, int) or restart_every < 0:
            raise ValueError(f"restart_every must be an integer >= 0 (0 = never), got {restart_every!r}")
        staleness_weight(0, alpha, cutoff)  # validates alpha and cutoff with their own messages
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, alpha=alpha, cutoff=cutoff, restart_every=restart_every
        )
        super().__init__(params, defaults)

    def _step_group(self, group: dict[str, Any], age: float) -> bool:
        """Apply the group's pseudo-gradients at the given age; False when σ(age) dropped them."""
        scale = staleness_weight(age, group["alpha"], group["cutoff"])
        if scale == 0.0:
            return False
        by_device: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], ...]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse pseudo-gradients")
            state = self.state[p]
            restart = group["restart_every"]
            if not state or (restart and int(state["step"]) % restart == 0 and int(state["step"]) > 0):
                moment_dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(
                    p, dtype=moment_dtype, memory_format=torch.preserve_format
                )
                state["exp_avg_sq"] = torch.zeros_like(
                    p, dtype=moment_dtype, memory_format=torch.preserve_format
                )
            lists = by_device.setdefault((p.device, p.dtype), ([], [], [], [], []))
            for lst, t in zip(
                lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]), strict=True
            ):
                lst.append(t)
        beta1, beta2 = group["betas"]
        for params, grads, exp_avgs, exp_avg_sqs, steps in by_device.values():
            cgad_update(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                scale=scale,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
            )
        return True


class CGAD(_AgeWeightedAdam):
    """Cosine-Gated Adam-Decay: every group receives pseudo-gradients of one age per step.

    Defaults: see DEFAULT_LR, DEFAULT_ALPHA and DEFAULT_CUTOFF.
    ``restart_every`` = K > 0 resets m, v and t every K applied steps (outer-momentum restart).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = DEFAULT_LR,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        alpha: float = DEFAULT_ALPHA,
        cutoff: float = DEFAULT_CUTOFF,
        restart_every: int = 0,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, alpha=alpha, cutoff=cutoff, restart_every=restart_every
        )

    @torch.no_grad()
    def step(self, closure: Any = None, *, age: float = 0) -> Any:
        """Apply ``p.grad`` as a pseudo-gradient of ``age`` outer rounds to every group."""
        age = check_age(age)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group, age)
        return loss


class AdamDecay(CGAD):
    """CGAD without the cosine gate (γ ≡ 1): stale input is shrunk by e^(−ατ), never dropped."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = DEFAULT_LR,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        alpha: float = DEFAULT_ALPHA,
        restart_every: int = 0,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, alpha=alpha, cutoff=math.inf, restart_every=restart_every
        )


class PACGAD(_AgeWeightedAdam):
    """Per-fragment CGAD: each param group is one fragment with its own age and step count."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = DEFAULT_LR,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        alpha: float = DEFAULT_ALPHA,
        cutoff: float = DEFAULT_CUTOFF,
        restart_every: int = 0,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, alpha=alpha, cutoff=cutoff, restart_every=restart_every
        )

    @torch.no_grad()
    def step(self, closure: Any = None, *, ages: Sequence[float | None]) -> Any:
        """``ages[i]`` is fragment i's age this step; ``None`` leaves fragment i untouched."""
        if len(ages) != len(self.param_groups):
            raise ValueError(
                f"PACGAD has {len(self.param_groups)} fragments (param groups) but got {len(ages)} ages"
            )
        checked = [None if a is None else check_age(a) for a in ages]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, age in zip(self.param_groups, checked, strict=True):
            if age is not None:
                self._step_group(group, age)
        return loss
