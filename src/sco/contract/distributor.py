"""Contract distributor: publishes signed bundles where nodes fetch them, over HTTPS (or plain HTTP).

Why HTTP with ETag/If-None-Match rather than NATS JetStream's object store: the bundle path must not
share a failure with the notice path (NATS), a 60 s conditional GET costs one round trip and a 304 when
nothing changed, any web server or object store can serve the same files in production, and the node
side needs only ``http.client`` (no aiohttp in the agent's memory budget). Integrity comes from the
signature, not the transport, so caches and mirrors in between cannot forge a bundle; TLS (on by default in a
deployed hall: the server's certificate from the hall's CA, which nodes verify) keeps a man in the middle from
withholding or replaying bundles unseen, and ``/metrics`` from being read or forged on the way.

Layout under the publish root: ``<root>/<hall>/bundle.json``, served at ``/v1/halls/<hall>/bundle.json``.
``/metrics``: Prometheus text format (docs/METRICS.md): requests by code, refused connections, serial per hall.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any

from sco._fs import atomic_write
from sco._http_server import BoundedHandler, BoundedHTTPServer
from sco._tls import ServerTls
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
    """Bundle bytes and ETags by hall, re-read only when the file changes on disk.

    No lock: an entry is one immutable tuple, read and replaced whole (atomic in CPython), and two threads that
    both find it stale read the same file. A lock here was a convoy: under load every connection's thread queued
    on it, and a thread queued there held its slot unarmed (neither answered nor sheddable)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._cache: dict[str, tuple[tuple[int, int, int], bytes, str]] = {}

    def get(self, hall: str) -> tuple[bytes, str] | None:
        path = bundle_path(self.root, hall)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._cache.get(hall)
        if hit and hit[0] == key:
            return hit[1], hit[2]
        data = path.read_bytes()
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        self._cache[hall] = (key, data, etag)
        return data, etag


def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


class _Handler(BoundedHandler):
    """No body is ever read (GET and HEAD only)."""

    server: DistributorServer

    def parse_request(self) -> bool:
        ok = super().parse_request()  # headers complete: the answer is not held to their deadline
        # but to the idle one, and sheddable from here to the end of its write: the answer is a stat and a lookup,
        # and a thread between requests must not hold its slot unarmed (under load a flood held every slot so)
        self.server.deadlines.arm(self.connection, time.monotonic() + self.server.idle_timeout)
        if ok and self.headers.get("Content-Length", "0") not in ("", "0"):
            self.close_connection = True  # a body announced is never read: it must not be parsed as a request
        return ok

    def send_response(self, code: int, message: str | None = None) -> None:
        self.server.count(int(code))
        super().send_response(code, message)

    def _serve(self, head: bool) -> None:
        if self.path.split("?", 1)[0] == "/metrics":
            self._send(HTTPStatus.OK, self.server.metrics(), "text/plain; version=0.0.4; charset=utf-8", head=head)
            return
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
        # The answer is under a deadline too, and sheddable: a client that sends complete requests (pipelined by
        # the thousand) and never reads holds its thread blocked in a write; with every slot taken by such, a
        # node's GET went unanswered for up to idle_timeout, again and again.
        self.end_and_write(None if head else body)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)


class DistributorServer(BoundedHTTPServer):
    """One thread per connection: at most ``max_connections`` at once and ``max_per_client`` from one address
    (more are closed at once: a node retries at its next refresh, and one client cannot take every slot); a
    request's line and headers must arrive within ``header_timeout`` seconds in all (a slowloris trickling a
    byte at a time is cut off), and no read or write waits more than ``idle_timeout``. With every slot taken, a
    new connection takes the slot of the one that has waited longest for its headers (a slowloris from many
    addresses holds them all; a node sends its GET within milliseconds, so it is never the oldest); only when
    every slot is sending an answer is a new connection closed at once (sco._http_server)."""

    def __init__(
        self,
        root: Path,
        address: tuple[str, int] = ("127.0.0.1", 8470),
        verbose: bool = False,
        *,
        max_connections: int = 256,
        max_per_client: int = 16,
        header_timeout: float = 10.0,
        idle_timeout: float = 15.0,
        tls: ServerTls | None = None,
    ):
        self.files = _Files(root)
        self.verbose = verbose
        self.requests: dict[int, int] = {}  # by HTTP status code (a small fixed set)
        self._requests_lock = threading.Lock()
        self._serials: dict[str, tuple[str, Any]] = {}  # hall: (etag, serial)
        super().__init__(
            address, _Handler, max_connections=max_connections, max_per_client=max_per_client,
            header_timeout=header_timeout, idle_timeout=idle_timeout, name="distributor-deadlines", tls=tls,
        )  # fmt: skip

    def count(self, code: int) -> None:
        with self._requests_lock:
            self.requests[code] = self.requests.get(code, 0) + 1

    def metrics(self) -> bytes:
        """No client or node labels: hall and status code only."""
        with self._requests_lock:
            requests = sorted(self.requests.items())
        lines = [
            "# HELP sco_distributor_requests_total HTTP requests answered, by status code.",
            "# TYPE sco_distributor_requests_total counter",
            *(f'sco_distributor_requests_total{{code="{c}"}} {n}' for c, n in requests),
            "# HELP sco_distributor_refused_connections_total Connections closed at once (connection limits).",
            "# TYPE sco_distributor_refused_connections_total counter",
            f"sco_distributor_refused_connections_total {self.refused_connections}",
            "# HELP sco_distributor_tls_handshake_failures_total Connections closed at a failed TLS handshake"
            " (a plaintext client, a client that does not trust the certificate, a handshake past its deadline).",
            "# TYPE sco_distributor_tls_handshake_failures_total counter",
            f"sco_distributor_tls_handshake_failures_total {self.tls_handshake_failures}",
            "# HELP sco_distributor_bundle_serial Serial of the bundle published for the hall.",
            "# TYPE sco_distributor_bundle_serial gauge",
        ]
        for d in sorted(self.files.root.iterdir()) if self.files.root.is_dir() else []:
            if not _PATH.match(f"/v1/halls/{d.name}/bundle.json"):
                continue
            found = self.files.get(d.name)
            if found is None:
                continue
            cached = self._serials.get(d.name)
            if cached is None or cached[0] != found[1]:  # parsed once per published bundle, not per scrape
                payload = peek_payload(found[0])
                cached = (found[1], payload.get("serial") if payload else None)
                self._serials[d.name] = cached
            serial = cached[1]
            if isinstance(serial, int) and not isinstance(serial, bool):
                lines.append(f'sco_distributor_bundle_serial{{hall="{d.name}"}} {serial}')
        return ("\n".join(lines) + "\n").encode()


def parse_listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise BundleError(f"--listen {value!r}: expected HOST:PORT") from None
