"""Private swarms: a shared secret (the swarm key) that every request between members proves.

p2pd has no pre-shared-key network, so the fence is built where this project's requests are
made: every DHT RPC (hivemind's ``AuthorizerBase`` hook on its requests and responses) and every
``Fetch`` and ``Describe`` request carries a ticket, a time, a fresh nonce and an HMAC-SHA256 of
the whole request under the swarm key. A peer without the key can open a libp2p connection, but
it can neither read nor write the swarm's DHT records, nor fetch a fragment or a snapshot, nor
learn who a member is. A ticket is refused when its time is more than ``CLOCK_SKEW`` away from
the receiver's clock or when its nonce was seen before (a replay).

The key file holds a header line and 64 hex digits; it is created readable by its owner only
(``SwarmKey.create``) and a key file others can read is warned about when loaded.

An allowlist (``--allow``) is the other fence: ``AllowedCallers`` answers DHT RPCs only from the
listed peers (libp2p authenticates each caller's peer id), so an unlisted peer can neither store
records in this node's DHT nor read them from it.

Threads: a ``NonceLedger`` is touched by the event-loop thread that verifies requests.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2PContext
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPublicKey

from cgad.protocol.files import atomic_write

__all__ = [
    "DESCRIBE_PURPOSE", "FETCH_PURPOSE", "AllowedCallers", "NonceLedger", "SwarmAuthorizer", "SwarmKey",
    "SwarmKeyError",
]  # fmt: skip

logger = logging.getLogger(__name__)

HEADER = "cgad swarm key v1"
KEY_BYTES = 32
CLOCK_SKEW = 120.0  # seconds a ticket's time may differ from the receiver's clock
# what each kind of ticket is for: a ticket made for one kind of request never passes for another
FETCH_PURPOSE = b"fetch"
DESCRIBE_PURPOSE = b"describe"
MAX_NONCES = 200_000  # tickets remembered for replay checks (a window of CLOCK_SKEW seconds each)


class SwarmKeyError(ValueError):
    """A swarm key file that is missing, malformed or already there."""


class SwarmKey:
    """The shared secret of a private swarm."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != KEY_BYTES:
            raise SwarmKeyError(f"a swarm key is {KEY_BYTES} bytes, not {len(secret)}")
        self._secret = secret

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> SwarmKey:
        """A new key, written to ``path`` readable by its owner only; an existing file is never
        replaced (``SwarmKeyError``)."""
        if os.path.exists(path):
            raise SwarmKeyError(f"{path} exists already: a swarm key is never overwritten")
        key = cls.generate()
        atomic_write(path, f"{HEADER}\n{key._secret.hex()}\n".encode(), mode=0o600)
        return key

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwarmKey:
        """The key in ``path``; ``SwarmKeyError`` saying what is wrong with the file otherwise."""
        try:
            with open(path, "rb") as key_file:
                mode = os.fstat(key_file.fileno()).st_mode
                text = key_file.read(4096).decode("ascii")
        except FileNotFoundError:
            raise SwarmKeyError(
                f"no swarm key at {path} (create one with `cgad-node keygen --swarm-key`)"
            ) from None
        except UnicodeDecodeError:
            raise SwarmKeyError(f"{path} is not a swarm key file (it is not text)") from None
        lines = text.split()
        if len(lines) < 2 or " ".join(lines[:-1]) != HEADER:
            raise SwarmKeyError(f"{path} is not a swarm key file (its first line should be {HEADER!r})")
        try:
            secret = bytes.fromhex(lines[-1])
        except ValueError:
            raise SwarmKeyError(f"{path} is corrupt: the key is not hexadecimal") from None
        if len(secret) != KEY_BYTES:
            raise SwarmKeyError(f"{path} is corrupt: {len(secret)} bytes of key, not {KEY_BYTES}")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("the swarm key %s can be read by other users (chmod 600 it)", path)
        return cls(secret)

    @property
    def fingerprint(self) -> str:
        """A short public name of this key, for logs and status (it reveals nothing of it)."""
        return hmac.new(self._secret, b"cgad fingerprint", hashlib.sha256).hexdigest()[:12]

    def mac(self, purpose: bytes, data: bytes) -> bytes:
        return hmac.new(self._secret, purpose + b"\0" + data, hashlib.sha256).digest()

    def sign(self, message: Any, ticket: Any, purpose: bytes) -> bytes:
        """The MAC of ``message`` as it would be with ``ticket.signature`` empty (``ticket``
        is a field of ``message``)."""
        signature = ticket.signature
        ticket.signature = b""
        try:
            return self.mac(purpose, message.SerializeToString(deterministic=True))
        finally:
            ticket.signature = signature

    def stamp(self, message: Any, ticket: Any, purpose: bytes) -> None:
        """Fill ``ticket`` (a field of ``message`` with ``time``, ``nonce`` and ``signature``)
        so that it proves the sender holds the key, for this exact message."""
        ticket.time = time.time()
        ticket.nonce = secrets.token_bytes(16)
        ticket.signature = self.sign(message, ticket, purpose)

    def check(self, message: Any, ticket: Any, purpose: bytes, nonces: NonceLedger | None = None) -> bool:
        """Whether ``ticket`` proves the key for this message, is fresh, and (with ``nonces``)
        was not seen before."""
        if abs(ticket.time - time.time()) > CLOCK_SKEW:
            return False
        if not hmac.compare_digest(bytes(ticket.signature), self.sign(message, ticket, purpose)):
            return False
        return nonces is None or nonces.first_time(bytes(ticket.nonce))


