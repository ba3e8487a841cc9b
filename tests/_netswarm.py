"""The swarm the network-transport tests share: real hivemind peers on 127.0.0.1.

p0 fetches over either path, p1 over gRPC only, p2 over libp2p only, and p3 starts with no
fragments to receive and a fan-in of 2, so tests can decide when it starts looking. Each test
uses its own fragment indices, so the tests do not see each other's fragments.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from cgad.protocol.config import NetworkOptions
from cgad.protocol.network import NetworkTransport
from cgad.protocol.transport import Fragment, FragmentKey, Kind

RUN = "net-test"
NUM_FRAGMENTS = 16
BIG = 1 << 21  # 8 MiB of fp32: several chunks on every path
SMALL = 4096
KILLED = 5 << 20  # 20 MiB of fp32, served at 10 MB/s: long enough to kill its publisher mid-way
HUGE = 1 << 25  # 128 MiB of fp32: a fragment of 100 MB+ must flow on both paths
NUMEL = {0: BIG, 1: KILLED, 2: 1 << 20, 3: 1 << 20, 14: HUGE} | {
    f: SMALL for f in range(4, NUM_FRAGMENTS) if f != 14
}
MAX_NORM = 1e5


def make_transport(fragment_numel: dict[int, int] = NUMEL, **overrides: object) -> NetworkTransport:
    settings: dict = dict(
        run_id=RUN,
        poll_interval=0.2,
        connect_timeout=1.0,
        chunk_timeout=3.0,
        max_norm=MAX_NORM,
        private_endpoints=True,  # one machine: every gRPC endpoint is on 127.0.0.1
    )
    settings.update(overrides)
    return NetworkTransport(
        NetworkOptions(**settings), num_fragments=NUM_FRAGMENTS, fragment_numel=fragment_numel
    )


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def settle(transport: NetworkTransport) -> None:
    """Until two more DHT polls have gone through and no fetch is in flight: whatever the records
    seen so far would bring has arrived (or been refused) by then."""
    polls = transport.polls
    wait_for(lambda: transport.polls >= polls + 2 and not transport.transfers(), what="two quiet polls")


def collect(transport: NetworkTransport, fragment: int, count: int, timeout: float = 20.0) -> list[Fragment]:
    got: list[Fragment] = []

    def enough() -> bool:
        got.extend(transport.receive(fragment))
        return len(got) >= count

    wait_for(enough, timeout, f"{count} fragment(s) {fragment} at {transport.peer_id[-6:]}")
    return got


def key(transport: NetworkTransport, fragment: int, base: int, kind: Kind = Kind.DELTA) -> FragmentKey:
    return FragmentKey(RUN, fragment, base, transport.peer_id, kind)


@contextlib.contextmanager
def running_swarm() -> Iterator[list[NetworkTransport]]:
    peers = [make_transport()]
    initial = peers[0].maddrs()
    try:
        peers.append(make_transport(peers=initial, paths=["grpc"]))
        peers.append(make_transport(peers=initial, paths=["libp2p"]))
        peers.append(make_transport({}, peers=initial, fan_in=2))
        yield peers
    finally:
        for peer in peers:
            peer.close()
