"""A member's outer state as it travels: φ, versions and the outer optimizer's state, packed
for a checkpoint or a joining peer's snapshot, and checked whole before it is adopted.

Every value of a state that came from a peer is the peer's claim: versions must be whole and
non-negative, φ finite in the dtype it will be held in, and the optimizer's per-parameter state
of its parameter's shape and finite, or nothing of it is taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["STATE_DTYPES", "load_checked_state", "snapshot_state"]


def snapshot_state(
    phi: Sequence[Tensor], versions: Sequence[int], optimizer: torch.optim.Optimizer, compact: bool
) -> dict[str, Any]:
    """φ, versions and ``optimizer``'s state (``OuterLoop.state_dict``).

    Args:
        phi: the outer parameters.
        versions: their versions, per fragment.
        optimizer: the outer optimizer.
        compact: φ in float16 and the optimizer's float tensors in bfloat16 (a snapshot).
    """
    packed = optimizer.state_dict()
    if compact:
        packed["state"] = {
            index: {
                k: v.to(torch.bfloat16) if isinstance(v, Tensor) and v.is_floating_point() else v
                for k, v in state.items()
            }
            for index, state in packed["state"].items()
        }
        phi = [p.detach().to(torch.float16) if _fits_float16(p) else p.detach().clone() for p in phi]
    else:
        phi = [p.detach().clone() for p in phi]
    return {"phi": phi, "versions": list(versions), "optimizer": packed}


def load_checked_state(
    local_phi: Sequence[Tensor], fragments: int, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> tuple[list[Tensor], list[int]]:
    """Check a state whole against this member's φ and load its optimizer part into
    ``optimizer`` (left as it was when anything does not fit): the state's φ and versions, for
    the caller to adopt. ``ValueError`` when it does not fit.

    Args:
        local_phi: this member's φ (shapes and dtypes to hold the state's in).
        fragments: this member's number of fragments.
        optimizer: the outer optimizer to load the state's part into.
        state: the state, as ``snapshot_state`` made it (a peer's claim).
    """

    phi, versions = state["phi"], state["versions"]
    if not (isinstance(versions, list) and all(type(v) is int and v >= 0 for v in versions)):
        raise ValueError(f"versions {versions!r}")
    if len(phi) != len(local_phi) or len(versions) != fragments:
        raise ValueError("outer state has a different model or fragment layout")
    for p, q in zip(local_phi, phi, strict=True):
        if not isinstance(q, Tensor) or p.shape != q.shape:
            raise ValueError(f"outer state tensor {getattr(q, 'shape', q)} != local {tuple(p.shape)}")
        # as φ will hold it: a float64 1e39 is finite, and Inf in float32
        if q.dtype not in STATE_DTYPES or not torch.isfinite(q.to(p.dtype)).all():
            raise ValueError(f"outer state tensor of {q.dtype} holds NaN or Inf, or is not a float")
    # moments and step counts from the state; hyperparameters stay this peer's own, but the
    # running freshness is state (a resumed node kept it at 0 and lost its momentum)
    ours = [{k: v for k, v in g.items() if k not in ("params", "freshness")} for g in optimizer.param_groups]
    saved = optimizer.state_dict()
    try:
        optimizer.load_state_dict(state["optimizer"])
        for group, hyper in zip(optimizer.param_groups, ours, strict=True):
            group.update(hyper)
            if "freshness" in group:
                group["freshness"] = _share(group["freshness"])
        _check_optimizer_state(optimizer)
    except Exception as exc:  # torch raises whatever the malformed part provokes
        optimizer.load_state_dict(saved)
        raise ValueError(f"the outer optimizer's state does not fit this peer's: {exc!r}") from exc
    return phi, list(versions)


STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what φ may come in


def _share(value: object) -> float:
    """A running share read from a state: a number in [0, 1], else 0 (nothing known)."""
    return min(1.0, max(0.0, float(value))) if _finite_number(value) else 0.0  # type: ignore[arg-type]


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every per-parameter state tensor of ``optimizer`` has its parameter's shape (or none, a
    step count) and finite values, and every number is finite: a wrong shape failed at the next
    outer step, and a NaN moment made φ NaN for good. ``ValueError`` otherwise."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    if value.dim() != 0 and value.shape != p.shape:
                        raise ValueError(f"state {name!r} of shape {tuple(value.shape)} for {tuple(p.shape)}")
                    if value.is_floating_point() and not torch.isfinite(value).all():
                        raise ValueError(f"state {name!r} holds NaN or Inf")
                elif not _finite_number(value):
                    raise ValueError(f"state {name!r} is {value!r}")


def _fits_float16(tensor: Tensor) -> bool:
    """Whether float16 holds every value of ``tensor`` (only the largest magnitude can overflow;
    the smallest lose digits that are negligible beside the others)."""
    return tensor.numel() == 0 or float(tensor.detach().abs().max()) < torch.finfo(torch.float16).max / 2
