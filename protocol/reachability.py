"""Reachability: whether other peers can dial this one, found by asking a peer to dial back.

A node behind a home router can dial out but nobody can dial in, and nothing in libp2p tells it
so in time (the daemon's AutoNAT wants several peers to agree). So at start a node that joins
asks a peer it dialed (a bootstrap peer) to open a plain TCP connection back to each of its
listening ports, at the address that peer sees the node's connection come from. An answer with
a port that opened means reachable at that address; none opened means behind NAT (or a
firewall). The node then picks its mode itself: a reachable node is a DHT server; one behind NAT
is a DHT client that dials out, asks its bootstrap peers to relay for it, and is reached through
the peers that fetch its fragments and serve them onward.

The dial-back server is careful with what a peer asks: it dials only the addresses it sees that
peer's own connections come from (never an address the request names), at most ``MAX_PORTS``
ports, one request per peer per ``MIN_INTERVAL`` seconds, ``MAX_CONCURRENT`` at a time, and the
request's size is checked before it is parsed. The answer is as untrusted: only well-formed
addresses at the ports asked about are taken.

A node's records name the libp2p addresses it is reached at (``AnnouncedAddresses``): a fetcher
dials a holder by peer id, and its daemon's routing may not know that peer yet (met through the
DHT records alone, or a node that just restarted its daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import random
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf.wrappers_pb2 import StringValue
from hivemind.p2p import P2P, P2PContext, PeerID

from cgad.protocol.auth import CLOCK_SKEW, NonceLedger, SwarmKey
from cgad.protocol.records import MAX_ADDRESSES
from cgad.protocol.text import printable

__all__ = [
    "DIAL_BACK",
    "FIRST_NODE",
    "AnnouncedAddresses",
    "DialBackServer",
    "Reachability",
    "ask_dial_back",
    "ask_when_peers",
    "relays_in",
    "same_port",
    "tcp_ports",
]

DIAL_BACK = "cgad.DialBack"  # the libp2p handler's name
MAX_PORTS = 4  # ports one request may ask about
MAX_REQUEST = 512  # characters of a request (JSON, a private swarm's ticket included)
MAX_REPLY = 1024  # characters of a reply
MIN_INTERVAL = 10.0  # seconds between two requests of one peer that are served
MAX_CONCURRENT = 4  # requests served at once
DIAL_TIMEOUT = 2.0  # seconds a dial back may take
ASK_TIMEOUT = 8.0  # seconds the asking peer waits for an answer
ASK_AGAIN = 15.0  # seconds between a first node's asks while no live peer answers (> MIN_INTERVAL)
FIRST_NODE = "the first node: no peer to ask yet"
ADDRESSES_REFRESH = 30.0  # seconds between two reads of this node's own addresses from its daemon
_IP4_TCP = re.compile(r"^/ip4/(\d{1,3}(?:\.\d{1,3}){3})/tcp/(\d{1,5})$")


@dataclass
class Reachability:
    """What this node found out about itself: ``public`` True (a peer dialed it back at
    ``addresses``), False (none of its ports opened from ``seen_as``) or None (not checked, or no
    peer answered: ``detail`` says which)."""

    public: bool | None
    addresses: list[str] = field(default_factory=list)
    seen_as: list[str] = field(default_factory=list)  # the addresses the asked peer saw
    checked_by: str | None = None
    detail: str = ""

    def line(self, relays: list[str]) -> str:
        """One line for the start-up output and status: how others reach this node."""
        if self.public:
            return f"reachable at {', '.join(self.addresses)} (dialed back by {_short(self.checked_by)})"
        if self.public is False:
            via = (
                f"relay {', '.join(_short(r) for r in relays)}"
                if relays
                else "peers that re-serve its fragments"
            )
            seen = ", ".join(self.seen_as) or "an unknown address"
            return (
                f"behind NAT: reached through {via} (seen as {seen}; {_short(self.checked_by)}"
                " could not dial back); a DHT client"
            )
        return f"reachability unknown: {self.detail}"

    def as_dict(self, relays: list[str]) -> dict:
        return {"public": self.public, "addresses": list(self.addresses), "seen_as": list(self.seen_as),
                "checked_by": self.checked_by, "relays": list(relays), "line": self.line(relays)}  # fmt: skip


def _short(peer_id: str | None) -> str:
    return "?" if peer_id is None else f"…{peer_id[-8:]}"


def tcp_ports(maddrs: list[str]) -> list[int]:
    """The TCP ports this node listens on, from its own multiaddrs (relayed ones left out)."""
    ports = {int(m) for a in maddrs if "p2p-circuit" not in a for m in re.findall(r"/tcp/(\d+)", a)}
    return sorted(ports)[:MAX_PORTS]


def relays_in(maddrs: list[str]) -> list[str]:
    """The peer ids of the relays in this node's relayed (``/p2p-circuit``) multiaddrs."""
    relays = [m.group(1) for a in maddrs for m in [re.search(r"/p2p/(\w+)/p2p-circuit", a)] if m]
    return sorted(set(relays))