class NonceLedger:
    """Nonces of recent tickets: a second ticket with one of them is a replay. Bounded: an entry
    is forgotten after ``CLOCK_SKEW`` × 2 seconds (its ticket's time is refused by then) or when
    ``MAX_NONCES`` newer ones arrived."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def first_time(self, nonce: bytes) -> bool:
        now = time.monotonic()
        while self._seen and (len(self._seen) >= MAX_NONCES or next(iter(self._seen.values())) < now):
            self._seen.popitem(last=False)
        if not nonce or nonce in self._seen:
            return False
        self._seen[nonce] = now + 2 * CLOCK_SKEW
        return True


class SwarmAuthorizer(AuthorizerBase):
    """hivemind's DHT hook: every DHT request and response between members carries a ticket
    (``auth``: time, nonce, signature) under the swarm key; anything else is dropped."""

    def __init__(self, key: SwarmKey) -> None:
        self.key = key
        self._nonces = NonceLedger()

    async def sign_request(self, request: AuthorizedRequestBase, service_key: RSAPublicKey | None) -> None:
        self.key.stamp(request, request.auth, b"dht request")

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        return self.key.check(request, request.auth, b"dht request", self._nonces)

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        response.auth.nonce = request.auth.nonce  # binds the answer to its question
        response.auth.signature = self.key.sign(response, response.auth, b"dht response")

    async def validate_response(
        self, response: AuthorizedResponseBase, request: AuthorizedRequestBase
    ) -> bool:
        expected = self.key.sign(response, response.auth, b"dht response")
        return response.auth.nonce == request.auth.nonce and hmac.compare_digest(
            bytes(response.auth.signature), expected
        )


class AllowedCallers:
    """A servicer's RPC handlers (``rpc_*``) answering only the callers ``allowed`` admits (it
    also counts the refusals); any other caller's request is never handled and gets an error."""

    def __init__(self, servicer: Any, allowed: Callable[[P2PContext], bool]) -> None:
        self._servicer = servicer
        self._allowed = allowed

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self._servicer, name)
        if not name.startswith("rpc_"):
            return handler

        async def checked(request: Any, context: P2PContext) -> Any:
            if not self._allowed(context):
                raise PermissionError("not in this peer's --allow")
            return await handler(request, context)

        return checked
