"""What a hostile peer sends: the attacks the simulator plays (``--attackers K --attack KIND``) and
the adversarial tests replay against real daemons.

An attacker trains like any worker and then forges what it publishes; its own model is not
judged. Kinds, with the defence each meets (docs/SECURITY.md):

- ``scale:F``   its pseudo-gradient times F (clipping around the receiver's own Δ);
- ``signflip``  its pseudo-gradient reversed (clipping bounds it to a radius);
- ``noise:F``   Gaussian noise of F times its pseudo-gradient's norm in place of it (clipping);
- ``nan``, ``inf``  every value non-finite (refused, counted ``non_finite``);
- ``tokens:N``  a claim of N tokens for its block (capped at twice the receiver's own);
- ``future:N``  a claim that its fragment is N versions newer than it is (beyond the cutoff:
  refused, counted ``future``; within it: taken at age 0, which is what a fresh fragment gets);
- ``mirror:S``  an honest-looking Δ (its own, trained on its shard) shifted by S times its norm
  along one fixed direction per fragment, the same for every attacker of a run (``direction_seed``):
  at S = 1 it sits as close to a receiver's own Δ as an honest one does (√3 norms at most, inside
  the radius of 2) with the same sign of cosine, so neither clipping nor the direction screen
  touches it, and what it pushes adds up round after round. Several attackers are colluders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from cgad.protocol.codec import SPARSE_KEPT, Codec, decode, encode, kept_in
from cgad.protocol.errors import FragmentError
from cgad.protocol.transport import Fragment, FragmentKey, Kind, Transport

__all__ = ["ATTACK_KINDS", "Attack", "ForgingTransport", "direction"]

# kind -> whether it takes an amount (``kind:amount``)
ATTACK_KINDS = {"scale": True, "signflip": False, "noise": True, "nan": False, "inf": False,
                "tokens": True, "future": True, "mirror": True}  # fmt: skip


@dataclass(frozen=True)
class Attack:
    kind: str
    amount: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Attack:
        """``kind`` or ``kind:amount``; a ValueError that lists the kinds otherwise."""
        kind, _, amount = text.partition(":")
        usage = ", ".join(f"{k}:N" if takes else k for k, takes in ATTACK_KINDS.items())
        if kind not in ATTACK_KINDS:
            raise ValueError(f"unknown attack {text!r}; one of {usage}")
        if ATTACK_KINDS[kind] != bool(amount):
            need = "needs an" if ATTACK_KINDS[kind] else "takes no"
            raise ValueError(f"attack {text!r}: {kind} {need} amount ({usage})")
        if not amount:
            return cls(kind)
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"attack {text!r}: {amount!r} is not a number") from None
        whole = kind in ("tokens", "future")
        if not math.isfinite(value) or (whole and (value < 0 or value != int(value))):
            raise ValueError(f"attack {text!r}: {kind} takes a {'whole' if whole else 'finite'} amount")
        return cls(kind, value)

    def __str__(self) -> str:
        return self.kind if not ATTACK_KINDS[self.kind] else f"{self.kind}:{self.amount:g}"

    def forge(
        self, fragment: Fragment, generator: torch.Generator | None = None, direction_seed: int = 0
    ) -> Fragment:
        """What the attacker publishes in place of ``fragment`` (pseudo-gradients only: its
        outer parameters, where it shares them, go out as they are). ``generator`` draws noise;
        ``direction_seed`` fixes the direction ``mirror`` pushes along (colluders share it)."""
        if fragment.key.kind is not Kind.DELTA:
            return fragment
        tensor = fragment.tensor
        if self.kind == "mirror":
            return replace(fragment, tensor=tensor + self.amount * tensor.norm() * direction(
                tensor.numel(), direction_seed * 65_537 + fragment.key.fragment
            ).reshape(tensor.shape).to(tensor.dtype))  # fmt: skip
        if self.kind == "scale":
            return replace(fragment, tensor=tensor * self.amount)
        if self.kind == "signflip":
            return replace(fragment, tensor=-tensor)
        if self.kind == "noise":
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            return replace(
                fragment, tensor=noise * (self.amount * tensor.norm() / max(tensor.numel(), 1) ** 0.5)
            )
        if self.kind in ("nan", "inf"):
            return replace(fragment, tensor=torch.full_like(tensor, float(self.kind)))
        if self.kind == "tokens":
            return replace(fragment, tokens=int(self.amount))
        key = fragment.key  # future
        return replace(fragment, key=replace(key, base_version=key.base_version + int(self.amount)))


def direction(numel: int, seed: int) -> torch.Tensor:
    """A unit vector of ``numel`` values, the same for the same seed."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return values / values.norm().clamp_min(1e-12)


class ForgingTransport(Transport):
    """A transport whose every published fragment is forged by ``attack``; receiving is honest.
    ``seed`` draws this attacker's noise; ``direction_seed`` is the run's, shared by colluders."""

    def __init__(self, inner: Transport, attack: Attack, seed: int = 0, direction_seed: int = 0) -> None:
        self.inner = inner
        self.attack = attack
        self.peer_id = inner.peer_id
        self.stats = inner.stats
        self.fan_in = inner.fan_in
        self._generator = torch.Generator().manual_seed(seed)
        self._direction_seed = direction_seed

    def publish(self, fragment: Fragment) -> None:
        self.inner.publish(self.attack.forge(fragment, self._generator, self._direction_seed))

    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        """The honest bytes decoded, forged, and sent in the same codec and values per block (what
        the codec cannot carry, NaN or Inf, goes out whole)."""
        forged = self.attack.forge(Fragment(key, decode(data), tokens), self._generator, self._direction_seed)
        try:
            encoded = encode(forged.tensor, codec, kept_in(data) or SPARSE_KEPT)
        except (FragmentError, ValueError, OverflowError):
            self.inner.publish(forged)
            return
        self.inner.publish_encoded(forged.key, encoded, codec=codec, numel=numel, tokens=forged.tokens)

    def receive(self, index: int, kind: Kind = Kind.DELTA) -> list[Fragment]:
        return self.inner.receive(index, kind)

    def live_peers(self) -> list[str]:
        return self.inner.live_peers()

    def close(self) -> None:
        self.inner.close()
