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
no decoded copy outlives the step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from cgad.protocol.codec import ROUNDING, Codec, decode, encode
from cgad.protocol.config import SPARSE_KEPT, wire_codec
from cgad.protocol.feedback import ErrorFeedback
from cgad.protocol.scheduling import auto_codec

__all__ = ["Sender", "Yardstick"]


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

    def decoded(self) -> Tensor:
        return self.data if isinstance(self.data, Tensor) else decode(self.data)


class Yardstick:
    """The own Δ of a fragment that one outer step judges its peers' deltas against: what this
    member sends of it (Δ plus what is still owed), dense, and as a delivery of a given sparsity
    would carry it. Built when first asked for (a step that judges nothing builds nothing) and
    dropped with the step.

    Args:
        target: builds the dense target from the own Δ as it went out (decoded once, shared with
            ``reference``).
        sent: the own Δ as it went out (None: never sent: the target is this round's Δ).
    """

    def __init__(self, target: Callable[[Tensor | None], Tensor], sent: _Sent | None) -> None:
        self._build = target
        self._sent_record = sent
        self._picked: dict[int | None, Tensor] = {}

    @cached_property
    def _sent(self) -> Tensor | None:
        return None if self._sent_record is None else self._sent_record.decoded()

    @cached_property
    def target(self) -> Tensor:
        return self._build(self._sent)

    def reference(self, kept: int | None) -> Tensor:
        """The yardstick as a delivery that keeps ``kept`` values per block (None: dense) carries
        it: the own Δ as sent when it was sent so, else the target picked the same way."""
        if self._sent_record is not None and kept == self._sent_record.kept:
            return self._sent  # type: ignore[return-value]
        if kept is None:
            return self.target
        if kept not in self._picked:
            self._picked[kept] = decode(encode(self.target, Codec.SPARSE, kept))
        return self._picked[kept]

    def norm(self) -> float:
        """‖target‖, in float64 (a finite fp32 tensor of 1e20s overflows fp32's)."""
        return float(torch.linalg.vector_norm(self.target, dtype=torch.float64))


class Sender:
    """Encodes a member's pseudo-gradients.

    Args:
        codec: the ``--codec`` name ("auto", "sparse", "4bit", ...; None or "fp32": sent whole).
        sparse_keep: values per block of 256 under "sparse".
        link_budget: bytes per round the link carries to each fetching peer (None: not measured
            yet; infinite: not what limits), for "auto".
        total_numel: values in the whole model (a fragment gets its share of the budget).
        error_feedback: carry what a rounding codec drops into later rounds (sparse always does).
    """

    def __init__(
        self,
        codec: str | None,
        *,
        sparse_keep: int = SPARSE_KEPT,
        link_budget: Callable[[], float | None] | None = None,
        total_numel: int = 1,
        error_feedback: bool = True,
    ) -> None:
        self.codec = codec
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
            self._sent[fragment] = _Sent(sparse_kept, data, _How.PLAIN)
            return data, codec, kept
        data = feedback.send(delta, codec, kept)
        self._sent[fragment] = _Sent(sparse_kept, data, _How.FED_BACK)
        return data, codec, kept

    def sent_whole(self, fragment: int, delta: Tensor) -> None:
        """Fragment ``fragment``'s Δ went out as it is (not encoding): it is its own yardstick."""
        self._sent[fragment] = _Sent(None, delta, _How.PLAIN)

    def withhold(self, fragment: int, delta: Tensor) -> None:
        """A block that is not sent (kept from the peers after adopting a state): its yardstick is
        the target it would have had, picked as this round would send it; the residual is left
        alone."""
        if not self.encodes:
            self._sent[fragment] = _Sent(None, delta, _How.PLAIN)
            return
        codec, kept = self.choose(delta.numel())
        feedback = self._unsent.get(fragment)
        carries = feedback is not None and self._feeds_back(codec)
        target = feedback.target(delta) if carries else delta
        self._sent[fragment] = _Sent(
            kept if codec is Codec.SPARSE else None,
            encode(target, codec, kept),
            _How.WITHHELD if carries else _How.PLAIN,
        )

    def yardstick(self, fragment: int, own: Tensor | None) -> Yardstick | None:
        """What fragment ``fragment``'s peers' deltas are judged against at its outer step:
        ``own``, this round's Δ (sent or withheld), with what it owed; without one (the block
        diverged), the latest own Δ as it went out; None when there never was one."""
        sent = self._sent.get(fragment)
        if sent is None:
            return None if own is None else Yardstick(lambda _: own, None)
        feedback = self._unsent.get(fragment)
        residual = feedback.residual if feedback is not None else None
        if sent.how is _How.FED_BACK:
            # widened first, then added in place: a float32 + bfloat16 add is twice as slow
            if residual is None:
                target = lambda as_sent: as_sent  # noqa: E731
            else:
                target = lambda as_sent: residual.float().add_(as_sent)  # noqa: E731
        elif own is None:  # an earlier round's, as it went out
            target = lambda as_sent: as_sent  # noqa: E731
        elif sent.how is _How.WITHHELD and feedback is not None:
            target = lambda _: feedback.target(own)  # noqa: E731
        else:
            target = lambda _: own  # noqa: E731
        return Yardstick(target, sent)

    def forget(self) -> None:
        """Drop what the old trajectory left unsent (the member adopted another state)."""
        self._unsent.clear()
        self._sent.clear()
