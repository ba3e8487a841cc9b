"""Offering this node's outer state to peers that join or fall behind, off the trainer's thread.

A snapshot is packed every ``state_every`` rounds: φ in the snapshot codec (int8 blocks of
φ − φ₀ by default, ``outer_state``), the swarm's identity and the round, into one safetensors
blob that the transport hashes, signs a record for, and serves by content hash. The packing runs
on one "cgad-snapshot" thread: it holds the outer lock while φ is read (a consistent state, never
half an outer step), so the trainer waits only if its own outer step falls in that moment. A
round whose previous snapshot is still being packed offers none (the next one is newer anyway).

φ₀ is this node's initial parameters (the model its ``--seed`` builds), kept as int8 blocks: a
byte per parameter. A joiner regenerates the φ₀ of the seed a snapshot names by building the
model from it (``reference``): the seed is a claim like any other, and a wrong one only yields a
φ that its loss will show, never one that is not finite.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from cgad.node.daemon.checkpoint import pack
from cgad.node.member.outer import OuterLoop
from cgad.node.member.outer_state import Phi0
from cgad.protocol.event_thread import side_worker
from cgad.protocol.network import NetworkTransport

__all__ = ["SnapshotPublisher"]

logger = logging.getLogger(__name__)


class SnapshotPublisher:
    """Packs and offers snapshots of ``loop``'s outer state.

    Args:
        loop: the outer loop whose state is offered.
        transport: hashes, announces and serves the packed blob.
        lock: the outer lock (held by outer steps).
        swarm: the swarm's identity, packed into every snapshot.
        codec: the snapshot codec (``outer_state.SNAPSHOT_CODECS``).
        phi0: this node's initial parameters (int8 snapshots are the difference to them).
        build_phi0: the initial parameters of another seed (a joiner's reference).
    """

    def __init__(
        self,
        loop: OuterLoop,
        transport: NetworkTransport,
        lock: threading.Lock,
        swarm: dict[str, Any],
        codec: str,
        phi0: Phi0,
        build_phi0: Callable[[int], Phi0],
    ) -> None:
        self.loop, self.transport, self.lock, self.swarm = loop, transport, lock, swarm
        self.codec, self.phi0, self._build_phi0 = codec, phi0, build_phi0
        self._other: Phi0 | None = None  # the last φ₀ built for another seed
        self._worker = side_worker("cgad-snapshot")
        self._pending: Future[None] | None = None
        self.bytes = 0  # the size of the latest snapshot offered
        self.pack_seconds = 0.0  # how long packing it took (on the snapshot thread)
        self.skipped = 0  # rounds that offered none: the previous one was still being packed

    def reference(self, seed: int) -> Phi0:
        """φ₀ of ``seed``: this node's own, or built from the seed (a model's initialisation;
        the last one built is kept, as the swarm's snapshots name one seed)."""
        if seed == self.phi0.seed:
            return self.phi0
        if self._other is None or self._other.seed != seed:
            self._other = self._build_phi0(seed)
        return self._other

    def offer(self, round_: int, wait: bool = False) -> None:
        """Pack and offer a snapshot at ``round_`` on the snapshot thread (``wait``: and return
        once it is offered)."""
        if self._pending is not None and not self._pending.done():
            self.skipped += 1
            return
        self._pending = self._worker.submit(self._pack, round_)
        if wait:
            self._pending.result()

    def _pack(self, round_: int) -> None:
        started = time.monotonic()
        try:
            with self.lock:  # one consistent snapshot, never half an outer step
                versions = list(self.loop.versions)
                reference = self.phi0 if self.codec == "int8" else None
                snapshot = {"swarm": self.swarm, "round": round_,
                            "outer": self.loop.state_dict(self.codec, reference=reference)}  # fmt: skip
                # int8 holds copies only; fp32 holds the optimizer's live tensors: packed here
                blob = None if self.codec == "int8" else pack(snapshot)
            blob = blob or pack(snapshot)
            self.transport.publish_state(blob, versions)
        except Exception:  # a failed snapshot must not end the node: the next round offers one
            logger.exception("packing the state snapshot failed")
            return
        self.bytes, self.pack_seconds = len(blob), time.monotonic() - started

    def close(self) -> None:
        self._worker.shutdown(wait=True)
