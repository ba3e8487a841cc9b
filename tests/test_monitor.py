"""`cgad-node swarm`: a read-only monitor lists every live peer of a run from real hivemind peers on
127.0.0.1, and never shows up as a peer itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _netswarm import RUN, SMALL, key, make_transport, settle, wait_for

from cgad.node.daemon.monitor import render
from cgad.protocol.transport import Fragment

pytestmark = pytest.mark.integration

CLI = str(Path(sys.executable).with_name("cgad-node"))


@pytest.mark.timeout(120)
def test_the_monitor_lists_the_live_peers_of_a_swarm_and_stays_invisible() -> None:
    with (
        make_transport({}) as alice,
        make_transport({}, peers=alice.maddrs()) as bob,
        make_transport({}, peers=alice.maddrs()) as carol,
    ):
        alice.publish(Fragment(key(alice, 0, 0), torch.randn(SMALL)))
        wait_for(lambda: alice.stats.published == 1, what="alice's fragment to be published")
        alice.report_progress([7] * 16, inner_step=70, tokens_per_second=1500.0)
        bob.report_progress([5] * 16, inner_step=50, tokens_per_second=900.0)
        carol.report_progress([6] * 16, inner_step=60, tokens_per_second=1200.0)
        wait_for(lambda: {alice.peer_id, carol.peer_id} <= set(bob.swarm_progress()), what="bob to see both")
        listed = subprocess.run(
            [CLI, "swarm", "--peers", *alice.maddrs(), "--run-id", RUN, "--json"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        peers = {row["peer_id"]: row for row in json.loads(listed.stdout)["peers"]}
        assert set(peers) == {alice.peer_id, bob.peer_id, carol.peer_id}
        assert [row["version"] for row in json.loads(listed.stdout)["peers"]] == [
            7,
            6,
            5,
        ]  # most advanced first
        assert peers[alice.peer_id]["version"] == 7 and peers[alice.peer_id]["inner_step"] == 70
        assert peers[bob.peer_id]["tokens_per_second"] == 900.0
        assert peers[alice.peer_id]["published"] == 1 and peers[bob.peer_id]["published"] == 0
        assert peers[alice.peer_id]["direct_path"] and peers[alice.peer_id]["seen_seconds_ago"] < 60
        settle(alice)
        assert alice.live_peers() == sorted([bob.peer_id, carol.peer_id])  # the monitor was never a peer

        other_run = subprocess.run(
            [CLI, "swarm", "--peers", *alice.maddrs(), "--run-id", "no-such-run"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert other_run.returncode == 0 and "no live peer found" in other_run.stdout


def test_the_table_names_each_peer_and_sums_the_swarm() -> None:
    keys = ("peer_id", "version", "inner_step", "tokens_per_second", "published", "seen_seconds_ago")
    keys += ("direct_path",)
    values = [("QmA", 9, 90, 1000.0, 31, 2.0, True), ("QmB", 8, 80, 500.0, 7, 12.0, False)]
    rows = [dict(zip(keys, v, strict=True)) for v in values]
    text = render("r", rows)
    assert "QmA" in text and "grpc+libp2p" in text and "12s  libp2p" in text
    assert text.splitlines()[2].split()[4] == "7"  # QmB's published fragments
    assert text.endswith("run r: 2 live peer(s), median version 8, 1500 tokens/s in all")
    assert "no live peer found" in render("r", [])
