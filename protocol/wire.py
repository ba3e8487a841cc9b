"""Moving encoded fragments as messages: chunking, reassembly with hash check, safe parsing.

Both data paths (direct gRPC and libp2p streams) send the same ``FetchResponse`` messages: one
header, then chunks of at most ``CHUNK_BYTES``. The receiving side never trusts the sender: the
expected hash and length come from the publisher's signed DHT record, and the assembler refuses
out-of-order, surplus or mismatching bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.errors import FragmentError

__all__ = [
    "CHUNK_BYTES",
    "GRPC_FETCH",
    "LIBP2P_DESCRIBE",
    "LIBP2P_FETCH",
    "MAX_PIECES",
    "PIECE_BYTES",
    "SERVICE",
    "ChunkAssembler",
    "RangeAssembler",
    "content_hash",
    "parse",
    "piece_bounds",
    "piece_count",
    "piece_hashes",
    "response_stream",
    "serialized_response_stream",
    "split_chunk",
]

CHUNK_BYTES = 1 << 20  # libp2p caps a message at 4 MiB; 1 MiB parts keep both paths streaming

# FragmentService's calls, registered by hand on both paths (no generated stubs, so that chunks
# can be streamed pre-serialized): the gRPC method paths and the libp2p protocol names.
SERVICE = pb.DESCRIPTOR.services_by_name["FragmentService"].full_name
GRPC_FETCH = f"/{SERVICE}/Fetch"
# a holder's answer for bytes it no longer keeps (a newer snapshot replaced them): final, unlike
# "busy", so a fetcher stops asking it
NOT_HELD = "not held here"
LIBP2P_FETCH = f"{SERVICE}.Fetch"
LIBP2P_DESCRIBE = f"{SERVICE}.Describe"

MessageT = TypeVar("MessageT", bound=Message)

# A snapshot is fetched in pieces of at least PIECE_BYTES, several holders at once; its
# publisher's signed record names each piece's hash (at most MAX_PIECES of them: a record is
# stored at every replica and re-stored, so they stay 32 bytes each and few), so a piece that
# fails names the holder that sent it and only that piece is fetched again.
PIECE_BYTES = 4 << 20  # a few seconds of a 10 Mbit uplink, few enough to track
MAX_PIECES = 16


def piece_count(byte_length: int) -> int:
    """How many pieces a snapshot of ``byte_length`` bytes is cut into (and hashed by)."""
    return max(1, min(MAX_PIECES, -(-byte_length // PIECE_BYTES)))


def piece_bounds(byte_length: int, pieces: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``pieces`` contiguous pieces of equal size (the last shorter)
    covering ``byte_length`` bytes; every piece holds at least one byte.

    Args:
        byte_length: the whole transfer's length.
        pieces: how many pieces (1 to ``byte_length``).
    """
    if not 1 <= pieces <= max(byte_length, 1):
        raise ValueError(f"{pieces} pieces of {byte_length} bytes")
    size = -(-byte_length // pieces)
    return [(start, min(start + size, byte_length)) for start in range(0, byte_length, size)]


def piece_hashes(data: bytes | bytearray | memoryview) -> tuple[bytes, list[bytes]]:
    """The whole's content hash and each piece's (``piece_count``, ``piece_bounds``), in one pass.

    Args:
        data: the snapshot's bytes.
    """
    view, whole, hashes = memoryview(data), hashlib.sha256(), []
    for start, end in piece_bounds(len(view), piece_count(len(view))) if len(view) else []:
        whole.update(view[start:end])
        hashes.append(hashlib.sha256(view[start:end]).digest())
    return whole.digest(), hashes


def content_hash(data: bytes | bytearray | memoryview) -> bytes:
    """The content address of encoded bytes (sha256)."""
    return hashlib.sha256(data).digest()


def parse(message_type: type[MessageT], data: bytes) -> MessageT:
    """Parse protobuf bytes from a peer; malformed input is a ``FragmentError("garbage")``."""
    try:
        return message_type.FromString(data)
    except (DecodeError, ValueError, TypeError) as error:
        raise FragmentError("garbage", f"unparsable {message_type.__name__}: {error}") from None


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buffer: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if shift > 63:
            raise ValueError("varint too long")
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value & 0xFFFF_FFFF_FFFF_FFFF, position  # protobuf keeps the low 64 bits
        shift += 7


def serialized_response_stream(
    header: pb.FragmentHeader,
    data: bytes | bytearray,
    offset: int = 0,
    chunk_bytes: int = CHUNK_BYTES,
    end: int | None = None,
) -> Iterator[bytes]:
    """``response_stream`` already serialized, each chunk message written around its slice of
    ``data`` with one copy (building and serializing a ``Chunk`` copies the megabyte three times:
    on the direct gRPC path that was the sender's bottleneck)."""
    yield pb.FetchResponse(header=header).SerializeToString()
    view = memoryview(data)[: len(data) if end is None else end]
    for start in range(offset, len(view), chunk_bytes):
        piece = view[start : start + chunk_bytes]
        chunk_head = b"\x08" + _varint(start) + b"\x12" + _varint(len(piece))  # Chunk.offset, Chunk.data
        message_head = b"\x12" + _varint(len(chunk_head) + len(piece))  # FetchResponse.chunk
        yield b"".join((message_head, chunk_head, piece))


def split_chunk(message: bytes) -> tuple[int, memoryview] | None:
    """Offset and data of a serialized ``FetchResponse`` that is exactly one chunk laid out as
    ``serialized_response_stream`` writes it, without copying the data; None for anything else,
    which the caller then parses with protobuf."""
    try:
        if message[0] != 0x12:
            return None
        length, position = _read_varint(message, 1)
        if position + length != len(message) or message[position] != 0x08:
            return None
        offset, position = _read_varint(message, position + 1)
        if message[position] != 0x12:
            return None
        size, position = _read_varint(message, position + 1)
    except (IndexError, ValueError):
        return None
    if position + size != len(message):
        return None
    return offset, memoryview(message)[position:]


def response_stream(
    header: pb.FragmentHeader,
    data: bytes | bytearray,
    offset: int = 0,
    chunk_bytes: int = CHUNK_BYTES,
    end: int | None = None,
) -> Iterator[pb.FetchResponse]:
    """The header, then ``data[offset:end]`` in chunks."""
    yield pb.FetchResponse(header=header)
    view = memoryview(data)[: len(data) if end is None else end]
    for start in range(offset, len(view), chunk_bytes):
        yield pb.FetchResponse(chunk=pb.Chunk(offset=start, data=bytes(view[start : start + chunk_bytes])))


# One hashing thread for all transfers: sha256 releases the GIL, so hashing what has arrived
# overlaps with receiving the next chunk instead of stalling the event loop that receives it.
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cgad-sha256")


class ChunkAssembler:
    """Collects one fragment's chunks in order and checks them against the signed record.

    A transfer that breaks off can resume from ``received`` at another holder: the bytes are
    content-addressed, so where they came from does not matter, and the running hash covers them
    all. ``grow``: memory is taken as bytes arrive, not for the length a record claims (a state
    snapshot, whose length no local rule fixes; a fragment's is checked against its numel first).
    """

    end = 0  # a whole transfer: ask for everything from ``received`` on (``RangeAssembler``)

    def __init__(self, expected_hash: bytes, byte_length: int, grow: bool = False) -> None:
        self.expected_hash = expected_hash
        self.byte_length = byte_length
        self.received = 0
        self._grow = grow
        self._buffer = bytearray(0 if grow else byte_length)
        self._parts: list[bytes] = []  # with ``grow``: what arrived, in order
        self._hash = hashlib.sha256()
        self._hashed: Future[None] | None = None  # the latest queued hash update (FIFO)

    @property
    def complete(self) -> bool:
        return self.received == self.byte_length

    def check_header(self, header: pb.FragmentHeader) -> None:
        """The holder's header must describe the bytes the record names."""
        if header.content_hash != self.expected_hash or header.byte_length != self.byte_length:
            raise FragmentError("bad_header", "holder describes other bytes than the signed record")

    def add(self, chunk: pb.Chunk) -> None:
        self.add_slice(chunk.offset, chunk.data)

    def add_slice(self, offset: int, data: bytes | memoryview) -> None:
        if offset != self.received:
            raise FragmentError("bad_chunk", f"chunk at {offset}, expected {self.received}")
        end = self.received + len(data)
        if end > self.byte_length:
            raise FragmentError("oversized", f"{end} bytes, the record says {self.byte_length}")
        if self._grow:
            piece: bytes | memoryview = bytes(data)
            self._parts.append(piece)  # type: ignore[arg-type]
        else:
            self._buffer[self.received : end] = data
            piece = memoryview(self._buffer)[self.received : end]
        # hash our own copy: the sender's buffer may be reused once we return
        self._hashed = _HASHER.submit(self._hash.update, piece)
        self.received = end

    def _wait_for_hash(self) -> None:
        if self._hashed is not None:
            self._hashed.result()

    def restart(self) -> None:
        """Forget what arrived (after a hash mismatch nothing received can be trusted)."""
        self._wait_for_hash()
        self.received = 0
        self._parts = []
        self._hash = hashlib.sha256()
        self._hashed = None

    def finish(self) -> bytearray:
        if self.received != self.byte_length:
            raise FragmentError("truncated", f"{self.received} of {self.byte_length} bytes")
        self._wait_for_hash()
        if self._hash.digest() != self.expected_hash:
            raise FragmentError("bad_hash", "bytes do not match the content hash in the signed record")
        if self._grow:
            self._buffer, self._parts = bytearray(b"".join(self._parts)), []
        return self._buffer


class RangeAssembler:
    """Collects the chunks of one range ``[start, end)`` of a transfer in order, as part of a
    download from several holders at once: memory grows with what arrived, and bytes past
    ``end`` (a holder that ignores the requested length) are left out. The hash covers the
    whole transfer, so the caller checks it once every range is in (``content_hash``).

    Args:
        expected_hash: the whole transfer's hash (what the holder is asked for).
        byte_length: the whole transfer's length (what its header must say).
        start: the first byte of the range.
        end: one past its last byte.
    """

    def __init__(self, expected_hash: bytes, byte_length: int, start: int, end: int) -> None:
        self.expected_hash, self.byte_length = expected_hash, byte_length
        self.start, self.end = start, end
        self.received = start  # the next byte expected, counted from the transfer's start
        self._parts: list[bytes] = []

    @property
    def complete(self) -> bool:
        return self.received >= self.end

    check_header = ChunkAssembler.check_header

    def add(self, chunk: pb.Chunk) -> None:
        self.add_slice(chunk.offset, chunk.data)

    def add_slice(self, offset: int, data: bytes | memoryview) -> None:
        if offset != self.received:
            raise FragmentError("bad_chunk", f"chunk at {offset}, expected {self.received}")
        piece = bytes(data[: self.end - self.received])
        self._parts.append(piece)
        self.received += len(piece)

    def restart(self) -> None:
        self.received, self._parts = self.start, []

    def digest(self) -> bytes:
        """The sha256 of the bytes in so far (a piece's, once complete)."""
        h = hashlib.sha256()
        for part in self._parts:
            h.update(part)
        return h.digest()

    def finish(self) -> bytes:
        """The range's bytes (checked by the caller: its piece's hash, the whole's), joined once
        and kept so: the parts are not held twice (a piece is up to 1/16 of a snapshot)."""
        if not self.complete:
            raise FragmentError("truncated", f"range at {self.received} of [{self.start}, {self.end})")
        if len(self._parts) != 1:
            self._parts = [b"".join(self._parts)]
        return self._parts[0]
