"""The outer loop: one peer's outer state, and its step at each fragment's turn.

This is the code both the daemon and the simulator run. At fragment f's turn:

1. Δ_f = φ_f − θ_f, the pseudo-gradient of the inner steps since f's last sync, is published,
   tagged with the version it started from (``versions[f]``) and the tokens behind it;
2. what peers published for f and the transport delivered since is taken; each delivery's age is
   τ = versions[f] − base (DESIGN.md §3); the own Δ has age 0;
3. the outer optimizer takes one step on f (one step per fragment per round, whatever arrived):
   the age-aware family combines Δ̄ = Σ w_i·σ(τ_i)·Δ_i / Σ w_i with token weights w_i; Nesterov
   and SGD take the token-weighted mean; Delayed Nesterov takes each delivery as one arrival;
   NoLoCo averages with one random peer of the round;
4. versions[f] += 1, and θ_f ← φ_f: the local model continues from the new outer parameters.

A peer more than the cutoff behind the newest version it has seen should re-sync its state
(``behind_by``); the driver does that with ``state_dict`` / ``load_state_dict`` from a live peer.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from cgad.optim import (
    CGAD,
    DEFAULT_ALPHA,
    DEFAULT_CUTOFF,
    DEFAULT_LR,
    PACGAD,
    DelayedNesterov,
    OuterNesterov,
    noloco_update,
    staleness_weight,
)
from cgad.protocol.transport import Fragment, FragmentKey, Kind, Transport

HISTORY = 100_000

__all__ = ["OPTIMIZERS", "Delivery", "OuterConfig", "OuterLoop", "strided_fragments"]

OPTIMIZERS = ("cgad", "pa-cgad", "adam-decay", "adam", "nesterov", "delayed-nesterov", "sgd", "noloco")
_AGE_AWARE = ("cgad", "pa-cgad", "adam-decay", "adam")

# Outer learning rates when none is given: DiLoCo's 0.7 for the momentum-SGD family and NoLoCo's
# reference η; the Adam family's from the delay sweep (docs/RESULTS.md).
OUTER_LR = {
    "cgad": DEFAULT_LR,
    "pa-cgad": DEFAULT_LR,
    "adam-decay": DEFAULT_LR,
    "adam": DEFAULT_LR,
    "nesterov": 0.7,
    "delayed-nesterov": 0.7,
    "sgd": 0.7,
    "noloco": 0.7,
}


@dataclass
class OuterConfig:
    optimizer: str = "cgad"
    lr: float | None = None  # None: OUTER_LR[optimizer]
    fragments: int = 1
    alpha: float = DEFAULT_ALPHA  # CGAD's decay rate per round of age
    cutoff: float = DEFAULT_CUTOFF  # CGAD's gate reaches zero here; also the re-sync threshold
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9  # Nesterov family
    noloco_beta: float = 0.5
    restart_every: int = 0
    mixing: str = "none"  # "gossip": after the outer step, average φ with one random peer's
    mixing_period: int = 1  # rounds between gossip mixes

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if self.fragments < 1:
            raise ValueError(f"fragments must be >= 1, got {self.fragments}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"outer lr must be > 0, got {self.lr}")
        staleness_weight(0, self.alpha, self.cutoff)  # alpha >= 0 and cutoff > 0, or a clear error
        if self.mixing not in ("none", "gossip"):
            raise ValueError(f"mixing must be none or gossip, got {self.mixing!r}")
        if self.mixing_period < 1:
            raise ValueError(f"mixing_period must be >= 1, got {self.mixing_period}")

    @property
    def outer_lr(self) -> float:
        return OUTER_LR[self.optimizer] if self.lr is None else self.lr


@dataclass(frozen=True)
class Delivery:
    """A pseudo-gradient as the optimizer saw it."""

    fragment: int
    publisher: str
    base_version: int
    age: int
    weight: float  # σ(τ) for the age-aware family, 1 otherwise
    own: bool  # this peer's own fresh pseudo-gradient


def strided_fragments(num_params: int, count: int) -> list[list[int]]:
    """Parameter indices of each fragment: strided, so every fragment spans the whole depth."""
    if count > num_params:
        raise ValueError(f"{count} fragments for only {num_params} parameter tensors")
    return [list(range(f, num_params, count)) for f in range(count)]


@dataclass
class _Counters:
    published: int = 0
    applied: int = 0
    dropped_stale: int = 0
    from_future: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    applied_by_peer: Counter[str] = field(default_factory=Counter)
    age_sum: int = 0
    age_count: int = 0
    mixed: int = 0


class OuterLoop:
    """Outer parameters φ, their versions and optimizer, for one peer."""

    def __init__(
        self,
        params: list[Tensor],
        config: OuterConfig,
        transport: Transport,
        run_id: str,
        seed: int = 0,
    ) -> None:
        self.theta = params
        self.config = config
        self.transport = transport
        self.run_id = run_id
        self.fragments = strided_fragments(len(params), config.fragments)
        self.phi = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params]
        self.versions = [0] * config.fragments
        self.newest_seen = [0] * config.fragments
        self.counters = _Counters()
        # the deliveries the optimizer took, newest last (bounded: a daemon runs for weeks)
        self.history: deque[Delivery] = deque(maxlen=HISTORY)
        self._rng = random.Random(seed)
        self._own: dict[int, Fragment] = {}  # published, not yet applied
        self._noloco_momentum = (
            [torch.zeros_like(p) for p in self.phi] if config.optimizer == "noloco" else []
        )
        self.optimizer = self._build_optimizer()

    def _build_optimizer(self) -> torch.optim.Optimizer | None:
        c = self.config
        groups = [{"params": [self.phi[i] for i in frag]} for frag in self.fragments]
        lr = c.outer_lr
        if c.optimizer in ("cgad", "adam-decay", "adam"):
            # σ is applied while combining the round's deliveries, so the optimizer sees age 0
            return CGAD(groups, lr=lr, betas=c.betas, restart_every=c.restart_every)
        if c.optimizer == "pa-cgad":
            return PACGAD(groups, lr=lr, betas=c.betas, restart_every=c.restart_every)
        if c.optimizer in ("nesterov", "sgd"):
            momentum = c.momentum if c.optimizer == "nesterov" else 0.0
            return OuterNesterov(groups, lr=lr, momentum=momentum, restart_every=c.restart_every)
        if c.optimizer == "delayed-nesterov":
            # one momentum update per round's worth of arrivals: N = the peers expected per round
            period = max(1, len(self.transport.live_peers()) + 1)
            return DelayedNesterov(groups, lr=lr, momentum=c.momentum, period=period)
        return None  # noloco: a function over explicit state

    def staleness(self, age: int) -> float:
        c = self.config
        if c.optimizer == "adam":
            return 1.0
        cutoff = math.inf if c.optimizer == "adam-decay" else c.cutoff
        return staleness_weight(age, c.alpha, cutoff)

    # -- the step ---------------------------------------------------------------------------

    @staticmethod
    def layout_numels(params: list[Tensor], fragments: int) -> list[int]:
        """How many values each fragment holds, for a transport that validates what it fetches."""
        return [sum(params[i].numel() for i in idx) for idx in strided_fragments(len(params), fragments)]

    def sync(self, f: int, tokens: int) -> list[Delivery]:
        """Fragment f's turn: publish its pseudo-gradient, then apply what has arrived."""
        self.publish(f, tokens)
        return self.apply(f)

    def publish(self, f: int, tokens: int) -> None:
        """Compute Δ_f = φ_f − θ_f and hand it to the transport (and φ_f too, for NoLoCo)."""
        idx = self.fragments[f]
        with torch.no_grad():
            own = torch.cat([(self.phi[i] - self.theta[i].float()).flatten() for i in idx])
            if not torch.isfinite(own).all():
                # the local block diverged: drop it (θ_f back to φ_f); peers' fragments still apply
                self.counters.rejected["local_non_finite"] += 1
                for i in idx:
                    self.theta[i].copy_(self.phi[i])
                self._own[f] = None
                return
        key = FragmentKey(self.run_id, f, self.versions[f], self.transport.peer_id)
        self._own[f] = Fragment(key, own, tokens)
        self.transport.publish(self._own[f])
        self.counters.published += 1
        if self.config.optimizer == "noloco" or self._mixing_due(f):
            params = torch.cat([self.phi[i].detach().flatten() for i in idx])
            self.transport.publish(Fragment(replace(key, kind=Kind.PARAMS), params, tokens))

    def apply(self, f: int) -> list[Delivery]:
        """One outer step on fragment f with its own fresh Δ and everything delivered since."""
        if f not in self._own:
            raise RuntimeError(f"apply({f}) without publish({f}) first")
        own = self._own.pop(f)
        base = self.versions[f]
        incoming: list[tuple[Fragment, int]] = [] if own is None else [(own, 0)]
        for frag in self.transport.receive(f):
            if frag.tensor.numel() != self._numel(f):
                self.counters.rejected["bad_shape"] += 1
                continue
            age = base - frag.key.base_version
            self.newest_seen[f] = max(self.newest_seen[f], frag.key.base_version + 1)
            if age < 0:  # a peer ahead of us: fresh information, and a hint that we lag
                self.counters.from_future += 1
                age = 0
            incoming.append((frag, age))
        # outer parameters published by peers: taken by NoLoCo and gossip, drained otherwise
        params = self.transport.receive(f, Kind.PARAMS)
        with torch.no_grad():
            if incoming:
                taken = self._apply(f, incoming, own is not None, params)
            else:
                taken = []
            if self._mixing_due(f):
                self._gossip(f, params)
            self.versions[f] += 1
            for i in self.fragments[f]:
                self.theta[i].copy_(self.phi[i])
        self.newest_seen[f] = max(self.newest_seen[f], self.versions[f])
        return taken

    def _apply(
        self, f: int, incoming: list[tuple[Fragment, int]], has_own: bool, params: list[Fragment]
    ) -> list[Delivery]:
        opt = self.config.optimizer
        weights = [self.staleness(age) if opt in _AGE_AWARE else 1.0 for _, age in incoming]
        taken = []
        for n, ((frag, age), w) in enumerate(zip(incoming, weights, strict=True)):
            if w == 0.0:
                self.counters.dropped_stale += 1
                continue
            is_own = has_own and n == 0
            d = Delivery(f, frag.key.publisher, frag.key.base_version, age, w, own=is_own)
            taken.append(d)
            if not is_own:
                self.counters.applied_by_peer[frag.key.publisher] += 1
            self.counters.age_sum += age
            self.counters.age_count += 1
        self.counters.applied += len(taken) - int(has_own)  # the own fragment is not "applied"
        self.history.extend(taken)
        kept = [(frag, age, w) for (frag, age), w in zip(incoming, weights, strict=True) if w > 0.0]
        if not kept:
            return taken
        if opt == "noloco":
            self._noloco_step(f, kept, has_own, params)
        elif opt == "delayed-nesterov":
            # N = the arrivals expected per round: this peer and the peers it sees now
            for group in self.optimizer.param_groups:
                group["period"] = len(self.transport.live_peers()) + 1
            for frag, _, _ in sorted(kept, key=lambda x: -x[1]):  # oldest first, own fresh one last
                self._set_grad(f, frag.tensor)
                self.optimizer.step()
        else:
            total_tokens = sum(max(frag.tokens, 1) for frag, _, _ in kept)
            mean = torch.zeros_like(kept[0][0].tensor)
            for frag, _, w in kept:
                mean.add_(frag.tensor, alpha=w * max(frag.tokens, 1) / total_tokens)
            self._set_grad(f, mean)
            if opt == "pa-cgad":
                self.optimizer.step(ages=[0 if g == f else None for g in range(len(self.fragments))])
            else:
                self.optimizer.step()
        return taken

    def _set_grad(self, f: int, flat: Tensor) -> None:
        for p in self.phi:
            p.grad = None
        offset = 0
        for i in self.fragments[f]:
            p = self.phi[i]
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def _unflatten(self, f: int, flat: Tensor) -> list[Tensor]:
        out, offset = [], 0
        for i in self.fragments[f]:
            n = self.phi[i].numel()
            out.append(flat[offset : offset + n].view_as(self.phi[i]))
            offset += n
        return out

    def _mixing_due(self, f: int) -> bool:
        c = self.config
        return c.mixing == "gossip" and c.optimizer != "noloco" and self.versions[f] % c.mixing_period == 0

    def _gossip(self, f: int, params: list[Fragment]) -> None:
        """Average fragment f's φ with one random peer's latest published φ (pairwise gossip),
        among peers whose φ is at most the cutoff old."""
        newest: dict[str, Fragment] = {}
        for p in params:
            fresh = self.versions[f] - p.key.base_version <= self.config.cutoff
            if fresh and p.tensor.numel() == self._numel(f):
                held = newest.get(p.key.publisher)
                if held is None or p.key.base_version > held.key.base_version:
                    newest[p.key.publisher] = p
        if not newest:
            return
        partner = newest[self._rng.choice(sorted(newest))]
        for mine, theirs in zip(
            [self.phi[i].data for i in self.fragments[f]], self._unflatten(f, partner.tensor), strict=True
        ):
            mine.lerp_(theirs.to(mine.dtype), 0.5)
        self.counters.mixed += 1

    def _numel(self, f: int) -> int:
        return sum(self.phi[i].numel() for i in self.fragments[f])

    def _noloco_step(
        self, f: int, kept: list[tuple[Fragment, int, float]], has_own: bool, params: list[Fragment]
    ) -> None:
        idx = self.fragments[f]
        phi = [self.phi[i].data for i in idx]
        momentum = [self._noloco_momentum[i] for i in idx]
        peers_kept = kept[1:] if has_own else kept
        partners = {frag.key.publisher: frag for frag, _, _ in peers_kept}
        numel = self._numel(f)
        newest_phi = {  # each peer's newest φ (sorted by version: later ones overwrite)
            p.key.publisher: p
            for p in sorted(params, key=lambda p: p.key.base_version)
            if p.tensor.numel() == numel
        }
        if not has_own:  # the local block was discarded: no own Δ to step with
            return
        own_delta = self._unflatten(f, kept[0][0].tensor)
        candidates = sorted(set(partners) & set(newest_phi))
        if not candidates:
            noloco_update(
                phi, own_delta, None, None, momentum, lr=self.config.outer_lr, beta=self.config.noloco_beta
            )
            return
        partner = self._rng.choice(candidates)
        their_phi = self._unflatten(f, newest_phi[partner].tensor)
        their_delta = self._unflatten(f, partners[partner].tensor)
        mean_phi = [(a + b) / 2 for a, b in zip(phi, their_phi, strict=True)]
        mean_delta = [(a + b) / 2 for a, b in zip(own_delta, their_delta, strict=True)]
        noloco_update(
            phi,
            own_delta,
            mean_phi,
            mean_delta,
            momentum,
            lr=self.config.outer_lr,
            beta=self.config.noloco_beta,
        )

    # -- swarm position and state -----------------------------------------------------------

    def behind_by(self) -> int:
        """How many versions this peer's most lagging fragment is behind the newest seen."""
        return max(n - v for n, v in zip(self.newest_seen, self.versions, strict=True))

    def mean_age(self) -> float:
        c = self.counters
        return c.age_sum / c.age_count if c.age_count else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "phi": [p.detach().clone() for p in self.phi],
            "versions": list(self.versions),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "noloco_momentum": [m.clone() for m in self._noloco_momentum],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt another peer's (or a checkpoint's) outer state; θ restarts from its φ."""
        if len(state["phi"]) != len(self.phi) or len(state["versions"]) != len(self.versions):
            raise ValueError("outer state has a different model or fragment layout")
        with torch.no_grad():
            for p, q, t in zip(self.phi, state["phi"], self.theta, strict=True):
                if p.shape != q.shape:
                    raise ValueError(f"outer state shape {tuple(q.shape)} != local {tuple(p.shape)}")
                p.copy_(q)
                t.copy_(q)
            for m, q in zip(self._noloco_momentum, state["noloco_momentum"], strict=True):
                m.copy_(q)
        self.versions = list(state["versions"])
        self.newest_seen = [max(a, b) for a, b in zip(self.newest_seen, self.versions, strict=True)]
        if self.optimizer is not None:
            # moments and step counts from the state; hyperparameters stay this peer's own
            ours = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            self.optimizer.load_state_dict(state["optimizer"])
            for group, hyper in zip(self.optimizer.param_groups, ours, strict=True):
                group.update(hyper)
