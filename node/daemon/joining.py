"""How a node gets the swarm's outer state: at joining, and again when it has fallen behind.

Peers offer signed snapshots of their outer state (``NetworkTransport.publish_state``). A joining
node first asks the peers named by ``--peers`` who they are (another run, model or method is
refused at once), then adopts the newest snapshot ahead of it; a snapshot that trails the swarm
once adopted (it was old when picked) is followed by a newer one, unless the download itself took
rounds (on a slow link the next would trail as far), and finally the node counts its versions on
to where the source has moved meanwhile. Every claim in a snapshot's record is a
claim until its bytes are checked; no single peer's report moves the ceiling or the lag.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from cgad.node.config import JoinConfig
from cgad.node.daemon.checkpoint import CheckpointError, unpack
from cgad.node.member.outer import OuterLoop
from cgad.node.member.outer_state import Reference
from cgad.node.member.swarm import behind, snapshot_ceiling, swarm_versions
from cgad.protocol.errors import FragmentError
from cgad.protocol.multisource import MAX_SOURCES
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import PROTOCOL_VERSION
from cgad.protocol.selection import Candidate

__all__ = ["IncompatibleSwarm", "StateSync", "check_compatible", "settled"]

logger = logging.getLogger(__name__)

# bytes per second a state download may not fall below on average: its timeout is a minute
# plus its size at this rate. Joiners share the source's uplink: three of them through one 2 Mbit
# link got 69 kB/s each, and a limit of 100 kB/s cut one off at 95% of its 15 MB. A stalled or
# trickling sender is dropped by the fetcher long before this (chunk timeout, `too_slow`).
MIN_STATE_RATE = 20e3
MAX_ADOPTIONS = 3  # snapshots one sync may adopt in a row while the swarm stays ahead
# versions an adopted snapshot may trail the swarm by: its parameters lack the rounds in between
# for good (pseudo-gradient averaging never closes an offset), so a newer one is fetched first
ADOPTED_LAG = 1
# what makes two nodes members of one swarm, with the words an error uses for each
SWARM_IDENTITY = (
    ("run_id", "run id"),
    ("model", "model config"),
    ("tokenizer", "tokenizer"),
    ("optimizer", "outer optimizer"),
    ("fragments", "number of fragments"),
    ("sync", "exchange (--sync)"),
)
# what a description or checkpoint from before a part of the identity existed meant by leaving it out
IDENTITY_DEFAULTS = {"sync": "exchange"}


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

    def sync(self, required: bool) -> tuple[str, int] | None:
        """Adopt the newest snapshot of the swarm's outer state that is ahead of ours (for a
        fresh node, ``required``: any, within ``join_timeout``); the source and the round this
        node is at now, or None when nothing was adopted.
        A snapshot that trails the swarm by more than ``ADOPTED_LAG`` versions once adopted (an
        old snapshot) is followed by a newer one, up to ``MAX_ADOPTIONS``, unless the download
        itself took longer than that many rounds (a slow link: the next would trail as far);
        then this peer's versions are counted on to the source's (``_fast_forward``)."""
        c = self.config
        give_up = time.monotonic() + (c.join_timeout if required else 10.0)
        failures: list[str] = []
        adopted: tuple[str, int] | None = None  # the last snapshot adopted: publisher, round
        adoptions = 0
        grew = 0  # versions the swarm went on by during the last download
        while not self.leave.is_set():
            offers = self._worth_adopting(at_least_ours=required and adopted is None)
            if adopted is not None and settled(bool(offers), adoptions, self.behind(), grew):
                break
            failed: set[str] = set()  # publishers whose newest offer failed: not their older ones
            for candidate in offers:
                if candidate.key.publisher in failed:
                    continue
                swarm_before = self._swarm_version()
                snapshot_round = self._adopt(candidate, failures)
                if snapshot_round is not None:
                    adopted, adoptions = (candidate.key.publisher, snapshot_round), adoptions + 1
                    grew = self._swarm_version() - swarm_before
                    break
                failed.add(candidate.key.publisher)
            else:
                # no newer snapshot could be had: a fresh node keeps trying while time allows
                settle = adopted is not None and (adoptions >= MAX_ADOPTIONS or not required)
                if settle or time.monotonic() > give_up or (offers and not required and adopted is None):
                    break
                time.sleep(1.0)
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

    def _worth_adopting(self, at_least_ours: bool) -> list[Candidate]:
        """Snapshots on offer ahead of this peer (or level with it, ``at_least_ours``), none
        claiming to be past ``_ceiling`` (a claim, until the bytes are checked): those within
        ``ADOPTED_LAG`` of the newest first, the most holders first among them (a download
        draws from every holder at once, and the version it lacks is replayed after it), then
        the rest, newest first."""
        mine = min(self.loop.versions)
        ceiling = self._ceiling()
        offers = [
            c
            for c in self.transport.state_offers()
            if (c.key.base_version >= mine if at_least_ours else c.key.base_version > mine)
            and c.key.base_version <= ceiling
        ]
        if not offers:
            return offers
        newest = max(c.key.base_version for c in offers)
        near = [c for c in offers if c.key.base_version >= newest - ADOPTED_LAG]
        near.sort(key=lambda c: (min(len(c.holders), MAX_SOURCES), c.key.base_version), reverse=True)
        return near + [c for c in offers if c.key.base_version < newest - ADOPTED_LAG]

    def _adopt(self, candidate: Candidate, failures: list[str]) -> int | None:
        """Download one snapshot, check it and adopt it: its round, or None (with why, in
        ``failures``) when it is unusable, a snapshot of another swarm included."""
        peer, size = candidate.key.publisher, candidate.offer.byte_length
        timeout = 60.0 + size / MIN_STATE_RATE
        logger.info(
            "downloading the state of %s (version %d, %.1f MB) from %d holder(s)",
            peer, candidate.key.base_version, size / 1e6, len(candidate.holders),
        )  # fmt: skip
        try:
            data = self.transport.fetch_state(candidate, timeout)
            state = unpack(data)
        except (FragmentError, CheckpointError, TimeoutError) as exc:
            failures.append(str(exc))
            logger.warning("state download failed: %s", exc)
            return None
        try:
            # the peers at --peers were checked already (Describe): a snapshot of another swarm
            # is one bad offer among others, never a reason to stop
            theirs = state.get("swarm", {}) if isinstance(state, dict) else {}
            check_compatible(self.swarm, theirs if isinstance(theirs, dict) else {}, f"peer {peer}")
            versions, snapshot_round = state["outer"]["versions"], state["round"]
            if type(snapshot_round) is not int or snapshot_round < 0:
                raise ValueError(f"round {snapshot_round!r}")
            if not (isinstance(versions, list) and versions and all(type(v) is int for v in versions)):
                raise ValueError(f"versions {versions!r}")
            if min(versions) != candidate.key.base_version:
                raise ValueError(
                    f"its record says version {candidate.key.base_version}, its bytes {min(versions)}"
                )
            # one fragment far ahead would drop every honest delta of it as stale, for good: an
            # honest node's fragments are at most a replay (the cutoff) apart, and its record's
            # ceiling holds for each of them
            if max(versions) > self._ceiling() or max(versions) - min(versions) > self.config.cutoff:
                raise ValueError(f"versions {versions} past the swarm's or too far apart")
            with self.outer_lock:
                # checks the whole before adopting any
                self.loop.load_state_dict(state["outer"], reference=self.reference)
        # IncompatibleSwarm is a ValueError; ArithmeticError: int() of a huge float, for one
        except (KeyError, TypeError, ValueError, RuntimeError, ArithmeticError) as exc:
            failures.append(f"snapshot of {peer} is unusable: {exc}")
            self.transport.stats.rejected["bad_state"] += 1
            logger.warning("the snapshot of %s is unusable: %s", peer, exc)
            return None
        self.transport.reserve_state(candidate, data)
        # the round is the peer's word: never past its versions, which count rounds (a forged
        # round would spread to later joiners and end a --max-rounds node at once)
        return min(snapshot_round, min(versions))

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
        moved = max(b - a for a, b in zip(self.loop.versions, latest.versions, strict=True))
        if not ADOPTED_LAG < moved <= self.config.history_versions:
            return 0
        with self.outer_lock:
            self.loop.fast_forward(latest.versions)
        return moved
