"""Gossip: pulling a fragment's outer parameters toward one peer's, by how far the two drifted.

Pseudo-gradient averaging never closes an offset between two members' φ: adding the same mean to
each keeps the gap. Gossip closes it a share at a time (``--mixing``): φ_f ← φ_f − μ·σ(V − s)·
(φ_f(s) − φ_peer(s)), the difference taken at a version s both published. Measured at the same
version, a peer's φ that is s rounds old still says how far apart the two drifted, never how far
behind it is; so a late φ does not drag this member back to where it was.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from torch import Tensor

from cgad.node.member.methods import unflatten
from cgad.optim import AroundOwn, SpreadBound, staleness_weight
from cgad.protocol.transport import Fragment

__all__ = ["PHI_KEPT", "gossip_pull", "held_phi", "remember_phi"]

# own φ_f versions kept to measure drift at, each 4 bytes a parameter: the two newest ended no
# worse than every version up to the cutoff (8 members x 150 rounds, random:8 delays, 2 seeds:
# 3.764 against 3.770; bench/phi_kept.py), where a quarter of the mixes had been 2-3 rounds old
PHI_KEPT = 2


def remember_phi(published: dict[int, Tensor], version: int, phi: Tensor, kept: int = PHI_KEPT) -> None:
    """Keep ``phi`` (this member's flat φ_f as published at ``version``) in ``published``, and
    only the ``kept`` newest versions there."""
    published[version] = phi
    for old in sorted(published)[:-kept]:
        del published[old]


def gossip_pull(
    params: Sequence[Tensor],
    published: dict[int, Tensor],
    peers: Sequence[Fragment],
    *,
    version: int,
    rate: float,
    alpha: float,
    cutoff: float,
    rng: random.Random,
    hold: Callable[[Tensor, Tensor], Tensor],
) -> bool:
    """Pull ``params`` (fragment f's φ, in place) toward one random peer's φ; whether it did.
    Versions of ``published`` the cutoff has passed are dropped (σ is 0 from there on).

    Args:
        params: fragment f's φ tensors.
        published: this member's own φ_f (flat) at each recent version it published.
        peers: peers' φ_f that arrived (``Kind.PARAMS``).
        version: fragment f's version now (V).
        rate: μ, the share of the drift closed at age 0 (already scaled by lateness if late).
        alpha: σ's decay; cutoff: the age where σ reaches 0.
        rng: this member's random stream (the partner).
        hold: a peer's φ as this member mixes it in, given its own φ at that version (clipping).
    """
    numel = sum(p.numel() for p in params)
    newest: dict[str, Fragment] = {}
    for p in peers:
        if p.key.base_version in published and p.tensor.numel() == numel:
            held = newest.get(p.key.publisher)
            if held is None or p.key.base_version > held.key.base_version:
                newest[p.key.publisher] = p
    mixed = False
    if newest:
        partner = newest[rng.choice(sorted(newest))]
        s = partner.key.base_version
        pull = rate * staleness_weight(version - s, alpha, cutoff)
        if pull > 0:
            drift = published[s] - hold(published[s], partner.tensor)
            for p, d in zip(params, unflatten(params, drift), strict=True):
                p.data.sub_(d.to(p.dtype), alpha=pull)
            mixed = True
    for old in [v for v in published if v <= version - cutoff]:
        del published[old]
    return mixed


def held_phi(anchor: Tensor, theirs: Tensor, fixed: float, spread: SpreadBound) -> tuple[Tensor, bool]:
    """A peer's φ as a member mixes it in, and whether it had to be held: within the larger of
    ``fixed`` and ``spread``'s bound of ``anchor`` (honest φs drift apart with delay); the
    distance then joins ``spread``'s record.

    Args:
        anchor: this member's φ where the two are compared.
        theirs: the peer's φ.
        fixed: the bound in any case (the clip radius in norms of the own Δ).
        spread: the fragment's record of how far peers' φ have lain lately.
    """
    around = AroundOwn(anchor, 1.0, spread.bound(fixed))
    _, held, clipped, distance = around.measure(theirs)  # one float64 pass for both
    spread.observe(distance)
    return held, clipped
