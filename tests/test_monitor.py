"""`cgad-node swarm`: a read-only monitor lists every live peer of a run from real hivemind peers on
127.0.0.1, with each peer's credit from what the others signed, and never shows up as a peer
itself."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _netswarm import RUN, SMALL, key, make_transport, settle, wait_for

from cgad.node.daemon.credit import Credit, contributions, most_applied
from cgad.node.daemon.monitor import render
from cgad.protocol.records import Progress
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
        # what each signs it applied from whom; bob also claims a million of his own, carol
        # credits nobody, and the monitor must credit bob with what alice and carol signed only
        alice.report_progress(
            [7] * 16, 70, 1500.0, eval_loss=4.5, applied_from={bob.peer_id: 5, carol.peer_id: 2}
        )
        bob.report_progress([5] * 16, 50, 900.0, applied_from={alice.peer_id: 4, bob.peer_id: 10**6})
        carol.report_progress([6] * 16, 60, 1200.0, eval_loss=4.75, applied_from={bob.peer_id: 3})
        wait_for(
            lambda: (
                all(p.applied_from for p in bob.swarm_progress().values()) and len(bob.swarm_progress()) == 3
            ),
            what="bob to see both with their credits",
        )
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
        assert peers[alice.peer_id]["eval_loss"] == 4.5 and peers[bob.peer_id]["eval_loss"] is None
        # credit: alice 5 + carol 3 for bob (his own million counts for nothing), bob's 4 for
        # alice, alice's 2 for carol; each with how many peers' word it rests on
        credit = {peer: (row["applied_by_others"], row["credited_by"]) for peer, row in peers.items()}
        assert credit == {bob.peer_id: (8, 2), alice.peer_id: (4, 1), carol.peer_id: (2, 1)}
        assert not any(row["this_node"] for row in peers.values())

        # --watch: the same table again and again in the terminal, until Ctrl-C
        watching = subprocess.Popen(
            [CLI, "swarm", "--peers", *alice.maddrs(), "--run-id", RUN, "--watch", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        tables, deadline = [], time.monotonic() + 90
        for line in watching.stdout:
            if line.startswith(bob.peer_id):
                tables.append(line)
            if len(tables) == 2 or time.monotonic() > deadline:
                break
        watching.send_signal(signal.SIGINT)
        assert watching.wait(timeout=60) == 0, watching.stderr.read()[-2000:]
        assert len(tables) == 2 and all(" 8 by 2 " in row for row in tables), tables
        settle(alice)
        assert alice.live_peers() == sorted([bob.peer_id, carol.peer_id])  # the monitor was never a peer

        other_run = subprocess.run(
            [CLI, "swarm", "--peers", *alice.maddrs(), "--run-id", "no-such-run"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert other_run.returncode == 0 and "no live peer found" in other_run.stdout


def test_the_table_names_each_peer_and_sums_the_swarm() -> None:
    keys = ("peer_id", "version", "inner_step", "tokens_per_second", "eval_loss", "published")
    keys += ("applied_by_others", "credited_by", "seen_seconds_ago", "direct_path")
    values = [
        ("QmA", 9, 90, 1000.0, 4.25, 31, 12, 2, 2.0, True),
        ("QmB", 8, 80, 500.0, None, 7, 0, 0, 12.0, False),
    ]
    rows = [dict(zip(keys, v, strict=True)) for v in values]
    rows[0]["reachability"] = "reachable"  # a record that states it shows it
    text = render("r", rows)
    assert "QmA" in text and "grpc+libp2p (reachable)" in text and "12s  libp2p" in text
    assert text.splitlines()[1].split()[4:8] == ["4.250", "31", "12", "by"]
    assert text.splitlines()[2].split()[4:6] == ["-", "7"]  # QmB: no held-out loss, 7 published
    assert "run r: 2 live peer(s), median version 8, 1500 tokens/s in all, 12 fragment(s)" in text
    assert "held-out, tokens/s, published: each peer's own claim, not checked" in text
    assert "no live peer found" in render("r", [])


def _progress(peer: str, applied_from: dict[str, int], versions: tuple[int, ...] = (10,)) -> Progress:
    return Progress(peer_id=peer, versions=list(versions), inner_step=1, tokens_per_second=1.0, time=0.0,
                    applied_from=applied_from)  # fmt: skip


def test_no_peer_can_credit_itself_and_each_reporter_counts_once() -> None:
    records = {
        "QmHonest": _progress("QmHonest", {"QmWorker": 6, "QmLiar": 1}),
        "QmWorker": _progress("QmWorker", {"QmHonest": 2}),
        # the liar signs a million applications of its own fragments, and credits nobody else
        "QmLiar": _progress("QmLiar", {"QmLiar": 10**6}),
    }
    assert contributions(records) == {
        "QmWorker": Credit(6, 1),
        "QmHonest": Credit(2, 1),
        "QmLiar": Credit(1, 1),  # what the honest peer signed, nothing of its own claim
    }
    # a record filed under another peer's id (the live view never holds one) counts for nothing
    # about its signer either
    assert (
        contributions(
            {"QmLiar": _progress("QmLiar", {"QmLiar": 5}), "QmX": _progress("QmLiar", {"QmLiar": 5})}
        )
        == {}
    )


def test_a_credit_is_at_most_what_any_peer_could_have_applied() -> None:
    """One throwaway identity signed 2^64 − 1 applications of a friend who published nothing: the
    contribution table showed the friend at 100% and every honest peer at 0%. A reporter's count
    is cut to the swarm's versions summed over its fragments (one fragment per fragment and
    version), which a liar claiming far-ahead versions of its own does not move."""
    records = {
        "QmA": _progress("QmA", {"QmB": 37}, versions=(20, 19)),
        "QmB": _progress("QmB", {"QmA": 30}, versions=(20, 20)),
        "QmC": _progress("QmC", {"QmA": 35, "QmB": 36}, versions=(19, 19)),
        "QmLiar": _progress("QmLiar", {"QmFriend": 2**64 - 1}, versions=(10**9, 10**9)),
    }
    assert most_applied(records) == 20 + 19  # the low medians: (19, 20, 20, 1e9) and (19, 19, 20, 1e9)
    credit = contributions(records)
    assert credit["QmFriend"] == Credit(39, 1)  # as much as one honest peer can be credited by one
    assert credit["QmA"] == Credit(30 + 35, 2) and credit["QmB"] == Credit(37 + 36, 2)  # honest: whole
    # a liar listing a hundred fragments more, each at 2^62, lifts no bound: the swarm has two
    longer = {
        **records,
        "QmLiar": _progress("QmLiar", {"QmFriend": 2**64 - 1}, versions=(0, 0, *(2**62,) * 100)),
    }
    assert most_applied(longer) <= 20 + 19 and contributions(longer)["QmFriend"].applied_by_others <= 39
