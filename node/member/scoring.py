"""The data score: a peer's pseudo-gradient judged by what it does to this member's loss.

A screen of shapes (the direction screen, the clip around the own Δ, tensor by tensor) cannot see
a Δ that has an honest shape and a harmful effect: an honest Δ plus a push on a few parameters
that stays inside every radius, or one aimed at what this member's data needs. What such a step
does shows on data. At fragment f's outer step, for each peer's Δ_j that passed the screen, on
windows of the member's own held-out text that no evaluation window overlaps, drawn afresh each
step (``training/data.py::ProbeWindows``):

    h_j = mean over windows w of [ loss_w(φ − Δ_j) − max(loss_w(φ), loss_w(φ − Δ_own)) ]

with its standard error s_j over the windows (the losses are paired: the same tokens; a
window's chunks are not independent, so the spread is the windows'). The
reference is the worse of not stepping and taking the own Δ alone: a whole Δ taken alone is a
step several times the length of its share in the mean (the inner lr's √N rule), fit from another
member's φ, and honest ones often do a little worse there than the own; what singles a peer out
is doing worse than both, beyond chance.
A Δ with h_j > t* · s_j and h_j > ``min_harm`` is refused (``harmful``), t* the Student's t value
as unlikely over that many windows as a normal variable past ``z`` (``critical_t``: 9.2 over 4
windows, 4.5 over 8, 3.3 over 31 at z = 3). Each identity keeps a
record, a running mean of its t = h_j / s_j (cut to [−z, 2z]); every Δ it sends that is taken
weighs ``(z − record) / (z − 1)`` of its token claim, cut to [0, 1]: in full up to a record of 1,
nothing at z (counted ``distrusted``); a peer whose steps do worse than the own round after round,
each within chance, weighs less and less. A newcomer starts at 0 (full weight) and is probed
first: its first harmful Δ is refused by the test itself. A step with no own Δ (a replay) probes
nothing.

The score costs forward passes: at most ``share`` of the inner compute of a block (a forward pass
counted a third of a training step), split between the losses at φ and at φ − Δ_own and one per
peer's Δ, each on at most four times the windows the test needs; where the fan-in is wider than
the budget holds at ``min_chunks`` chunks (and ``min_windows`` windows) each, publishers with no
record are probed first and then a random subset (from a seed no peer knows), the rest taken at
their record's weight; a block too small for even one peer's test beside the own probes nothing
(``--score-share`` up).
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cgad.node.member.ledger import Counters
from cgad.node.training.data import ProbeWindows, TokenDataset
from cgad.node.training.probe import Probe, chunks_per_window

RECORDS_KEPT = 4096  # identities whose records are kept

__all__ = ["DataScore", "ScoreOptions", "Verdict", "data_score", "judge_losses"]


@dataclass(frozen=True)
class ScoreOptions:
    """How the data score judges and what it may cost.

    Args:
        share: the most of a block's inner compute its forward passes take (token-passes, a
            forward a third of a training step).
        z: the t-value past which a Δ's harm is beyond chance.
        min_harm: the least rise in loss (nats) refused however sure (a step that changes the loss
            by less harms nothing worth a refusal).
        decay: the record's running-mean decay per probed Δ.
        min_chunks: the fewest chunks (of ``probe.CHUNK`` tokens) a Δ is probed on.
        min_windows: the fewest windows: the spread is taken over windows (the chunks of one
            window are not independent), and fewer make it, and the test, a guess.
    """

    share: float = 0.1
    z: float = 3.0
    min_harm: float = 0.002
    decay: float = 0.8
    min_chunks: int = 16
    min_windows: int = 4


@dataclass(frozen=True)
class Verdict:
    """One probed Δ: its mean rise in loss, the rise's standard error, and whether it is refused."""

    harm: float
    error: float
    refused: bool

    @property
    def t(self) -> float:
        if self.error > 0.0:
            return self.harm / self.error
        return math.copysign(math.inf, self.harm) if self.harm else 0.0


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return result


def t_tail(t: float, dof: int) -> float:
    """P(T > t) for Student's t with ``dof`` degrees of freedom (t ≥ 0)."""
    x = dof / (dof + t * t)
    a, b = dof / 2.0, 0.5
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return 0.5 * front * _beta_fraction(a, b, x) / a
    return 0.5 * (1.0 - front * _beta_fraction(b, a, 1.0 - x) / b)


