"""The admin API: gRPC on localhost (by default), for `cgad-node status` and `cgad-node leave`.

The service ``cgad.node.Admin`` has two unary methods whose messages are JSON documents (the
status is a flat, growing set of keys that tools read by name), beside the standard
``grpc.health.v1.Health`` service for container and orchestrator probes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["SERVICE", "AdminServer", "call_admin", "check_health"]

SERVICE = "cgad.node.Admin"


def _encode(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data.decode()) if data else {}


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
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=1.0).wait()


def call_admin(address: str, method: str, timeout: float = 10.0) -> dict[str, Any]:
    """Call ``Status`` or ``Leave`` on a node; raises ``ConnectionError`` when nobody answers."""
    with grpc.insecure_channel(address) as channel:
        rpc = channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_encode, response_deserializer=_decode
        )
        try:
            return rpc({}, timeout=timeout)
        except grpc.RpcError as exc:
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
