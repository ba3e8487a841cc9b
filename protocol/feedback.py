"""Error feedback: what a lossy codec drops from one round's pseudo-gradient is sent in a later one.

``ErrorFeedback`` keeps, per fragment, the part of Δ + residual that the bytes did not carry. The
residual is held in bfloat16 (2 bytes a value beside φ's 4, where a model-sized buffer counts:
docs/SCALE.md), rounded stochastically: each value to one of its two bfloat16 neighbours, with
the probability that makes the rounding unbiased. Rounding to nearest was biased where a small Δ
is added round after round to a large residual (sparse, whose values wait many rounds to be
sent): 0.58% of what went in was lost over 400 rounds of `sparse`, against 0.07% stochastically
(``tests/test_codec.py``). Either way a value loses less than one bfloat16 step (2⁻⁷ of it) per
round, neither sent nor owed; the draws come from the feedback's own generator, so a run
repeats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cgad.protocol.codec import SPARSE_KEPT, Codec, decode, encode, join_slices
from cgad.protocol.errors import FragmentError

__all__ = ["RESIDUAL_DTYPE", "ErrorFeedback", "to_bfloat16_stochastic"]

RESIDUAL_DTYPE = torch.bfloat16
_LOW_BITS = 1 << 16  # the float32 bits that bfloat16 drops
_ROUNDING_SLICE = 1 << 20


def to_bfloat16_stochastic(tensor: Tensor, generator: torch.Generator) -> Tensor:
    """``tensor`` (float32) in bfloat16, each value rounded up or down at random with the
    probability that makes the rounding unbiased: uniform noise added to the 16 bits bfloat16
    drops, which are then cut (a value whose rounding carries into its exponent moves on to the
    next binade, as it should; one that would carry into Inf stays at the largest finite value).
    A slice at a time (``_ROUNDING_SLICE`` values): the noise is no model-sized buffer.

    Args:
        tensor: a finite float32 tensor.
        generator: where the draws come from.
    """
    flat = tensor.detach().reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=RESIDUAL_DTYPE)
    largest = torch.finfo(RESIDUAL_DTYPE).max
    for start in range(0, flat.numel(), _ROUNDING_SLICE):
        bits = flat[start : start + _ROUNDING_SLICE].view(torch.int32)
        noise = torch.randint(0, _LOW_BITS, bits.shape, dtype=torch.int32, generator=generator)
        rounded = noise.add_(bits).bitwise_and_(-_LOW_BITS).view(torch.float32)
        out[start : start + _ROUNDING_SLICE] = rounded.clamp_(-largest, largest)
    return out.view(tensor.shape)


class ErrorFeedback:
    """Carries a lossy codec's rounding error into the next round (error feedback).

    ``encode(t)`` encodes ``t + residual`` and keeps ``(t + residual) - decode(bytes)``, in
    ``RESIDUAL_DTYPE`` (rounded stochastically), as the new residual, so what the codec drops in
    one round is sent in a later one instead of being lost. The residual is only what has not
    gone out yet, whatever the codec: ``send`` may switch codec and ``kept`` from one round to
    the next (``--codec auto``) and nothing is lost or sent twice beyond the residual's own
    rounding.

    Args:
        codec: the codec ``encode`` uses (``send`` may name another per round).
        kept: for ``sparse``, the values sent per block of 256.
    """

    def __init__(self, codec: Codec | str, kept: int = SPARSE_KEPT) -> None:
        self.codec = Codec(codec)
        self.kept = kept  # sparse: values sent per block
        self.residual: Tensor | None = None
        self._rounding = torch.Generator().manual_seed(0)

    def encode(self, tensor: Tensor) -> bytes:
        return self.send(tensor)

    def send(self, tensor: Tensor, codec: Codec | None = None, kept: int | None = None) -> bytes:
        """``encode``'s bytes of ``tensor`` + residual, the residual then what they did not carry;
        this round in ``codec`` keeping ``kept`` when given, else in the feedback's own. A slice
        at a time (``_ROUNDING_SLICE`` values, whole blocks of every codec): no float32 copy of
        the tensor, only the new residual beside the old until the bytes are whole (a send that
        raises leaves the residual as it was); the draws of the rounding and the bytes are those
        of the whole tensor at once.

        Args:
            tensor: this round's Δ.
            codec: this round's codec (None: the feedback's own).
            kept: for ``sparse``, the values sent per block (None: the feedback's own).
        """
        codec, kept = codec or self.codec, self.kept if kept is None else kept
        flat = tensor.detach().reshape(-1)
        if self.residual is not None and self.residual.shape != tensor.shape:
            raise FragmentError("bad_shape", f"residual {self.residual.shape} vs {tensor.shape}")
        owed = self.residual.view(-1) if self.residual is not None else None
        residual = torch.empty(flat.numel(), dtype=RESIDUAL_DTYPE)
        corrected = torch.empty(min(flat.numel(), _ROUNDING_SLICE), dtype=torch.float32)
        pieces, draws = [], self._rounding.get_state()
        try:
            for start in range(0, flat.numel(), _ROUNDING_SLICE):
                stop = min(start + _ROUNDING_SLICE, flat.numel())
                part = corrected[: stop - start].copy_(flat[start:stop])
                if owed is not None:
                    part.add_(owed[start:stop])
                pieces.append(encode(part, codec, kept))
                residual[start:stop] = to_bfloat16_stochastic(part.sub_(decode(pieces[-1])), self._rounding)
        except BaseException:
            self._rounding.set_state(draws)  # as if never sent: the next send draws the same
            raise
        data = join_slices(pieces, tuple(tensor.shape)) if pieces else encode(tensor.float(), codec, kept)
        self.residual = residual.view(tensor.shape)
        return data

    def target(self, tensor: Tensor) -> Tensor:
        """What a send of ``tensor`` now would approximate: the tensor plus what is still owed
        (a tensor of its own, never ``tensor``'s storage)."""
        corrected = tensor.detach().to(torch.float32)
        if self.residual is None:
            return corrected.clone() if corrected.data_ptr() == tensor.data_ptr() else corrected
        if self.residual.shape != corrected.shape:
            raise FragmentError("bad_shape", f"residual {self.residual.shape} vs {corrected.shape}")
        return self.residual.float().add_(corrected)  # widened, then added: a mixed add is slower

    def reset(self) -> None:
        self.residual = None
