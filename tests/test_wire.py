"""The committed protobuf modules match fragment.proto; chunking and reassembly refuse bad bytes."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from pathlib import Path

import pydantic.v1 as pydantic
import pytest
from _protoc import GENERATED, PROTO_DIR, generate  # tests/ is on sys.path under pytest
from google.protobuf import descriptor_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from cgad.protocol import FragmentError
from cgad.protocol import fragment_pb2 as pb
from cgad.protocol.records import Offer
from cgad.protocol.wire import (
    CHUNK_BYTES,
    MAX_PIECES,
    PIECE_BYTES,
    ChunkAssembler,
    RangeAssembler,
    content_hash,
    parse,
    piece_bounds,
    piece_count,
    piece_hashes,
    response_stream,
    serialized_response_stream,
    split_chunk,
)

pytestmark = pytest.mark.timeout(60)


def _file_descriptor(module_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """The serialized descriptor a generated ``_pb2.py`` embeds, without importing it."""
    source = module_path.read_text()
    literal = re.search(r"AddSerializedFile\((b'.*?')\)", source, re.S)
    assert literal is not None
    proto = descriptor_pb2.FileDescriptorProto()
    proto.ParseFromString(eval(literal.group(1)))  # a bytes literal written by protoc
    return proto


def test_committed_generated_module_is_fresh(tmp_path: Path) -> None:
    fresh = {path.name: path for path in generate(tmp_path)}
    assert set(fresh) == set(GENERATED)
    assert _file_descriptor(fresh["fragment_pb2.py"]) == _file_descriptor(PROTO_DIR / "fragment_pb2.py"), (
        "protocol/fragment_pb2.py is stale: run `python tests/_protoc.py`"
    )


def test_staleness_check_notices_an_edit(tmp_path: Path) -> None:
    edited_proto = (PROTO_DIR / "fragment.proto").read_text().replace("byte_length = 11", "byte_count = 11")
    (tmp_path / "fragment.proto").write_text(edited_proto)
    fresh = generate(tmp_path / "out", proto_dir=tmp_path)[0]
    assert _file_descriptor(fresh) != _file_descriptor(PROTO_DIR / "fragment_pb2.py")


def _header(data: bytes) -> pb.FragmentHeader:
    return pb.FragmentHeader(
        run_id="r",
        fragment=3,
        base_version=7,
        publisher="peer",
        kind=pb.DELTA,
        codec="fp32",
        content_hash=content_hash(data),
        byte_length=len(data),
    )


def test_response_stream_reassembles_in_one_mebibyte_parts() -> None:
    data = os.urandom(3 * CHUNK_BYTES + 12345)
    messages = list(response_stream(_header(data), data))
    assert messages[0].WhichOneof("part") == "header"
    chunks = [m.chunk for m in messages[1:]]
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks) and len(chunks) == 4
    assembler = ChunkAssembler(content_hash(data), len(data))
    assembler.check_header(messages[0].header)
    for message in messages[1:]:
        # what a real transport does: serialize, send, parse
        assembler.add(parse(pb.FetchResponse, message.SerializeToString()).chunk)
    assert bytes(assembler.finish()) == data


def test_transfer_resumes_from_another_holder() -> None:
    data = os.urandom(2 * CHUNK_BYTES + 10)
    assembler = ChunkAssembler(content_hash(data), len(data))
    first = list(response_stream(_header(data), data))
    assembler.add(first[1].chunk)  # the first holder broke off after one chunk
    for message in list(response_stream(_header(data), data, offset=assembler.received))[1:]:
        assembler.add(message.chunk)
    assert bytes(assembler.finish()) == data


def test_assembler_refuses_bad_bytes() -> None:
    data = os.urandom(5000)
    chunks = [m.chunk for m in list(response_stream(_header(data), data, chunk_bytes=1000))[1:]]

    out_of_order = ChunkAssembler(content_hash(data), len(data))
    with pytest.raises(FragmentError) as info:
        out_of_order.add(chunks[1])
    assert info.value.reason == "bad_chunk"

    too_long = ChunkAssembler(content_hash(data), len(data) - 1)
    with pytest.raises(FragmentError) as info:
        for chunk in chunks:
            too_long.add(chunk)
    assert info.value.reason == "oversized"

    short = ChunkAssembler(content_hash(data), len(data))
    short.add(chunks[0])
    with pytest.raises(FragmentError) as info:
        short.finish()
    assert info.value.reason == "truncated"

    tampered = ChunkAssembler(content_hash(data), len(data))
    for chunk in chunks:
        tampered.add(pb.Chunk(offset=chunk.offset, data=chunk.data[::-1]))
    with pytest.raises(FragmentError) as info:
        tampered.finish()
    assert info.value.reason == "bad_hash"
    tampered.restart()
    for chunk in chunks:
        tampered.add(chunk)
    assert bytes(tampered.finish()) == data

    with pytest.raises(FragmentError) as info:
        ChunkAssembler(content_hash(data), len(data)).check_header(_header(data[1:]))
    assert info.value.reason == "bad_header"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([pb.FetchResponse, pb.FetchRequest, pb.FragmentHeader]))
def test_fuzz_message_parsing_only_raises_fragment_error(data: bytes, message_type: type) -> None:
    try:
        message = parse(message_type, data)
    except FragmentError as error:
        assert error.reason == "garbage"
    else:
        assert isinstance(message, message_type)


def test_serialized_stream_is_the_same_messages() -> None:
    data = os.urandom(2 * CHUNK_BYTES + 777)
    for offset in (0, 5, CHUNK_BYTES + 1):
        plain = list(response_stream(_header(data), data, offset=offset))
        serialized = list(serialized_response_stream(_header(data), data, offset=offset))
        assert [parse(pb.FetchResponse, m) for m in serialized] == plain
        for message, raw in zip(plain[1:], serialized[1:], strict=True):
            piece = split_chunk(raw)
            assert piece is not None
            assert piece[0] == message.chunk.offset and bytes(piece[1]) == message.chunk.data
    assert split_chunk(serialized[0]) is None  # a header takes the protobuf path


@settings(max_examples=500, deadline=None)
@given(
    st.binary(max_size=64)
    | st.builds(lambda n, d: bytes([0x12, n]) + d, st.integers(0, 255), st.binary(max_size=40))
)
def test_fuzz_fast_chunk_reading_agrees_with_protobuf(data: bytes) -> None:
    piece = split_chunk(data)
    if piece is None:
        return
    message = pb.FetchResponse.FromString(data)  # whatever the fast path reads, protobuf reads alike
    assert message.WhichOneof("part") == "chunk"
    assert (message.chunk.offset, message.chunk.data) == (piece[0], bytes(piece[1]))


LENGTHS = [1, 5, PIECE_BYTES, PIECE_BYTES + 1, 4 * PIECE_BYTES + 12345, 70 * PIECE_BYTES]


@pytest.mark.parametrize("length", LENGTHS)
def test_a_snapshots_pieces_cover_it_and_their_hashes_add_up_to_the_wholes(length: int) -> None:
    n = piece_count(length)
    assert 1 <= n <= MAX_PIECES and (n == MAX_PIECES or n == -(-length // PIECE_BYTES))
    bounds = piece_bounds(length, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(end > start for start, end in bounds)
    if length <= 5 * PIECE_BYTES:  # the hashes themselves, on a size worth allocating
        data = bytes(range(256)) * (length // 256) + bytes(length % 256)
        whole, hashes = piece_hashes(data)
        assert whole == content_hash(data)
        assert hashes == [hashlib.sha256(data[s:e]).digest() for s, e in bounds]
    with pytest.raises(ValueError):
        piece_bounds(length, 0)


def test_a_record_names_at_most_max_pieces_piece_hashes() -> None:
    fields = dict(publisher="QmPub1isherABCDE9", base_version=1, kind="state", tokens=0, codec="state",
                  numel=0, content_hash=bytes(32), byte_length=10 << 20)  # fmt: skip
    assert Offer(**fields, piece_hashes=[bytes(32)] * MAX_PIECES).piece_hashes == [bytes(32)] * MAX_PIECES
    with pytest.raises(pydantic.ValidationError):
        Offer(**fields, piece_hashes=[bytes(32)] * (MAX_PIECES + 1))
    with pytest.raises(pydantic.ValidationError):
        Offer(**fields, piece_hashes=[bytes(31)])


def test_a_range_knows_the_hash_of_what_it_holds() -> None:
    piece = RangeAssembler(bytes(32), 10, 2, 8)
    piece.add_slice(2, b"abc")
    piece.add_slice(5, b"defgh")
    assert piece.complete and piece.digest() == hashlib.sha256(b"abcdef").digest()
