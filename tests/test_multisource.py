"""A state snapshot downloaded from several holders at once, between real hivemind peers on
loopback: faster than one holder's uplink, counted in bytes_in, and whole even when one holder
serves wrong bytes (``protocol/multisource.py``)."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
from _netswarm import NUM_FRAGMENTS, make_transport, wait_for  # tests/ is on sys.path under pytest

from cgad.protocol.multisource import PIECE_BYTES

pytestmark = pytest.mark.integration  # real hivemind peers (p2pd processes) on loopback

UPLINK = 2e6  # bytes per second each holder serves at


@pytest.mark.timeout(120)
def test_a_snapshot_comes_from_two_holders_at_once_and_a_lying_one_cannot_spoil_it() -> None:
    publisher = make_transport(upload_limit=UPLINK)
    peers = publisher.maddrs()
    reserver = make_transport(peers=peers, upload_limit=UPLINK)
    liar = make_transport(peers=peers, upload_limit=UPLINK)
    joiner = make_transport(peers=peers)
    try:
        blob = os.urandom(4 * PIECE_BYTES + 12345)  # ~16.8 MB: 8.4 s from one holder
        publisher.publish_state(blob, [3] * NUM_FRAGMENTS)
        wait_for(lambda: reserver.state_offers(), what="the snapshot's record")
        [candidate] = reserver.state_offers()
        assert bytes(reserver.fetch_state(candidate, timeout=60)) == blob  # from the publisher alone
        reserver.reserve_state(candidate, blob)
        wait_for(lambda: any(len(c.holders) == 2 for c in joiner.state_offers()), what="two holders")
        [two] = joiner.state_offers()
        started = time.monotonic()
        assert bytes(joiner.fetch_state(two, timeout=60)) == blob
        seconds = time.monotonic() - started
        # two uplinks at once: well above one holder's rate (8.4 s alone)
        assert len(blob) / seconds > 1.4 * UPLINK, f"{len(blob) / seconds / 1e6:.2f} MB/s"
        assert joiner.stats.bytes_received >= len(blob)  # the status's bytes_in counts the snapshot

        # a holder that serves other bytes under the same hash: the ranges fail the hash, the
        # download is done again one holder at a time, and the result is the publisher's bytes
        wrong = bytearray(blob)
        for start in range(0, len(blob), PIECE_BYTES):  # whichever range it serves is wrong
            wrong[start + 7] ^= 0xFF
        liar.reserve_state(candidate, bytes(wrong))
        late = make_transport(peers=peers)
        try:
            wait_for(lambda: any(len(c.holders) == 3 for c in late.state_offers()), what="three holders")
            [three] = late.state_offers()
            # the liar and the publisher only: both draw a range at once, so the liar serves one
            holders = {holding.peer_id: holding for holding in three.holders}
            two_of_them = dataclasses.replace(
                three, holders=[holders[liar.peer_id], holders[publisher.peer_id]]
            )
            assert bytes(late.fetch_state(two_of_them, timeout=90)) == blob
            # what the liar sent was caught, in the piece it sent: the liar is named, and only
            # that piece was fetched again (not the whole, one holder at a time)
            assert liar.stats.bytes_sent > 0 and late.stats.rejected["bad_hash"] >= 1
            assert late.stats.rejected_by_peer[liar.peer_id] >= 1
            assert publisher.peer_id not in late.stats.rejected_by_peer
            piece = -(-len(blob) // len(candidate.offer.piece_hashes))
            assert late.stats.bytes_received <= len(blob) + 2 * piece, late.stats.bytes_received
        finally:
            late.close()
    finally:
        for transport in (joiner, liar, reserver, publisher):
            transport.close()


@pytest.mark.timeout(120)
def test_a_holder_far_slower_than_the_others_leaves_its_range_to_them() -> None:
    """The endgame: once every range is taken, a holder twice as fast takes over a slow one's
    range from where it stopped, instead of the download waiting for the slow holder."""
    publisher = make_transport()  # unlimited: loopback
    peers = publisher.maddrs()
    slow = make_transport(peers=peers, upload_limit=40e3)  # a 4 MiB range would take 100 s
    joiner = make_transport(peers=peers)
    try:
        blob = os.urandom(3 * PIECE_BYTES)
        publisher.publish_state(blob, [3] * NUM_FRAGMENTS)
        wait_for(lambda: slow.state_offers(), what="the snapshot's record")
        [candidate] = slow.state_offers()
        assert bytes(slow.fetch_state(candidate, timeout=60)) == blob
        slow.reserve_state(candidate, blob)
        wait_for(lambda: any(len(c.holders) == 2 for c in joiner.state_offers()), what="two holders")
        [two] = joiner.state_offers()
        started = time.monotonic()
        assert bytes(joiner.fetch_state(two, timeout=90)) == blob
        # not the slow holder's 100 s for its range, nor the 15 s before its rate floor drops it
        assert time.monotonic() - started < 12
    finally:
        for transport in (joiner, slow, publisher):
            transport.close()
