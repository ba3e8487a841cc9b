"""Tensor codecs for pseudo-gradients and parameters: self-describing, checksummed bytes.

Layout (little-endian)::

    magic "CGFR" | version u8 | codec u8 | dtype u8 | ndim u8 | block u32 | numel u64 | payload u64
    | shape: ndim x u64 | crc32 u32 (over everything before it and the payload) | payload

Codecs:

- ``fp32``: the values as they are (exact).
- ``fp16``: IEEE half precision; values beyond ±65504 are refused at encode time.
- ``int8``: blocks of 256 values, one fp32 scale per block (absmax / 127), values rounded to nearest.
- ``4bit``: blocks of 64 values, one fp32 scale per block (absmax / 6), each value rounded to the
  nearest FP4 E2M1 number {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign bit (the OCP MX element format
  that Streaming DiLoCo exchanges), two values per byte, low nibble first. 4.5 bits per value.
  Blocks whose absmax is below ``_TINY`` encode as zeros.
- ``2bit``: blocks of 64 values, one fp32 scale per block (the block's RMS), each value a sign bit
  and a magnitude bit choosing 0.4528 or 1.5104 times the scale (the Lloyd-Max levels of a unit
  Gaussian, split at 0.9816), four values per byte, the first in the low bits. 2.5 bits per
  value: for links where 4bit's bytes do not fit a round (error feedback carries what it drops).
- ``sparse``: blocks of 256 values, of which only the k largest in magnitude are sent (top-k;
  k from 1 to 64, 16 by default): one fp32 scale per block (the kept absmax / 127), every block's
  kept positions as k strictly increasing uint8 indices, then their values as int8; every other
  value decodes as 0. k is not in the header: the payload's length says it. At k = 16, 1.125 bits
  per value, 4x fewer bytes than 4bit: error feedback sends what a round leaves out once it has
  grown large enough to be among a block's largest (SparseLoCo's top-k with error feedback).

All work is whole-tensor torch/numpy kernels (no per-element Python): int8, 4bit and 2bit map
values to codes through lookup tables and encode and decode at memory speed; sparse's encoder
selects each block's top k (numpy's introselect), slower than the others. ``decode`` checks
every field against the bytes it was given before it allocates anything, so a header that claims a
huge shape is refused instead of honoured, and every failure is a ``FragmentError`` with a reason.
"""

from __future__ import annotations

import enum
import math
import struct
import threading
import zlib
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from cgad.protocol.config import SPARSE_KEPT, SPARSE_MAX_KEPT
from cgad.protocol.errors import FragmentError

__all__ = [
    "MAX_NUMEL", "ROUNDING", "SCRATCH_BYTES", "SPARSE_KEPT", "SPARSE_MAX_KEPT", "Codec", "all_finite",
    "decode", "encode", "encoded_size", "join_slices", "kept_in", "sparse_kept",
]  # fmt: skip


