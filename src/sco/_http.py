"""A small asyncio HTTP/1.1 client: keep-alive pool, JSON bodies, chunked responses, one timeout per call.

Why not httpx or aiohttp: the node agent's memory budget is 40 MiB, and the official clients cost more than the
few calls the agent makes (recipes: +kubernetes 79 MiB, +httpx 41.4 MiB, http.client 36.9 MiB). This stays
on the standard library.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any


class HttpError(Exception):
    """Connection refused, reset, malformed response: the peer did not answer properly."""


class HttpTimeout(HttpError):
    """No complete answer within the call's timeout."""


class HttpTooLarge(HttpError):
    """The response body exceeds the client's cap (an endless or absurd body is refused, never buffered)."""


DEFAULT_MAX_BODY = 64 << 20  # the largest answer the agent expects: a node's pod list (110 pods: ~1 MiB)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class AsyncHttpClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        max_connections: int = 16,
        headers: dict[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_body: int = DEFAULT_MAX_BODY,
    ) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"{base_url}: expected an http or https URL")
        self.host = u.hostname or "localhost"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.ssl = (ssl_context or ssl.create_default_context()) if u.scheme == "https" else None
        self.timeout = timeout  # the whole exchange, connect to last body byte: a 1 byte/s peer cannot stall a call
        self.max_body = max_body
        self.headers = {"Host": f"{self.host}:{self.port}", "Accept": "application/json", **(headers or {})}
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def close(self) -> None:
        while self._idle:
            _, w = self._idle.pop()
            w.close()

    async def _connect(self) -> _Conn:
        while self._idle:
            r, w = self._idle.pop()
            if not w.is_closing() and not r.at_eof():
                return r, w
            w.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float | None = None,
        query: dict[str, str] | None = None,
    ) -> Response:
        target = self.prefix + path + (("?" + urllib.parse.urlencode(query)) if query else "")
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        head = [f"{method} {target} HTTP/1.1"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        if body is not None:
            head.append(f"Content-Type: {content_type}")
        head.append(f"Content-Length: {len(data)}")
        raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data
        async with self._slots:
            try:
                async with asyncio.timeout(self.timeout if timeout is None else timeout):
                    return await self._exchange(raw, method)
            except TimeoutError:
                raise HttpTimeout(f"{method} {target}: no answer within {timeout or self.timeout} s") from None

    async def _exchange(self, raw: bytes, method: str) -> Response:
        for attempt in (0, 1):
            reused = bool(self._idle)
            try:
                conn = await self._connect()
            except OSError as e:
                raise HttpError(f"connect {self.host}:{self.port}: {e.strerror or e}") from None
            reader, writer = conn
            try:
                writer.write(raw)
                await writer.drain()
                resp, keep = await self._read(reader, method)
            except HttpTooLarge:
                writer.close()
                raise
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                writer.close()
                if reused and attempt == 0:
                    continue  # a pooled connection the server had closed: try once on a fresh one
                raise HttpError(f"{self.host}:{self.port}: {e}") from None
            except BaseException:
                writer.close()  # cancelled or timed out mid-exchange: the connection's state is unknown
                raise
            if keep:
                self._idle.append(conn)
            else:
                writer.close()
            return resp
        raise HttpError("unreachable")  # pragma: no cover

    def _check_size(self, n: int) -> None:
        if n > self.max_body:
            raise HttpTooLarge(
                f"{self.host}:{self.port}: a response body of {n}+ bytes exceeds the {self.max_body} byte cap"
            )

    async def _read(self, reader: asyncio.StreamReader, method: str) -> tuple[Response, bool]:
        line = await reader.readline()
        if not line:
            raise ValueError("connection closed before a response")
        parts = line.decode("latin-1").split(" ", 2)
        status = int(parts[1])
        headers: dict[str, str] = {}
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if method == "HEAD" or status in (204, 304):
            body = b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            total = 0
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                total += size
                self._check_size(total)
                chunks.append(await reader.readexactly(size))
                await reader.readline()
            body = b"".join(chunks)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            self._check_size(length)
            body = await reader.readexactly(length)
        else:
            pieces: list[bytes] = []
            total = 0
            while chunk := await reader.read(65536):
                total += len(chunk)
                self._check_size(total)
                pieces.append(chunk)
            return Response(status, headers, b"".join(pieces)), False
        keep = headers.get("connection", "").lower() != "close"
        return Response(status, headers, body), keep
