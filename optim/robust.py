"""Keeping one bad pseudo-gradient from moving the outer step far or the wrong way: clipping
around the own Δ, and refusing a Δ that points against it.

A peer's Δ_i arrives as the peer's claim; the node's own fresh Δ_0 is the one it can trust. Each
delivery is clipped around it (centered clipping):

    Δ_i' = Δ_0 + (Δ_i − Δ_0) · min(1, r / ‖Δ_i − Δ_0‖),   r = radius · ‖Δ_0‖

so however a delivery is scaled, it lands within r of the node's own update, and the merged
update (a weighted mean of points within r of Δ_0) has a norm of at most (1 + radius)·‖Δ_0‖.
Honest peers' Δs of the same round differ from the own one by about √2·‖Δ_0‖ when their noise
dominates (independent batches), so a radius of 2 leaves them almost always untouched; an
attacker's ×1e6 becomes a step no larger than an honest peer's worst. The clip also bounds what
reaches an Adam-family optimizer's second moment.

Clipping bounds how far, not which way: a sign-flipped Δ is about 2‖Δ_0‖ from the own one and
passes whole. Early in training honest deltas of a round share the descent direction (cosine
with the own Δ 0.23 at the lowest and 0.40 at the median over 262 deliveries of a 4-worker run
under random delays up to 4 rounds), so a delivery whose cosine with Δ_0 is below a floor (0 by
default: it undoes the own progress) is refused instead. Late in training that is no longer so:
over 8 workers and 150 rounds 4-15% of honest deltas fell below 0; refusing them cost 0.007 of
final loss against no defence, with and without delay, where late mixing pulls back the drift the
refusals make (bench/defence_tax.py; ~0.1 in a simulator that barely mixed, docs/RESULTS.md); the
floor is the caller's to set (-1 takes every direction). What
an attacker can still send is a Δ at most r from Δ_0 and not against it: noise of bounded size.

A peer's φ (gossip, late mixing) is held the same way around this node's φ at that version, but
two honest φs drift apart with delay, not with one round's Δ: under random delays up to 8 rounds
most of them lay beyond 2 norms of a Δ, and holding them there took the drift removal mixing is
for (0.05 of final loss at 8 workers). ``SpreadBound`` widens that bound to a multiple of the
median distance of the peers' φs seen lately, which one far-off φ among many moves little.

The reference is the same for every delivery of a round: ``AroundOwn`` takes its norm once, then
one float64 pass over each delivery (its dot product with the reference and its own norm) gives
both the cosine and the distance ‖Δ_i − Δ_0‖² = ‖Δ_i‖² − 2⟨Δ_i, Δ_0⟩ + ‖Δ_0‖² (in float64 the
cancellation is harmless where it matters: near the clip radius the distance is of the order of
the norms). The passes go through ``FLOAT64_CHUNK`` values at a time: whole float64 copies of the
reference and of each delivery were 16 bytes per parameter of host memory at the outer step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FLOAT64_CHUNK", "AroundOwn", "SpreadBound", "Verdict", "chunk_dots", "near_copies", "verdict"]

FLOAT64_CHUNK = 1 << 20  # values per float64 pass: 8 MB of copies, whatever the fragment's size


def chunk_dots(delivery: Tensor, reference: Tensor | None) -> tuple[float, float]:
    """⟨delivery, reference⟩ (0 without one) and ⟨delivery, delivery⟩ of one chunk of at most
    ``FLOAT64_CHUNK`` values, in float64 (both flat). Summed over the chunks in order, as
    ``AroundOwn`` does, whoever walks the chunks gets the same floats.

    Args:
        delivery: the chunk of a delivery.
        reference: the same chunk of the reference, or None.
    """
    d = delivery.double()
    dot = 0.0 if reference is None else float(torch.dot(d, reference.double()))
    return dot, float(torch.dot(d, d))


def near_copies(dots: Tensor, threshold: float, norm_ratio: float = 2.0) -> list[list[bool]]:
    """Which pairs of k tensors are near copies of each other, from their Gram matrix: a cosine
    of ``threshold`` or more at norms within ``norm_ratio`` of each other (a scaled copy is a
    scaled delivery, the clip's to judge). A k × k table, False on the diagonal.

    Args:
        dots: the k × k float64 matrix of ⟨a_i, a_j⟩.
        threshold: the cosine from which two are one.
        norm_ratio: the most one's norm may exceed the other's for them to count as one.
    """
    norms = dots.diagonal().clamp_min(0.0).sqrt()
    scale = torch.outer(norms, norms)
    cosine = torch.where(scale > 0, dots / torch.where(scale > 0, scale, 1.0), torch.zeros_like(dots))
    ratio = torch.outer(norms, 1.0 / norms.clamp_min(1e-300))
    alike = (cosine >= threshold) & (ratio <= norm_ratio) & (ratio >= 1.0 / norm_ratio)
    alike.fill_diagonal_(False)
    return alike.tolist()


def _dots(delivery: Tensor, reference: Tensor | None) -> tuple[float, float]:
    """⟨delivery, reference⟩ (0 without one) and ⟨delivery, delivery⟩ in float64, a chunk at a
    time (both flat)."""
    dot = norm_sq = 0.0
    for start in range(0, delivery.numel(), FLOAT64_CHUNK):
        stop = start + FLOAT64_CHUNK
        d, n = chunk_dots(delivery[start:stop], None if reference is None else reference[start:stop])
        dot, norm_sq = dot + d, norm_sq + n
    return dot, norm_sq


@dataclass(frozen=True)
class Verdict:
    """What the reference makes of one delivery: its cosine with it, its distance from it, and
    the weight of the delivery in ``lerp(reference, delivery, weight)`` that holds it within the
    bound (None: within it already, taken as sent)."""

    cosine: float
    distance: float
    weight: float | None


def verdict(dot: float, norm_sq: float, reference_norm_sq: float, bound: float) -> Verdict:
    """The verdict on a delivery from its dot product with the reference, its squared norm and
    the reference's (float64 sums), for a clip at ``bound`` around the reference.

    Args:
        dot: ⟨delivery, reference⟩.
        norm_sq: ‖delivery‖².
        reference_norm_sq: ‖reference‖².
        bound: the distance from the reference within which a delivery is taken as sent.
    """
    if not (math.isfinite(dot) and math.isfinite(norm_sq)):
        raise ValueError("AroundOwn needs finite deliveries")
    norms = math.sqrt(norm_sq * reference_norm_sq)
    cosine = 1.0 if norms == 0.0 else dot / norms
    distance = math.sqrt(max(norm_sq - 2.0 * dot + reference_norm_sq, 0.0))
    return Verdict(cosine, distance, None if distance <= bound else bound / distance)


class AroundOwn:
    """A round's yardstick: the own Δ, against which each peer's Δ of the round is judged.
    ``scale`` is what the radius counts in (default ‖reference‖): a peer's φ is judged around
    this node's φ in norms of its own Δ. Non-finite input is the caller's to refuse first
    (``ValueError`` here)."""

    def __init__(self, reference: Tensor, radius: float, scale: float | None = None) -> None:
        if not math.isfinite(radius) or radius < 0:
            raise ValueError(f"radius must be finite and >= 0, got {radius}")
        if scale is not None and not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"scale must be finite and >= 0, got {scale}")
        self.reference = reference
        # in float64: a finite fp32 tensor of 1e20s has a norm that overflows fp32
        self._flat = reference.detach().reshape(-1)
        _, self._norm_sq = _dots(self._flat, None)
        if not math.isfinite(self._norm_sq):
            raise ValueError("AroundOwn needs a finite reference")
        self.bound = radius * (math.sqrt(self._norm_sq) if scale is None else scale)

    def judge(self, delivery: Tensor) -> tuple[float, Tensor, bool]:
        """The delivery's cosine with the reference (1.0 when either is zero: no direction to
        oppose), the delivery clipped to within ``radius · ‖reference‖`` of the reference, and
        whether it had to be."""
        cosine, held, clipped, _ = self.measure(delivery)
        return cosine, held, clipped

    def measure(self, delivery: Tensor) -> tuple[float, Tensor, bool, float]:
        """``judge``'s three, and the delivery's distance to the reference, from the same pass."""
        if delivery.shape != self.reference.shape:
            raise ValueError(f"shapes differ: {tuple(self.reference.shape)} and {tuple(delivery.shape)}")
        dot, norm_sq = _dots(delivery.detach().reshape(-1), self._flat)
        judged = verdict(dot, norm_sq, self._norm_sq, self.bound)
        if judged.weight is None:
            return judged.cosine, delivery, False, judged.distance
        # reference + (delivery − reference) · bound / distance, in one new tensor
        held = delivery.to(self.reference.dtype)
        return judged.cosine, torch.lerp(self.reference, held, judged.weight), True, judged.distance


class SpreadBound:
    """How far a peer's φ may lie from this node's and still be taken as sent: the larger of a
    fixed bound (the caller's: ``radius`` norms of the own Δ) and ``spread`` times the median of
    the last ``window`` distances seen (once ``min_seen`` are in). A distance is recorded after
    the bound it is judged by is taken, so a far-off φ does not widen its own.

    Args:
        spread: the multiple of the median distance that is still taken whole.
        window: how many recent distances the median is over.
        min_seen: how many it needs before it widens the fixed bound.
    """

    def __init__(self, spread: float = 3.0, window: int = 32, min_seen: int = 4) -> None:
        self.spread = spread
        self.min_seen = min_seen
        self.seen: deque[float] = deque(maxlen=window)

    def bound(self, fixed: float) -> float:
        if len(self.seen) < self.min_seen:
            return fixed
        # the low median: with half the window far off, the mean of the middle two would be
        # half the far value, and the bound 1.5 times it; a strict majority is needed instead
        return max(fixed, self.spread * statistics.median_low(self.seen))

    def observe(self, distance: float) -> None:
        if math.isfinite(distance):
            self.seen.append(distance)
