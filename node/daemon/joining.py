"""How a node gets the swarm's outer state: at joining, and again when it has fallen behind.

Peers offer signed snapshots of their outer state (``NetworkTransport.publish_state``). A joining
node first asks the peers named by ``--peers`` who they are (another run, model or method is
refused at once), then adopts a snapshot ahead of it, those nearest the swarm's low median version
first (an attacker claims the highest version the ceiling allows); a snapshot that trails the
swarm once adopted (it was old when picked) is followed by a newer one, unless the download itself
took rounds (on a slow link the next would trail as far), and finally the node counts its versions
on to where the source has moved meanwhile, never past the swarm's low median. Every claim in a
snapshot's record is a claim until its bytes are checked, against what the node knows itself too
(``outer_state.check_drift``); no single peer's report moves the ceiling or the lag.

A download's time is bounded by this node's own link estimate and the size it expects a snapshot
of its model to have (``state_timeout``), never by the holder's claim, and the loop over offers
stops at ``join_timeout``. A re-sync (a node that trains) downloads and checks on a thread of its
own ("cgad-resync") and adopts at its next call, so the trainer waits for no download.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from cgad.node.config import JoinConfig
from cgad.node.daemon.checkpoint import CheckpointError, unpack
from cgad.node.member.outer import OuterLoop
from cgad.node.member.outer_state import Reference, check_drift, decode_phi, drift_per_version
from cgad.node.member.swarm import ADOPTED_LAG, behind, snapshot_ceiling, snapshot_order, swarm_versions
from cgad.protocol.errors import FragmentError
from cgad.protocol.multisource import MAX_SOURCES
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import PROTOCOL_VERSION
from cgad.protocol.selection import Candidate

__all__ = ["IncompatibleSwarm", "StateSync", "check_compatible", "settled", "state_timeout"]

logger = logging.getLogger(__name__)

# The rate a state download is expected at before the downlink is measured, and never less:
# joiners share the source's uplink (three of them through one 2 Mbit link got 69 kB/s each). A
# stalled or trickling holder is dropped long before the timeout (``multisource``'s rate floor).
MIN_STATE_RATE = 20e3
STATE_GRACE = 30.0  # seconds any download gets on top of its bytes (dialling, the first range)
STATE_LINK_SHARE = 0.25  # of the measured downlink a snapshot is expected at (holders share uplinks)
# bytes per parameter of a snapshot in each codec, with room (int8: 1.02; fp16 with a momentum
# in bfloat16: ~4; fp32 with two moments: 12), and the packing's own bytes
SNAPSHOT_BYTES_PER_PARAMETER = {"int8": 1.1, "fp16": 6.0, "fp32": 12.0}
SNAPSHOT_OVERHEAD = 1 << 20
MAX_ADOPTIONS = 3  # snapshots one sync may adopt in a row while the swarm stays ahead
# seconds a sync waits for a look at the snapshots on offer made after it asked: a node polls them
# only while someone reads them (``polling.states_due``), so the last look may be half a minute old
FRESH_OFFERS = 10.0
# what makes two nodes members of one swarm, with the words an error uses for each
SWARM_IDENTITY = (
    ("run_id", "run id"),
    ("model", "model config"),
    ("tokenizer", "tokenizer"),
    ("optimizer", "outer optimizer"),
    ("fragments", "number of fragments"),
    ("sync", "exchange (--sync)"),
    ("consensus_every", "blocking consensus step (--consensus-every)"),
)
# what a description or checkpoint from before a part of the identity existed meant by leaving it out
IDENTITY_DEFAULTS = {"sync": "exchange", "consensus_every": 0}


def settled(newer_on_offer: bool, adoptions: int, behind: int, moved_while_downloading: int) -> bool:
    """Whether a sync that has adopted a snapshot stops there (and counts its versions on)
    rather than fetch a newer one: none is on offer, it has adopted enough in a row, it trails the
    swarm by at most ``ADOPTED_LAG``, or its last download took longer than that many rounds (on
    a slow link a newer snapshot would trail as far once here)."""
    return (
        not newer_on_offer
        or adoptions >= MAX_ADOPTIONS
        or behind <= ADOPTED_LAG
        or moved_while_downloading > ADOPTED_LAG
    )


def state_timeout(claimed: float, expected: float, link_rate: float | None, left: float) -> float:
    """Seconds a snapshot download may take: ``STATE_GRACE`` plus the smaller of the claimed and
    the expected size at this node's own link estimate (a share of it, at least
    ``MIN_STATE_RATE``), never more than ``left``. The holder's claim can shorten it, never
    lengthen it: a claim of the largest size allowed at 20 kB/s held a joiner for 27 minutes.

    Args:
        claimed: the snapshot's size in its publisher's record.
        expected: the size this node expects a snapshot of its model to have.
        link_rate: this node's measured downlink, bytes per second (None: not measured).
        left: seconds left of the sync's own bound (``join_timeout``).
    """
    rate = max(MIN_STATE_RATE, STATE_LINK_SHARE * link_rate) if link_rate else MIN_STATE_RATE
    return max(0.0, min(left, STATE_GRACE + min(claimed, expected) / rate))


class IncompatibleSwarm(ValueError):
    """A checkpoint, peer or snapshot belongs to another run, model, tokenizer or method."""


def check_compatible(ours: dict[str, Any], theirs: dict[str, Any], where: str) -> None:
    """Raise ``IncompatibleSwarm`` naming the first part of the swarm's identity that differs."""
    for key, what in SWARM_IDENTITY:
        stated, own = (side.get(key, IDENTITY_DEFAULTS.get(key)) for side in (theirs, ours))
        if stated != own:
            raise IncompatibleSwarm(
                f"{where} has a different {what} ({stated!r}, this node: {own!r}); refusing to join"
            )


