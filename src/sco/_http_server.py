"""A bounded threading HTTP server, shared by the control host's listeners (the contract distributor, the
enrolment service).

One thread per connection: at most ``max_connections`` at once and ``max_per_client`` from one address (more are
closed at once: one client cannot take every slot); a request's line and headers must arrive within
``header_timeout`` seconds in all (a slowloris trickling a byte at a time is cut off by a reaper thread, however
slowly it trickles), and no single read or write waits more than ``idle_timeout``. With every slot taken, a new
connection takes the slot of the one whose deadline is nearest (one that has waited longest for its headers: a
client sends its request within milliseconds, so it is never that one); only when none is armed is a new
connection closed at once. A connection is armed from its accept (its thread may not run for a while on a loaded
machine). Handlers arm :attr:`BoundedHTTPServer.deadlines` around whatever else must not hang
(an answer being written, a request body being read).

With ``tls`` (sco._tls.ServerTls) every connection speaks TLS only: the handshake runs on the connection's own
thread under the header deadline (a client that never finishes it is cut like a slowloris, and never holds up
the accepting thread), and a plaintext request is no handshake: the connection is closed without an answer.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sco._tls import ServerTls

# For a shed connection's thread to give its slot back: it is woken at once, but on a loaded machine it may wait
# for the CPU (1.18 s measured under 16 CPU burners on 2 cores, and 1 s had a node refused in CI).
SHED_WAIT_S = 5.0


def _cut(conn: socket.socket) -> None:
    """Shut the connection's socket for reading and writing: a read or write blocked on another thread returns at
    once. For a TLS socket the plain socket's shutdown (ssl.SSLSocket's own would drop its TLS state under the
    thread still using it)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(conn, socket.SHUT_RDWR)


class Deadlines:
    """Connections with a deadline; one reaper thread shuts the overdue ones (their blocked read or write returns
    at once, the handler thread ends)."""

    def __init__(self, period: float = 0.25, name: str = "http-deadlines") -> None:
        self._lock = threading.Lock()
        self._by_conn: dict[socket.socket, float] = {}
        self._stop = threading.Event()
        self.reaped = 0
        self.shed = 0  # shut early to make room for a new connection
        threading.Thread(target=self._reap, args=(period,), name=name, daemon=True).start()

    def arm(self, conn: socket.socket, at: float) -> None:
        with self._lock:
            self._by_conn[conn] = at

    def disarm(self, conn: socket.socket) -> None:
        with self._lock:
            self._by_conn.pop(conn, None)

    def shed_oldest(self) -> bool:
        """Shut the connection whose deadline is nearest: the one that has waited longest for its request's
        headers or been longest in writing an answer (False: none is armed)."""
        with self._lock:
            if not self._by_conn:
                return False
            conn = min(self._by_conn, key=self._by_conn.__getitem__)
            del self._by_conn[conn]
        self.shed += 1
        _cut(conn)
        return True

    def _reap(self, period: float) -> None:
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                late = [c for c, at in self._by_conn.items() if at <= now]
                for c in late:
                    del self._by_conn[c]
            for c in late:
                self.reaped += 1
                _cut(c)

    def close(self) -> None:
        self._stop.set()


class BoundedHandler(BaseHTTPRequestHandler):
    """The request's line and headers under the server's header deadline; reads and writes under its idle one."""

    server: BoundedHTTPServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout)

    def handle_one_request(self) -> None:
        # The request line and every header must be in within header_timeout of the connection being ready for a
        # request, however slowly they trickle in (a slowloris resets a per-read timeout with each byte); an idle
        # keep-alive connection is closed by the same deadline.
        self.request_started = time.monotonic()
        self.server.deadlines.arm(self.connection, self.request_started + self.server.header_timeout)
        try:
            super().handle_one_request()
        finally:
            self.server.deadlines.disarm(self.connection)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.deadlines.disarm(self.connection)  # headers complete: the answer is not held to it
        return ok

    def end_and_write(self, body: bytes | None) -> None:
        """The headers sent so far and ``body`` (None: none, a HEAD) under the idle deadline, and sheddable: a
        client that sends complete requests and never reads would hold its thread blocked in a write."""
        self.server.deadlines.arm(self.connection, time.monotonic() + self.server.idle_timeout)
        try:
            self.end_headers()
            if body is not None:
                self.wfile.write(body)
                self.wfile.flush()
        finally:
            self.server.deadlines.disarm(self.connection)

    def log_message(self, format: str, *args: object) -> None:
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)


