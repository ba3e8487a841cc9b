"""How many members a round's weighted mean averages, and the inner lr that follows from it.

An outer step that averages N members' pseudo-gradients averages N Adam *updates*, each already
normalised by its own member's noisy second moment. Data-parallel Adam on the same N batches
normalises the averaged *gradient* instead, whose noise is N times smaller: where the gradient
noise dominates (most coordinates, most of training) its steps are √N times longer than the mean
of the members' steps, and equally noisy. So N members that average their deltas track
data-parallel training at inner lr η when each trains at √N·η: Adam's square-root scaling rule
(Malladi et al. 2022) applied to the swarm's effective batch. The weighted mean of deliveries
with weights s_i reduces noise as much as an unweighted mean of (Σ s_i)² / Σ s_i² of them
(Kish's effective sample size), which is the N the rule takes: a member alone, or one whose peers'
deltas are all gated out as stale, counts 1 and trains at η exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["MAX_AVERAGED", "effective_count", "inner_lr_scale", "running_count"]

MAX_AVERAGED = 16.0  # the most members the scale follows (×4 inner lr): tested up to 16 members
COUNT_DECAY = 0.5  # the running count is half this round's count, half the past's


def effective_count(weights: Sequence[float]) -> float:
    """(Σ w)² / Σ w²: how many equally weighted deliveries the mean is worth (1 for one, or none).

    Args:
        weights: each delivery's weight in the mean (>= 0).
    """
    total, squares = math.fsum(weights), math.fsum(w * w for w in weights)
    return total * total / squares if squares > 0 else 1.0


def running_count(count: float, now: float, decay: float = COUNT_DECAY) -> float:
    """c ← ρ·c + (1 − ρ)·now, kept within [1, MAX_AVERAGED].

    Args:
        count: the running count so far.
        now: this step's effective count.
        decay: ρ, the weight of the past.
    """
    value = decay * count + (1 - decay) * now
    return min(max(value, 1.0), MAX_AVERAGED)


def inner_lr_scale(count: float) -> float:
    """√N: the factor on the inner lr of a member whose steps are averaged over N members."""
    return math.sqrt(min(max(count, 1.0), MAX_AVERAGED))
