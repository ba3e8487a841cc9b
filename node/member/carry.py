"""The inner steps a fragment's θ took between its publish and its outer step, carried over the
step (``OuterLoop.apply(carry=True)``: training ran on while the round's deltas arrived).

The progress is θ_f − θ_f at publish = θ_f − (φ_f − Δ_own), and θ_f afterwards φ_f' plus it. A
float32 θ holds the progress itself during the step (the same arithmetic as a copy, in the same
order: nothing changes but the 4 bytes per parameter a float32 copy of the fragment took at
every outer step); θ of another dtype gets the float32 host copy, so that no precision is lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["hold_progress", "restart_theta"]


def hold_progress(
    theta: Sequence[Tensor], phi: Sequence[Tensor], own: Sequence[Tensor]
) -> list[Tensor] | None:
    """Take the progress out of a fragment's θ before its outer step: in θ itself where every
    tensor is float32 (None), else as float32 host copies (returned).

    Args:
        theta: the fragment's θ tensors (the model's; any device).
        phi: the fragment's φ tensors (float32, host), before the step.
        own: the own Δ published, cut as ``phi``.
    """
    with torch.no_grad():
        if all(t.dtype == torch.float32 for t in theta):
            for t, p, d in zip(theta, phi, own, strict=True):
                t.sub_(p.to(t.device)).add_(d.to(t.device))
            return None
        return [t.detach().to("cpu", torch.float32) - p + d for t, p, d in zip(theta, phi, own, strict=True)]


def restart_theta(
    theta: Sequence[Tensor], phi: Sequence[Tensor], progress: list[Tensor] | None, carried: bool
) -> None:
    """θ ← φ after the outer step, plus the progress when it is ``carried`` (held in θ where
    ``progress`` is None, else those copies).

    Args:
        theta: the fragment's θ tensors.
        phi: the fragment's φ tensors, after the step.
        progress: what ``hold_progress`` returned.
        carried: whether ``hold_progress`` was called for this step.
    """
    with torch.no_grad():
        for n, (t, p) in enumerate(zip(theta, phi, strict=True)):
            if not carried:
                t.copy_(p)
            elif progress is None:
                t.add_(p.to(t.device))
            else:
                t.copy_(p + progress[n])
