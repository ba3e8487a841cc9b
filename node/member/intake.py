"""What an outer step takes: each delivery judged, weighed and counted before the method steps.

For fragment f's step, the own Δ (age 0) and the peers' deliveries, each with its age τ:

1. its age scale σ(τ) (the method's; 1 for a method that is not age-aware); scaled to 0: dropped
   as stale;
2. with ``--aggregation clip``, its shape against the own latest Δ (``sender.Yardstick``): pointing
   against it, refused (``opposed``); a copy of the own, refused (``copied``); the rest clipped
   around it, tensor by tensor and whole;
3. with a data score (``scoring.DataScore``), what it does: a step that raises this member's loss
   on its own held-out windows beyond chance is refused (``harmful``), and every peer's token
   claim is cut to its record's share (``distrusted`` at none);
4. its token claim, at most ``TOKEN_CAP`` times the own block.

Nothing here steps: ``take`` returns the contributions and the deliveries, counted in ``counters``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from torch import Tensor

from cgad.node.member.ledger import Counters, Delivery
from cgad.node.member.methods import Contribution
from cgad.node.member.scoring import DataScore
from cgad.node.member.sender import Judged, Yardstick
from cgad.protocol.transport import Fragment

TOKEN_CAP = 2  # a delivery weighs at most this many times the receiver's own block (claims are cheap)

__all__ = ["TOKEN_CAP", "take"]


def take(
    f: int,
    incoming: list[tuple[Fragment, int]],
    own: Fragment | None,
    yardstick: Yardstick | None,
    *,
    aggregation: str,
    clip_radius: float,
    min_cosine: float,
    own_tokens: int | None,
    age_scale: Callable[[int], float],
    counters: Counters,
    refused: deque[tuple[int, str, int]],
    score: DataScore | None = None,
) -> tuple[list[Contribution], list[Delivery]]:
    """The deliveries fragment f's step takes, each with its weight.

    Args:
        f: the fragment.
        incoming: (fragment, age) pairs, the own Δ among them where there is one.
        own: the own Δ's fragment (None: none this turn).
        yardstick: the own latest Δ of f that peers are judged by (None: no finite block yet).
        aggregation, clip_radius, min_cosine: the member's options (``OuterOptions``).
        own_tokens: the tokens behind the own latest finite block of f (a claim's cap).
        age_scale: σ(τ), the method's weight of a delivery of age τ.
        counters: where refusals, clips and applications are counted.
        refused: the (fragment, publisher, version) of refused deliveries, whose first moments
            are not mixed either; appended to.
        score: the data score, or None.
    """
    taken: list[Contribution] = []
    deliveries: list[Delivery] = []
    cap = TOKEN_CAP * max(own_tokens, 1) if yardstick is not None and own_tokens is not None else None
    # peers' deltas are judged against this node's own latest Δ of f, never against what peers
    # sent: beside one honest peer and one attacker, any statistic of theirs is the attacker's
    if aggregation == "clip" and yardstick is None:
        # no finite block of its own yet: nothing to judge peers by
        counters.rejected["no_yardstick"] += sum(frag is not own for frag, _ in incoming)
        incoming = [(frag, age) for frag, age in incoming if frag is own]
    scales = [age_scale(a) for _, a in incoming]
    judged: dict[int, Judged] = {}  # by position in incoming
    if aggregation == "clip" and yardstick is not None:
        peers = [n for n, (frag, _) in enumerate(incoming) if frag is not own and scales[n] != 0.0]
        deltas = [(incoming[n][0].tensor, incoming[n][0].kept) for n in peers]
        judged = dict(zip(peers, yardstick.judge(deltas, clip_radius), strict=True))
    kept: list[tuple[int, Tensor, bool, bool]] = []  # (position, delta, clipped, credited)
    for n, (frag, _) in enumerate(incoming):
        if scales[n] == 0.0:
            counters.dropped_stale += 1
            continue
        delta, clipped, credited = frag.tensor, False, True
        if n in judged:
            j = judged[n]
            if j.cosine < min_cosine or j.copy:
                refused.append((f, frag.key.publisher, frag.key.base_version))  # nor its m
                counters.rejected["copied" if j.copy else "opposed"] += 1
                if not j.copy:  # no blame for a copy: whose work it is, the bytes cannot tell
                    counters.rejected_by_peer[frag.key.publisher] += 1
                continue
            delta, clipped, credited = j.delta, j.clipped, not j.uncredited  # copies of it: no credit
            counters.clipped += clipped
            counters.tensors_cut += j.tensors_cut > 0
        kept.append((n, delta, bool(clipped), credited))
    weights = [1.0] * len(kept)
    harmful: set[int] = set()  # positions in kept refused by this step's test, not by a record
    if score is not None:
        peers = [i for i, (n, _, _, _) in enumerate(kept) if incoming[n][0] is not own]
        own_delta = next((d for n, d, _, _ in kept if incoming[n][0] is own), None)
        offered = [(incoming[kept[i][0]][0].key.publisher, kept[i][1]) for i in peers]
        for i, (weight, refused_now) in zip(peers, score.judge(f, own_delta, offered), strict=True):
            weights[i] = weight
            if refused_now:
                harmful.add(i)
    for k, ((n, delta, clipped, credited), weight) in enumerate(zip(kept, weights, strict=True)):
        frag, age = incoming[n]
        is_own = frag is own
        if weight == 0.0:
            refused.append((f, frag.key.publisher, frag.key.base_version))
            counters.rejected["harmful" if k in harmful else "distrusted"] += 1
            counters.rejected_by_peer[frag.key.publisher] += 1
            continue
        scale = scales[n]
        tokens = frag.tokens
        if cap is not None and not is_own and tokens > cap:
            tokens = cap
            counters.tokens_capped += 1
        if weight < 1.0:  # its record's share of its claim: every method weighs deltas by tokens
            tokens = max(1, round(tokens * weight))
        taken.append(Contribution(delta, tokens, age, scale, frag.key.publisher, is_own, clipped))
        deliveries.append(Delivery(f, frag.key.publisher, frag.key.base_version, age, scale, own=is_own))
        if not is_own:
            counters.applied += 1
            if credited:
                counters.applied_by_peer[frag.key.publisher] += 1
            counters.applied_by_age[age] += 1
        counters.age_sum += age
        counters.age_count += 1
    return taken, deliveries
