"""NoLoCo's outer step (arXiv:2506.10911): no all-reduce, a momentum step within a small group.

Each round a worker i meets a random group G (pairs by default) and, in DiLoCo's sign convention
(Δ = φ_before − θ_after), updates its outer momentum δ and outer parameters φ:

    δ_i ← β·δ_i − η·mean_G(Δ) − η·(φ_i − mean_G(φ));   φ_i ← φ_i + δ_i

The group exchange itself belongs to the transport; this is only the arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["noloco_update"]


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
