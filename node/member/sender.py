"""What a member sends of its pseudo-gradients: the codec of each round, and error feedback.

The one owner of both. A lossy codec (int8, 4bit, 2bit, sparse) drops part of each Δ; what it
drops is kept per fragment and sent in a later round (``ErrorFeedback``), whatever codec that
round uses. Under ``--codec auto`` each round's codec is the one the link carries in time (4bit
where it fits, else sparse with as many values per block as fit: ``scheduling.auto_codec``),
from the bytes per round the link is measured to carry (``link_budget``). The transport gets
bytes, never a policy.

The own Δ a peer's delta is judged against (``robust.AroundOwn``) is what this member would send
(Δ plus what is still owed), picked as sparsely as each delivery is: a sparse delta sits about
the whole norm of a dense one away by its support alone.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from cgad.protocol.codec import ROUNDING, Codec, ErrorFeedback, decode, encode
from cgad.protocol.config import SPARSE_KEPT, wire_codec
from cgad.protocol.scheduling import auto_codec

__all__ = ["Sender"]


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
        # per fragment: the progress not sent yet, and the own Δ as sent last with its values per
        # block (None: dense)
        self._unsent: dict[int, ErrorFeedback] = {}
        self._sent: dict[int, tuple[int | None, Tensor]] = {}

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

    def send(self, fragment: int, delta: Tensor) -> tuple[bytes, Codec, int, Tensor]:
        """Encode fragment ``fragment``'s Δ with what earlier rounds left out: the bytes, the
        codec and values per block, and the target they approximate (the own yardstick)."""
        codec, kept = self.choose(delta.numel())
        feedback = self._unsent.setdefault(fragment, ErrorFeedback(Codec.SPARSE))
        if not self._feeds_back(codec):
            data = encode(delta, codec, kept)
            self._sent[fragment] = (kept if codec is Codec.SPARSE else None, decode(data))
            return data, codec, kept, delta
        target = feedback.target(delta)
        data, picked = feedback.send(delta, codec, kept)
        self._sent[fragment] = (kept if codec is Codec.SPARSE else None, picked)
        return data, codec, kept, target

    def withhold(self, fragment: int, delta: Tensor) -> Tensor:
        """A block that is not sent (kept from the peers after adopting a state): the target it
        would have had, picked as this round would send it, leaving the residual alone."""
        codec, kept = self.choose(delta.numel())
        feedback = self._unsent.get(fragment)
        target = feedback.target(delta) if feedback is not None and self._feeds_back(codec) else delta
        self._sent[fragment] = (kept if codec is Codec.SPARSE else None, decode(encode(target, codec, kept)))
        return target

    def reference(self, fragment: int, yardstick: Tensor, kept: int | None) -> Tensor:
        """The yardstick as a delivery that keeps ``kept`` values per block (None: dense) would
        carry it: the own Δ as sent when it was sent so, else picked the same way."""
        sent_kept, sent = self._sent.get(fragment, (None, yardstick))
        if kept == sent_kept and sent.shape == yardstick.shape:
            return sent
        return yardstick if kept is None else decode(encode(yardstick, Codec.SPARSE, kept))

    def forget(self) -> None:
        """Drop what the old trajectory left unsent (the member adopted another state)."""
        self._unsent.clear()
        self._sent.clear()
