"""The admin API: gRPC on localhost (by default), for `cgad-node status` and `cgad-node leave`.

The service ``cgad.node.Admin`` has two unary methods whose messages are JSON documents (the
status is a flat, growing set of keys that tools read by name), beside the standard
``grpc.health.v1.Health`` service for container and orchestrator probes.

``Status`` answers anyone who reaches the port. ``Leave`` stops the node, so it needs the
node's token: a random secret the node writes, readable by its own user alone, to a file named
by its admin address (``token_path``) in a folder of that user's, and removes when it stops.
`cgad-node leave` run by the same user reads it; another local user cannot. Where the folder
cannot be written (a read-only home), the node runs with ``Leave`` off (a signal still stops it).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cgad.protocol.files import atomic_write

__all__ = ["SERVICE", "AdminServer", "call_admin", "check_health", "token_path"]

logger = logging.getLogger(__name__)

SERVICE = "cgad.node.Admin"


def _encode(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data.decode()) if data else {}


def token_path(address: str) -> Path:
    """Where the node listening at ``address`` (HOST:PORT) keeps its ``Leave`` token: in
    $CGAD_ADMIN_DIR, else ~/.cache/cgad-node/admin (the same for the user's every session: a
    service and a shell of one user find the same file)."""
    root = Path(os.environ.get("CGAD_ADMIN_DIR") or Path.home() / ".cache" / "cgad-node" / "admin")
    host, _, port = address.rpartition(":")
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in host.strip("[]"))
    return root / f"{safe}_{port}.token"


def _read_token(address: str) -> str | None:
    """The token of the node at ``address``; a node listening on every address wrote its token
    under that name, so the any-address names of the port are tried too."""
    port = address.rpartition(":")[2]
    for name in (address, f"0.0.0.0:{port}", f"[::]:{port}", f"127.0.0.1:{port}", f"localhost:{port}"):
        try:
            return token_path(name).read_text().strip()
        except OSError:
            continue
    return None


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        status: Callable[[], dict[str, Any]],
        leave: Callable[[], None],
    ) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="cgad-admin"))

        def on_status(request: Any, context: grpc.ServicerContext) -> Any:
            return status()

        def on_leave(request: Any, context: grpc.ServicerContext) -> Any:
            token = request.get("token") if isinstance(request, dict) else None
            if (
                self._token is None
                or not isinstance(token, str)
                or not hmac.compare_digest(token.encode(), self._token.encode())
            ):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "Leave needs this node's token")
            leave()
            return {"leaving": True}

        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=_decode, response_serializer=_encode
            )
            for name, fn in (("Status", on_status), ("Leave", on_leave))
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise ValueError(f"admin API cannot listen on {host}:{port}")
        self.address = f"{host}:{bound}"
        self.token_file = token_path(self.address)
        self._token: str | None = secrets.token_hex(16)
        try:
            self.token_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write(self.token_file, self._token.encode(), mode=0o600)
        except OSError as exc:
            logger.warning("no Leave through the admin API (its token cannot be written: %s)", exc)
            self._token = None
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=1.0).wait()
        if self._token is not None:
            self.token_file.unlink(missing_ok=True)


def call_admin(address: str, method: str, timeout: float = 10.0, token: str | None = None) -> dict[str, Any]:
    """Call ``Status`` or ``Leave`` on a node; raises ``ConnectionError`` when nobody answers
    and ``PermissionError`` when it refuses.

    Args:
        address: the node's admin API, HOST:PORT.
        method: ``Status`` or ``Leave``.
        timeout: seconds.
        token: ``Leave``'s token; None: read from the node's token file (``token_path``).
    """
    request: dict[str, Any] = {}
    if method == "Leave":
        request["token"] = token if token is not None else _read_token(address)
    with grpc.insecure_channel(address) as channel:
        rpc = channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_encode, response_deserializer=_decode
        )
        try:
            return rpc(request, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionError(
                    f"the node at {address} refused {method}: run it as the node's user, who can"
                    f" read {token_path(address)}"
                ) from exc
            raise ConnectionError(f"no cgad-node admin API at {address}: {exc.code().name}") from exc


def check_health(address: str, timeout: float = 5.0) -> bool:
    """The standard gRPC health check, as a probe would run it."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
