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

from cgad.node.config import OuterOptions
from cgad.node.member.ledger import Counters
from cgad.node.member.methods import unflatten
from cgad.optim import AroundOwn, SpreadBound, staleness_weight
from cgad.protocol.codec import encoded_size
from cgad.protocol.config import wire_codec
from cgad.protocol.transport import Fragment

__all__ = ["LATE_SHARE", "PHI_KEPT", "Mixer", "gossip_pull", "held_phi", "remember_phi"]

# own φ_f versions kept to measure drift at, each 4 bytes a parameter: the two newest ended no
# worse than every version up to the cutoff (8 members x 150 rounds, random:8 delays, 2 seeds:
# 3.764 against 3.770; bench/phi_kept.py), where a quarter of the mixes had been 2-3 rounds old
PHI_KEPT = 2
# --mixing late sends φ_f in a round only when the peers' deltas have been this late (1 − r):
# below it the pull would be a quarter of --mixing-rate or less, not worth φ's bytes
LATE_SHARE = 0.25


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


class Mixer:
    """One member's φ mixing (``--mixing``): in which rounds φ_f goes out and is pulled toward a
    peer's, how a peer's φ is held, and the own φ_f kept to measure drift at.

    Args:
        options: the outer options (mixing, its period and rate, aggregation, clip radius, α, cutoff).
        mixes_params: the method mixes φ itself (NoLoCo): no separate mixing.
        params_codec: how φ goes out (its bytes, against the link's round budget).
        counters: where the mixes and held φs are counted.
        rng: picks the gossip partner.
    """

    def __init__(
        self,
        options: OuterOptions,
        mixes_params: bool,
        params_codec: str,
        counters: Counters,
        rng: random.Random,
    ) -> None:
        self.options, self.mixes_params, self.params_codec = options, mixes_params, params_codec
        self.counters, self.rng = counters, rng
        # φ_f as published at each recent version (gossip measures drift against peers' φ there),
        # and how far peers' φ_f have lain from it lately (``hold``)
        self.published: dict[int, dict[int, Tensor]] = {}
        self.spread: dict[int, SpreadBound] = {}

    def due(self, version: int, lateness: Callable[[], float]) -> bool:
        """Whether this round's φ_f (at ``version``; peers' deltas ``lateness()`` late) goes out."""
        o = self.options
        if o.mixing == "none" or self.mixes_params:
            return False
        if o.mixing == "late":
            return lateness() >= LATE_SHARE
        return version % o.mixing_period == 0

    def room(self, numel: int, sent_bytes: int, budget: float | None, total_numel: int) -> bool:
        """Under ``--mixing late``: whether a φ_f of ``numel`` values fits the link's round
        ``budget`` (bytes for all ``total_numel`` values; None: not measured) beside the Δ just
        sent (``sent_bytes``). φ is several times a Δ's bytes; on a link it does not fit it would
        delay the deltas behind it (the 10 Mbit testbed at H = 50: docs/RESULTS.md item 8), so
        there the node sends deltas only. Gossip every round is sent regardless."""
        if self.options.mixing != "late":
            return True
        if budget is None:
            return False
        params_bytes = encoded_size(numel, wire_codec(self.params_codec))
        return sent_bytes + params_bytes <= budget * numel / total_numel

    def now(self, f: int, version: int, lateness: Callable[[], float]) -> bool:
        """Whether fragment f mixes at this step: late mixing wherever its φ went out this round
        (the step has moved the freshness since), gossip at its period."""
        if self.options.mixing == "late":
            return version in self.published.get(f, {})
        return self.due(version, lateness)

    def hold(self, f: int, anchor: Tensor, theirs: Tensor, own_norm: Callable[[], float | None]) -> Tensor:
        """A peer's φ_f as this member mixes it in (``held_phi``: within ``clip_radius`` × the own
        Δ_f's norm ``own_norm()`` of ``anchor``, this member's φ_f where the two are compared, or
        the peers' recent spread where wider); ``anchor`` without an own Δ (``own_norm()`` None);
        as sent under ``mean``."""
        if self.options.aggregation != "clip":
            return theirs
        norm = own_norm()
        if norm is None:
            return anchor
        spread = self.spread.setdefault(f, SpreadBound())
        held, clipped = held_phi(anchor, theirs, self.options.clip_radius * norm, spread)
        self.counters.clipped_params += clipped
        return held

    def pull(
        self, f: int, phi: Sequence[Tensor], params: Sequence[Fragment], version: int,
        lateness: Callable[[], float], own_norm: Callable[[], float | None],
    ) -> None:  # fmt: skip
        """Pull fragment f's φ toward one random peer's (``gossip_pull``); with ``--mixing late``
        scaled by the lateness 1 − r as well."""
        o = self.options
        rate = o.mixing_rate * (lateness() if o.mixing == "late" else 1.0)
        mine = self.published.setdefault(f, {})
        hold = lambda anchor, theirs: self.hold(f, anchor, theirs, own_norm)  # noqa: E731
        if gossip_pull(
            phi, mine, params, version=version, rate=rate,
            alpha=o.alpha, cutoff=o.cutoff, rng=self.rng, hold=hold,
        ):  # fmt: skip
            self.counters.mixed += 1

    def forget(self) -> None:
        """φ moved outside an outer step or another trajectory was adopted: drift measured at
        older versions is gone."""
        self.published.clear()