@functools.lru_cache(maxsize=256)
def critical_t(dof: int, z: float) -> float:
    """The t-value past which a mean over ``dof`` + 1 windows is as unlikely by chance as a normal
    variable past ``z``: the spread itself is estimated from those windows, so with few of them the
    bar is higher (4 windows, z = 3: about 10)."""
    tail = 0.5 * math.erfc(z / math.sqrt(2.0))
    low, high = z, z * 1000.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_tail(middle, dof) > tail else (low, middle)
    return high


def judge_losses(base: Tensor, stepped: Tensor, z: float, min_harm: float) -> Verdict:
    """The verdict on a step from the per-window losses of the reference (``base``) and after the
    step (``stepped``), the same windows. Non-finite losses after the step are harm beyond any
    doubt."""
    if not bool(torch.isfinite(stepped).all()):
        return Verdict(math.inf, 0.0, True)
    finite = torch.isfinite(base)
    diff = (stepped - base)[finite].double()
    if diff.numel() == 0:
        return Verdict(0.0, 0.0, False)
    harm = float(diff.mean())
    if diff.numel() < 2:
        return Verdict(harm, 0.0, False)  # no spread to judge by
    error = float(diff.std(unbiased=True)) / math.sqrt(diff.numel())
    return Verdict(harm, error, harm > min_harm and harm > critical_t(diff.numel() - 1, z) * error)


