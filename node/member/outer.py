"""The outer loop: one peer's outer state, and its step at each fragment's turn.

This is the code both the daemon and the simulator run. At fragment f's turn:

1. Δ_f = φ_f − θ_f, the pseudo-gradient of the inner steps since f's last sync, is published,
   tagged with the version it started from (``versions[f]``) and the tokens behind it, in the
   codec its ``Sender`` picks (node/member/sender.py), with the inner first moment beside it
   (node/member/moments.py);
2. what peers published for f and the transport delivered since is taken; each delivery's age is
   τ = versions[f] − base (docs/DESIGN.md §3); the own Δ has age 0; with ``--aggregation clip``
   (the default) a peer's Δ pointing against the own one is refused (``opposed``) and the rest
   are clipped around it, tensor by tensor and whole (``sender.Yardstick``); with a data score, a
   Δ that raises the member's held-out loss is refused and each peer weighs by its record; a
   peer's token claim weighs at most ``TOKEN_CAP`` times the own block (node/member/intake.py);
3. the outer method (``cgad.node.member.methods``) takes one step on f, whatever arrived;
4. versions[f] += 1, and θ_f ← φ_f: the local model continues from the new outer parameters,
   with the peers' fresh first moments averaged into its own; a peer behind the swarm's version
   then replays the peers' deltas of each version it missed (``apply(swarm_version=)``).

A peer that fell more than the cutoff behind re-syncs its state (the driver's call: ``state_dict``
/ ``load_state_dict``, ``fast_forward``). Deliveries outside ``methods.UsableVersions`` are dropped.
One thread drives the loop (the trainer's); a daemon serving its state from another holds its own
lock around ``sync`` and ``state_dict``.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from cgad.node.config import OuterOptions, TrainingOptions
from cgad.node.member.audience import Audience
from cgad.node.member.carry import hold_progress, restart_theta
from cgad.node.member.intake import take
from cgad.node.member.ledger import Counters, Delivery, strided_fragments
from cgad.node.member.methods import Contribution, StepInput, UsableVersions, fresh_share, method, unflatten
from cgad.node.member.mixing import Mixer, remember_phi
from cgad.node.member.moments import SharedMoments
from cgad.node.member.outer_state import HEARD, Phi0, Reference, load_checked_state, snapshot_state
from cgad.node.member.scoring import DataScore
from cgad.node.member.sender import Sender, Yardstick
from cgad.optim.averaging import effective_count, running_count
from cgad.optim.averaging import inner_lr_scale as sqrt_scale
from cgad.optim.cga import running_freshness
from cgad.protocol.codec import Codec, all_finite, encoded_size
from cgad.protocol.config import SPARSE_KEPT
from cgad.protocol.fan_in import takeable
from cgad.protocol.transport import Fragment, FragmentKey, Kind, Transport

HISTORY = 100_000
REFUSED_KEPT = 1024  # the latest refused deliveries, whose first moments are not mixed either

__all__ = ["OuterLoop", "inner_lr_scale"]


class OuterLoop:
    """Outer parameters φ, their versions and optimizer, for one peer."""

    def __init__(
        self,
        params: list[Tensor],
        options: OuterOptions,
        transport: Transport,
        run_id: str,
        seed: int = 0,
        codec: str | None = None,
        sparse_keep: int = SPARSE_KEPT,
        params_codec: str = "fp32",
        link_budget: Callable[[], float | None] | None = None,
        error_feedback: bool = True,
        encoder: Executor | None = None,
        heard: bool = True,
        score: DataScore | None = None,
    ) -> None:
        """``codec``, ``sparse_keep``, ``link_budget``, ``error_feedback``: the member's ``Sender``'s
        (the one owner of the codec choice; the transport gets bytes). ``params_codec``: φ's, for
        mixing. ``encoder``: a one-thread executor that encodes each Δ while training goes on (a
        daemon's); None: at once (the simulator's, which must repeat). ``heard``: whether the
        member starts with an audience (``Audience``: the first of a swarm starts without).
        ``score``: what judges each peer's Δ on this member's held-out windows (None: shape only)."""
        self.theta = params
        self.options = options
        self.score = score
        self.method, self.transport, self.run_id = method(options.optimizer), transport, run_id
        self.usable = UsableVersions.of(options)
        self.fragments = strided_fragments(len(params), options.fragments)
        # the outer state lives in host memory whatever device θ trains on: peers' deltas arrive
        # there, and a GPU keeps its memory for the model (θ crosses over once per block)
        self.phi = [torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in params]
        self.versions = [0] * options.fragments
        self.counters = Counters()
        # the deliveries the optimizer took, newest last (bounded: a daemon runs for weeks)
        self.history: deque[Delivery] = deque(maxlen=HISTORY)
        self.rng = random.Random(seed)
        # this turn's own Δ per fragment, published, not yet applied; None: diverged or discarded
        self._turn: dict[int, Fragment | None] = {}
        # a discarded block's Δ until its outer step: no peer gets it, the step does not take it,
        # peers' deltas are judged against it
        self._withheld: dict[int, Tensor] = {}
        # the tokens of the latest finite block per fragment, shared or not: a peer's claim is
        # capped at TOKEN_CAP times them (the Δ itself, judged against, is the sender's: Yardstick)
        self._own_tokens: dict[int, int] = {}
        self._ahead: dict[int, list[Fragment]] = {}  # peers' deltas of versions not reached yet
        self._refused: deque[tuple[int, str, int]] = deque(maxlen=REFUSED_KEPT)  # (f, publisher, version)
        # members a fresh step averages (1: alone), the inner lr's count; a joiner counts from 1
        self.averaged = 1.0
        self.audience = Audience(transport, math.ceil(options.cutoff * options.fragments), heard)
        self.mixer = Mixer(options, self.method.mixes_params, params_codec, self.counters, self.rng)
        self.moments = SharedMoments(  # a peer's first moment weighs as its delta of that age would
            params, self.fragments, options, transport, self.counters, link_budget, self._age_scale
        )
        # with an encoder (a daemon's thread), each fragment's send under way
        self._encoder = encoder
        self._sending: dict[int, Future[None]] = {}
        sizes = [[self.phi[i].numel() for i in f] for f in self.fragments]  # each fragment's tensors
        self.sender = Sender(  # the Δ leaves the first moment its share of the budget
            codec, sparse_keep=sparse_keep, link_budget=self.moments.delta_budget,
            total_numel=sum(map(sum, sizes)), error_feedback=error_feedback, segments=sizes,
        )  # fmt: skip
        if score is not None:
            score.attach(self.phi, self.fragments, self.counters)
        groups = [{"params": [self.phi[i] for i in frag]} for frag in self.fragments]
        self.optimizer = self.method.build(groups, options, peers=len(transport.live_peers()))

    # -- the step ---------------------------------------------------------------------------

    def sync(self, f: int, tokens: int) -> list[Delivery]:
        """Fragment f's turn: publish its pseudo-gradient, then apply what has arrived."""
        self.publish(f, tokens)
        return self.apply(f)

    def publish(self, f: int, tokens: int, share: bool = True) -> None:
        """Compute Δ_f = φ_f − θ_f and hand it to the transport (and φ_f too, for mixing). With
        ``share`` False the block is discarded: peers do not get Δ_f and the outer step does not
        take it either (it takes the peers' deltas, and θ_f restarts from the new φ_f): a block
        only this node stepped on would leave its φ apart from its peers' for good; its use is to
        warm up the inner optimizer after adopting a state."""
        idx = self.fragments[f]
        with torch.no_grad():
            own = torch.empty(self.numel(f))  # written in place: no per-tensor copies to join
            finite = True  # checked per tensor while it is in cache: half the time of a second pass
            for view, i in zip(self.unflatten(f, own), idx, strict=True):
                torch.sub(self.phi[i], self.theta[i].detach().to("cpu", torch.float32), out=view)
                finite = finite and all_finite(view)
            if not finite:
                # the local block diverged: drop it (θ_f back to φ_f); peers' fragments still apply.
                # Every non-finite θ goes back to its φ (one forward pass made the others NaN too)
                self.counters.rejected["local_non_finite"] += 1
                own_block = set(idx)
                for i, t in enumerate(self.theta):
                    if i in own_block or not all_finite(t):
                        t.copy_(self.phi[i])
                self._turn[f] = None
                return
        key = FragmentKey(self.run_id, f, self.versions[f], self.transport.peer_id)
        self._own_tokens[f] = tokens
        if share and self.method.shares:
            self._turn[f] = Fragment(key, own, tokens)
            if not self.audience.listening():  # nobody could fetch it: not encoded, nothing owed
                self.settle()  # a send under way (of another fragment) reads what is forgotten
                self.sender.forget()
                self.counters.unheard += 1
                return
            moments = self.moments.take(f)  # now: the inner steps change it in place
            if self._encoder is None:
                self._send(f, key, own, tokens, moments)
            else:  # encoding and hashing overlap the inner steps until the outer step waits for them
                self._sending[f] = self._encoder.submit(self._send, f, key, own, tokens, moments)
            return
        if self.method.shares:
            # a discarded block (judged by, never sent, so it leaves the residual alone) is still
            # this node's own work: a yardstick no peer can move
            self.sender.withhold(f, own)
            self._withheld[f] = own
            self.counters.discarded += 1
            self._turn[f] = None
        else:
            self._turn[f] = Fragment(key, own, tokens)

    def _send(self, f: int, key: FragmentKey, own: Tensor, tokens: int, m: Tensor | None = None) -> None:
        """Hand Δ_f to the transport, in the codec the sender picks (and φ_f too when mixing is
        due). The own step still takes the whole Δ_f (waiting for what a lossy round leaves out
        would delay the own progress by rounds); peers get Δ_f and what earlier rounds left out,
        and are judged against that (``sender.Yardstick``). Runs on the encoder thread when there is
        one: it reads φ_f, which only f's outer step changes, and that waits for it (``settle``)."""
        if self.sender.encodes:
            data, codec, kept = self.sender.send(f, own)
            self.counters.sent_as[f"sparse:{kept}" if codec is Codec.SPARSE else str(codec)] += 1
            self.transport.publish_encoded(key, data, codec=codec, numel=own.numel(), tokens=tokens)
            sent_bytes = len(data)
        else:
            self.sender.sent_whole(f, own)
            self.transport.publish(Fragment(key, own, tokens))
            sent_bytes = encoded_size(own.numel(), "fp32")
        self.counters.published += 1
        # the inner first moment beside it where the link has room, and φ where the rest has
        sent_bytes += 0 if m is None else self.moments.send(key, m, tokens, sent_bytes)
        lateness = lambda: self._lateness(f)  # noqa: E731
        mixing_due = self.mixer.due(self.versions[f], lateness) and self.mixer.room(
            own.numel(), sent_bytes, self.moments.link_budget(), self.sender.total_numel
        )
        # with no live peer a φ would reach nobody, and a kept copy is 4 bytes a parameter
        if (self.method.mixes_params or mixing_due) and self.transport.live_peers():
            params = self.flat_phi(f)
            self.transport.publish(Fragment(replace(key, kind=Kind.PARAMS), params, tokens))
            if mixing_due:  # kept to measure drift against peers' φ of this version
                remember_phi(self.mixer.published.setdefault(f, {}), self.versions[f], params)

    def sending(self, f: int) -> bool:
        """Whether fragment f's Δ is still being encoded and handed over on the encoder thread."""
        pending = self._sending.get(f)
        return pending is not None and not pending.done()

    def settle(self, f: int | None = None) -> None:
        """Wait for fragment f's send on the encoder thread (None: every fragment's); what it
        raised is raised here."""
        for fragment in [f] if f is not None else list(self._sending):
            pending = self._sending.pop(fragment, None)
            if pending is not None:
                pending.result()

    def apply(self, f: int, carry: bool = False, swarm_version: int | None = None) -> list[Delivery]:
        """One outer step on fragment f with its own fresh Δ and everything delivered since.
        θ_f then restarts from the new φ_f; with ``carry``, the inner steps taken since
        ``publish(f)`` are kept on top of it (θ_f ← φ_f' + θ_f − θ_f at publish): the driver may
        let training run on while the round's fragments arrive, and apply the step late.

        ``swarm_version``, the version of f the swarm is at (the driver's word: a median over
        live peers' reports, or the source's own at the first step after adopting its state),
        lets a peer that is behind catch up: the deliveries of each version after its own, up
        to that one, are taken as steps of their own, in order, as the peers took them (a
        joiner whose snapshot is a round old replays the round it missed). Other deliveries
        from ahead are held for their own version's step, where they are fresh."""
        if f not in self._turn:
            raise RuntimeError(f"apply({f}) without publish({f}) first")
        self.settle(f)
        own = self._turn.pop(f)
        withheld = self._withheld.pop(f, None)
        yardstick = self.sender.yardstick(f, own.tensor if own is not None else withheld)
        base = self.versions[f]
        incoming: list[tuple[Fragment, int]] = [] if own is None else [(own, 0)]
        fresh: list[Fragment] = []  # checked once here; held ones were checked when they came
        for frag in self.transport.receive(f) if self.method.shares else ():
            if frag.tensor.numel() != self.numel(f):
                self.counters.rejected["bad_shape"] += 1
                self.counters.rejected_by_peer[frag.key.publisher] += 1
                continue
            if self.usable.too_far_ahead(frag.key.base_version, base):
                # claims to be further ahead than any honest peer gets before re-syncing us: it
                # moves neither the outer step nor this peer's idea of how far behind it is
                self.counters.rejected["future"] += 1
                self.counters.rejected_by_peer[frag.key.publisher] += 1
                continue
            if not all_finite(frag.tensor):
                self.counters.rejected["non_finite"] += 1
                self.counters.rejected_by_peer[frag.key.publisher] += 1
                continue
            fresh.append(frag)
        ahead: list[Fragment] = []  # from peers ahead of this one: replayed or held, below
        for frag in self._ahead.pop(f, []) + fresh:
            if frag.key.base_version > base:
                ahead.append(frag)
            else:
                incoming.append((frag, base - frag.key.base_version))
        # outer parameters published by peers: taken by NoLoCo and gossip, drained otherwise
        peer_params = self.transport.receive(f, Kind.PARAMS)
        # the versions to replay: contiguous from base + 1, at most up to the swarm's
        replay: list[list[tuple[Fragment, int]]] = []
        version = base + 1
        while swarm_version is not None and version <= swarm_version:
            batch = [(frag, 0) for frag in ahead if frag.key.base_version == version]
            if not batch:
                break
            replay.append(batch)
            version += 1
        held = [frag for frag in ahead if frag.key.base_version >= version]
        self.counters.held_ahead += sum(frag.key.base_version >= version for frag in fresh)
        if held:
            self._ahead[f] = held
        theta = [self.theta[i] for i in self.fragments[f]]
        carried = carry and own is not None  # the inner steps since publish(f) go on after the step
        phi = self.fragment_phi(f)
        progress = hold_progress(theta, phi, self.unflatten(f, own.tensor)) if carried else None
        try:
            deliveries = self._take_steps(f, incoming, own, yardstick, peer_params, replay)
        except BaseException:
            if carried:  # θ_f holds the bare progress: never leave it so
                restart_theta(theta, phi, progress, carried)
            raise
        restart_theta(theta, phi, progress, carried)
        self.moments.mix(f, base, self._refused, self.score.weight if self.score is not None else None)
        return deliveries

    def _take_steps(
        self, f: int, incoming: list[tuple[Fragment, int]], own: Fragment | None, yardstick: Yardstick | None,
        peer_params: list[Fragment], replay: list[list[tuple[Fragment, int]]],
    ) -> list[Delivery]:  # fmt: skip
        """Fragment f's outer step, its mixing, then a step per version to replay."""
        with torch.no_grad():
            taken, deliveries = self._take(f, incoming, own, yardstick)
            if taken:
                self._step(f, taken, peer_params, yardstick)
            lateness = lambda: self._lateness(f)  # noqa: E731
            if self.mixer.now(f, self.versions[f], lateness):
                self.mixer.pull(
                    f, self.fragment_phi(f), peer_params, self.versions[f], lateness, _norm_of(yardstick)
                )
            self.versions[f] += 1
            for batch in replay:
                taken, caught_up = self._take(f, batch, None, yardstick)
                if taken:
                    self._step(f, taken, [], yardstick)
                deliveries += caught_up
                self.versions[f] += 1
                self.counters.replayed += 1
        return deliveries

    def _step(
        self, f: int, taken: list[Contribution], peer_params: list[Fragment], yardstick: Yardstick | None
    ) -> None:
        """The method's step on fragment f (``methods.StepInput``: the deliveries, the peers' φ,
        the live peers; nothing of the loop itself)."""
        for p in self.phi:  # only fragment f's φ carries a pseudo-gradient into the optimizer
            p.grad = None
        numel = self.numel(f)
        newest = {  # each peer's newest φ_f (sorted by version: later ones overwrite)
            p.key.publisher: p.tensor
            for p in sorted(peer_params, key=lambda p: p.key.base_version)
            if p.tensor.numel() == numel
        }
        live, fan_in = len(self.transport.live_peers()), self.transport.fan_in
        step = StepInput(
            params=self.fragment_phi(f),
            fragment=f,
            fragments=len(self.fragments),
            taken=taken,
            peer_phi=newest,
            hold_phi=lambda theirs: self.mixer.hold(f, self.flat_phi(f), theirs, _norm_of(yardstick)),
            live_peers=live,
            takeable_peers=takeable(live, fan_in),
            rng=self.rng,
        )
        self.method.step(self.optimizer, step)
        # the running share of every live peer heard fresh (late mixing follows it; CGA's momentum
        # the share of those the fan-in lets in): in the param group, so it travels with the state
        heard, group = fresh_share(taken, live), self.optimizer.param_groups[f]
        if heard is not None:
            group[HEARD] = running_freshness(group.get(HEARD, 0.0), heard)
            # a step of this round (the own Δ among the taken): how many members it averaged
            self.averaged = running_count(self.averaged, self._averaged_now(taken))
        for p in step.params:  # spent: a model-sized buffer not to hold until the next step
            p.grad = None

    def _averaged_now(self, taken: list[Contribution]) -> float:
        """The effective count of the step's mean (``cgad.optim.averaging``); 1 for a method
        that does not average (NoLoCo's pair and the floor take no mean of the round)."""
        if not self.method.averages:
            return 1.0
        # members, not deliveries (a peer's deltas of two versions in one step are one), and a
        # delta cut to the clip radius counts as none: the length is for honest members' noise
        weights: Counter[str] = Counter()
        for c in (c for c in taken if not c.clipped):
            weights[c.publisher] += max(c.tokens, 1) * c.scale
        return effective_count(list(weights.values()))

    def inner_lr_scale(self) -> float:
        """√N of the running count of members averaged: what the inner lr is multiplied by under
        ``--inner-lr-scaling sqrt`` (1 alone, or with every peer late)."""
        return sqrt_scale(self.averaged)

    def _age_scale(self, age: int) -> float:
        return self.method.scale(age, self.options)  # 1 for a method that is not age-aware

    def _take(
        self, f: int, incoming: list[tuple[Fragment, int]], own: Fragment | None, yardstick: Yardstick | None
    ) -> tuple[list[Contribution], list[Delivery]]:
        """The deliveries the step takes (``intake.take``), kept in ``history``."""
        o = self.options
        taken, deliveries = take(
            f, incoming, own, yardstick, aggregation=o.aggregation, clip_radius=o.clip_radius,
            min_cosine=o.min_cosine, own_tokens=self._own_tokens.get(f), age_scale=self._age_scale,
            counters=self.counters, refused=self._refused, score=self.score,
        )  # fmt: skip
        self.history.extend(deliveries)
        return taken, deliveries

    # -- φ by fragment ------------------------------------------------------------

    def fragment_phi(self, f: int) -> list[Tensor]:
        return [self.phi[i] for i in self.fragments[f]]

    def flat_phi(self, f: int) -> Tensor:
        """Fragment f's φ as one flat tensor (a copy), as peers receive it."""
        return torch.cat([self.phi[i].detach().flatten() for i in self.fragments[f]])

    def unflatten(self, f: int, flat: Tensor) -> list[Tensor]:
        return unflatten(self.fragment_phi(f), flat)

    def numel(self, f: int) -> int:
        return sum(self.phi[i].numel() for i in self.fragments[f])

    def _lateness(self, f: int) -> float:
        """1 − fragment f's running share of live peers heard fresh: how late (or, past the
        fan-in, how seldom) the peers' deltas have been coming."""
        return 1.0 - self.optimizer.param_groups[f].get(HEARD, 0.0)

    # -- swarm position and state -----------------------------------------------------------

    def fast_forward(self, versions: list[int]) -> None:
        """Count this peer's versions on from where the swarm's are now (after adopting a state
        that the swarm has moved past while it downloaded): ages then measure real lateness."""
        if len(versions) != len(self.versions):
            raise ValueError(f"{len(versions)} versions for {len(self.versions)} fragments")
        self.settle()  # a send under way reads versions
        self.versions = [max(a, int(b)) for a, b in zip(self.versions, versions, strict=True)]

    def forget_published_phi(self) -> None:
        """φ moved outside an outer step (to a group's mean): drift measured at older versions is gone."""
        self.mixer.forget()

    def state_dict(self, codec: str = "fp32", reference: Phi0 | None = None) -> dict[str, Any]:
        """φ, versions and the outer optimizer's state, φ in ``codec`` (``SNAPSHOT_CODECS``:
        fp32 for a checkpoint; for a snapshot that joining peers wait for, int8 blocks of
        φ − φ₀ with ``reference`` = φ₀, an error of at most half a step of 1/127 of each
        block's largest |φ − φ₀|, and no per-parameter optimizer state). Loading decodes."""
        return snapshot_state(self.phi, self.versions, self.optimizer, codec, reference)

    def load_state_dict(self, state: dict[str, Any], reference: Reference | None = None) -> None:
        """Adopt another peer's (or a checkpoint's) outer state; θ restarts from its φ. Checked
        whole before anything changes: a state that does not fit raises and leaves this one.
        ``reference`` regenerates φ₀ from the seed an int8 state names."""
        self.settle()
        phi, versions = load_checked_state(self.phi, len(self.versions), self.optimizer, state, reference)
        with torch.no_grad():
            for p, q, t in zip(self.phi, phi, self.theta, strict=True):
                p.copy_(q)
                t.copy_(q)
        self.versions = list(versions)
        # held deltas of versions the adopted state has passed are in it already
        self._ahead = {
            f: [d for d in held if d.key.base_version >= versions[f]] for f, held in self._ahead.items()
        }
        # what the old trajectory left unsent, and the φ it published, belong to that trajectory
        self.sender.forget()
        self.mixer.forget()


def inner_lr_scale(options: TrainingOptions, loop: OuterLoop) -> Callable[[], float] | None:
    """What a trainer's lr follows (``InnerTrainer(lr_scale=)``): the loop's √N under
    ``--inner-lr-scaling sqrt``, None (the lr as given) otherwise. One place decides it for the
    daemon and the simulator alike."""
    return loop.inner_lr_scale if options.inner_lr_scaling == "sqrt" else None


def _norm_of(yardstick: Yardstick | None) -> Callable[[], float | None]:
    """The own Δ's norm, taken when asked (None without an own Δ)."""
    return lambda: None if yardstick is None else yardstick.norm()