class StateSync:
    """Adopts peers' snapshots into ``loop`` (under ``outer_lock``, never half an outer step);
    ``swarm`` is this node's identity of the swarm; ``leave`` ends any wait. It is also the
    member engine's view of the swarm (``SwarmView``): live peers, arrivals, progress reports."""

    def __init__(
        self,
        config: JoinConfig,
        transport: NetworkTransport,
        loop: OuterLoop,
        swarm: dict[str, Any],
        outer_lock: threading.Lock,
        leave: threading.Event,
        reference: Reference | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.loop = loop
        self.swarm = swarm
        self.outer_lock = outer_lock
        self.leave = leave
        self.reference = reference  # φ₀ of the seed an int8 snapshot names
        self._misses: dict[str, int] = {}  # downloads per publisher that brought nothing: tried later
        self._refused: set[bytes] = set()  # snapshots (by hash) whose bytes were refused: never again
        self._refused_from: set[str] = set()  # publishers refused in this sync: none of theirs again
        # holders whose own bytes failed the hash in a download of this sync: left out of its
        # later downloads, and their fault is not the publisher's
        self._blamed: set[str] = set()
        # a first sync ran (at the node's start, before it trains), or none will: a swarm's first
        # node (no --peers) starts alone, and any sync of its later is a re-sync, off its trainer
        self._synced = not config.peers
        self._resync: threading.Thread | None = None  # a re-sync's download under way
        # a re-sync's snapshot, downloaded and checked, waiting for the next call: its offer,
        # bytes, state and when it was ready
        self._ready: tuple[Candidate, bytes | bytearray, dict[str, Any], float] | None = None

    def check_bootstrap_peers(self) -> list[dict[str, Any]]:
        """Ask the peers named by --peers who they are: a node of another run, model or method
        is refused at once (``IncompatibleSwarm``), before it waits for what it would never see.
        Their descriptions, as they stated them."""
        described = []
        for addr in self.config.peers:
            if "/p2p/" not in addr:
                continue
            peer = addr.rsplit("/p2p/", 1)[1]
            try:
                run_id, swarm_json = self.transport.describe(peer)
            except FragmentError as exc:
                logger.warning("the peer at --peers did not say who it is: %s", exc)
                continue
            try:
                theirs = json.loads(swarm_json)
            except ValueError:
                theirs = None
            theirs = theirs if isinstance(theirs, dict) else {}
            if theirs.get("protocol") != PROTOCOL_VERSION:
                said = theirs.get("protocol")
                version = "1 (it does not say: an older release)" if said is None else repr(said)
                raise IncompatibleSwarm(
                    f"the peer at --peers ({peer}) speaks protocol version {version}, this node"
                    f" {PROTOCOL_VERSION}: the nodes of a swarm need cgad-node releases of one protocol"
                    " version; refusing to join"
                )
            check_compatible(self.swarm, {**theirs, "run_id": run_id}, f"the peer at --peers ({peer})")
            described.append(theirs)
        return described

    def sync(self, required: bool, wait: bool | None = None) -> tuple[str, int] | None:
        """Adopt a snapshot of the swarm's outer state that is ahead of ours (for a fresh node,
        ``required``: any, within ``join_timeout``); the source and the round this node is at
        now, or None when nothing was adopted.
        A snapshot that trails the swarm by more than ``ADOPTED_LAG`` versions once adopted (an
        old snapshot) is followed by a newer one, up to ``MAX_ADOPTIONS``, unless the download
        itself took longer than that many rounds (a slow link: the next would trail as far);
        then this peer's versions are counted on to the source's (``_fast_forward``).
        ``wait``: download here (the default for a required sync and for the node's first, at
        its start); else a re-sync: the download runs on the "cgad-resync" thread, this returns
        None at once, and a later call adopts what it brought (checked again then)."""
        first, self._synced = not self._synced, True
        if not (required or first) if wait is None else not wait:
            return self._resync_in_background()
        self._refused_from, self._blamed = set(), set()
        give_up = time.monotonic() + self.config.join_timeout  # what any sync may take
        retry_until = time.monotonic() + (self.config.join_timeout if required else 10.0)
        failures: list[str] = []
        adopted: tuple[str, int] | None = None  # the last snapshot adopted: publisher, round
        adoptions = 0
        grew = 0  # versions the swarm went on by during the last download
        while not self.leave.is_set() and time.monotonic() < give_up:
            offers = self._worth_adopting(at_least_ours=required and adopted is None)
            if adopted is not None and settled(bool(offers), adoptions, self.behind(), grew):
                break
            swarm_before = self._swarm_version()
            found = self._download_first(offers, give_up, failures)
            if found is not None:
                snapshot_round = self._install(*found, failures)
                if snapshot_round is not None:
                    adopted, adoptions = (found[0].key.publisher, snapshot_round), adoptions + 1
                    grew = self._swarm_version() - swarm_before
                    continue
            # no newer snapshot could be had: a fresh node keeps trying while time allows
            settle = adopted is not None and (adoptions >= MAX_ADOPTIONS or not required)
            if settle or time.monotonic() > retry_until or (offers and not required and adopted is None):
                break
            time.sleep(1.0)
        return self._finish(adopted, required, failures)

    def _finish(
        self, adopted: tuple[str, int] | None, required: bool, failures: list[str]
    ) -> tuple[str, int] | None:
        c = self.config
        if adopted is not None:
            peer, snapshot_round = adopted
            moved = self._fast_forward(peer)
            logger.info(
                "adopted the outer state of %s at versions %s (%d counted on to the source's)",
                peer, self.loop.versions, moved,
            )  # fmt: skip
            return peer, snapshot_round + moved
        if required and not self.leave.is_set():
            why = "; ".join(failures[-3:]) or (
                f"no peer of run {c.run_id!r} offered a snapshot within {c.join_timeout:.0f} s"
                " (is --peers right, and does that swarm train this run id?)"
            )
            raise ConnectionError(f"could not download the swarm's state: {why}")
        return None

    def _resync_in_background(self) -> tuple[str, int] | None:
        """A re-sync off the caller's thread: adopt what the last download brought, if it is
        still ahead of this node; else start a download (none while one runs) and return None."""
        ready, self._ready = self._ready, None
        if ready is not None:
            candidate, data, state, when = ready
            failures: list[str] = []
            fresh = time.monotonic() - when < self.config.join_timeout
            if fresh and candidate.key.base_version > min(self.loop.versions):
                snapshot_round = self._install(candidate, data, state, failures)
                if snapshot_round is not None:
                    return self._finish((candidate.key.publisher, snapshot_round), False, failures)
        if self._resync is None or not self._resync.is_alive():
            self._resync = threading.Thread(target=self._prepare, name="cgad-resync", daemon=True)
            self._resync.start()
        return None

    def _prepare(self) -> None:
        """The "cgad-resync" thread: download and check the first usable snapshot on offer
        within ``join_timeout``, for the next call to adopt."""
        torch.set_num_threads(1)  # beside training: one torch thread (see ``side_worker``)
        self._refused_from, self._blamed = set(), set()  # this sync's own, as a waited one's
        try:
            offers = self._worth_adopting(at_least_ours=False)
            found = self._download_first(offers, time.monotonic() + self.config.join_timeout, [])
            if found is not None:
                self._ready = (*found, time.monotonic())
        except Exception:  # a failed re-sync must not end the node: the next round tries again
            logger.exception("re-syncing the outer state failed")

    def _download_first(
        self, offers: list[Candidate], give_up: float, failures: list[str]
    ) -> tuple[Candidate, bytes | bytearray, dict[str, Any]] | None:
        """The first of ``offers`` whose bytes download within ``give_up`` and pass every check
        short of adopting (``_checked``): its offer, bytes and state (φ decoded)."""
        failed: set[str] = set()  # publishers whose newest offer failed: not their older ones
        for candidate in offers:
            left = give_up - time.monotonic()
            if left <= 0 or self.leave.is_set():
                break
            if candidate.key.publisher in failed | self._refused_from:
                continue
            data = self._download(candidate, left, failures)
            state = self._checked(candidate, data, failures) if data is not None else None
            if state is not None:
                return candidate, data, state  # type: ignore[return-value]
            failed.add(candidate.key.publisher)
        return None

    def reports(self) -> dict[str, list[int]]:
        """The versions each live peer reports (this node's own report is not among them), for
        as many fragments as this node has."""
        live = set(self.transport.live_peers())
        return {
            pid: p.versions
            for pid, p in self.transport.swarm_progress().items()
            if pid in live and len(p.versions) == len(self.loop.versions)
        }

    def live_peers(self) -> list[str]:
        return self.transport.live_peers()

    def arrived(self, index: int, base_version: int) -> int:
        return self.transport.arrived(index, base_version)

    def behind(self) -> int:
        """How far this peer's slowest fragment trails the swarm's (``swarm.behind``)."""
        return behind(self.reports(), self.loop.versions)

    def _swarm_version(self) -> int:
        """The swarm's slowest fragment's version; 0 with no live peer."""
        return min(swarm_versions(self.reports(), len(self.loop.versions)) or [0])

    def _ceiling(self) -> int:
        """The furthest version a snapshot may be at (``swarm.snapshot_ceiling``)."""
        return snapshot_ceiling(self.reports(), self.loop.versions, self.config.cutoff)

    def _median(self) -> int:
        """The swarm's low median version (the live peers' reports, as ``snapshot_ceiling`` reads
        them: peers still at 0 left out), or this node's own with none in view."""
        return self._ceiling() - self.config.cutoff

    def _worth_adopting(self, at_least_ours: bool) -> list[Candidate]:
        """Snapshots on offer ahead of this peer (or level with it, ``at_least_ours``), none
        claiming to be past ``_ceiling`` (a claim, until the bytes are checked): those within
        ``ADOPTED_LAG`` of the swarm's low median first, the most holders first among them (a
        download draws from every holder at once, and the version it lacks is replayed after
        it), then the rest, nearest the median first (below it before above it: the highest
        claim is an attacker's favourite). Publishers whose downloads brought nothing come
        after the others, and snapshots larger than this node expects after all of them."""
        mine = min(self.loop.versions)
        ceiling, median = self._ceiling(), self._median()
        offers = [
            c
            for c in self.transport.state_offers(fresh=0.0 if self.leave.is_set() else FRESH_OFFERS)
            if (c.key.base_version >= mine if at_least_ours else c.key.base_version > mine)
            and c.key.base_version <= ceiling
            and c.offer.content_hash not in self._refused
            and c.key.publisher not in self._refused_from
        ]

        expected = self._expected_bytes()

        def order(c: Candidate) -> tuple[bool, int, bool, int, int, bool, int]:
            missed = self._misses.get(c.key.publisher, 0)
            # a claim past the size this node expects of its model's snapshot (its codec's, with
            # room) comes last: a liar's bytes are buffered whole before the hash can refuse them
            oversized = c.offer.byte_length > expected
            return (
                oversized,
                *snapshot_order(c.key.base_version, len(c.holders), missed, median, MAX_SOURCES),
            )

        return sorted(offers, key=order)

    def _download(self, candidate: Candidate, left: float, failures: list[str]) -> bytes | bytearray | None:
        """A snapshot's bytes within ``state_timeout`` (at most ``left`` seconds), or None. Holders
        whose bytes failed the hash in an earlier download of this sync are left out; a publisher
        whose own bytes failed its own hash is refused for the sync. A failure counts against the
        publisher (its snapshots are tried later) unless a re-server is proven at fault (bytes of
        its own that failed the hash): slowness proves nothing, and a publisher that says it no
        longer holds its snapshot must not hide behind re-servers that trickle."""
        peer, size = candidate.key.publisher, candidate.offer.byte_length
        holders = [h for h in candidate.holders if h.peer_id not in self._blamed]
        if not holders:
            failures.append(f"the snapshot of {peer}: every holder was at fault in this sync")
            return None
        timeout = state_timeout(size, self._expected_bytes(), self.transport.downlink_rate, left)
        logger.info(
            "downloading the state of %s (version %d, %.1f MB) from %d holder(s) within %.0f s",
            peer, candidate.key.base_version, size / 1e6, len(holders), timeout,
        )  # fmt: skip
        try:
            return self.transport.fetch_state(replace(candidate, holders=holders), timeout)
        except (FragmentError, TimeoutError) as exc:
            failures.append(str(exc))
            blamed = exc.blamed if isinstance(exc, FragmentError) else {}
            liars = {holder for holder, why in blamed.items() if why == "bad_hash"}
            self._blamed |= liars
            if peer in liars:
                self._refused_from.add(peer)
            elif not liars:
                self._misses[peer] = self._misses.get(peer, 0) + 1
            logger.warning("state download failed: %s", exc)
            return None

    def _expected_bytes(self) -> float:
        """The size this node expects a snapshot of its model to have (its own codec's, with room)."""
        per = SNAPSHOT_BYTES_PER_PARAMETER.get(self.config.snapshot_codec, 12.0)
        return per * sum(p.numel() for p in self.loop.phi) + SNAPSHOT_OVERHEAD

    def _checked(
        self, candidate: Candidate, data: bytes | bytearray, failures: list[str]
    ) -> dict[str, Any] | None:
        """The snapshot's state, checked short of adopting: the swarm's identity, its round and
        versions against its record and the ceiling, and its φ (decoded) against this node's own
        (``check_drift``). None (with why, counted ``bad_state``) when it is unusable, a snapshot
        of another swarm included; its hash is then never fetched again."""
        peer, c = candidate.key.publisher, self.config
        try:
            state = unpack(data)
            # the peers at --peers were checked already (Describe): a snapshot of another swarm
            # is one bad offer among others, never a reason to stop
            theirs = state.get("swarm", {}) if isinstance(state, dict) else {}
            check_compatible(self.swarm, theirs if isinstance(theirs, dict) else {}, f"peer {peer}")
            self._check_versions(candidate, state)
            outer = state["outer"]
            phi = decode_phi(self.loop.phi, outer, self.reference)
            per_version = drift_per_version(c.inner_steps, c.inner_lr, c.outer_lr)
            with self.outer_lock:  # this node's φ, never half an outer step
                mine = self.loop.versions
                apart = 1 + max(abs(a - b) for a, b in zip(outer["versions"], mine, strict=True))
                check_drift(self.loop.phi, phi, apart, per_version)
            state["outer"] = {**outer, "phi": phi, "phi_codec": "fp32", "reference_seed": None}
            return state
        # IncompatibleSwarm is a ValueError; ArithmeticError: int() of a huge float, for one
        except (CheckpointError, KeyError, TypeError, ValueError, RuntimeError, ArithmeticError) as exc:
            self._refuse(candidate, exc, failures)
            return None

    def _check_versions(self, candidate: Candidate, state: dict[str, Any]) -> None:
        """The snapshot's round and versions: whole, its record's version, within the ceiling."""
        versions, snapshot_round = state["outer"]["versions"], state["round"]
        if type(snapshot_round) is not int or snapshot_round < 0:
            raise ValueError(f"round {snapshot_round!r}")
        if not (isinstance(versions, list) and versions and all(type(v) is int for v in versions)):
            raise ValueError(f"versions {versions!r}")
        if len(versions) != len(self.loop.versions):
            raise ValueError(f"{len(versions)} versions for {len(self.loop.versions)} fragments")
        if min(versions) != candidate.key.base_version:
            said = candidate.key.base_version
            raise ValueError(f"its record says version {said}, its bytes {min(versions)}")
        # one fragment far ahead would drop every honest delta of it as stale, for good: an
        # honest node's fragments are at most a replay (the cutoff) apart, and its record's
        # ceiling holds for each of them
        if max(versions) > self._ceiling() or max(versions) - min(versions) > self.config.cutoff:
            raise ValueError(f"versions {versions} past the swarm's or too far apart")

    def _refuse(self, candidate: Candidate, exc: Exception, failures: list[str]) -> None:
        peer = candidate.key.publisher
        failures.append(f"snapshot of {peer} is unusable: {exc}")
        self._refused.add(candidate.offer.content_hash)
        self._refused_from.add(peer)
        self.transport.stats.rejected["bad_state"] += 1
        logger.warning("the snapshot of %s is unusable: %s", peer, exc)

    def _install(
        self, candidate: Candidate, data: bytes | bytearray, state: dict[str, Any], failures: list[str]
    ) -> int | None:
        """Adopt a checked snapshot (its versions checked again against the ceiling now: a re-sync
        adopts a while after its download): its round, or None (with why, in ``failures``)."""
        with self.outer_lock:
            self.loop.settle()  # a failed send of the own Δ raises here: it is not the snapshot's fault
        try:
            self._check_versions(candidate, state)
            with self.outer_lock:
                # checks the whole before adopting any
                self.loop.load_state_dict(state["outer"], reference=self.reference)
        except (KeyError, TypeError, ValueError, RuntimeError, ArithmeticError) as exc:
            self._refuse(candidate, exc, failures)
            return None
        self.transport.reserve_state(candidate, data)
        # the round is the peer's word: never past its versions, which count rounds (a forged
        # round would spread to later joiners and end a --max-rounds node at once)
        return min(state["round"], min(state["outer"]["versions"]))

    def _fast_forward(self, peer: str) -> int:
        """Versions the source moved on while its state downloaded (from its latest progress
        record), counted on here so that this peer's versions and ages agree with the swarm's
        instead of trailing it for good, when they are more than ``ADOPTED_LAG``: the
        parameters are then that many rounds stale under current labels, which a slow link
        cannot avoid. Fewer are caught up with their content instead: the peers' deltas of the
        missed versions are replayed as outer steps (``OuterLoop.apply``). Bounded by the
        history horizon (the record is the peer's own claim)."""
        latest = self.transport.swarm_progress().get(peer)
        if latest is None or len(latest.versions) != len(self.loop.versions):
            return 0
        # never past the swarm's low median: a source's record of +64 versions after the
        # joiner took its state left the joiner ahead of everyone for good (honest deltas
        # dropped as stale, its own refused as from the future)
        swarm = swarm_versions(self.reports(), len(self.loop.versions)) or list(latest.versions)
        target = [min(int(v), s) for v, s in zip(latest.versions, swarm, strict=True)]
        moved = max(b - a for a, b in zip(self.loop.versions, target, strict=True))
        if not ADOPTED_LAG < moved <= self.config.history_versions:
            return 0
        with self.outer_lock:
            self.loop.fast_forward(target)
        return moved
