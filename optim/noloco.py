"""NoLoCo's outer step (arXiv:2506.10911): no all-reduce, a momentum step within a small group.

Each round a worker i meets a random group G (pairs by default) and, in DiLoCo's sign convention
(Δ = φ_before − θ_after), updates its outer momentum δ and outer parameters φ:

    δ_i ← β·δ_i − η·mean_G(Δ) − η·(φ_i − mean_G(φ));   φ_i ← φ_i + δ_i

The group exchange itself belongs to the transport; this is only the arithmetic: ``noloco_update``
is the functional core, ``NoLoCo`` keeps δ per parameter the way ``torch.optim`` keeps state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["NoLoCo", "noloco_update"]


def noloco_update(
    phi: list[Tensor],
    delta: list[Tensor],
    group_mean_phi: list[Tensor] | None,
    group_mean_delta: list[Tensor] | None,
    momentum: list[Tensor],
    *,
    lr: float = 0.7,
    beta: float = 0.5,
) -> tuple[list[Tensor], list[Tensor]]:
    """Update ``phi`` and ``momentum`` in place and return them.

    ``delta`` is this worker's own pseudo-gradient. When the group exchange failed this round,
    pass ``None`` for the group means: the worker is then a group of one (mean_G(Δ) = own Δ,
    and the pull toward the group's weights vanishes), so it still takes its local step.
    """
    if not lr > 0:
        raise ValueError(f"lr (η) must be > 0, got {lr}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    lengths = {len(phi), len(delta), len(momentum)}
    lengths |= {len(x) for x in (group_mean_phi, group_mean_delta) if x is not None}
    if len(lengths) != 1:
        raise ValueError(f"phi, delta, group means and momentum must hold as many tensors; got {lengths}")
    mean_delta = delta if group_mean_delta is None else group_mean_delta
    torch._foreach_mul_(momentum, beta)
    torch._foreach_add_(momentum, mean_delta, alpha=-lr)
    if group_mean_phi is not None:
        torch._foreach_add_(momentum, phi, alpha=-lr)
        torch._foreach_add_(momentum, group_mean_phi, alpha=lr)
    torch._foreach_add_(phi, momentum)
    return phi, momentum


class NoLoCo(Optimizer):
    """NoLoCo's outer step over ``p.grad`` (this worker's own Δ); parameters without a grad are
    left alone, so one fragment's parameters step at a time."""

    def __init__(self, params: Iterable[Any], lr: float = 0.7, beta: float = 0.5) -> None:
        if not lr > 0:
            raise ValueError(f"lr (η) must be > 0, got {lr}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, group_mean_phi: list[Tensor] | None = None, group_mean_delta: list[Tensor] | None = None
    ) -> None:
        """One step of every parameter that has a grad; the group means, when given, hold one
        tensor per such parameter, in parameter order (None: a group of one)."""
        offset = 0
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            momentum = []
            for p in params:
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                momentum.append(state["momentum"])
            end = offset + len(params)
            noloco_update(
                params,
                [p.grad for p in params],
                None if group_mean_phi is None else group_mean_phi[offset:end],
                None if group_mean_delta is None else group_mean_delta[offset:end],
                momentum,
                lr=group["lr"],
                beta=group["beta"],
            )
            offset = end