class DataScore:
    """The data score of one member (its probe, its windows, its records of peers).

    Args:
        probe: the member's model, to compute losses at other parameters.
        windows: draws n held-out windows ([n, seq_len]; None where there are none).
        budget: token-passes one outer step may spend (``share`` of a block's inner compute).
        seq_len: tokens per window.
        options: the thresholds.
        seed: draws which peers are probed where the budget holds fewer than the fan-in.
    """

    def __init__(
        self,
        probe: Probe,
        windows: Callable[[int], Tensor | None],
        budget: int,
        seq_len: int,
        options: ScoreOptions = ScoreOptions(),
        seed: int = 0,
    ) -> None:
        self.probe = probe
        self.windows = windows
        self.budget = budget
        self.seq_len = seq_len
        self.options = options
        self.rng = random.Random(seed)
        self.records: dict[str, float] = {}
        self.counters = Counters()  # the loop's, once attached: probed, probe_tokens
        self._phi: list[Tensor] = []
        self._fragments: list[list[int]] = []

    @classmethod
    def of(
        cls,
        probe: Probe,
        windows: Callable[[int], Tensor | None],
        *,
        inner_steps: int,
        fragments: int,
        batch_size: int,
        seq_len: int,
        options: ScoreOptions = ScoreOptions(),
        seed: int = 0,
    ) -> DataScore:
        """The score whose budget per outer step is ``options.share`` of a block's inner compute
        (a block: ``inner_steps / fragments`` steps of ``batch_size × seq_len`` tokens, each a
        forward and a backward pass, three forwards' worth)."""
        block_tokens = inner_steps * batch_size * seq_len // max(fragments, 1)
        return cls(probe, windows, int(options.share * 3 * block_tokens), seq_len, options, seed)

    def attach(self, phi: list[Tensor], fragments: list[list[int]], counters: Counters) -> None:
        """The outer parameters φ (updated in place by the loop), each fragment's indices, and the
        loop's counters."""
        self._phi, self._fragments, self.counters = phi, fragments, counters

    def _remember(self, publisher: str, record: float) -> None:
        """Keep ``record``; past ``RECORDS_KEPT`` identities the least recently judged is forgotten
        (throwaway identities cannot grow the table; a forgotten one is probed first again)."""
        self.records.pop(publisher, None)  # kept in the order of their last update
        self.records[publisher] = record
        if len(self.records) > RECORDS_KEPT:
            del self.records[next(iter(self.records))]  # the least recently judged

    def weight(self, publisher: str) -> float:
        """What a Δ of ``publisher`` weighs by its record: 1 up to a record of 1 (an honest peer
        does a little worse on this member's windows than its own Δ now and then), 0 at ``z``."""
        z = self.options.z
        return min(1.0, max(0.0, (z - self.records.get(publisher, 0.0)) / (z - 1.0)))

    def distrusted(self, most: int = 32) -> dict[str, float]:
        """The peers whose deltas weigh less than in full by their records, the least trusted
        first (at most ``most``): what a status shows."""
        weights = {publisher: self.weight(publisher) for publisher in self.records}
        low = sorted((w, p) for p, w in weights.items() if w < 1.0)[:most]
        return {publisher: round(weight, 3) for weight, publisher in low}

    def plan(self, peers: int) -> tuple[int, int]:
        """(peers probed, windows each) within the budget, beside the two reference passes (φ
        and the own step): every peer where the budget holds ``min_chunks`` chunks each, else as
        many as it holds; none where it holds not even one peer's (a block too small for the
        share: the records rule)."""
        per_pass = self.budget // max(self.seq_len, 1)  # windows the budget holds in all
        o = self.options
        least = max(o.min_windows, math.ceil(o.min_chunks / chunks_per_window(self.seq_len)))
        if peers == 0 or per_pass < 3 * least:
            return 0, 0
        if per_pass >= (peers + 2) * least:  # the budget is a bound, not a target: 4 × the least
            return peers, min(per_pass // (peers + 2), 4 * least)
        return per_pass // least - 2, least

    def judge(self, f: int, own: Tensor | None, peers: list[tuple[str, Tensor]]) -> list[tuple[float, bool]]:
        """Each peer's Δ of fragment f (flat, screened and clipped): its weight (0: not taken), and
        whether this step's test refused it (else its weight is its record's).

        Args:
            f: the fragment.
            own: the own Δ of this step, what each peer's is held against (None: no own Δ this
                step, a replay's: nothing is probed, each peer weighs by its record).
            peers: (publisher, Δ) pairs.
        """
        if not peers:
            return []
        if not self._phi:
            raise RuntimeError("DataScore.judge before attach")
        weights = [(self.weight(publisher), False) for publisher, _ in peers]
        count, per = self.plan(len(peers))
        windows = None if own is None or count == 0 else self.windows(per)
        if windows is None:
            return weights
        # publishers with no record first (a fresh identity's Δ is not taken unjudged at full
        # weight), the rest drawn at random (from a seed no peer knows)
        order = sorted(range(len(peers)), key=lambda n: (peers[n][0] in self.records, self.rng.random()))
        probed = sorted(order[:count])
        # a window's reference is the worse of not stepping and the own step: a peer is refused
        # only for doing worse than both (a whole Δ alone is a longer step than its share of the
        # mean, and one fit from another φ: honest ones often do a little worse than the own)
        phi = [p.detach().to(self.probe.device) for p in self._phi]  # once: a GPU's copy of φ
        stay = self._window_losses(phi, windows)
        reference = torch.maximum(stay, self._window_losses(self._stepped(phi, f, own), windows))
        self.counters.probe_tokens += windows.numel() * (2 + len(probed))
        o = self.options
        for n in probed:
            publisher, delta = peers[n]
            stepped = self._window_losses(self._stepped(phi, f, delta), windows)
            verdict = judge_losses(reference, stepped, o.z, o.min_harm)
            self.counters.probed += 1
            t = max(-o.z, min(2 * o.z, verdict.t))
            self._remember(publisher, o.decay * self.records.get(publisher, 0.0) + (1 - o.decay) * t)
            weights[n] = (0.0, True) if verdict.refused else (self.weight(publisher), False)
        return weights

    def _window_losses(self, params: list[Tensor], windows: Tensor) -> Tensor:
        """Each window's mean chunk loss (+inf where a chunk's is not finite)."""
        return self.probe.chunk_losses(params, windows).view(windows.shape[0], -1).mean(dim=1)

    def _stepped(self, phi: list[Tensor], f: int, delta: Tensor) -> list[Tensor]:
        """Every parameter at ``phi``, fragment f's at φ_f − Δ (Δ flat, on the host)."""
        params = list(phi)
        offset = 0
        for i in self._fragments[f]:
            numel = params[i].numel()
            part = delta[offset : offset + numel].view_as(params[i])
            params[i] = params[i] - part.to(params[i].device, params[i].dtype)
            offset += numel
        return params


def data_score(
    config: Any,
    model: torch.nn.Module,
    dataset: TokenDataset,
    seed: int | None,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> DataScore | None:
    """The member's data score as its configuration sets it (``--data-score``, ``--score-share``),
    cut at the composition root, the daemon's and the simulator's alike; None when off.

    Args:
        config: the daemon's or the simulator's configuration.
        model: the member's model (its probe computes with it, never changing it).
        dataset: the corpus whose held-out tail the windows come from.
        seed: which windows and which peers are probed (None: drawn from the operating system,
            a daemon's: a peer must not know them; the simulator passes its own, to repeat).
        device, autocast_dtype: where and how the member's model computes.
    """
    if config.data_score != "on":
        return None
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "big")
    windows = ProbeWindows(dataset, (config.eval_batches, config.batch_size), config.seq_len, seed)
    return DataScore.of(
        Probe(model, device, autocast_dtype, batch_windows=config.batch_size), windows.draw,
        inner_steps=config.inner_steps, fragments=config.fragments, batch_size=config.batch_size,
        seq_len=config.seq_len, options=ScoreOptions(share=config.score_share), seed=seed,
    )  # fmt: skip
