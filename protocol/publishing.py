"""Publishing: encode a fragment (or take a packed snapshot), keep its bytes, announce them signed.

``publish`` copies the tensor on the caller's thread and returns; encoding (as it is: error
feedback is the sender's, node/member/sender.py) and hashing run on the codec worker; storing and
announcing run on the event loop. The announcements are this peer's signed holdings records under
the fragment's DHT key (or the run's state key), plus its progress record, its heartbeat;
``refresh_forever`` keeps them alive.

Threads: ``progress`` is replaced whole by the
trainer's thread and read by the loop; ``dht_node`` is set once the loop has started it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor

import torch
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from cgad.protocol.codec import Codec, encode
from cgad.protocol.config import NetworkOptions, wire_codec
from cgad.protocol.dhtbounds import search_beam
from cgad.protocol.errors import FragmentError
from cgad.protocol.event_thread import EventLoopThread
from cgad.protocol.records import Holdings, Identity, Offer, Progress, fragment_key, progress_key, state_key
from cgad.protocol.selection import STATE_CODEC, Candidate
from cgad.protocol.store import FragmentStore, StoredFragment, fragment_header
from cgad.protocol.transport import Fragment, FragmentKey, Kind, TransportStats
from cgad.protocol.wire import content_hash, piece_hashes

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)


class Publisher:
    """This peer's side of the records: what it holds and how far it is. ``on_own`` is told of
    each own fragment as it is stored (its content must never be fetched back from a peer), and
    ``on_progress`` of each progress record as it goes out."""

    def __init__(
        self,
        options: NetworkOptions,
        identity: Identity,
        store: FragmentStore,
        stats: TransportStats,
        runner: EventLoopThread,
        codec_worker: Executor,
        grpc_contact: Callable[[], tuple[str | None, str | None]],
        addresses: Callable[[], Awaitable[list[str]]],
        on_own: Callable[[StoredFragment], None],
        on_progress: Callable[[Progress], None],
        progress: Progress,
    ) -> None:
        self.options = options
        self.identity = identity
        self.peer_id = identity.peer_id
        self.store = store
        self.stats = stats
        self.progress = progress
        self.dht_node: DHTNode | None = None
        self._runner = runner
        self._codec_worker = codec_worker
        self._grpc_contact = grpc_contact  # the gRPC endpoint and its TLS certificate, once serving
        self._addresses = addresses  # its libp2p multiaddrs (reachability.AnnouncedAddresses)
        self._on_own = on_own
        self._on_progress = on_progress
        # loop-side: when each record last went out (fragment index, None: snapshots, or
        # "progress"), and the re-announcements waiting to go out together
        self._stored_at: dict[int | str | None, float] = {}
        self._announcing: set[int] = set()

    # ---------------------------------------------------------------- any thread

    def publish(self, fragment: Fragment, codec: Codec | str | None = None) -> None:
        """Encode and offer ``fragment``. A pseudo-gradient handed over whole goes out in float32:
        which codec a delta takes is the member's sender's decision (``node/member/sender.py``,
        which hands encoded ones to ``publish_encoded``), not the transport's; outer parameters
        go out in ``--params-codec``. ``codec`` overrides both (tests of the wire)."""
        key = fragment.key
        named = "fp32" if key.kind is Kind.DELTA else self.options.params_codec
        codec = Codec(codec or wire_codec(named))
        snapshot = fragment.tensor.detach().reshape(-1).to(device="cpu", copy=True)
        if snapshot.numel() and not all(math.isfinite(float(v)) for v in torch.aminmax(snapshot.float())):
            raise FragmentError("non_finite", f"{key} holds NaN or Inf")
        self._codec_worker.submit(self._encode_and_publish, key, snapshot, codec, fragment.tokens)

    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        if key.publisher != self.peer_id:
            raise ValueError(f"this peer is {self.peer_id}; it cannot publish as {key.publisher}")
        entry = self._entry(key, data, codec=str(codec), numel=numel, tokens=tokens)
        self.stats.published += 1
        self._runner.submit(self._add_and_announce(entry))

    def publish_state(self, data: bytes, versions: Sequence[int]) -> None:
        key = FragmentKey(self.options.run_id, 0, min(versions, default=0), self.peer_id, Kind.STATE)
        # hashing a model-sized blob is the codec worker's job, not the trainer's
        self._codec_worker.submit(self._offer_state, key, data)

    def reserve_state(self, candidate: Candidate, data: bytes | bytearray) -> None:
        entry = StoredFragment(
            fragment_header(candidate.key, candidate.offer), data, candidate.offer, own=False
        )
        self._runner.submit(self._keep_state(entry))

    # ---------------------------------------------------------------- the codec worker

    def _encode_and_publish(self, key: FragmentKey, tensor: torch.Tensor, codec: Codec, tokens: int) -> None:
        try:
            # a tensor handed over whole is encoded as it is: error feedback is the sender's
            # (node/member/sender.py), which hands over bytes whenever a codec drops anything
            data = (
                encode(tensor, codec, self.options.sparse_keep)
                if key.kind is Kind.DELTA
                else encode(tensor, codec)
            )
            self.publish_encoded(key, data, codec=codec, numel=tensor.numel(), tokens=tokens)
        except Exception:
            logger.exception("publishing %s failed", key)

    def _offer_state(self, key: FragmentKey, data: bytes) -> None:
        entry = self._entry(key, data, codec=STATE_CODEC, numel=0, tokens=0, pieces=True)
        self._runner.submit(self._keep_state(entry))

    def _entry(
        self, key: FragmentKey, data: bytes, *, codec: str, numel: int, tokens: int, pieces: bool = False
    ) -> StoredFragment:
        """An own offer of ``data``; with ``pieces`` (a snapshot, fetched in pieces from several
        holders) each piece's hash too (``wire.piece_hashes``)."""
        whole, hashes = piece_hashes(data) if pieces else (content_hash(data), [])
        offer = Offer(
            publisher=self.peer_id,
            base_version=key.base_version,
            kind=str(key.kind),
            tokens=tokens,
            codec=codec,
            numel=numel,
            content_hash=whole,
            byte_length=len(data),
            piece_hashes=hashes,
        )
        return StoredFragment(fragment_header(key, offer), data, offer, own=True)

    # ---------------------------------------------------------------- the event loop

    async def _add_and_announce(self, entry: StoredFragment) -> None:
        self.store.put(entry)
        self._on_own(entry)
        await self.announce(entry.header.fragment)

    async def _keep_state(self, entry: StoredFragment) -> None:
        self.store.put(entry)
        await self.announce(None)

    def announce_soon(self, fragment: int) -> None:
        """Announce the holdings of a fragment ``poll_interval`` from now, once for whatever is
        stored meanwhile: a peer re-announces each fragment it fetches (one more holder), and the
        round's fragments arrive within a few seconds of each other, and each store is a signed
        DHT write to every replica."""
        if fragment in self._announcing:
            return
        self._announcing.add(fragment)

        async def later() -> None:
            try:
                await asyncio.sleep(self.options.poll_interval)
            finally:
                self._announcing.discard(fragment)
            await self.announce(fragment)

        self._runner.spawn(later())

    async def announce(self, fragment: int | None) -> None:
        """This peer's holdings of a fragment (None: of state snapshots), signed."""
        # before the offers are read: no await may come between reading them and dating the
        # record, or an older announcement still waiting would overwrite a newer one
        maddrs = await self._addresses()
        offers = self.store.offers(fragment)
        if not offers or self.dht_node is None:
            return
        self._stored_at[fragment] = asyncio.get_running_loop().time()
        self.stats.records_stored["holdings" if fragment is not None else "state"] += 1
        endpoint, certificate = self._grpc_contact()
        holdings = Holdings(
            peer_id=self.peer_id, grpc=endpoint, tls=certificate, offers=offers, maddrs=maddrs
        )
        run_id = self.options.run_id
        stored = await self.dht_node.store(
            state_key(run_id) if fragment is None else fragment_key(run_id, fragment),
            holdings.dict(),
            get_dht_time() + self.options.record_ttl,
            subkey=self.identity.owner_subkey,
            beam_size=search_beam(self.dht_node, store=True),
        )
        if not stored:
            logger.debug("announcing fragment %s reached no DHT peer", fragment)

    async def store_progress(self) -> None:
        """Refresh this peer's progress record (``on_progress`` sees it first)."""
        if self.dht_node is None:
            return
        progress = self.progress.copy(update={"time": get_dht_time(), "grpc": self._grpc_contact()[0]})
        self._on_progress(progress)
        self._stored_at["progress"] = asyncio.get_running_loop().time()
        self.stats.records_stored["progress"] += 1
        await self.dht_node.store(
            progress_key(self.options.run_id),
            progress.dict(),
            get_dht_time() + self.options.liveness_ttl,
            subkey=self.identity.owner_subkey,
            beam_size=search_beam(self.dht_node, store=True),
        )

    async def store_farewell(self) -> None:
        """Replace this peer's progress record with nothing (the schema allows an owner's subkey
        to hold None): its peers see it gone at their next poll instead of when its heartbeat
        expires, and stop waiting for its fragments."""
        if self.dht_node is None:
            return
        await self.dht_node.store(
            progress_key(self.options.run_id),
            None,
            get_dht_time() + self.options.liveness_ttl,
            subkey=self.identity.owner_subkey,
            beam_size=search_beam(self.dht_node, store=True),
        )

    async def refresh_forever(self, num_fragments: int) -> None:
        """Keep this peer's records alive: progress (its heartbeat) and its holdings, each once
        a third of its lifetime has passed since it last went out (a round's own reports and
        announcements usually come sooner: then nothing is stored twice)."""
        heartbeat, holdings = self.options.liveness_ttl / 3, self.options.record_ttl / 3
        clock = asyncio.get_running_loop()
        while True:
            try:
                if clock.time() - self._stored_at.get("progress", -math.inf) >= heartbeat:
                    await self.store_progress()
                for fragment in [*range(num_fragments), None]:
                    if clock.time() - self._stored_at.get(fragment, -math.inf) >= holdings:
                        await self.announce(fragment)
            except Exception:  # one failed pass must not end the heartbeat: peers would drop us
                logger.exception("refreshing this peer's records failed; trying again")
            await asyncio.sleep(min(heartbeat, holdings) / 2)
