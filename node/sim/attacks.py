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
  touches it, and what it pushes adds up round after round. Several attackers are colluders;
- ``edge:K``, ``edge:NAME``  adaptive, against a defender it has read: its own honest Δ plus a
  push on a small set of values, K of each fragment (fixed per fragment and run, shared by
  colluders) or the parameter NAME (``edge:norm.weight``: the final RMSNorm's gains, 96 values of
  the sweep model's 320k), as long as keeps its cosine with its own Δ at
  ``EDGE_MIN_COSINE`` (above the direction screen's 0) and at most ``EDGE_MAX_PUSH`` times its
  norm, with a token claim at the receiver's cap (``TOKEN_CAP`` times its own block): the clip
  around a receiver's Δ lets most of it through, all of it aimed at those K values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from cgad.protocol.codec import SPARSE_KEPT, Codec, decode, encode, kept_in
from cgad.protocol.errors import FragmentError
from cgad.protocol.transport import Fragment, FragmentKey, Kind, Transport

__all__ = [
    "ATTACK_KINDS",
    "Attack",
    "ForgingTransport",
    "direction",
    "edge_indices",
    "edge_targets",
    "largest_push",
]

# kind -> whether it takes an amount (``kind:amount``)
ATTACK_KINDS = {"scale": True, "signflip": False, "noise": True, "nan": False, "inf": False,
                "tokens": True, "future": True, "mirror": True, "edge": True}  # fmt: skip
EDGE_MIN_COSINE = 0.15  # the push's bound: its Δ's cosine with its own honest Δ
EDGE_MAX_PUSH = 4.0  # and at most this many times that Δ's norm
EDGE_TOKENS = 2  # its token claim, times its own block: the receivers' cap (outer.TOKEN_CAP)


@dataclass(frozen=True)
class Attack:
    kind: str
    amount: float = 1.0
    target: str | None = None  # edge:NAME: the parameter it pushes on

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
        if kind == "edge" and re.fullmatch(r"[A-Za-z_][\w.]*", amount):
            return cls(kind, target=amount)
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"attack {text!r}: {amount!r} is not a number") from None
        whole = kind in ("tokens", "future", "edge")
        if not math.isfinite(value) or (whole and (value < 0 or value != int(value))):
            raise ValueError(f"attack {text!r}: {kind} takes a {'whole' if whole else 'finite'} amount")
        return cls(kind, value)

    def __str__(self) -> str:
        if self.target is not None:
            return f"{self.kind}:{self.target}"
        return self.kind if not ATTACK_KINDS[self.kind] else f"{self.kind}:{self.amount:g}"

    def forge(
        self,
        fragment: Fragment,
        generator: torch.Generator | None = None,
        direction_seed: int = 0,
        targets: Mapping[int, torch.Tensor] | None = None,
    ) -> Fragment:
        """What the attacker publishes in place of ``fragment`` (pseudo-gradients only: its
        outer parameters, where it shares them, go out as they are). ``generator`` draws noise;
        ``direction_seed`` fixes the direction ``mirror`` pushes along (colluders share it);
        ``targets``: per fragment, the offsets of ``edge:NAME``'s parameter (``edge_targets``)."""
        if fragment.key.kind is not Kind.DELTA:
            return fragment
        tensor = fragment.tensor
        if self.kind == "mirror":
            return replace(fragment, tensor=tensor + self.amount * tensor.norm() * direction(
                tensor.numel(), direction_seed * 65_537 + fragment.key.fragment
            ).reshape(tensor.shape).to(tensor.dtype))  # fmt: skip
        if self.kind == "edge":
            unit = torch.zeros(tensor.numel(), dtype=torch.float64)
            if self.target is None:
                seed = direction_seed * 65_537 + fragment.key.fragment
                unit[edge_indices(tensor.numel(), int(self.amount), seed)] = 1.0
            elif targets is not None and fragment.key.fragment in targets:
                unit[targets[fragment.key.fragment]] = 1.0
            unit /= unit.norm().clamp_min(1e-12)
            push = largest_push(tensor.flatten().double(), unit)
            forged = (tensor.flatten().double() + push * unit).reshape(tensor.shape).to(tensor.dtype)
            return replace(fragment, tensor=forged, tokens=fragment.tokens * EDGE_TOKENS)
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


def edge_targets(
    named: Sequence[tuple[str, int]], fragments: Sequence[Sequence[int]], name: str
) -> dict[int, torch.Tensor]:
    """Per fragment, the offsets of the parameter ``name`` (or the one whose name ends in
    ``.name``) in that fragment's flat Δ.

    Args:
        named: the model's parameters in order, as (name, numel).
        fragments: each fragment's parameter indices (``ledger.strided_fragments``).
        name: the parameter.
    """
    found: dict[int, torch.Tensor] = {}
    for f, indices in enumerate(fragments):
        offset = 0
        for i in indices:
            param, numel = named[i]
            if param == name or param.endswith("." + name):
                found[f] = torch.arange(offset, offset + numel)
            offset += numel
    if not found:
        raise ValueError(f"edge:{name}: the model has no parameter of that name")
    return found


def edge_indices(numel: int, count: int, seed: int) -> torch.Tensor:
    """``count`` coordinates of a fragment of ``numel`` values, the same for the same seed."""
    return torch.randperm(numel, generator=torch.Generator().manual_seed(seed))[: max(1, min(count, numel))]


def largest_push(delta: torch.Tensor, unit: torch.Tensor) -> float:
    """The longest push along ``unit`` that keeps ``delta + push·unit`` at a cosine of
    ``EDGE_MIN_COSINE`` or more with ``delta``, and within ``EDGE_MAX_PUSH`` norms of it."""
    norm = float(delta.norm())
    if norm == 0.0:
        return 0.0

    def cosine(push: float) -> float:
        moved = delta + push * unit
        return float(moved @ delta) / max(float(moved.norm()) * norm, 1e-30)

    low, high = 0.0, EDGE_MAX_PUSH * norm
    if cosine(high) >= EDGE_MIN_COSINE:
        return high
    for _ in range(40):  # the cosine falls as the push grows (the push is near orthogonal)
        middle = (low + high) / 2
        low, high = (middle, high) if cosine(middle) >= EDGE_MIN_COSINE else (low, middle)
    return low


def direction(numel: int, seed: int) -> torch.Tensor:
    """A unit vector of ``numel`` values, the same for the same seed."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return values / values.norm().clamp_min(1e-12)


class ForgingTransport(Transport):
    """A transport whose every published fragment is forged by ``attack``; receiving is honest.
    ``seed`` draws this attacker's noise; ``direction_seed`` is the run's, shared by colluders."""

    def __init__(
        self,
        inner: Transport,
        attack: Attack,
        seed: int = 0,
        direction_seed: int = 0,
        targets: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        self.inner = inner
        self._targets = targets
        self.attack = attack
        self.peer_id = inner.peer_id
        self.stats = inner.stats
        self.fan_in = inner.fan_in
        self._generator = torch.Generator().manual_seed(seed)
        self._direction_seed = direction_seed

    def publish(self, fragment: Fragment) -> None:
        self.inner.publish(self.attack.forge(fragment, self._generator, self._direction_seed, self._targets))

    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        """The honest bytes decoded, forged, and sent in the same codec and values per block (what
        the codec cannot carry, NaN or Inf, goes out whole)."""
        forged = self.attack.forge(
            Fragment(key, decode(data), tokens), self._generator, self._direction_seed, self._targets
        )
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
