"""Pulling content-addressed bytes from holders: fragments, and state snapshots for joining peers.

Two data paths, tried in the order ``NetworkOptions.paths`` gives: a direct gRPC stream to the
holder's announced ``host:port`` when it answers within ``connect_timeout``, else hivemind's
libp2p protobuf stream (which goes through relays and NAT). Either way the same header-then-chunks
``FetchResponse`` messages flow into a ``ChunkAssembler``, which checks them against the hash in
the publisher's signed record; a transfer that breaks off resumes at the next holder (or stream)
from where it stopped, and one whose bytes then fail the hash is fetched again from one holder.

Threads: a ``Fetcher`` lives on the transport's event-loop thread ("cgad-net-*"): its coroutines,
gRPC channels, ``transfers`` and ``bytes_by_path`` are written there only. The trainer's thread
reads ``transfers`` and ``bytes_by_path`` as snapshots (``list``, ``dict``), which is safe under
the GIL. The chunk hashing runs on wire's "cgad-sha256" thread; ``receiving.decode_and_check``
runs on the transport's codec worker thread ("cgad-codec").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from google.protobuf.message import Message
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.auth import DESCRIBE_PURPOSE, FETCH_PURPOSE, SwarmKey
from cgad.protocol.config import NetworkOptions
from cgad.protocol.errors import FragmentError
from cgad.protocol.framing import Opening, iterate_capped
from cgad.protocol.records import Holdings
from cgad.protocol.selection import Candidate
from cgad.protocol.tls import channel_credentials, channel_options
from cgad.protocol.transport import FragmentKey, TransportStats
from cgad.protocol.wire import (
    CHUNK_BYTES,
    GRPC_FETCH,
    LIBP2P_DESCRIBE,
    LIBP2P_FETCH,
    NOT_HELD,
    ChunkAssembler,
    parse,
    split_chunk,
)

__all__ = ["MAX_DESCRIPTION", "MIN_TRANSFER_RATE", "Fetcher"]

MAX_DESCRIPTION = 4096
RETRY_SECONDS = 2.0  # between passes over a candidate's holders, and a busy holder's answers
BUSY_RETRIES = 5  # a holder that answers busy (its snapshot slots) is asked again this often
# A holder trickling bytes (a chunk just within the chunk timeout, again and again) would hold a
# slot for ever: after a grace period a stream slower than this on average is dropped, resumed
# elsewhere; far below an honest share of a slow uplink (1 Mbit/s over three fetchers: ~40 kB/s).
MIN_TRANSFER_RATE = 4_000.0
MIN_RATE_GRACE = 15.0  # seconds
MAX_CHANNELS = 32  # open gRPC channels to holders (a swarm of volunteers, not every record ever seen)
# An announced gRPC endpoint that did not answer (a private address, a firewall) is left to libp2p
# this long: else every fetch from that holder would first wait out connect_timeout.
UNANSWERED_FOR = 120.0  # seconds
# A holder whose libp2p stream would not open is dialed at its record's addresses at most this
# often: the addresses are its claim, and each dial is a connection attempt somewhere.
DIAL_AGAIN = 30.0  # seconds
MAX_DIALED = 1024  # holders whose last dial is remembered (a dial older than DIAL_AGAIN is forgotten)
# A holder answers a request with its header at once, from memory and before any payload: one
# whose stream is open and stays silent this many connect timeouts (10 s at the default), or that
# sends a header and no chunk within the chunk timeout, holds a fetch slot for nothing (a tarpit).
# It frees the slot; its gRPC endpoint is left to libp2p, and a holder silent on its last path is
# passed over for UNANSWERED_FOR seconds (at most MAX_SILENT remembered, the oldest forgotten
# first). The wait counts from the stream's opening: a dial through a relay is not its silence.
HEADER_TIMEOUTS = 5.0
MAX_SILENT = 1024

logger = logging.getLogger(__name__)


class Fetcher:
    """Fetches over gRPC or libp2p. ``p2p`` is set by the transport once libp2p runs; failures
    that say something about a holder are passed to ``reject(reason, detail)``, with the holder
    to blame as a third argument where one is known."""

    def __init__(
        self,
        options: NetworkOptions,
        stats: TransportStats,
        reject: Callable[..., None],
        swarm_key: SwarmKey | None = None,
    ) -> None:
        self.options = options
        self.swarm_key = swarm_key  # a private swarm: every request proves it
        self.stats = stats
        self.reject = reject
        self.p2p: P2P | None = None
        self.bytes_by_path: Counter[str] = Counter()  # bytes fetched over each path
        self.bytes_in = 0  # payload bytes received so far, counted as chunks land (the link meter's input)
        self.transfers: dict[FragmentKey, ChunkAssembler] = {}  # fetches in progress
        # by endpoint and certificate, least recently used first: records name them, so a peer
        # that restarts (or lies) brings a new one, and only MAX_CHANNELS stay open
        self._channels: OrderedDict[tuple[str, str | None], grpc.aio.Channel] = OrderedDict()
        # (endpoint, certificate) -> when it is tried again: keyed as channels are, so that a record
        # naming another peer's endpoint with a wrong certificate does not get that peer skipped
        self._unanswered: OrderedDict[tuple[str, str | None], float] = OrderedDict()
        self._dialed: OrderedDict[str, float] = OrderedDict()  # peer id -> when its addresses were dialed
        self._silent: OrderedDict[str, float] = OrderedDict()  # peer id -> until when it is passed over

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def fetch(
        self,
        candidate: Candidate,
        timeout: float | None = None,
        passes: int = 1,
        min_rate: float | None = None,
    ) -> bytearray:
        """The candidate's bytes from the first of its holders that delivers them verified, each
        holder resuming where the last stopped; ``passes`` times over the holders (a busy one may
        have a slot a moment later), within ``timeout`` (default ``fetch_timeout``); a holder
        slower than ``min_rate`` bytes per second on average is dropped, and no later pass tries
        it. ``FragmentError("unavailable")`` says how far it got otherwise."""
        timeout = self.options.fetch_timeout if timeout is None else timeout
        offer = candidate.offer
        # a snapshot's length is only its record's claim: memory follows the bytes that arrive
        assembler = ChunkAssembler(offer.content_hash, offer.byte_length, grow=offer.kind == "state")
        self.transfers[candidate.key] = assembler
        loop = asyncio.get_running_loop()
        started = loop.time()
        # holders that no longer keep these bytes, sent wrong ones or trickled (why): no later pass
        gone: dict[str, str] = {}
        contributors: list[str] = []  # whose bytes the assembly holds now
        try:
            async with asyncio.timeout(timeout):
                for attempt in range(passes):
                    for holder in candidate.holders:
                        if holder.peer_id in gone:
                            continue
                        data = await self._fetch_judged(holder, assembler, contributors, gone, min_rate)
                        if data is not None:
                            return data
                    if len(gone) == len(candidate.holders):
                        break
                    if attempt + 1 < passes:
                        await asyncio.sleep(RETRY_SECONDS)
            everyone_gone = len(gone) == len(candidate.holders)
            ending = "no holder keeps it any more" if everyone_gone else "every holder failed"
        except TimeoutError:
            ending = f"timed out after {timeout:.0f} s"
        finally:
            del self.transfers[candidate.key]
        seconds = max(loop.time() - started, 1e-9)
        raise FragmentError(
            "unavailable",
            f"{candidate.key}: {ending} at {assembler.received / 1e6:.1f} of {offer.byte_length / 1e6:.1f} MB"
            f" ({assembler.received / seconds / 1e3:.0f} kB/s, {len(candidate.holders)} holder(s))",
            {peer: why for peer, why in gone.items() if why != "not_held"},
        )

    async def _fetch_judged(
        self,
        holder: Holdings,
        assembler: ChunkAssembler,
        contributors: list[str],
        gone: dict[str, str],
        min_rate: float | None = None,
    ) -> bytearray | None:
        """``fetch_from``, with the blame for bytes that fail the hash put where it belongs. The
        hash covers the whole, so a transfer resumed across holders does not say who sent the
        wrong part: a copy one holder sent whole is its fault; a mixed one is fetched again from
        the holder that completed it, alone and from the first byte, which then delivers or is at
        fault: one wrong byte spoils a transfer once, never the publisher's name or the fetch."""
        before, started = assembler.received, time.monotonic()
        try:
            data = await self.fetch_from(holder, assembler, min_rate=min_rate)
        except FragmentError as error:
            if error.reason == "not_held":
                gone[holder.peer_id] = "not_held"
                return None
            if error.reason != "bad_hash":
                raise
            others = [peer for peer in contributors if peer != holder.peer_id]
            assembler.restart()
            contributors.clear()
            if others:
                self.reject("bad_hash", f"from one of {', '.join([*others, holder.peer_id])}: {error.detail}")
                return await self._fetch_judged(holder, assembler, contributors, gone, min_rate)
            self.reject("bad_hash", f"from {holder.peer_id}: {error.detail}", holder.peer_id)
            gone[holder.peer_id] = "bad_hash"
            return None
        if assembler.received > before and holder.peer_id not in contributors:
            contributors.append(holder.peer_id)
        elapsed, floor = time.monotonic() - started, MIN_TRANSFER_RATE if min_rate is None else min_rate
        if data is None and elapsed > MIN_RATE_GRACE and assembler.received - before < floor * elapsed:
            gone[holder.peer_id] = "slow"  # it trickled: another pass would only trickle again
        return data

    async def describe(self, peer_id: str) -> tuple[str, str]:
        """A peer's run id and swarm identity (JSON), as it states them; at most
        ``MAX_DESCRIPTION`` characters are believed to be a description."""
        assert self.p2p is not None
        request = pb.DescribeRequest()
        if self.swarm_key is not None:
            self.swarm_key.stamp(request, request.ticket, DESCRIBE_PURPOSE)
        try:
            call = self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id), LIBP2P_DESCRIBE, request, pb.DescribeResponse
            )
            response = await asyncio.wait_for(call, self.options.connect_timeout * HEADER_TIMEOUTS)
        except Exception as error:  # hivemind P2P errors, timeouts and a bad peer id share no base
            raise FragmentError("unavailable", f"{peer_id} did not say who it is: {error!r}") from None
        if len(response.run_id) > 64 or len(response.swarm_json) > MAX_DESCRIPTION:
            raise FragmentError("oversized", f"{peer_id} describes itself at length")
        if not response.run_id:
            raise FragmentError(
                "unauthorized",
                f"{peer_id} did not say who it is: its swarm is private (does --swarm-key hold its key?)",
            )
        return response.run_id, response.swarm_json

    async def fetch_from(
        self,
        holder: Holdings,
        assembler: ChunkAssembler,
        paths: Sequence[str] | None = None,
        min_rate: float | None = None,
    ) -> bytearray | None:
        """Bytes from one holder over the first path that works, resuming where a previous holder
        or stream stopped, at ``min_rate`` bytes per second at least (after ``MIN_RATE_GRACE``);
        None when this holder could not deliver. ``FragmentError`` when it
        says it no longer keeps them ("not_held"), or when the completed bytes fail the hash
        ("bad_hash": the caller restarts the assembly and knows who else contributed)."""
        if self.silent(holder.peer_id):
            self.stats.skipped["silent_holder"] += 1
            return None
        # the rate floor holds over all of a holder's streams: one that sends a byte per stream
        # and ends it would otherwise be reopened for ever
        since = (time.monotonic(), assembler.received)
        for path in paths or self.options.paths:
            # a private swarm's bytes cross gRPC only encrypted (libp2p always is)
            plaintext_only = self.swarm_key is not None and holder.tls is None
            if path == "grpc" and (
                holder.grpc is None or plaintext_only or self._unanswering((holder.grpc, holder.tls))
            ):
                continue
            fruitless, dialed, busy = 0, False, 0
            while fruitless < 2:
                received_before = assembler.received
                try:
                    opening = Opening(HEADER_TIMEOUTS * self.options.connect_timeout)
                    stream = self._open_fetch(path, holder, assembler, opening.opened)
                    await self._drain(stream, assembler, since, min_rate, opening)
                    if assembler.complete:
                        return assembler.finish()
                    # libp2p reports a dropped connection as a clean end of stream: resume
                    logger.debug("stream from %s over %s ended early", holder.peer_id, path)
                except FragmentError as error:
                    if error.reason in ("bad_hash", "not_held"):  # no other path to it helps
                        raise
                    if error.reason == "busy" and busy < BUSY_RETRIES:  # a snapshot slot frees soon
                        busy += 1
                        await asyncio.sleep(RETRY_SECONDS)
                        since = (time.monotonic(), assembler.received)  # the wait was not its bytes
                        continue
                    if error.reason in ("busy", "too_slow"):  # what it sent stays: the next holder resumes it
                        self.reject(error.reason, f"from {holder.peer_id} over {path}: {error.detail}")
                        return None
                    if error.reason == "silent":  # its gRPC endpoint is left to libp2p a while
                        self.reject("silent", f"from {holder.peer_id} over {path}: {error.detail}")
                        if path == "grpc" and holder.grpc is not None:
                            self._unanswered[holder.grpc, holder.tls] = time.monotonic() + UNANSWERED_FOR
                        if path == (paths or self.options.paths)[-1]:
                            self._mark_silent(holder.peer_id)  # silent on its last path: passed over
                            return None
                        break
                    logger.debug("holder %s over %s: %s", holder.peer_id, path, error)
                    break
                except Exception as error:  # gRPC, socket, timeout and hivemind P2P errors share no base
                    logger.debug("holder %s over %s failed: %r", holder.peer_id, path, error)
                    if path == "libp2p" and not dialed and await self._dial(holder):
                        dialed = True  # its daemon's routing did not know the holder: once more,
                        # and the rate floor counts from here (the failed open and the dial were
                        # waiting, not this holder's bytes)
                        since = (time.monotonic(), assembler.received)
                        continue
                    break
                finally:
                    self.bytes_by_path[path] += assembler.received - received_before
                fruitless = 0 if assembler.received > received_before else fruitless + 1
        return None

    async def _dial(self, holder: Holdings) -> bool:
        """Connect libp2p to ``holder`` at the addresses in its record (a peer met through the DHT
        records alone may be unknown to this daemon's routing, "routing: not found"); whether
        it connected. At most once per ``DIAL_AGAIN`` seconds per holder."""
        if not holder.maddrs or self.p2p is None:
            return False
        now = time.monotonic()
        if self._dialed.get(holder.peer_id, -math.inf) > now - DIAL_AGAIN:
            return False
        self._dialed[holder.peer_id] = now
        self._dialed.move_to_end(holder.peer_id)
        while self._dialed and (
            len(self._dialed) > MAX_DIALED or next(iter(self._dialed.values())) <= now - DIAL_AGAIN
        ):
            self._dialed.popitem(last=False)
        try:
            addresses = [Multiaddr(a) for a in holder.maddrs]
            # hivemind's P2P has no connect of its own; its daemon client does (p2pd's CONNECT)
            connect = self.p2p._client.connect(PeerID.from_base58(holder.peer_id), addresses)
            await asyncio.wait_for(connect, self.options.connect_timeout * 5)
        except Exception as error:  # a malformed address, a refused dial, a timeout
            logger.debug("dialing %s at %s failed: %r", holder.peer_id, holder.maddrs, error)
            return False
        return True

    def silent(self, peer_id: str) -> bool:
        """Whether ``peer_id`` opened a stream and sent no header within the last
        ``UNANSWERED_FOR`` seconds (passed over until then)."""
        until = self._silent.get(peer_id)
        if until is not None and time.monotonic() >= until:
            del self._silent[peer_id]
            until = None
        return until is not None

    def _mark_silent(self, peer_id: str) -> None:
        self._silent[peer_id] = time.monotonic() + UNANSWERED_FOR
        self._silent.move_to_end(peer_id)
        while len(self._silent) > MAX_SILENT:
            self._silent.popitem(last=False)

    def _unanswering(self, endpoint: tuple[str, str | None]) -> bool:
        """Whether ``endpoint`` (with its certificate) failed to answer within the last
        ``UNANSWERED_FOR`` seconds."""
        until = self._unanswered.get(endpoint)
        if until is not None and time.monotonic() >= until:
            del self._unanswered[endpoint]
            until = None
        return until is not None

    async def _open_grpc(
        self,
        endpoint: str,
        certificate: str | None,
        method: str,
        request: Message,
        opened: Callable[[], None] | None = None,
    ) -> AsyncIterator[bytes]:
        """Serialized response messages: ``_drain`` reads chunks out of them in place. With the
        holder's certificate, over TLS that trusts that certificate alone."""
        channel = self._channels.get((endpoint, certificate))
        if channel is None:
            if certificate is None:
                channel = grpc.aio.insecure_channel(endpoint)
            else:
                credentials = channel_credentials(certificate)
                channel = grpc.aio.secure_channel(endpoint, credentials, channel_options())
            self._channels[endpoint, certificate] = channel
            if len(self._channels) > MAX_CHANNELS:  # a transfer on it resumes at its next holder
                _, oldest = self._channels.popitem(last=False)
                await oldest.close()
        self._channels.move_to_end((endpoint, certificate))
        try:
            await asyncio.wait_for(channel.channel_ready(), self.options.connect_timeout)
        except TimeoutError:
            self._unanswered[endpoint, certificate] = time.monotonic() + UNANSWERED_FOR
            while len(self._unanswered) > MAX_CHANNELS:
                self._unanswered.popitem(last=False)
            raise
        call = channel.unary_stream(method, request_serializer=type(request).SerializeToString)(request)
        if opened is not None:
            opened()
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()

    async def _open_libp2p(
        self,
        peer_id: str,
        handler: str,
        request: Message,
        response_type: type[Message],
        opened: Callable[[], None] | None = None,
    ) -> AsyncIterator[Message]:
        assert self.p2p is not None
        # each response frame's declared length is checked before a byte of it is buffered: a
        # holder's frame is a header or a chunk, never more than CHUNK_BYTES and its framing
        peer, most = PeerID.from_base58(peer_id), CHUNK_BYTES + (64 << 10)
        stream = iterate_capped(self.p2p, peer, handler, request, response_type, most, opened)
        try:
            async for message in stream:
                yield message
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _open_fetch(
        self, path: str, holder: Holdings, assembler: ChunkAssembler, opened: Callable[[], None] | None = None
    ) -> AsyncIterator[Message | bytes]:
        request = pb.FetchRequest(
            content_hash=assembler.expected_hash,
            offset=assembler.received,
            length=assembler.end - assembler.received if assembler.end else 0,  # a range, or to the end
        )
        if self.swarm_key is not None:
            self.swarm_key.stamp(request, request.ticket, FETCH_PURPOSE)
        if path == "grpc":
            assert holder.grpc is not None
            return self._open_grpc(holder.grpc, holder.tls, GRPC_FETCH, request, opened)
        return self._open_libp2p(holder.peer_id, LIBP2P_FETCH, request, pb.FetchResponse, opened)

    async def _drain(
        self,
        stream: AsyncIterator[Message | bytes],
        assembler: ChunkAssembler,
        since: tuple[float, int],
        min_rate: float | None = None,
        opening: Opening | None = None,
    ) -> None:
        """Read a header-then-chunks stream into ``assembler``, which expects what the signed
        record names; ``FragmentError("too_slow")`` when the holder has sent less than
        ``min_rate`` (None: ``MIN_TRANSFER_RATE``) on average since ``since`` (its first
        stream: time, bytes then), ``FragmentError("silent")`` when no header came within
        ``opening``'s wait of the stream's opening, or no chunk within the chunk timeout of the
        header (a holder that sends a header and then nothing is a tarpit too)."""
        min_rate = MIN_TRANSFER_RATE if min_rate is None else min_rate
        iterator = aiter(stream)
        first, payload = True, False  # the header, and a chunk, not arrived yet
        started, start_bytes = since
        try:
            while True:
                elapsed = time.monotonic() - started
                if elapsed > MIN_RATE_GRACE and assembler.received - start_bytes < min_rate * elapsed:
                    rate = (assembler.received - start_bytes) / elapsed
                    raise FragmentError("too_slow", f"{rate:.0f} B/s over {elapsed:.0f} s")
                try:
                    async with asyncio.timeout(self.options.chunk_timeout) as within:
                        if first and opening is not None:
                            opening.within = within  # the open cuts the wait to the header's
                        item = await anext(iterator)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if first and opening is not None and opening.is_open:
                        raise FragmentError(
                            "silent", f"no header {opening.wait:.0f} s after opening"
                        ) from None
                    if not first and not payload:
                        raise FragmentError("silent", "a header, then no chunk") from None
                    raise
                if isinstance(item, bytes):
                    piece = None if first else split_chunk(item)
                    if piece is not None:
                        payload = True
                        before = assembler.received
                        assembler.add_slice(*piece)
                        self.bytes_in += assembler.received - before
                        if assembler.complete:
                            break
                        continue
                    message = parse(pb.FetchResponse, item)
                else:
                    message = item
                part = message.WhichOneof("part")
                if first:
                    if part != "header":
                        if message.error == NOT_HELD:
                            raise FragmentError("not_held", NOT_HELD)
                        if message.error.startswith("busy"):
                            raise FragmentError("busy", message.error)
                        raise FragmentError(
                            "bad_header", message.error or "stream did not start with a header"
                        )
                    assembler.check_header(message.header)
                    first = False
                elif part == "chunk":
                    payload = True
                    before = assembler.received
                    assembler.add(message.chunk)
                    self.bytes_in += assembler.received - before
                    if assembler.complete:
                        break
                else:
                    raise FragmentError("bad_chunk", f"unexpected {part} inside a transfer")
        finally:
            with contextlib.suppress(Exception):
                await iterator.aclose()
