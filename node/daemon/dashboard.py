"""The dashboard every node serves: one self-contained page (node/daemon/dashboard.html, no asset from the
internet) that polls ``/api/status`` and draws this node's losses (beside a lone node's, the
floor, when ``--dashboard-floor`` names one), the whole swarm from the live peers' signed progress
records with each peer's credit (node/daemon/credit.py), the ages of applied fragments, refusals
and traffic.

It listens on 127.0.0.1 by default (``--dashboard-host`` exposes it, with a warning: the page
shows peer ids, endpoints and the run's progress). It answers GET only, for these two paths.
Threads: the server runs in its own thread "cgad-dashboard"; ``snapshot`` is called there and
must only read.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["DashboardServer", "FloorFile", "floor_points"]

logger = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("dashboard.html")
MAX_FLOOR_BYTES = 1 << 20  # a floor file is read only up to this size
MAX_FLOOR_POINTS = 20_000


class DashboardServer:
    """Serves the page and ``snapshot()`` as JSON on ``host:port`` (port 0: any free one; a busy
    port falls back to a free one, with a warning: a dashboard must never stop a node)."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], dict[str, Any]]) -> None:
        page = PAGE.read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/":
                    self._send(HTTPStatus.OK, "text/html; charset=utf-8", page)
                elif path == "/api/status":
                    body = json.dumps(_finite(snapshot()), allow_nan=False, default=str).encode()
                    self._send(HTTPStatus.OK, "application/json", body)
                else:
                    self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

            def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("dashboard: " + format, *args)

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as error:
            if port == 0:
                raise
            logger.warning("dashboard port %d is taken (%s): serving on a free port instead", port, error)
            self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        bound_host, bound_port = self.server.server_address[:2]
        self.url = f"http://{_url_host(str(bound_host))}:{bound_port}/"
        if not _is_loopback(host):
            logger.warning(
                "the dashboard listens on %s: anyone who can reach it sees this node's peers and progress",
                host,
            )
        self._thread = threading.Thread(target=self.server.serve_forever, name="cgad-dashboard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class FloorFile:
    """A lone node's held-out loss, read from a JSON file ``{"points": [[round, seconds, loss],
    ...]}`` (``cgad-node demo`` writes one as its lone node trains) again whenever it changes.
    Anything wrong with the file (missing, too big, malformed, a value not a finite number) reads
    as no floor, logged once per change: a dashboard must never stop a node.

    Args:
        path: the file; None: no floor.
    """

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._seen: tuple[int, int] | None = None
        self._points: list[list[float]] | None = None

    def points(self) -> list[list[float]] | None:
        """``[round, seconds, loss]`` points, rounds increasing; None when there is no floor."""
        if self.path is None:
            return None
        try:
            stat = self.path.stat()
        except OSError:
            return None
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            self._seen = (stat.st_mtime_ns, stat.st_size)
            try:
                self._points = _read_floor(self.path)
            except (OSError, ValueError) as error:
                logger.warning("dashboard floor %s unread: %s", self.path, error)
                self._points = None
        return self._points


_FLOORS: dict[str, FloorFile] = {}


def floor_points(path: str | None) -> list[list[float]] | None:
    """``FloorFile(path).points()``, one ``FloorFile`` per path for the process's life (so the
    file is parsed again only when it changes).

    Args:
        path: the floor file; None: no floor.
    """
    if path is None:
        return None
    return _FLOORS.setdefault(path, FloorFile(path)).points()


def _read_floor(path: Path) -> list[list[float]]:
    with path.open("rb") as floor_file:
        data = floor_file.read(MAX_FLOOR_BYTES + 1)
    if len(data) > MAX_FLOOR_BYTES:
        raise ValueError(f"over {MAX_FLOOR_BYTES} bytes")
    document = json.loads(data)
    points = document.get("points") if isinstance(document, dict) else None
    if not isinstance(points, list) or len(points) > MAX_FLOOR_POINTS:
        raise ValueError(f"'points' is not a list of at most {MAX_FLOOR_POINTS} points")
    checked = []
    for point in points:
        if not (isinstance(point, list) and len(point) == 3):
            raise ValueError("a point is not [round, seconds, loss]")
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in point
        ):
            raise ValueError("a point holds something other than a finite number")
        checked.append([float(v) for v in point])
    return sorted(checked)
