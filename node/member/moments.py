"""The inner optimizer's first moment, shared beside each delta (``--moments shared``, the default).

Why. At the end of a block each member's AdamW first moment m is an average of its own last
~1/(1 − β1) gradients: as noisy as one member's batches. The outer step starts every member's next
block from the same φ, but each with its own m, so the first steps of every block follow each
member's own noise, where data-parallel Adam's m averages all N members' gradients. Averaging m
as the deltas are averaged closes most of that gap: at the sweep scale (8 members, τ = 0, 60
rounds, seed 0) G rose from 0.67 to 0.89 with every member's m averaged, and to 0.85 with four
peers' m in 4-bit blocks, while no estimate of the mean m from the averaged delta helped
(docs/DESIGN.md §1, "The inner first moment").

What is sent: m of the fragment's tensors when its Δ is published, as a ``Kind.MOMENTS`` fragment
of the same key: in 4-bit blocks (an eighth of a float32 Δ's bytes) where the link's round budget
has room for it beside the Δ, else sparse (the largest magnitudes of each block) in what the Δ
leaves of the budget; on a measured link (``--codec auto``) the Δ leaves m ``BUDGET_SHARE`` (at about 0.2
bytes a parameter, the 10 Mbit testbed's, a 4-bit m never fit and no m was ever sent: docs/DESIGN.md
§1, "Under a link budget"). While the link is not measured, 4-bit where m is at most half the Δ's
bytes. What is taken at the outer step: the peers' m of this step's version and of the
versions before it, each weighted as the outer method weighs a delta of its age (σ(τ) under
CGA, 0 past the cutoff: a late m belongs to a trajectory φ has left; daemons a version apart in
phase would otherwise never take each other's), each judged around the own m as a peer's Δ is
around the own Δ (tensor by tensor and whole, within the clip radius; refused below the cosine
screen); then m ← m + the weighted mean(own m as sent at weight 1, the peers') − own m as sent,
coordinate by coordinate over the peers that sent it (a sparse m says nothing of the coordinates
it left out, and is judged around the own m there). What the inner steps since the publish added
(an overlapped outer step) stays. A member alone, or one whose peers' m all come past the cutoff,
keeps its own m exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor

from cgad.node.config import OuterOptions
from cgad.node.member.ledger import Counters
from cgad.node.member.sender import Yardstick
from cgad.protocol.codec import SPARSE_MAX_KEPT, Codec, all_finite, decode, encode, encoded_size
from cgad.protocol.transport import Fragment, FragmentKey, Kind, Transport

__all__ = ["BUDGET_SHARE", "CODEC", "REACH", "UNMEASURED_SHARE", "SharedMoments"]

CODEC = Codec.FP4  # m only seeds the next steps' average, which new gradients soon outweigh
UNMEASURED_SHARE = 0.5  # m's bytes at most this share of the Δ's while the link is not measured
# of a measured round budget, what the Δ (``--codec auto``) leaves for m: at the testbed's budget, 4
# members captured G 0.85 [0.82-0.88] at 60 rounds with it, 0.64 without an m (seeds 0-2); 0.3 and
# 0.5 gave 0.83 and 0.82 in a prototype (seed 0; bench/results/worth_budget_exploration.json)
BUDGET_SHARE = 0.3
REACH = 2.0  # the mixed m within this many times what Adam's own m can be beside its v (``_bound``)


class SharedMoments:
    """A member's first moments, sent beside its deltas and averaged at its outer steps.

    Args:
        theta: the model's parameters, in the loop's order.
        fragments: each fragment's parameter indices.
        options: the outer step's options (``moments``, ``aggregation``, ``clip_radius``,
            ``min_cosine``).
        transport: where the moments go and come from.
        counters: the loop's counters (``moments_mixed``, ``rejected['moments_*']``).
        link_budget: bytes per round the link carries to each fetching peer (None: not measured
            yet; infinite: not what limits), as the sender reads it.
        weight: how a delivery of an age weighs in the outer step (the outer method's
            ``scale``): a peer's m weighs as its delta of that age would.
    """

    def __init__(
        self,
        theta: Sequence[Tensor],
        fragments: Sequence[Sequence[int]],
        options: OuterOptions,
        transport: Transport,
        counters: Counters,
        link_budget: Callable[[], float | None] | None = None,
        weight: Callable[[int], float] = lambda age: 1.0,
    ) -> None:
        self.theta, self.fragments, self.options = list(theta), fragments, options
        self.transport, self.counters = transport, counters
        self.link_budget = link_budget or (lambda: float("inf"))
        self.total_numel = max(sum(p.numel() for p in self.theta), 1)
        self.weight = weight
        self._optimizer: torch.optim.Optimizer | None = None
        self._reach: dict[int, float] = {}  # per parameter (by id): its m's bound in √v (``_bound``)
        self._sent: dict[int, tuple[int, bytes]] = {}  # per fragment: (version, own m as sent)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Read and write the first moment (``exp_avg``) of ``optimizer``, the inner trainer's
        Adam-family optimizer over ``theta`` (its ``exp_avg_sq`` bounds what is written); until
        then nothing is shared."""
        self._optimizer = optimizer
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            if beta1 * beta1 < beta2:  # else Adam's m is not bounded by its v: left as mixed
                reach = REACH * (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))
                self._reach.update((id(p), reach) for p in group["params"])

    @property
    def on(self) -> bool:
        return self._optimizer is not None and self.options.moments == "shared"

    def _moments(self, f: int) -> list[Tensor] | None:
        assert self._optimizer is not None
        found = [self._optimizer.state.get(self.theta[i], {}).get("exp_avg") for i in self.fragments[f]]
        return None if any(m is None for m in found) else found  # type: ignore[return-value]

    def _weight(self, age: int) -> float:
        """A peer's m of ``age`` versions behind this step's, as a delta of that age weighs (0
        ahead)."""
        return 0.0 if age < 0 else self.weight(age)

    def _bound(self, f: int, moments: list[Tensor]) -> None:
        """Hold each m within twice what Adam itself can reach beside its v: |m| ≤ 2κ·√v, κ =
        (1 − β1) / √((1 − β2)(1 − β1²/β2)) (Cauchy-Schwarz on the two running averages of one
        gradient sequence; 1.17 at (0.9, 0.95)). A peer's m where this member's v is about 0 (a
        row of an embedding it never saw) would otherwise move that row by lr·m/ε at the next
        step. Twice: the peers' mean may rightly exceed the own reach where their gradients are
        larger (at the sweep scale, seed 0, 8 members: κ ended 0.015 above no bound at τ = 0,
        2κ 0.004; under random:4 both below it)."""
        assert self._optimizer is not None
        for i, m in zip(self.fragments[f], moments, strict=True):
            p = self.theta[i]
            v, reach = self._optimizer.state[p].get("exp_avg_sq"), self._reach.get(id(p))
            if v is not None and reach is not None:
                bound = v.sqrt().mul_(reach)
                torch.clamp(m, -bound, bound, out=m)

    def take(self, f: int) -> Tensor | None:
        """Fragment f's m as one flat float32 host copy, taken when its Δ is (on the trainer's
        thread: the inner steps change m in place); None when not shared or not made yet."""
        moments = self._moments(f) if self.on else None
        if moments is None:
            return None
        numel, budget = sum(m.numel() for m in moments), self.link_budget()
        sparsest = encoded_size(numel, Codec.SPARSE, kept=1)
        if budget is not None and sparsest > budget * numel / self.total_numel:
            return None  # no room even for the sparsest m: no copy for ``send`` to drop
        with torch.no_grad():
            return torch.cat([m.detach().to("cpu", torch.float32).reshape(-1) for m in moments])

    def delta_budget(self) -> float | None:
        """What of the link's round budget the Δ may fill (the sender's ``link_budget``): all but
        ``BUDGET_SHARE`` while m is shared (unmeasured or unbounded: all of it)."""
        budget, optimizer = self.link_budget(), self._optimizer
        if budget is None or not math.isfinite(budget) or not self.on or not (optimizer and optimizer.state):
            return budget  # unmeasured, unbounded, or no m yet (before the first inner step)
        return budget * (1 - BUDGET_SHARE)

    def _wire(self, numel: int, room: float | None, sent_bytes: int) -> tuple[Codec, int] | None:
        """How m of ``numel`` values goes out in ``room`` bytes (None: the link is not measured):
        4-bit where it fits, else sparse with the most values per block that fit; None: not sent."""
        if room is None:  # unmeasured: 4-bit where it is a small share of the Δ's bytes
            return (CODEC, 0) if encoded_size(numel, CODEC) <= UNMEASURED_SHARE * sent_bytes else None
        if encoded_size(numel, CODEC) <= room:
            return CODEC, 0
        fits = (k for k in range(SPARSE_MAX_KEPT, 0, -1) if encoded_size(numel, Codec.SPARSE, kept=k) <= room)
        kept = next(fits, 0)
        return (Codec.SPARSE, kept) if kept else None

    def send(self, key: FragmentKey, flat: Tensor, tokens: int, sent_bytes: int) -> int:
        """Publish ``flat`` (``take``'s copy of the m of ``key``'s fragment) beside its Δ of
        ``sent_bytes``, in what the link's round budget leaves (``_wire``); while the link is not
        measured, where m is at most ``UNMEASURED_SHARE`` of the Δ's bytes (a Δ in 16 or 32 bits:
        a 4-bit m is 0.28 of a 16-bit Δ's bytes). The bytes it sent (0: none)."""
        budget, numel = self.link_budget(), flat.numel()
        room = None if budget is None else budget * numel / self.total_numel - sent_bytes
        wire = self._wire(numel, room, sent_bytes)
        if wire is None or not all_finite(flat):
            return 0
        codec, kept = wire
        own = encode(flat, CODEC)  # the own m as a dense send would carry it: what the mix is around
        data = own if codec is CODEC else encode(flat, codec, kept)
        self._sent[key.fragment] = (key.base_version, own)
        moments_key = FragmentKey(key.run_id, key.fragment, key.base_version, key.publisher, Kind.MOMENTS)
        self.transport.publish_encoded(moments_key, data, codec=codec, numel=numel, tokens=tokens)
        self.counters.moments_sent += 1
        return len(data)

    def _judged(
        self, f: int, own: Tensor, sound: list[tuple[Fragment, float]]
    ) -> list[tuple[Tensor, float, Tensor | None]]:
        """The peers' m that pass the screen, each (m, weight, where it was sent: None for all),
        clipped around the own m with ``--aggregation clip``: the dense ones in one pass, a sparse
        one around the own m at the coordinates it carries (the only ones it moves)."""
        masked = [
            (m.tensor.reshape(-1), w, None if m.kept is None else m.tensor.reshape(-1) != 0) for m, w in sound
        ]
        if self.options.aggregation != "clip":
            return masked
        sizes = [self.theta[i].numel() for i in self.fragments[f]]
        dense = [n for n, (_, _, sent) in enumerate(masked) if sent is None]
        whole = Yardstick(lambda _, a, b: own[a:b], None, own.numel(), segments=sizes)
        judged = whole.judge([(masked[n][0], None) for n in dense], self.options.clip_radius, copies=False)
        verdicts = dict(zip(dense, judged, strict=True))
        out = []
        for n, (t, w, sent) in enumerate(masked):
            if sent is not None:  # the own m where this one was sent, a chunk at a time
                stick = Yardstick(
                    lambda _, a, b, s=sent: own[a:b] * s[a:b], None, own.numel(), segments=sizes
                )
                verdicts[n] = stick.judge([(t, None)], self.options.clip_radius, copies=False)[0]
            if verdicts[n].cosine < self.options.min_cosine:
                self.counters.rejected["moments_opposed"] += 1
                continue
            out.append((verdicts[n].delta, w, sent))
        return out

    def mix(
        self,
        f: int,
        version: int,
        refused: Collection[tuple[int, str, int]] = (),
        trust: Callable[[str], float] | None = None,
    ) -> int:
        """After fragment f's outer step from ``version``: average the own m as sent with the
        peers' fresh ones (each judged around it) into the trainer's m; how many peers' were taken.
        Every m received for f is drained, used or not; the m of a delta the step refused
        (``refused``: fragment, publisher, version) is not mixed either, and ``trust`` (the data
        score's weight of a publisher, 0 to 1) weighs each peer's m as it weighs its deltas."""
        received = self.transport.receive(f, Kind.MOMENTS)
        self.counters.moments_received += len(received)  # reached the mix, taken or not
        if refused:
            bad = set(refused)
            kept = [m for m in received if (f, m.key.publisher, m.key.base_version) not in bad]
            self.counters.rejected["moments_refused"] += len(received) - len(kept)
            received = kept
        sent = self._sent.pop(f, None)
        if not self.on or sent is None or sent[0] != version:
            return 0
        moments = self._moments(f)
        own = decode(sent[1]).reshape(-1)
        if moments is None or not received:
            return 0
        aged = [(m, self._weight(version - m.key.base_version)) for m in received]
        aged = [(m, w) for m, w in aged if w > 0.0]  # ahead, or past the cutoff
        self.counters.rejected["moments_late"] += len(received) - len(aged)
        if trust is not None:
            trusted = [(m, w * trust(m.key.publisher)) for m, w in aged]
            aged = [(m, w) for m, w in trusted if w > 0.0]
            self.counters.rejected["moments_distrusted"] += len(trusted) - len(aged)
        sound = [(m, w) for m, w in aged if m.tensor.numel() == own.numel() and all_finite(m.tensor)]
        self.counters.rejected["moments_malformed"] += len(aged) - len(sound)
        fresh = self._judged(f, own, sound)
        if not fresh:
            return 0
        with torch.no_grad():  # per coordinate, over the m that carry it: the own at weight 1
            shift, weights = torch.zeros_like(own), 1.0  # a weight per coordinate once one is sparse
            dense = 0.0  # the dense ones' weights: Σ w·(t − own) is Σ w·t − (Σ w)·own, no copies
            for t, w, sent in fresh:  # summed one at a time: no k model-sized copies at once
                if sent is None:
                    shift.add_(t, alpha=w)
                    dense += w
                    weights += w
                else:  # at the coordinates it carries only: no model-sized copy per peer
                    where = sent.nonzero().squeeze(1)
                    shift.index_add_(0, where, t[where].sub_(own[where]), alpha=w)
                    weights = torch.full_like(own, weights) if isinstance(weights, float) else weights
                    weights.index_add_(0, where, torch.full((where.numel(),), w, dtype=own.dtype))
            if dense:
                shift.sub_(own, alpha=dense)
            shift.div_(weights)
            start = 0
            for m in moments:  # m ← m + mean(own as sent, peers') − own as sent
                part = shift[start : start + m.numel()].view_as(m)
                m.add_(part.to(m.device, m.dtype))
                start += m.numel()
            self._bound(f, moments)
        self.counters.moments_mixed += len(fresh)
        return len(fresh)