class Codec(enum.StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    FP4 = "4bit"
    TWO_BIT = "2bit"
    SPARSE = "sparse"


MAGIC = b"CGFR"
FORMAT_VERSION = 1
MAX_NDIM = 8
MAX_NUMEL = 1 << 34  # 64 GiB of fp32: larger than any fragment, small enough to bound arithmetic
_FIXED = struct.Struct("<4sBBBBIQQ")
_CRC = struct.Struct("<I")
_CODEC_IDS = {Codec.FP32: 0, Codec.FP16: 1, Codec.INT8: 2, Codec.FP4: 3, Codec.TWO_BIT: 4, Codec.SPARSE: 5}
_CODECS_BY_ID = {v: k for k, v in _CODEC_IDS.items()}
_DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPES_BY_ID = {v: k for k, v in _DTYPE_IDS.items()}
_BLOCK = {Codec.FP32: 0, Codec.FP16: 0, Codec.INT8: 256, Codec.FP4: 64, Codec.TWO_BIT: 64, Codec.SPARSE: 256}
LOSSY = (Codec.INT8, Codec.FP4, Codec.TWO_BIT, Codec.SPARSE)
# lossy by rounding every value: with a fixed codec the transport feeds the rounding back
ROUNDING = (Codec.INT8, Codec.FP4, Codec.TWO_BIT)
# the largest code of each lossy codec, in block scales: a scale beyond fp32's max / this decodes to Inf
_TOP_LEVEL = {Codec.INT8: 127.0, Codec.FP4: 6.0, Codec.TWO_BIT: 1.5104, Codec.SPARSE: 127.0}
_FP16_MAX = 65504.0
# Below this absmax a block is all zeros: its reciprocal scale would overflow fp32.
_TINY = 1e-30

# FP4 E2M1. Encoding first maps each value to its quarter-step bucket g = trunc(4·x/scale) in
# [-24, 24] (x/scale lies in [-6, 6]); every rounding boundary between E2M1 neighbours is a
# multiple of 0.25, so the bucket alone decides the nearest code, and a table turns a pair of
# buckets (read as one uint16) straight into a packed byte.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDARIES_IN_QUARTERS = (1, 3, 5, 7, 10, 14, 20)


def _fp4_tables() -> tuple[np.ndarray, np.ndarray]:
    bucket_code = np.zeros(256, dtype=np.uint8)
    for byte in range(256):
        bucket = byte - 256 if byte >= 128 else byte
        magnitude = bisect_right(_E2M1_BOUNDARIES_IN_QUARTERS, abs(bucket))
        bucket_code[byte] = magnitude | (8 if bucket < 0 else 0)
    pairs = np.arange(65536, dtype=np.uint32)
    pair_to_byte = (bucket_code[pairs & 0xFF] | (bucket_code[pairs >> 8] << 4)).astype(np.uint8)
    code_value = np.array([(-1.0 if c & 8 else 1.0) * _E2M1[c & 7] for c in range(16)], dtype=np.float32)
    byte_to_pair = np.stack([code_value[np.arange(256) & 15], code_value[np.arange(256) >> 4]], axis=1)
    # One packed byte decodes to two float32 values, gathered as one 8-byte word.
    return pair_to_byte, np.ascontiguousarray(byte_to_pair, dtype=np.float32).view(np.uint64).reshape(256)


_FP4_PAIR_TO_BYTE, _FP4_BYTE_TO_PAIR = _fp4_tables()

_TWO_BIT_LEVELS = (0.4528, 1.5104)  # Lloyd-Max for N(0, 1) with four levels
_TWO_BIT_SPLIT = 0.9816


def _two_bit_table() -> np.ndarray:
    """Each packed byte's four values (code: magnitude bit | sign bit << 1), as one 16-byte word."""
    code_value = [(-1.0 if code & 2 else 1.0) * _TWO_BIT_LEVELS[code & 1] for code in range(4)]
    quads = [[code_value[(byte >> (2 * i)) & 3] for i in range(4)] for byte in range(256)]
    table = np.array(quads, dtype=np.float32)
    return table.view(np.dtype((np.void, 16))).reshape(256)


_TWO_BIT_BYTE_TO_QUAD = _two_bit_table()


def _payload_size(codec: Codec, numel: int, kept: int = SPARSE_KEPT) -> int:
    block = _BLOCK[codec]
    if codec is Codec.FP32:
        return numel * 4
    if codec is Codec.FP16:
        return numel * 2
    blocks = -(-numel // block)
    code_bytes = {Codec.INT8: block, Codec.FP4: block // 2, Codec.TWO_BIT: block // 4, Codec.SPARSE: 2 * kept}
    return blocks * (4 + code_bytes[codec])


def encoded_size(numel: int, codec: Codec | str, ndim: int = 1, kept: int = SPARSE_KEPT) -> int:
    """The exact length of ``encode`` of a float32 tensor of ``numel`` values and ``ndim`` dims
    (for ``sparse``, keeping ``kept`` values per block)."""
    codec = Codec(codec)
    return _FIXED.size + 8 * ndim + _CRC.size + _payload_size(codec, numel, kept)


def sparse_kept(numel: int, payload_len: int) -> int | None:
    """The k of a ``sparse`` payload of ``payload_len`` bytes holding ``numel`` values; None when
    no k from 1 to ``SPARSE_MAX_KEPT`` gives that length."""
    blocks = -(-numel // _BLOCK[Codec.SPARSE])
    if blocks == 0:
        return SPARSE_KEPT if payload_len == 0 else None
    per_block, rest = divmod(payload_len, blocks)
    kept, odd = divmod(per_block - 4, 2)
    return kept if rest == 0 and odd == 0 and 1 <= kept <= SPARSE_MAX_KEPT else None


def kept_in(data: bytes | bytearray | memoryview) -> int | None:
    """How many values per block a ``sparse`` encoding keeps; None for every other codec. For
    bytes that ``decode`` accepted (the header is not checked again here)."""
    codec, _, _, numel, offset = _parse_header(memoryview(data).cast("B"))
    return sparse_kept(numel, len(data) - offset) if codec is Codec.SPARSE else None


def _finite_range(flat: Tensor) -> tuple[float, float]:
    # One reduction pass; NaN propagates through min/max and an inf shows up as an extreme.
    low, high = torch.aminmax(flat)
    return float(low), float(high)


def all_finite(tensor: Tensor) -> bool:
    """Whether every value of ``tensor`` is finite: one reduction pass with no copy
    (``torch.isfinite(t).all()`` writes a mask first, 40 times slower on a 26M-value tensor).

    Args:
        tensor: any tensor (integer and empty ones are finite).
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return all(math.isfinite(v) for v in _finite_range(tensor))


# Scratch space per thread, reused across calls: a fresh large allocation costs a page fault per
# 4 KiB on first touch, which here is slower than the arithmetic itself. The lossy codecs work
# through a tensor in slices of ``_SLICE_VALUES`` (whole blocks of either codec, a float32 and an
# int8 buffer each) so that a thread's scratch never exceeds ``SCRATCH_BYTES``, however large the
# fragment; the slices change nothing in the output, as every step is per block.
SCRATCH_BYTES = 64 << 20
_SLICE_VALUES = SCRATCH_BYTES // 5 // 256 * 256
_workspace = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype) -> Tensor:
    """A per-thread buffer of at least ``numel`` values, kept for the next call."""
    buffer: Tensor | None = getattr(_workspace, name, None)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype)
        setattr(_workspace, name, buffer)
    return buffer[:numel]


def _blocks(flat: Tensor, block: int) -> Tensor:
    """``flat`` as rows of ``block`` values, zero-padding the last row only when needed."""
    if flat.numel() % block == 0:
        return flat.view(-1, block)
    padded = torch.zeros(-(-flat.numel() // block) * block, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return padded.view(-1, block)


def _quantize(flat: Tensor, codec: Codec, kept: int) -> tuple[Tensor, np.ndarray]:
    """Per-block scales and the codes: for int8, ``round`` of value·127/absmax (scale absmax /
    127); for 4bit, the quarter-step buckets ``trunc`` of value·24/absmax, two to a byte through
    the E2M1 table (scale absmax / 6); for 2bit, sign and magnitude bits (scale the block's RMS)."""
    block = _BLOCK[codec]
    padded_numel = -(-flat.numel() // block) * block
    scales = torch.empty(padded_numel // block, dtype=torch.float32)
    if codec is Codec.INT8:
        codes = np.empty(padded_numel, dtype=np.int8)
    elif codec is Codec.SPARSE:  # every block's indices, then every block's values
        codes = np.empty(padded_numel // block * 2 * kept, dtype=np.uint8)
    else:
        codes = np.empty(padded_numel // (2 if codec is Codec.FP4 else 4), dtype=np.uint8)
    for start in range(0, padded_numel, _SLICE_VALUES):
        stop = min(start + _SLICE_VALUES, padded_numel)
        blocks = _blocks(flat[start:stop], block)
        work = _scratch("work", blocks.numel(), torch.float32).view_as(blocks)
        absmax = torch.abs(blocks, out=work).amax(dim=1)
        if absmax.numel() and not math.isfinite(float(absmax.max())):
            raise FragmentError("non_finite", "tensor holds NaN or Inf")
        if codec is Codec.TWO_BIT:
            out = codes[start // 4 : stop // 4]
            scales[start // block : stop // block] = _two_bit_codes(blocks, absmax, work, out)
            continue
        if codec is Codec.SPARSE:
            first, last = start // block * kept, stop // block * kept
            values = codes[codes.size // 2 :].view(np.int8)
            scales[start // block : stop // block] = _sparse_codes(
                blocks, work, absmax, codes[first:last], values[first:last]
            )
            continue
        levels = 127.0 if codec is Codec.INT8 else 24.0
        multiplier = torch.where(absmax > _TINY, levels / absmax, 0.0)
        torch.mul(blocks, multiplier[:, None], out=work)
        scales[start // block : stop // block] = torch.where(
            absmax > _TINY, absmax / (127.0 if codec is Codec.INT8 else 6.0), 0.0
        )
        # Float to int8 truncates toward zero; for 4bit that truncation is the quarter-step bucket.
        if codec is Codec.INT8:
            torch.from_numpy(codes[start:stop]).copy_(work.round_().view(-1))
        else:
            buckets = _scratch("codes", blocks.numel(), torch.int8).copy_(work.view(-1))
            # every uint16 indexes the 65536-entry table: "clip" never clips, and skips a buffer
            pairs = buckets.numpy().view(np.uint16)
            np.take(_FP4_PAIR_TO_BYTE, pairs, out=codes[start // 2 : stop // 2], mode="clip")
    return scales, codes


def _two_bit_codes(blocks: Tensor, absmax: Tensor, work: Tensor, out: np.ndarray) -> Tensor:
    """Pack ``blocks`` (rows of 64) into ``out`` as 2bit codes; return the rows' scales (RMS).
    Values are divided by the absmax first, so the norm never overflows; ``work`` then holds the
    magnitudes, so that no other float buffer of the slice's size is allocated."""
    torch.mul(blocks, torch.where(absmax > _TINY, 1.0 / absmax, 0.0)[:, None], out=work)
    unit_rms = torch.linalg.vector_norm(work, dim=1).div_(math.sqrt(work.shape[1]))
    negative = work < 0
    codes = (work.abs_() > (_TWO_BIT_SPLIT * unit_rms)[:, None]).to(torch.uint8)
    codes.bitwise_or_(negative.to(torch.uint8) << 1)
    quads = codes.view(-1, 4)
    packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    out[:] = packed.numpy()
    return torch.where(absmax > _TINY, absmax * unit_rms, 0.0)


def _sparse_codes(
    blocks: Tensor, magnitudes: Tensor, absmax: Tensor, indices: np.ndarray, values: np.ndarray
) -> Tensor:
    """Keep each row's k largest magnitudes (k = ``indices``' share of each row): their positions,
    ascending, into ``indices``, their values as int8 into ``values``; return the rows' scales
    (the rows' ``absmax``, always kept, / 127). numpy's introselect finds them in half the time
    of ``torch.topk`` on rows this short."""
    rows, width = magnitudes.shape
    kept = indices.size // rows
    chosen = np.argpartition(magnitudes.numpy(), width - kept, axis=1)[:, width - kept :]
    chosen.sort(axis=1)  # one canonical order, so the decoder can refuse repeats
    positions = torch.from_numpy(chosen)
    multiplier = torch.where(absmax > _TINY, 127.0 / absmax, 0.0)
    picked = blocks.gather(1, positions).mul_(multiplier[:, None]).round_()
    indices[:] = chosen.astype(np.uint8).reshape(-1)
    values[:] = picked.to(torch.int8).view(-1).numpy()
    return torch.where(absmax > _TINY, absmax / 127.0, 0.0)


def encode(tensor: Tensor, codec: Codec | str, kept: int = SPARSE_KEPT) -> bytes:
    """Encode a float tensor (fp32, fp16 or bf16, any shape) as self-describing, checksummed bytes
    (``kept``: the values per block of 256 that ``sparse`` sends, 1 to ``SPARSE_MAX_KEPT``).

    Raises ``FragmentError`` ("non_finite") for NaN/Inf (or beyond fp16's range for ``fp16``),
    ("bad_dtype") for non-float tensors, ("bad_shape") for more than 8 dimensions.
    """
    codec = Codec(codec)
    if codec is Codec.SPARSE and not 1 <= kept <= SPARSE_MAX_KEPT:
        raise ValueError(f"sparse keeps 1 to {SPARSE_MAX_KEPT} values per block, not {kept}")
    if tensor.dtype not in _DTYPE_IDS:
        raise FragmentError("bad_dtype", f"cannot encode {tensor.dtype}")
    if tensor.dim() > MAX_NDIM:
        raise FragmentError("bad_shape", f"{tensor.dim()} dimensions, at most {MAX_NDIM}")
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.float32:
        flat = flat.to(device="cpu", dtype=torch.float32)
    flat = flat.contiguous()
    numel = flat.numel()

    parts: list[np.ndarray]
    if codec is Codec.FP32 or codec is Codec.FP16:
        if numel:
            low, high = _finite_range(flat)
            limit = _FP16_MAX if codec is Codec.FP16 else torch.finfo(torch.float32).max
            if not (-limit <= low and high <= limit):
                raise FragmentError("non_finite", f"values in [{low}, {high}] do not fit {codec}")
        parts = [(flat if codec is Codec.FP32 else flat.to(torch.float16)).numpy()]
    else:
        scales, codes = _quantize(flat, codec, kept)
        parts = [scales.numpy(), codes]

    return _frame(codec, tensor.dtype, tuple(tensor.shape), parts)


def _frame(codec: Codec, dtype: torch.dtype, shape: tuple[int, ...], parts: Sequence[Any]) -> bytes:
    """Header, checksum and payload ``parts`` (buffers, in order) as one fragment's bytes."""
    payload_len = sum(memoryview(part).nbytes for part in parts)
    ids = (_CODEC_IDS[codec], _DTYPE_IDS[dtype], len(shape), _BLOCK[codec])
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, *ids, math.prod(shape), payload_len)
    header = fixed + struct.pack(f"<{len(shape)}Q", *shape)
    crc = zlib.crc32(header)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b"".join([header, _CRC.pack(crc), *parts])


def join_slices(pieces: Sequence[bytes], shape: tuple[int, ...]) -> bytes:
    """One tensor's encoding from the encodings of consecutive slices of its values, each but the
    last a whole number of blocks: byte for byte what ``encode`` of the whole gives (blocks are
    encoded independently), without the whole tensor in float32 at once.

    Args:
        pieces: ``encode``'s bytes of each slice of the flattened tensor, in order, one codec.
        shape: the whole tensor's shape.
    """
    if not pieces:
        raise ValueError("no slices to join")
    parsed = [_parse_header(piece) for piece in pieces]
    codec, dtype = parsed[0][0], parsed[0][1]
    block = _BLOCK[codec]
    if any((c, d) != (codec, dtype) for c, d, *_ in parsed):
        raise ValueError("slices of one tensor are encoded in one codec and dtype")
    if codec is Codec.SPARSE and len({kept_in(piece) for piece in pieces}) > 1:
        raise ValueError("slices of one sparse tensor keep as many values per block")
    if block and any(numel % block for *_, numel, _ in parsed[:-1]):
        raise ValueError(f"every slice but the last holds whole blocks of {block}")
    if sum(numel for *_, numel, _ in parsed) != math.prod(shape):
        raise ValueError(f"slices of {sum(numel for *_, numel, _ in parsed)} values for shape {shape}")
    sections: list[list[memoryview]] = [[], [], []]  # scales, then codes (sparse: indices, values)
    for piece, (*_, numel, offset) in zip(pieces, parsed, strict=True):
        payload = memoryview(piece)[offset:]
        if not block:
            sections[1].append(payload)
            continue
        nblocks = -(-numel // block)
        sections[0].append(payload[: 4 * nblocks])
        codes = payload[4 * nblocks :]
        half = len(codes) // 2 if codec is Codec.SPARSE else len(codes)
        sections[1].append(codes[:half])
        sections[2].append(codes[half:])
    return _frame(codec, dtype, tuple(shape), [part for section in sections for part in section if len(part)])


def _parse_header(data: bytes | memoryview) -> tuple[Codec, torch.dtype, tuple[int, ...], int, int]:
    """Validate the header against the length of ``data``; return codec, dtype, shape, numel and
    the payload's offset."""
    if len(data) < _FIXED.size:
        raise FragmentError("truncated", f"{len(data)} bytes is shorter than the header")
    magic, version, codec_id, dtype_id, ndim, block, numel, payload_len = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise FragmentError("garbage", "not a cgad fragment (bad magic)")
    if version != FORMAT_VERSION:
        raise FragmentError("unsupported_version", f"format version {version}")
    if codec_id not in _CODECS_BY_ID:
        raise FragmentError("unknown_codec", f"codec id {codec_id}")
    if dtype_id not in _DTYPES_BY_ID:
        raise FragmentError("bad_dtype", f"dtype id {dtype_id}")
    codec, dtype = _CODECS_BY_ID[codec_id], _DTYPES_BY_ID[dtype_id]
    if ndim > MAX_NDIM:
        raise FragmentError("bad_shape", f"{ndim} dimensions")
    if block != _BLOCK[codec]:
        raise FragmentError("bad_header", f"block {block} for {codec}")
    if numel > MAX_NUMEL:
        raise FragmentError("oversized", f"numel {numel}")
    payload_offset = _FIXED.size + 8 * ndim + _CRC.size
    if len(data) < payload_offset:
        raise FragmentError("truncated", "header cut short")
    shape = struct.unpack_from(f"<{ndim}Q", data, _FIXED.size)
    if math.prod(shape) != numel:
        raise FragmentError("bad_shape", f"shape {shape} does not hold {numel} values")
    if codec is Codec.SPARSE:
        if sparse_kept(numel, payload_len) is None:
            raise FragmentError("bad_header", f"payload of {payload_len} bytes for {numel} values in {codec}")
    elif payload_len != _payload_size(codec, numel):
        raise FragmentError("bad_header", f"payload of {payload_len} bytes for {numel} values in {codec}")
    if len(data) < payload_offset + payload_len:
        raise FragmentError("truncated", f"{len(data)} bytes, header promises {payload_offset + payload_len}")
    if len(data) > payload_offset + payload_len:
        raise FragmentError("bad_length", f"{len(data) - payload_offset - payload_len} trailing bytes")
    (crc,) = _CRC.unpack_from(data, payload_offset - _CRC.size)
    view = memoryview(data)
    if zlib.crc32(view[payload_offset:], zlib.crc32(view[: payload_offset - _CRC.size])) != crc:
        raise FragmentError("bad_checksum", "crc32 mismatch")
    return codec, dtype, shape, numel, payload_offset


def _decode_scales(data: bytes | memoryview, offset: int, count: int, codec: Codec) -> Tensor:
    scales = torch.from_numpy(np.frombuffer(data, dtype=np.float32, count=count, offset=offset).copy())
    ceiling = torch.finfo(torch.float32).max / _TOP_LEVEL[codec]
    # NaN fails both comparisons
    if count and not (float(scales.min()) >= 0 and float(scales.max()) <= ceiling):
        raise FragmentError("non_finite", "a block scale is negative, NaN, Inf, or so large it overflows")
    return scales


def decode(data: bytes | bytearray | memoryview) -> Tensor:
    """The tensor ``encode`` produced, in its original shape and dtype.

    Anything else (values its header's dtype cannot hold too) raises ``FragmentError`` with a
    reason; nothing is allocated before the header has been checked against the length of ``data``.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise FragmentError("garbage", f"expected bytes, got {type(data).__name__}")
    data = memoryview(data).cast("B") if isinstance(data, memoryview) else data
    codec, dtype, shape, numel, offset = _parse_header(data)

    if codec is Codec.FP32 or codec is Codec.FP16:
        # copy the payload out of the (read-only) bytes; torch widens fp16 faster than numpy
        wire = torch.empty(numel, dtype=torch.float32 if codec is Codec.FP32 else torch.float16)
        wire.view(torch.uint8).numpy()[:] = np.frombuffer(data, np.uint8, wire.nbytes, offset)
        flat = wire.float()
        if numel and not all(math.isfinite(v) for v in _finite_range(flat)):
            raise FragmentError("non_finite", "payload holds NaN or Inf")
    else:
        block = _BLOCK[codec]
        nblocks = -(-numel // block)
        scales = _decode_scales(data, offset, nblocks, codec)
        codes_offset = offset + 4 * nblocks
        if codec is Codec.SPARSE:
            kept = sparse_kept(numel, len(data) - offset)
            assert kept is not None  # the header's check
            blocks = _sparse_blocks(data, codes_offset, nblocks, kept)
        else:
            blocks = torch.empty(nblocks, block, dtype=torch.float32)
        if codec is Codec.INT8:
            codes = np.frombuffer(data, dtype=np.int8, count=nblocks * block, offset=codes_offset)
            blocks.numpy().reshape(-1)[:] = codes
        elif codec is Codec.FP4:
            packed = np.frombuffer(data, dtype=np.uint8, count=nblocks * block // 2, offset=codes_offset)
            blocks.numpy().view(np.uint64).reshape(-1)[:] = _FP4_BYTE_TO_PAIR[packed]
        elif codec is Codec.TWO_BIT:
            packed = np.frombuffer(data, dtype=np.uint8, count=nblocks * block // 4, offset=codes_offset)
            blocks.numpy().view(np.dtype((np.void, 16))).reshape(-1)[:] = _TWO_BIT_BYTE_TO_QUAD[packed]
        flat = blocks.mul_(scales[:, None]).view(-1)[:numel]
    if dtype is not torch.float32 and numel:
        # encode's bytes of a float16 tensor fit float16; others (1e6 under float16) decode to Inf
        low, high = _finite_range(flat)
        limit = torch.finfo(dtype).max
        if not -limit <= low <= high <= limit:
            raise FragmentError("non_finite", f"values in [{low}, {high}] overflow {dtype}")
    return flat.to(dtype).view(shape)


def _sparse_blocks(data: bytes | memoryview, offset: int, nblocks: int, kept: int) -> Tensor:
    """The blocks of a ``sparse`` payload before scaling: zeros, with each block's kept codes at
    its indices. Indices that repeat or are out of order are refused (two values for one slot)."""
    count = nblocks * kept
    indices = np.frombuffer(data, dtype=np.uint8, count=count, offset=offset).reshape(nblocks, kept)
    values = np.frombuffer(data, dtype=np.int8, count=count, offset=offset + count)
    if nblocks and not (np.diff(indices.astype(np.int16), axis=1) > 0).all():
        raise FragmentError("bad_indices", "a block's kept indices repeat or are not ascending")
    blocks = torch.zeros(nblocks, _BLOCK[Codec.SPARSE], dtype=torch.float32)
    positions = torch.from_numpy(indices.astype(np.int64))
    blocks.scatter_(1, positions, torch.from_numpy(values.astype(np.float32)).view(nblocks, kept))
    return blocks