async def _opens(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


class DialBackServer:
    """Answers ``DIAL_BACK``: which of the caller's ports open from here (see the module). In a
    private swarm only a member's request is answered: one from a peer outside ``allow`` (when
    set), or one without a fresh ticket under ``swarm_key`` for this caller and this node, gets an
    error and no dial."""

    def __init__(self, allow: frozenset[str] = frozenset(), swarm_key: SwarmKey | None = None) -> None:
        self.allow = allow
        self.swarm_key = swarm_key
        self._nonces = NonceLedger()
        self.p2p: P2P | None = None
        self._served: dict[PeerID, float] = {}
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)

    async def start(self, p2p: P2P) -> None:
        self.p2p = p2p
        await p2p.add_protobuf_handler(DIAL_BACK, self._dial_back, StringValue)

    async def _dial_back(self, request: StringValue, context: P2PContext) -> StringValue:
        if len(request.value) > MAX_REQUEST:
            return _reply(error="request too long")
        caller = context.remote_id.to_base58()
        if self.allow and caller not in self.allow:
            return _reply(error="not allowed")
        try:
            body = json.loads(request.value)
            ports = body["ports"]
        except (ValueError, TypeError, KeyError):
            return _reply(error="not a request")
        if not isinstance(ports, list) or not 0 < len(ports) <= MAX_PORTS:
            return _reply(error=f"1 to {MAX_PORTS} ports")
        if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
            return _reply(error="ports are integers 1-65535")
        if self.swarm_key is not None and not self._member(body.get("ticket"), caller, context, ports):
            return _reply(error="unauthorized: this swarm is private")
        now = time.monotonic()
        self._served = {p: t for p, t in self._served.items() if t > now - MIN_INTERVAL}
        if context.remote_id in self._served:
            return _reply(error="asked again too soon")
        self._served[context.remote_id] = now
        async with self._slots:
            seen = await self._seen_at(context.remote_id)
            dials = [(ip, port) for ip in seen for port in sorted(set(ports))]
            opened = await asyncio.gather(*(_opens(ip, port) for ip, port in dials))
        reachable = [f"/ip4/{ip}/tcp/{port}" for (ip, port), ok in zip(dials, opened, strict=True) if ok]
        return _reply(seen=[f"/ip4/{ip}" for ip in seen], reachable=reachable)

    def _member(self, ticket: object, caller: str, context: P2PContext, ports: list[int]) -> bool:
        """Whether ``ticket`` proves the swarm key, for this caller asking this node about these
        ports, is fresh and was not seen before."""
        assert self.swarm_key is not None
        if not isinstance(ticket, dict):
            return False
        when, nonce, mac = ticket.get("time"), ticket.get("nonce"), ticket.get("mac")
        if not isinstance(when, float) or not math.isfinite(when) or abs(when - time.time()) > CLOCK_SKEW:
            return False
        if not isinstance(nonce, str) or not isinstance(mac, str) or len(nonce) > 64:
            return False
        callee = context.local_id.to_base58()
        expected = self.swarm_key.mac(DIAL_PURPOSE, _signed(caller, callee, ports, when, nonce)).hex()
        return hmac.compare_digest(mac, expected) and self._nonces.first_time(nonce.encode())

    async def _seen_at(self, peer: PeerID) -> list[str]:
        """The IPv4 addresses of the caller's direct connections to this peer (two at most)."""
        assert self.p2p is not None
        ips = set()
        for info in await self.p2p.list_peers():
            if info.peer_id == peer:
                for addr in info.addrs:
                    match = _IP4_TCP.match(str(addr))
                    if match and "p2p-circuit" not in str(addr):
                        ips.add(match.group(1))
        return sorted(ips)[:2]


def _reply(**fields: object) -> StringValue:
    return StringValue(value=json.dumps(fields))


DIAL_PURPOSE = b"dial back"


def _signed(caller: str, callee: str, ports: list[int], when: float, nonce: str) -> bytes:
    return json.dumps([caller, callee, ports, when, nonce]).encode()


def _request(ports: list[int], caller: str, callee: str, key: SwarmKey | None) -> str:
    """A dial-back request; in a private swarm with a ticket for this caller and callee."""
    body: dict[str, object] = {"ports": ports}
    if key is not None:
        when, nonce = time.time(), secrets.token_hex(16)
        mac = key.mac(DIAL_PURPOSE, _signed(caller, callee, ports, when, nonce)).hex()
        body["ticket"] = {"time": when, "nonce": nonce, "mac": mac}
    return json.dumps(body)