class BoundedHTTPServer(ThreadingHTTPServer):
    """See the module's docstring."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int = 256,
        max_per_client: int = 16,
        header_timeout: float = 10.0,
        idle_timeout: float = 15.0,
        name: str = "http-deadlines",
        tls: ServerTls | None = None,
    ) -> None:
        self.tls = tls
        self.tls_handshake_failures = 0  # plaintext clients, other CAs' clients, handshakes cut at the deadline
        self._tls_failures_lock = threading.Lock()  # counted from the connections' threads
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._per_client: dict[str, int] = {}
        self._per_client_lock = threading.Lock()
        self.refused_connections = 0
        self.deadlines = Deadlines(name=name)
        super().__init__(address, handler)

    def _take(self, client: str) -> bool:
        with self._per_client_lock:
            n = self._per_client.get(client, 0)
            if n >= self.max_per_client:
                return False
            self._per_client[client] = n + 1
        # Outside the lock: the shed connection's thread takes it to give its slot back.
        if self._slots.acquire(blocking=False) or (
            self.deadlines.shed_oldest() and self._slots.acquire(timeout=SHED_WAIT_S)
        ):
            return True
        with self._per_client_lock:
            n = self._per_client.pop(client, 1) - 1
            if n > 0:
                self._per_client[client] = n
        return False

    def _give(self, client: str) -> None:
        with self._per_client_lock:
            n = self._per_client.pop(client, 1) - 1
            if n > 0:
                self._per_client[client] = n
            self._slots.release()

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0])
        if not self._take(client):
            self.refused_connections += 1
            self.shutdown_request(request)
            return
        # Sheddable from the moment it is accepted, under its header deadline: on a loaded machine a new thread may
        # wait seconds for the CPU before it reads the request, and slots whose threads had not yet started could
        # be neither shed nor used (a node's GET was refused with every slot taken that way).
        self.deadlines.arm(request, time.monotonic() + self.header_timeout)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.deadlines.disarm(request)
            self._give(client)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if self.tls is not None:
                request = self._handshake(request)
                if request is None:
                    return
            super().process_request_thread(request, client_address)
        finally:
            self.deadlines.disarm(request)
            self._give(str(client_address[0]))

    def _handshake(self, request: socket.socket) -> ssl.SSLSocket | None:
        """The TLS handshake on this connection's thread, within the header deadline; None: it failed (closed)."""
        assert self.tls is not None
        self.tls.refresh()
        self.deadlines.disarm(request)  # wrapping takes its descriptor: the TLS socket is the one to cut from here
        try:
            conn = self.tls.context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError):
            self._tls_failed()
            self.shutdown_request(request)
            return None
        self.deadlines.arm(conn, time.monotonic() + self.header_timeout)
        try:
            conn.settimeout(self.idle_timeout)
            conn.do_handshake()
        except (OSError, ValueError):  # ssl.SSLError is an OSError: a plaintext request, an unknown CA, a cut
            self._tls_failed()
            with contextlib.suppress(OSError):
                conn.close()
            return None
        finally:
            self.deadlines.disarm(conn)
        return conn

    def _tls_failed(self) -> None:
        with self._tls_failures_lock:
            self.tls_handshake_failures += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a connection cut (by us at its deadline or to make room, or by the peer): nothing to report
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        self.deadlines.close()
        super().server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}"
