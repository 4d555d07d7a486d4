"""Contract distributor: publishes signed bundles where nodes fetch them, over plain HTTP.

Why HTTP with ETag/If-None-Match rather than NATS JetStream's object store: the bundle path must not
share a failure with the notice path (NATS), a 60 s conditional GET costs one round trip and a 304 when
nothing changed, any web server or object store can serve the same files in production, and the node
side needs only ``http.client`` (no aiohttp in the agent's memory budget). Integrity comes from the
signature, not the transport, so caches and mirrors in between cannot forge a bundle.

Layout under the publish root: ``<root>/<hall>/bundle.json``, served at ``/v1/halls/<hall>/bundle.json``.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sco._fs import atomic_write
from sco.contract.bundle import Bundle, peek_payload
from sco.contract.signing import Keyring
from sco.errors import BundleError, RollbackError

BUNDLE_NAME = "bundle.json"
_PATH = re.compile(r"^/v1/halls/([a-z0-9]([-a-z0-9]*[a-z0-9])?)/bundle\.json$")


def bundle_path(root: Path, hall: str) -> Path:
    return Path(root) / hall / BUNDLE_NAME


def publish(raw: bytes, root: Path, keyring: Keyring) -> Bundle:
    """Verify ``raw`` and make it the hall's published bundle; refuse a forged or rolled-back one."""
    new = Bundle.from_bytes(raw, keyring)
    target = bundle_path(root, new.hall)
    if target.exists():
        current = peek_payload(target.read_bytes()) or {}
        cur_serial = int(current.get("serial", 0))
        if new.serial < cur_serial:
            raise RollbackError(f"serial {new.serial} is lower than the published serial {cur_serial}")
        if new.serial == cur_serial and current.get("contentDigest") != new.content_digest:
            raise RollbackError(f"serial {new.serial} is already published with different content")
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, raw)
    return new


class _Files:
    """Bundle bytes and ETags by hall, re-read only when the file changes on disk."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, int, int], bytes, str]] = {}

    def get(self, hall: str) -> tuple[bytes, str] | None:
        path = bundle_path(self.root, hall)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            hit = self._cache.get(hall)
            if hit and hit[0] == key:
                return hit[1], hit[2]
        data = path.read_bytes()
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        with self._lock:
            self._cache[hall] = (key, data, etag)
        return data, etag


def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


class _Handler(BaseHTTPRequestHandler):
    server: DistributorServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        # An idle keep-alive connection (or one sending a byte a minute) is closed after this long, so it
        # cannot hold its thread forever.
        super().setup()
        self.connection.settimeout(self.server.idle_timeout)

    def _serve(self, head: bool) -> None:
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, b"ok\n", "text/plain", head=head)
            return
        m = _PATH.match(self.path.split("?", 1)[0])
        found = self.server.files.get(m.group(1)) if m else None
        if found is None:
            self._send(HTTPStatus.NOT_FOUND, b"no such bundle\n", "text/plain", head=head)
            return
        data, etag = found
        if _etag_matches(self.headers.get("If-None-Match"), etag):
            self._send(HTTPStatus.NOT_MODIFIED, b"", None, etag=etag, head=True)
            return
        self._send(HTTPStatus.OK, data, "application/json", etag=etag, head=head)

    def _send(
        self, status: HTTPStatus, body: bytes, ctype: str | None, etag: str | None = None, head: bool = False
    ) -> None:
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        if etag:
            self.send_header("ETag", etag)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Content-Length", "0" if status == HTTPStatus.NOT_MODIFIED else str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def log_message(self, format: str, *args: object) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


class DistributorServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` at once (more are closed at once: a node
    retries at its next refresh), each closed after ``idle_timeout`` seconds without a request."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        root: Path,
        address: tuple[str, int] = ("127.0.0.1", 8470),
        verbose: bool = False,
        *,
        max_connections: int = 256,
        idle_timeout: float = 15.0,
    ):
        self.files = _Files(root)
        self.verbose = verbose
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused_connections = 0
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


def parse_listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise BundleError(f"--listen {value!r}: expected HOST:PORT") from None
