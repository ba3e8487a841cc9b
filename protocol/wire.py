"""Moving encoded fragments as messages: chunking, reassembly with hash check, safe parsing.

Both data paths (direct gRPC and libp2p streams) send the same ``FetchResponse`` messages: one
header, then chunks of at most ``CHUNK_BYTES``. The receiving side never trusts the sender: the
expected hash and length come from the publisher's signed DHT record, and the assembler refuses
out-of-order, surplus or mismatching bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.errors import FragmentError

__all__ = ["CHUNK_BYTES", "ChunkAssembler", "content_hash", "parse", "response_stream"]

CHUNK_BYTES = 1 << 20  # libp2p caps a message at 4 MiB; 1 MiB parts keep both paths streaming

MessageT = TypeVar("MessageT", bound=Message)


def content_hash(data: bytes | bytearray | memoryview) -> bytes:
    """The content address of encoded bytes (sha256)."""
    return hashlib.sha256(data).digest()


def parse(message_type: type[MessageT], data: bytes) -> MessageT:
    """Parse protobuf bytes from a peer; malformed input is a ``FragmentError("garbage")``."""
    try:
        return message_type.FromString(data)
    except (DecodeError, ValueError, TypeError) as error:
        raise FragmentError("garbage", f"unparsable {message_type.__name__}: {error}") from None


def response_stream(
    header: pb.FragmentHeader, data: bytes | bytearray, offset: int = 0, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.FetchResponse]:
    """The header, then ``data[offset:]`` in chunks."""
    yield pb.FetchResponse(header=header)
    view = memoryview(data)
    for start in range(offset, len(data), chunk_bytes):
        yield pb.FetchResponse(chunk=pb.Chunk(offset=start, data=bytes(view[start : start + chunk_bytes])))


class ChunkAssembler:
    """Collects one fragment's chunks in order and checks them against the signed record.

    A transfer that breaks off can resume from ``received`` at another holder: the bytes are
    content-addressed, so where they came from does not matter, and the running hash covers them
    all.
    """

    def __init__(self, expected_hash: bytes, byte_length: int) -> None:
        self.expected_hash = expected_hash
        self.byte_length = byte_length
        self.received = 0
        self._buffer = bytearray(byte_length)
        self._hash = hashlib.sha256()

    def check_header(self, header: pb.FragmentHeader) -> None:
        """The holder's header must describe the bytes the record names."""
        if header.content_hash != self.expected_hash or header.byte_length != self.byte_length:
            raise FragmentError("bad_header", "holder describes other bytes than the signed record")

    def add(self, chunk: pb.Chunk) -> None:
        if chunk.offset != self.received:
            raise FragmentError("bad_chunk", f"chunk at {chunk.offset}, expected {self.received}")
        end = self.received + len(chunk.data)
        if end > self.byte_length:
            raise FragmentError("oversized", f"{end} bytes, the record says {self.byte_length}")
        self._buffer[self.received : end] = chunk.data
        self._hash.update(chunk.data)
        self.received = end

    def restart(self) -> None:
        """Forget what arrived (after a hash mismatch nothing received can be trusted)."""
        self.received = 0
        self._hash = hashlib.sha256()

    def finish(self) -> bytearray:
        if self.received != self.byte_length:
            raise FragmentError("truncated", f"{self.received} of {self.byte_length} bytes")
        if self._hash.digest() != self.expected_hash:
            raise FragmentError("bad_hash", "bytes do not match the content hash in the signed record")
        return self._buffer
