"""Numbers a hostile peer shapes (issue 27, hole 8): bytes that decode only into a dtype's
overflow, and the swarm's view taken from live progress records only.
"""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from cgad.protocol import FragmentError
from cgad.protocol.codec import decode, encode

pytestmark = pytest.mark.timeout(60)


def _as_dtype(data: bytes, dtype_id: int) -> bytearray:
    """``data`` (an encoded 1-dimensional tensor) with another dtype in its header, checksum
    made good."""
    forged = bytearray(data)
    forged[6] = dtype_id  # the dtype byte
    header = 4 + 1 + 1 + 1 + 1 + 4 + 8 + 8 + 8  # the fixed part and one dimension
    crc = zlib.crc32(bytes(forged[header + 4 :]), zlib.crc32(bytes(forged[:header])))
    forged[header : header + 4] = struct.pack("<I", crc)
    return forged


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_decode_refuses_values_its_declared_dtype_cannot_hold(codec: str) -> None:
    """fp32 bytes of 1e6 whose header claims float16: decode returned Inf, which ``encode`` could
    never have produced for a float16 tensor."""
    data = encode(torch.full((512,), 1e6), codec)
    with pytest.raises(FragmentError, match="non_finite"):
        decode(_as_dtype(data, 1))
    # bfloat16 holds 1e6: the same bytes with that dtype decode
    assert torch.isfinite(decode(_as_dtype(data, 2))).all()
    # and a float16 tensor's own encoding decodes as it did
    small = torch.full((512,), 1000.0, dtype=torch.float16)
    assert torch.equal(decode(encode(small, codec)), small) or codec != "fp32"
