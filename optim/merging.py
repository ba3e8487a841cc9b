"""How one round's pseudo-gradients for a fragment become the one the outer optimizer steps on.

    Δ̄ = Σ_i w_i·s_i·Δ_i / Σ_i w_i

w_i is the tokens behind Δ_i (at least 1, so a publisher that claims none still counts once) and
s_i its age scale (σ(τ_i) for the age-aware methods, 1 for the rest). Deliveries with s_i = 0
are left out of both sums, so a gated-out straggler neither moves the mean nor dilutes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["merge"]


def merge(deltas: Sequence[Tensor], tokens: Sequence[int], scales: Sequence[float]) -> Tensor | None:
    """Δ̄ of the deliveries with a positive scale; None when no delivery has one."""
    if not len(deltas) == len(tokens) == len(scales):
        raise ValueError(f"{len(deltas)} deltas, {len(tokens)} token counts, {len(scales)} scales")
    if any(not s >= 0 for s in scales):
        raise ValueError(f"scales must be >= 0, got {list(scales)}")
    kept = [(d, max(int(t), 1), float(s)) for d, t, s in zip(deltas, tokens, scales, strict=True) if s > 0]
    if not kept:
        return None
    total = sum(w for _, w, _ in kept)
    mean = torch.zeros_like(kept[0][0])
    for delta, w, s in kept:
        mean.add_(delta, alpha=s * w / total)
    return mean
