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
from cgad.protocol.config import NetworkOptions
from cgad.protocol.polling import (
    MAX_FAULTY_RECORDS,
    EndpointClaims,
    FaultLedger,
    live_progress,
    public_endpoint,
)
from cgad.protocol.records import Holdings, Progress
from cgad.protocol.selection import swarm_version

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
    decoded = decode(encode(small, codec))
    assert decoded.dtype == torch.float16 and torch.equal(decoded, small)


def _pid(tag: str, i: int = 0) -> str:
    """A peer id's shape (base58 digits only) for ``tag`` and ``i``."""
    digits = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    text = ""
    while True:
        text, i = digits[i % 58] + text, i // 58
        if not i:
            return f"Qm{tag}{text}"


def _report(peer: str, time: float, versions: list[int]) -> Progress:
    return Progress(peer_id=peer, versions=versions, inner_step=0, tokens_per_second=0.0, time=time)


def test_the_swarm_view_takes_live_records_only() -> None:
    """Records older than the liveness TTL (peers gone, not yet expired from the DHT) count
    neither as live nor in the median version: three stale records at version 90 used to make
    the median of 5 peers 90."""
    now = 1000.0
    records = [_report(_pid("Z", i), now - 100, [90]) for i in range(3)]
    records += [_report("QmA", now - 1, [10]), _report("QmB", now - 2, [11])]
    live = live_progress(records, now, liveness_ttl=30.0)
    assert sorted(live) == ["QmA", "QmB"]
    assert swarm_version([p.versions for p in live.values()], 0) == 10


def test_the_ledger_of_faulty_records_is_bounded() -> None:
    ledger = FaultLedger(size=100, keep=60.0)
    assert all(ledger.first_time(("progress", i.to_bytes(16, "big"), 5.0), 0.0) for i in range(10_000))
    assert len(ledger) <= 100
    assert not ledger.first_time(("progress", (9_999).to_bytes(16, "big"), 5.0), 1.0)  # seen: once
    ledger.first_time(("state", b"x", 1.0), 100.0)  # a minute later the old ones are gone
    assert len(ledger) == 1
    assert MAX_FAULTY_RECORDS <= 1 << 16


def _holder(peer: str, endpoint: str) -> Holdings:
    return Holdings(peer_id=peer, grpc=endpoint, offers=[])


def test_records_cannot_aim_fetchers_at_any_number_of_endpoints() -> None:
    claims = EndpointClaims(per_host=4, size=64, private=True)  # documentation addresses: not public
    # the first peer to name an endpoint keeps it; another naming it is reached over libp2p
    assert claims.check(_holder("QmA", "203.0.113.9:4000")).grpc == "203.0.113.9:4000"
    assert claims.check(_holder("QmB", "203.0.113.9:4000")).grpc is None
    assert claims.check(_holder("QmA", "203.0.113.9:4000")).grpc == "203.0.113.9:4000"
    # sybils naming every port of one host: only per_host of them keep one
    kept = [claims.check(_holder(_pid("S", p), f"198.51.100.7:{p}")).grpc for p in range(1, 1000)]
    assert sum(e is not None for e in kept) == 4
    # bounded memory: endpoints beyond ``size`` are forgotten, oldest first
    for i in range(1000):
        claims.check(_holder(_pid("H", i), f"h{i}.example:5000"))
    assert len(claims._owner) <= 64


@pytest.mark.parametrize(
    "endpoint",
    ["127.0.0.1:22", "10.0.0.1:80", "192.168.1.1:443", "172.16.5.5:8080", "169.254.169.254:80",
     "[::1]:22", "[fe80::1]:80", "[fd00::1]:80", "0.0.0.0:22", "224.0.0.1:80", "203.0.113.9:4000",
     "localhost:22", "metadata.google.internal:80", "example.com:443", "[::127.0.0.1]:22",
     "[::ffff:0:7f00:1]:22", "[2002:7f00:1::1]:22", "[64:ff9b::a00:1]:80", "[::ffff:10.0.0.1]:80"],
)  # fmt: skip
def test_a_record_cannot_aim_fetchers_at_a_private_address_or_a_name(endpoint: str) -> None:
    """A record naming a loopback, private, link-local or reserved address, or a host name (which
    may resolve to one), keeps its offers, and is reached over libp2p; unless the swarm runs on
    one machine, a LAN or a testbed and says so (``--private-endpoints``)."""
    assert not public_endpoint(endpoint)
    assert EndpointClaims(private=False).check(_holder("QmA", endpoint)).grpc is None
    assert EndpointClaims(private=True).check(_holder("QmA", endpoint)).grpc == endpoint


def test_a_public_address_is_dialed() -> None:
    for endpoint in ("8.8.8.8:31338", "[2606:4700::1111]:443"):
        assert public_endpoint(endpoint)
        assert EndpointClaims(private=False).check(_holder("QmA", endpoint)).grpc == endpoint
    assert NetworkOptions(run_id="r").private_endpoints is False  # the default: public only
