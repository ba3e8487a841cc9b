"""The dial-back service answers only a private swarm's members (issue 46, item 10): a peer outside
``--allow``, or one without a fresh ticket under the swarm key for this caller and this node, gets
an error and no dial; a member's request is served; a ticket is good once. Real libp2p peers."""

from __future__ import annotations

import asyncio
import json

import pytest
from google.protobuf.wrappers_pb2 import StringValue
from hivemind.p2p import P2P

from cgad.protocol.auth import SwarmKey
from cgad.protocol.reachability import DIAL_BACK, DialBackServer, _request, ask_dial_back

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def _pair(server: DialBackServer) -> tuple[P2P, P2P]:
    node = await P2P.create()
    await server.start(node)
    asker = await P2P.create(initial_peers=await node.get_visible_maddrs())
    return node, asker


async def _ask(asker: P2P, node: P2P, body: str) -> dict:
    answer = await asker.call_protobuf_handler(node.peer_id, DIAL_BACK, StringValue(value=body), StringValue)
    return json.loads(answer.value)


def test_a_private_swarms_dial_back_answers_members_only() -> None:
    key, other = SwarmKey.generate(), SwarmKey.generate()

    async def main() -> list[dict]:
        node, asker = await _pair(DialBackServer(swarm_key=key))
        try:
            me, it = asker.peer_id.to_base58(), node.peer_id.to_base58()
            answers = [
                await _ask(asker, node, json.dumps({"ports": [4242]})),  # no ticket
                await _ask(asker, node, _request([4242], me, it, other)),  # another swarm's key
                await _ask(asker, node, _request([4242], me, "QmSomeoneElse", key)),  # for another node
            ]
            good = _request([4242], me, it, key)
            answers.append(await _ask(asker, node, good))  # a member: served
            await asyncio.sleep(0)
            answers.append(await _ask(asker, node, good))  # the same ticket again
            return answers
        finally:
            await asker.shutdown()
            await node.shutdown()

    outsider, foreign, misaddressed, member, replayed = asyncio.run(main())
    for refused in (outsider, foreign, misaddressed, replayed):
        assert refused == {"error": "unauthorized: this swarm is private"}, refused
    assert "error" not in member and member["reachable"] == [] and member["seen"], member


def test_a_peer_outside_the_allowlist_is_not_dialed_and_a_listed_one_is() -> None:
    async def main() -> tuple[str, dict]:
        node = await P2P.create()
        asker = await P2P.create(initial_peers=await node.get_visible_maddrs())
        listed = await P2P.create(initial_peers=await node.get_visible_maddrs())
        await DialBackServer(allow=frozenset([listed.peer_id.to_base58()])).start(node)
        try:
            found = await ask_dial_back(asker, [f"/p2p/{node.peer_id}"], [4242])
            served = await _ask(listed, node, json.dumps({"ports": [4242]}))
            return found.line([]), served
        finally:
            for p2p in (listed, asker, node):
                await p2p.shutdown()

    line, served = asyncio.run(main())
    assert "not allowed" in line, line
    assert "error" not in served and served["reachable"] == [], served


def test_ask_dial_back_carries_the_swarms_ticket() -> None:
    key = SwarmKey.generate()

    async def main() -> bool | None:
        node, asker = await _pair(DialBackServer(swarm_key=key))
        try:
            return (await ask_dial_back(asker, [f"/p2p/{node.peer_id}"], [4242], key)).public
        finally:
            await asker.shutdown()
            await node.shutdown()

    assert asyncio.run(main()) is False  # answered: port 4242 did not open from there