async def ask_dial_back(
    p2p: P2P, peers: list[str], ports: list[int], key: SwarmKey | None = None
) -> Reachability:
    """Ask the peers in ``peers`` (multiaddrs with a peer id), in turn, to dial this node back at
    ``ports``; the first well-formed answer decides."""
    failures = []
    for maddr in peers:
        peer = maddr.rstrip("/").split("/p2p/")[-1]
        try:
            answer = await asyncio.wait_for(
                p2p.call_protobuf_handler(
                    PeerID.from_base58(peer), DIAL_BACK,
                    StringValue(value=_request(ports, p2p.peer_id.to_base58(), peer, key)), StringValue,
                ),
                ASK_TIMEOUT,
            )  # fmt: skip
            reply = json.loads(answer.value) if len(answer.value) <= MAX_REPLY else {}
        except Exception as error:  # an older peer without the handler, or one that left
            failures.append(f"{_short(peer)}: {type(error).__name__}")
            continue
        if not isinstance(reply, dict) or "error" in reply or not isinstance(reply.get("reachable"), list):
            said = (
                reply.get("error", "a malformed answer") if isinstance(reply, dict) else "a malformed answer"
            )
            failures.append(f"{_short(peer)}: {printable(said, 80)}")
            continue
        reachable = [
            a for a in reply["reachable"][: MAX_PORTS * 2]
            if isinstance(a, str) and (m := _IP4_TCP.match(a)) and int(m.group(2)) in ports
        ]  # fmt: skip
        seen = [
            a for a in reply.get("seen", [])[:2] if isinstance(a, str) and re.fullmatch(r"/ip4/[\d.]+", a)
        ]
        return Reachability(bool(reachable), reachable, seen, peer)
    return Reachability(None, detail="no peer answered the dial-back request (" + "; ".join(failures) + ")")


async def ask_when_peers(
    p2p: P2P, live_peers: Callable[[], list[str]], key: SwarmKey | None = None
) -> Reachability:
    """A swarm's first node had nobody to ask at start: ask three of its live peers, drawn at
    random, as soon as there are some, and again every ``ASK_AGAIN`` seconds (doubling, up to
    ten times that) until one answers. Its mode stays what it started in (a DHT server: the
    others dialed it), so an answer that no port opened is said as that, not as a client's."""
    ports = tcp_ports([str(a) for a in await p2p.get_visible_maddrs()])
    pause = ASK_AGAIN
    while True:
        peers = live_peers()
        if peers:
            asked = random.sample(peers, min(3, len(peers)))
            found = await ask_dial_back(p2p, [f"/p2p/{peer}" for peer in asked], ports, key)
            if found.public:
                return found
            if found.public is False:
                detail = "the first node: no port opened when a peer dialed back (it serves the DHT still)"
                return Reachability(None, seen_as=found.seen_as, checked_by=found.checked_by, detail=detail)
            pause = min(2 * pause, 10 * ASK_AGAIN)
        await asyncio.sleep(pause)


def _reach_order(maddr: str) -> tuple[int, bool]:
    """Where a peer elsewhere most likely reaches an address: a public direct one, then a relayed
    one (a node behind NAT), then a private one (a LAN, docker, a VPN), then loopback."""
    if "p2p-circuit" in maddr:
        return 1, False
    match = re.match(r"/ip[46]/([^/]+)", maddr)
    try:
        ip = ipaddress.ip_address(match.group(1)) if match else None
    except ValueError:
        ip = None
    if ip is None:  # a DNS name: as a public address
        return 0, False
    rank = 3 if ip.is_loopback else 2 if ip.is_private else 0
    return rank, ip.version == 6


class AnnouncedAddresses:
    """This node's libp2p multiaddrs as its holdings records carry them: without its own
    ``/p2p/`` id, public direct ones first, then relayed, private and loopback ones, at most
    ``MAX_ADDRESSES``; read from its daemon
    at most every ``ADDRESSES_REFRESH`` seconds (a node behind NAT gains relay addresses after it
    starts). ``p2p`` gives the running daemon, or None before it runs."""

    def __init__(self, p2p: Callable[[], P2P | None]) -> None:
        self._p2p = p2p
        self._addresses: list[str] = []
        self._read_at = -math.inf

    async def __call__(self) -> list[str]:
        p2p, now = self._p2p(), time.monotonic()
        if p2p is None or now - self._read_at < ADDRESSES_REFRESH:
            return self._addresses
        self._read_at = now
        with contextlib.suppress(Exception):  # p2pd busy or closing: the last addresses stay
            own = f"/p2p/{p2p.peer_id.to_base58()}"
            maddrs = [str(a) for a in await asyncio.wait_for(p2p.get_visible_maddrs(latest=True), 5)]
            bare = [a.removesuffix(own) for a in maddrs if len(a) - len(own) <= 200]
            ordered = sorted(bare, key=_reach_order)
            self._addresses = [a for a in ordered if re.fullmatch(r"(/[A-Za-z0-9.:_-]+)+", a)][:MAX_ADDRESSES]
        return self._addresses


def same_port(host_maddrs: list[str], ports: list[int]) -> list[str]:
    """``host_maddrs`` with a TCP port of 0 (any) pinned to the one port the first daemon got."""
    if len(ports) != 1:
        return host_maddrs
    return [re.sub(r"/tcp/0(?=/|$)", f"/tcp/{ports[0]}", maddr) for maddr in host_maddrs]
