"""What a member sends of its pseudo-gradients: the codec of each round, and error feedback.

The one owner of both. A lossy codec (int8, 4bit, 2bit, sparse) drops part of each Δ; what it
drops is kept per fragment and sent in a later round (``ErrorFeedback``), whatever codec that
round uses. Under ``--codec auto`` each round's codec is the one the link carries in time (4bit
where it fits, else sparse with as many values per block as fit: ``scheduling.auto_codec``),
from the bytes per round the link is measured to carry (``link_budget``). The transport gets
bytes, never a policy.

The own Δ a peer's delta is judged against (``robust.AroundOwn``: a ``Yardstick``) is what this
member would send (Δ plus what is still owed), picked as sparsely as each delivery is: a sparse
delta sits about the whole norm of a dense one away by its support alone. It is rebuilt when a
step first judges a delivery, from what is held anyway: the own Δ as it went out, kept encoded
(the very bytes the transport's store serves), decoded then (for a sent Δ, that plus the
residual is the whole target), and the residual; a step with no peer's delta builds none, and
no decoded copy outlives the step. The target and its sparser pickings are built a chunk of 1M
values at a time as the deliveries are judged (``Yardstick.judge``), never whole: each whole
one was a fresh 4-byte-a-parameter buffer, and faulting those in was most of a swarm node's
outer step at 26M parameters.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import Tensor

from cgad.optim import FLOAT64_CHUNK, chunk_dots, near_copies, verdict
from cgad.protocol.codec import ROUNDING, Codec, decode, encode
from cgad.protocol.config import SPARSE_KEPT, wire_codec
from cgad.protocol.feedback import ErrorFeedback
from cgad.protocol.scheduling import auto_codec

# a chunk of the yardstick holds whole blocks of every codec (256 values at most): picked a chunk
# at a time, a sparse reference is the whole one's
assert FLOAT64_CHUNK % 256 == 0

__all__ = ["NEAR_COPY", "NEAR_COPY_VALUES", "Judged", "Sender", "Yardstick"]

# a peer's Δ this alike to the own Δ or to another peer's of the same step is a copy re-encoded
# (fp16, int8 and 4-bit re-encodings keep a cosine of 0.99 or more): honest deltas of 8 members
# at the sweep scale reached 0.80 at most, early in training; a 2-bit or sparse re-encoding
# (0.8) passes for honest work
NEAR_COPY = 0.98
# a fragment of fewer values is not judged for copies: the cosine of two honest deltas of n values
# swings by about 1/√n, and a few values are too few to call two of them one
NEAR_COPY_VALUES = 4096


@dataclass(frozen=True)
class Judged:
    """A peer's delta as judged against the own Δ: its cosine with it, the delta as taken (cut
    where it lay too far), whether the whole clip cut it, how many of its tensors were cut, and
    whether it is a near copy (``NEAR_COPY``)."""

    cosine: float
    delta: Tensor
    clipped: bool
    tensors_cut: int = 0
    copy: bool = False  # a near copy of the own Δ, or of a delivery judged before it: refused
    uncredited: bool = False  # taken, but others of the step are copies of it: credited to none


class _How(enum.Enum):
    """How a fragment's own Δ last went out, which says how its target is rebuilt."""

    FED_BACK = "fed_back"  # encoded with the residual: target = as sent + residual (after it)
    WITHHELD = "withheld"  # kept from the peers, the residual left alone: target = Δ + residual
    PLAIN = "plain"  # sent as it is (whole, or encoded without feedback): target = Δ


@dataclass(frozen=True)
class _Sent:
    kept: int | None  # values per block as it went out (None: dense)
    # the own Δ as it went out: its bytes (shared with the store that serves them), or the
    # tensor itself when sent whole
    data: bytes | Tensor
    how: _How
    numel: int

    def decoded(self) -> Tensor:
        """The own Δ as it went out, flat."""
        return (self.data if isinstance(self.data, Tensor) else decode(self.data)).reshape(-1)


