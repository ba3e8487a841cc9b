"""A peer's text never reaches a volunteer's terminal raw: an escape sequence in a dial-back
answer, a peer id or any string of a status would otherwise clear the screen, set the terminal's
title or reorder what is read (issue 46, item 10)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from google.protobuf.wrappers_pb2 import StringValue
from hivemind.p2p import P2P

from cgad.node.daemon.status import status_line, status_report
from cgad.protocol.reachability import DIAL_BACK, ask_dial_back
from cgad.protocol.text import printable

# an OSC title with BEL, a screen clear, an 8-bit CSI and a right-to-left override
EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202eevil"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def test_printable_shows_every_control_as_an_escape() -> None:
    shown = printable(EVIL)
    assert not RAW.search(shown)
    assert shown == "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202eevil"
    assert printable("a\nb\tc") == "a\\nb\\tc" and printable("a\nb", lines=True) == "a\nb"
    assert printable("x" * 100, limit=10) == "x" * 10 + "…"
    assert printable("ünïcode ok, 日本") == "ünïcode ok, 日本"
    # a lone surrogate (a terminal's encoder raises on it), line separators, bidirectional marks
    for sly in ("\ud800", "\u2028", "\u2029", "\u200e", "\u200f", "\u061c"):
        shown = printable(f"a{sly}b")
        assert shown.startswith("a\\u") and shown.encode("utf-8") and not RAW.search(shown), shown


def test_the_status_a_volunteer_reads_holds_no_raw_control() -> None:
    status = {
        "peer_id": "Qm" + EVIL, "run_id": EVIL, "optimizer": "cga", "device": "cpu", "uptime": 5.0,
        "started_from": f"peer {EVIL}", "resumed": False, "round": 3, "inner_step": 30, "versions": [3],
        "loss": 5.0, "eval_loss": 5.1, "tokens_per_second": 10.0, "peers": 1, "resyncs": 0,
        "published": 3, "applied": 2, "dropped_stale": 0, "clipped": 0, "tokens_capped": 0,
        "downlink_bytes_per_second": None, "fetches_waiting": 0, "rejected": {EVIL: 1}, "skipped": {},
        "mean_age": 0.0, "applied_by_peer": {EVIL: 2}, "reach": {"line": f"reachability unknown: {EVIL}",
        "paths_by_peer": {EVIL: {"direct": 1}}},
    }  # fmt: skip
    report = status_report(status)
    assert not RAW.search(report) and report.count("\n") > 10  # its own lines kept
    assert "pwned" in report  # shown, escaped, not dropped: a volunteer sees that something is off
    assert not RAW.search(status_line(status))


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reply", [json.dumps({"error": EVIL}), "[]"])
def test_a_peers_dial_back_error_is_shown_escaped(reply: str) -> None:
    """A real libp2p peer answers the dial-back request with an error full of escapes, or with
    something that is no mapping; the line this node prints about its reachability holds them
    escaped, and the ask ends in an answer, not an exception."""

    async def main() -> str:
        hostile = await P2P.create()

        async def answer(request: StringValue, context: object) -> StringValue:
            return StringValue(value=reply)

        await hostile.add_protobuf_handler(DIAL_BACK, answer, StringValue)
        asker = await P2P.create(initial_peers=await hostile.get_visible_maddrs())
        try:
            found = await ask_dial_back(asker, [f"/p2p/{hostile.peer_id}"], [4242])
        finally:
            await asker.shutdown()
            await hostile.shutdown()
        assert found.public is None
        return found.line([])

    line = asyncio.run(main())
    assert ("pwned" if "error" in reply else "a malformed answer") in line and not RAW.search(line), line