class Yardstick:
    """The own Δ of a fragment that one outer step judges its peers' deltas against: what this
    member sends of it (Δ plus what is still owed), dense, and as a delivery of a given sparsity
    would carry it. Built when first asked for (a step that judges nothing builds nothing) and
    dropped with the step. ``judge`` and ``norm`` build it a chunk at a time and hold no
    model-sized copy of it (beside the own Δ as sent, decoded once): a codec's blocks never
    straddle a chunk, so the values are those of the whole picked at once.

    Args:
        part: the dense target's values in [start, stop), from the own Δ as it went out
            (decoded, or None: never sent).
        sent: the own Δ as it went out (None: never sent: the target is this round's Δ).
        numel: values in the fragment.
        segments: the values of each tensor of the fragment, in order (None: judged whole only).
    """

    def __init__(
        self,
        part: Callable[[Tensor | None, int, int], Tensor],
        sent: _Sent | None,
        numel: int,
        from_sent: bool = False,
        segments: Sequence[int] | None = None,
    ) -> None:
        self._part = part
        self._sent_record = sent
        self.numel = numel
        if segments is not None and sum(segments) != numel:
            raise ValueError(f"segments of {sum(segments)} values for {numel}")
        self.segments = list(segments) if segments is not None and len(segments) > 1 else None
        self._bounds = [0, *itertools.accumulate(self.segments or [numel])]  # each tensor's first value
        self._from_sent = from_sent  # whether ``part`` reads the own Δ as sent (decoded only then)
        self._norm: float | None = None

    @cached_property
    def _sent(self) -> Tensor | None:
        return None if self._sent_record is None else self._sent_record.decoded()

    def _target_chunks(self) -> Iterator[tuple[int, Tensor]]:
        """The dense target, ``FLOAT64_CHUNK`` values at a time (start, values)."""
        for start in range(0, self.numel, FLOAT64_CHUNK):
            sent = self._sent if self._from_sent else None
            yield start, self._part(sent, start, min(start + FLOAT64_CHUNK, self.numel))

    def _chunks(self, kept: int | None) -> Iterator[tuple[int, Tensor]]:
        """The reference for ``kept`` (``reference``), ``FLOAT64_CHUNK`` values at a time."""
        if self._sent_record is not None and kept == self._sent_record.kept:
            sent = self._sent
            assert sent is not None
            for start in range(0, self.numel, FLOAT64_CHUNK):
                yield start, sent[start : start + FLOAT64_CHUNK]
            return
        for start, part in self._target_chunks():
            yield start, part if kept is None else decode(encode(part, Codec.SPARSE, kept))

    @property
    def target(self) -> Tensor:
        """The dense target, whole (a new tensor)."""
        return _whole(self._target_chunks(), self.numel)

    def reference(self, kept: int | None) -> Tensor:
        """The yardstick as a delivery that keeps ``kept`` values per block (None: dense) carries
        it, whole: the own Δ as sent when it was sent so, else the target picked the same way."""
        if self._sent_record is not None and kept == self._sent_record.kept:
            return self._sent  # type: ignore[return-value]
        return _whole(self._chunks(kept), self.numel)

    def judge(
        self, deliveries: Sequence[tuple[Tensor, int | None]], radius: float, copies: bool = True
    ) -> list[Judged]:
        """``AroundOwn(self.reference(kept), radius).judge(delta)`` for each (delta, kept): flat
        float32 deltas carrying ``kept`` values per block (None: dense). One pass over the
        reference per sparsity, built a chunk at a time, and one more where a delta is clipped:
        the same floats as ``AroundOwn``'s, without a whole reference.

        With ``segments``, each tensor is judged first: a tensor of a delta further from the
        reference's than ``radius`` × (its own norm there + its share of the whole norm,
        ‖ref‖·√(n_t/n)) is cut to that distance, and the whole verdict is taken on what is left.
        A push the whole clip lets through, concentrated on a few small tensors (the final norm's
        gains), is cut there to about the size of the own Δ of those tensors.

        Args:
            deliveries: the peers' deltas and the values per block each carries.
            radius: the clip radius, in norms of the reference.
            copies: whether to mark near copies (``_copies``: one more pass over the deliveries).
        """
        if not math.isfinite(radius) or radius < 0:
            raise ValueError(f"radius must be finite and >= 0, got {radius}")
        if any(d.numel() != self.numel for d, _ in deliveries):
            raise ValueError(f"deliveries of {[d.numel() for d, _ in deliveries]} values for {self.numel}")
        if not deliveries:  # nothing to judge: the reference is never built
            return []
        by_kept: dict[int | None, list[int]] = {}
        for n, (_, kept) in enumerate(deliveries):
            by_kept.setdefault(kept, []).append(n)
        judged: dict[int, Judged] = {}
        for kept, positions in by_kept.items():
            deltas = [deliveries[n][0] for n in positions]
            judged.update(zip(positions, self._judge_alike(deltas, kept, radius), strict=True))
        out = [judged[n] for n in range(len(deliveries))]
        if not copies:
            return out
        copied, uncredited = self._copies([d for d, _ in deliveries])
        return [replace(j, copy=n in copied, uncredited=n in uncredited) for n, j in enumerate(out)]

    def _copies(self, deltas: list[Tensor]) -> tuple[set[int], set[int]]:
        """Near copies (``NEAR_COPY``) among the deltas: those of the own Δ (the dense target) and
        those of a delta before them, refused; and the deltas kept whose copies were refused,
        taken once and credited to none (which publisher did the work, the bytes cannot tell).
        One more pass over them: their Gram matrix, a chunk at a time."""
        if self.numel < NEAR_COPY_VALUES:
            return set(), set()
        dots = torch.zeros(len(deltas) + 1, len(deltas) + 1, dtype=torch.float64)
        for start, part in self._target_chunks():
            stop = start + part.numel()
            # float32 products, summed in float64 across chunks: a copy is a cosine above 0.98,
            # honest deltas' stay near 0.8, and float32 moves a cosine by about 1e-4 at most here;
            # float64 copies of every chunk made this pass, on the trainer's thread, several
            # times the judging's. Values whose squares overflow float32 are no honest delta's
            block = torch.stack([part.float(), *(d[start:stop].float() for d in deltas)])
            dots += (block @ block.T).double()
        alike = near_copies(dots, NEAR_COPY)  # the own Δ first
        copies, uncredited = set(), set()
        for n in range(len(deltas)):
            kept = [m for m in range(n) if m not in copies and alike[n + 1][m + 1]]
            if alike[n + 1][0] or kept:
                copies.add(n)
                uncredited.update(kept[:1])
        return copies, uncredited

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(tensor, a, b): the values [a, b) of each tensor within the chunk [start, stop), in order
        (a tensor of no values has none)."""
        for t in range(bisect.bisect_right(self._bounds, start) - 1, len(self._bounds) - 1):
            if self._bounds[t] >= stop:
                return
            a, b = max(start, self._bounds[t]), min(stop, self._bounds[t + 1])
            if a < b:
                yield t, a, b

    def _judge_alike(self, deltas: list[Tensor], kept: int | None, radius: float) -> list[Judged]:
        count = len(self._bounds) - 1
        # per tensor: ‖ref_t‖², and per delta ⟨d_t, ref_t⟩ and ‖d_t‖² (float64 sums, in order)
        ref_sq = [0.0] * count
        dots = [[0.0] * count for _ in deltas]
        norms = [[0.0] * count for _ in deltas]
        for start, ref in self._chunks(kept):
            for t, a, b in self._pieces(start, start + ref.numel()):
                piece = ref[a - start : b - start]
                ref_sq[t] += chunk_dots(piece, None)[1]
                for n, d in enumerate(deltas):
                    dot, norm_sq = chunk_dots(d[a:b], piece)
                    dots[n][t], norms[n][t] = dots[n][t] + dot, norms[n][t] + norm_sq
        reference_sq = math.fsum(ref_sq)
        if not math.isfinite(reference_sq):
            raise ValueError("AroundOwn needs a finite reference")
        pairs = zip(dots, norms, strict=True)
        weights = [self._tensor_weights(ref_sq, d, s, reference_sq, radius) for d, s in pairs]
        verdicts, cosines = [], []
        bound = radius * math.sqrt(reference_sq)
        for n, w in enumerate(weights):  # the whole verdict on each delta as its tensors' cuts left it
            # the screen's cosine is the delta's as sent: cutting a tensor must not turn it around
            cosines.append(verdict(math.fsum(dots[n]), math.fsum(norms[n]), reference_sq, bound).cosine)
            dot = norm_sq = 0.0
            for t, wt in enumerate(w):
                if wt == 1.0:  # as sent: the sums as they are (one tensor: AroundOwn's floats)
                    dot, norm_sq = dot + dots[n][t], norm_sq + norms[n][t]
                    continue
                along = dots[n][t] - ref_sq[t]  # ⟨d − ref, ref⟩ of tensor t
                away = max(norms[n][t] - 2.0 * dots[n][t] + ref_sq[t], 0.0)  # ‖d − ref‖²
                dot += ref_sq[t] + wt * along
                norm_sq += ref_sq[t] + 2.0 * wt * along + wt * wt * away
            verdicts.append(verdict(dot, norm_sq, reference_sq, bound))
        cut = {n for n, v in enumerate(verdicts) if v.weight is not None or min(weights[n]) < 1.0}
        held = {n: torch.empty(self.numel) for n in cut}
        if held:  # reference + (delta − reference) · weight, as AroundOwn's lerp, tensor by tensor
            for start, ref in self._chunks(kept):
                for t, a, b in self._pieces(start, start + ref.numel()):
                    for n, out in held.items():
                        weight = weights[n][t] * (1.0 if verdicts[n].weight is None else verdicts[n].weight)
                        torch.lerp(ref[a - start : b - start], deltas[n][a:b].float(), weight, out=out[a:b])
        return [
            Judged(cosines[n], held.get(n, deltas[n]), v.weight is not None, sum(w < 1.0 for w in weights[n]))
            for n, v in enumerate(verdicts)
        ]

    def _tensor_weights(
        self, ref_sq: list[float], dots: list[float], norms: list[float], reference_sq: float, radius: float
    ) -> list[float]:
        """Each tensor's cut (1: as sent): its distance from the reference's within ``radius`` ×
        (‖ref_t‖ + ‖ref‖·√(n_t/n)). One tensor (no ``segments``): 1, the whole verdict decides."""
        if self.segments is None:
            return [1.0]
        weights = []
        for t, size in enumerate(self.segments):
            if not (math.isfinite(dots[t]) and math.isfinite(norms[t])):
                raise ValueError("AroundOwn needs finite deliveries")
            distance = math.sqrt(max(norms[t] - 2.0 * dots[t] + ref_sq[t], 0.0))
            bound = radius * (math.sqrt(ref_sq[t]) + math.sqrt(reference_sq * size / self.numel))
            weights.append(1.0 if distance <= bound else bound / distance)
        return weights

    def norm(self) -> float:
        """‖target‖, in float64 (a finite fp32 tensor of 1e20s overflows fp32's), a chunk at a time."""
        if self._norm is None:  # asked once per peer φ mixed in
            self._norm = math.sqrt(sum(chunk_dots(values, None)[1] for _, values in self._target_chunks()))
        return self._norm


def _whole(chunks: Iterator[tuple[int, Tensor]], numel: int) -> Tensor:
    out = torch.empty(numel)
    for start, values in chunks:
        out[start : start + values.numel()] = values
    return out


class Sender:
    """Encodes a member's pseudo-gradients.

    Args:
        codec: the ``--codec`` name ("auto", "sparse", "4bit", ...; None or "fp32": sent whole).
        sparse_keep: values per block of 256 under "sparse".
        link_budget: bytes per round the link carries to each fetching peer (None: not measured
            yet; infinite: not what limits), for "auto".
        total_numel: values in the whole model (a fragment gets its share of the budget).
        error_feedback: carry what a rounding codec drops into later rounds (sparse always does).
        segments: per fragment, the values of each of its tensors (peers' deltas are judged
            tensor by tensor as well as whole); None: whole only.
    """

    def __init__(
        self,
        codec: str | None,
        *,
        sparse_keep: int = SPARSE_KEPT,
        link_budget: Callable[[], float | None] | None = None,
        total_numel: int = 1,
        error_feedback: bool = True,
        segments: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.codec = codec
        self.segments = segments
        self.sparse_keep = sparse_keep
        self.link_budget = link_budget or (lambda: float("inf"))
        self.total_numel = max(total_numel, 1)
        self.error_feedback = error_feedback
        self._fixed = None if codec in (None, "auto") else Codec(wire_codec(codec))
        # per fragment: the progress not sent yet, and the own Δ as it last went out
        self._unsent: dict[int, ErrorFeedback] = {}
        self._sent: dict[int, _Sent] = {}

    @property
    def encodes(self) -> bool:
        """Whether deltas go out as bytes this sender encoded (else whole, in float32)."""
        return self.codec == "auto" or self._fixed not in (None, Codec.FP32)

    def choose(self, numel: int) -> tuple[Codec, int]:
        """This round's codec and values per block for a fragment of ``numel`` values."""
        if self._fixed is not None:
            return self._fixed, self.sparse_keep
        budget = self.link_budget()
        return auto_codec(numel, None if budget is None else budget * numel / self.total_numel)

    def _feeds_back(self, codec: Codec) -> bool:
        # under auto every round feeds back: a 4-bit round must not drop what sparse ones owe
        return codec is Codec.SPARSE or self.codec == "auto" or (self.error_feedback and codec in ROUNDING)

    def send(self, fragment: int, delta: Tensor) -> tuple[bytes, Codec, int]:
        """Encode fragment ``fragment``'s Δ with what earlier rounds left out: the bytes, the
        codec and the values per block."""
        codec, kept = self.choose(delta.numel())
        sparse_kept = kept if codec is Codec.SPARSE else None
        feedback = self._unsent.setdefault(fragment, ErrorFeedback(Codec.SPARSE))
        if not self._feeds_back(codec):
            data = encode(delta, codec, kept)
            self._sent[fragment] = _Sent(sparse_kept, data, _How.PLAIN, delta.numel())
            return data, codec, kept
        data = feedback.send(delta, codec, kept)
        self._sent[fragment] = _Sent(sparse_kept, data, _How.FED_BACK, delta.numel())
        return data, codec, kept

    def sent_whole(self, fragment: int, delta: Tensor) -> None:
        """Fragment ``fragment``'s Δ went out as it is (not encoding): it is its own yardstick."""
        self._sent[fragment] = _Sent(None, delta, _How.PLAIN, delta.numel())

    def withhold(self, fragment: int, delta: Tensor) -> None:
        """A block that is not sent (kept from the peers after adopting a state): its yardstick is
        the target it would have had, picked as this round would send it; the residual is left
        alone."""
        if not self.encodes:
            self._sent[fragment] = _Sent(None, delta, _How.PLAIN, delta.numel())
            return
        codec, kept = self.choose(delta.numel())
        feedback = self._unsent.get(fragment)
        carries = feedback is not None and self._feeds_back(codec)
        target = feedback.target(delta) if carries else delta
        self._sent[fragment] = _Sent(
            kept if codec is Codec.SPARSE else None,
            encode(target, codec, kept),
            _How.WITHHELD if carries else _How.PLAIN,
            delta.numel(),
        )

    def yardstick(self, fragment: int, own: Tensor | None) -> Yardstick | None:
        """What fragment ``fragment``'s peers' deltas are judged against at its outer step:
        ``own``, this round's Δ (sent or withheld), with what it owed; without one (the block
        diverged), the latest own Δ as it went out; None when there never was one."""
        sent = self._sent.get(fragment)
        if sent is None:
            if own is None:
                return None
            whole = own.reshape(-1)
            return Yardstick(lambda _, a, b: whole[a:b], None, own.numel(), segments=self._segments(fragment))
        feedback = self._unsent.get(fragment)
        residual = (
            feedback.residual.view(-1) if feedback is not None and feedback.residual is not None else None
        )
        part: Callable[[Tensor | None, int, int], Tensor]
        # each a slice [a, b) of the target; the bfloat16 residual widened before the add (a
        # float32 + bfloat16 add is twice as slow)
        if sent.how is _How.FED_BACK:  # as sent + what it still owes
            if residual is None:
                part = lambda as_sent, a, b: as_sent[a:b]  # noqa: E731
            else:
                part = lambda as_sent, a, b: residual[a:b].float().add_(as_sent[a:b])  # noqa: E731
        elif own is None:  # an earlier round's, as it went out
            part = lambda as_sent, a, b: as_sent[a:b]  # noqa: E731
        elif sent.how is _How.WITHHELD and residual is not None:  # this round's Δ + what is owed
            flat = own.reshape(-1)
            part = lambda _, a, b: residual[a:b].float().add_(flat[a:b])  # noqa: E731
        else:
            flat = own.reshape(-1)
            part = lambda _, a, b: flat[a:b]  # noqa: E731
        numel = own.numel() if own is not None else sent.numel
        from_sent = sent.how is _How.FED_BACK or own is None
        return Yardstick(part, sent, numel, from_sent=from_sent, segments=self._segments(fragment))

    def _segments(self, fragment: int) -> Sequence[int] | None:
        return None if self.segments is None else self.segments[fragment]

    def forget(self) -> None:
        """Drop what the old trajectory left unsent (the member adopted another state)."""
        self._unsent.clear()
        self._sent.clear()
