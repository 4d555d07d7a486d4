"""A small asyncio HTTP/1.1 client: keep-alive pool, JSON bodies, chunked responses, one deadline per call for
the whole exchange (connect to the last body byte: a peer sending a byte a second cannot stretch a call),
streamed responses read as they arrive (:meth:`AsyncHttpClient.stream`, a Kubernetes watch: the head within the
call's deadline, the body within the stream's own, each piece and record bounded), and :func:`get` for one-off
fetches from synchronous code. The agent's one HTTP client: the Kubernetes API, the
instance metadata poll, the bundle fetch (and the ConfigMap publisher on the Kubernetes credentials code).

Why not httpx or aiohttp: the node agent's memory budget is 40 MiB, and the official clients cost more than the
few calls the agent makes (recipes: +kubernetes 79 MiB, +httpx 41.4 MiB, http.client 36.9 MiB). This stays
on the standard library.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from sco._retry import Backoff


class HttpError(Exception):
    """Connection refused, reset, malformed response: the peer did not answer properly."""


class HttpTimeout(HttpError):
    """No complete answer within the call's timeout."""


class HttpTooLarge(HttpError):
    """The response body exceeds the client's cap (an endless or absurd body is refused, never buffered)."""


class HttpHeadersTooLarge(HttpError):
    """The response's header section exceeds the client's cap (an endless stream of header lines is refused at
    the cap, never buffered until the deadline)."""


DEFAULT_MAX_BODY = 64 << 20  # the largest answer the agent expects: a node's pod list (110 pods: ~1 MiB)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


# http.client's bounds: 100 header lines (_MAXHEADERS), and 64 KiB for the whole section (a line alone is
# already capped at 64 KiB by the StreamReader): --max-bytes bounds only the body, so a peer sending distinct
# header lines without end grew the agent past 800 MiB within a 5 s deadline.
MAX_HEADER_LINES = 100
MAX_HEADER_BYTES = 64 << 10

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
REFUSED_RETRY_S = (0.02, 0.2)  # a refused connect is tried again within the exchange's deadline (first, cap)


class Hearing:
    """What a peer has said lately, for a caller's definition of silence (the node agent's: nothing received
    for 800 ms while a request is outstanding, ARCHITECTURE.md). ``heard`` is called whenever anything arrives
    from the peer (a response's status line, its last body byte, a watch event); ``asked``/``ended`` bracket
    every request, so ``waiting`` says whether one went unanswered since the peer was last heard."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.heard_at: float | None = None
        self.outstanding = 0
        self.unanswered = False  # a request ended without an answer (timeout, refused to the end) since heard_at

    def heard(self) -> None:
        self.heard_at = self.clock()
        self.unanswered = False

    def asked(self) -> None:
        self.outstanding += 1

    def ended(self, answered: bool) -> None:
        self.outstanding -= 1
        if not answered:
            self.unanswered = True

    @property
    def waiting(self) -> bool:
        """A request is outstanding, or one ended unanswered and nothing has been heard since."""
        return self.outstanding > 0 or self.unanswered

    def quiet_for(self, since: float) -> float:
        """Seconds with nothing heard, counted from the last answer or from ``since``, whichever is later."""
        return self.clock() - max(since, self.heard_at if self.heard_at is not None else since)


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
        retry_refused: bool = False,
        hearing: Hearing | None = None,
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
        # A peer restarting refuses connections for a moment: with retry_refused, connect again (capped backoff
        # with jitter) until the exchange's deadline, so a refusal counts as silence only once that is spent.
        self.retry_refused = retry_refused
        self.hearing = hearing or Hearing()
        self.refused = ""  # the last refusal, named when the deadline ends the retries
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
        return await self._open()

    async def _open(self) -> _Conn:
        """A new connection (a refused one tried again with backoff when ``retry_refused``: the caller's
        deadline ends the retries)."""
        backoff = Backoff(*REFUSED_RETRY_S)
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
                break
            except ConnectionRefusedError as e:
                self.refused = str(e.strerror or e)
                if not self.retry_refused:
                    raise
                await asyncio.sleep(backoff.next())  # the exchange's timeout ends this loop
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
        headers: dict[str, str] | None = None,
    ) -> Response:
        target = self._target(path, query)
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        head = [f"{method} {target} HTTP/1.1"]
        head += [f"{k}: {v}" for k, v in {**self.headers, **(headers or {})}.items()]
        if body is not None:
            head.append(f"Content-Type: {content_type}")
        head.append(f"Content-Length: {len(data)}")
        raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data
        limit = self.timeout if timeout is None else timeout
        async with self._slots:
            self.hearing.asked()
            answered = False
            self.refused = ""
            try:
                async with asyncio.timeout(limit):
                    resp = await self._exchange(raw, method)
                answered = True
                return resp
            except TimeoutError:
                why = f" (connection refused: {self.refused})" if self.refused else ""
                raise HttpTimeout(f"{method} {target}: no answer within {limit:g} s{why}") from None
            except HttpError as e:
                answered = isinstance(e, (HttpTooLarge, HttpHeadersTooLarge))  # it answered, too much
                raise
            finally:
                self.hearing.ended(answered)

    def _target(self, path: str, query: dict[str, str] | None) -> str:
        return self.prefix + path + (("?" + urllib.parse.urlencode(query)) if query else "")

    async def stream(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        timeout: float | None = None,
        deadline: float,
        max_record: int | None = None,
    ) -> StreamResponse:
        """Send a body-less request on a connection of its own and return once the status line and headers are
        in (within ``timeout``, the client's by default); the body is then read as it arrives, for at most
        ``deadline`` seconds from now, each chunk and each newline-delimited record at most ``max_record`` bytes
        (the client's body cap by default). Close the stream (``async with``) when done."""
        target = self._target(path, query)
        head = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in self.headers.items())]
        raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        limit = self.timeout if timeout is None else timeout
        ends_at = asyncio.get_running_loop().time() + deadline
        writer: asyncio.StreamWriter | None = None
        self.refused = ""
        try:
            async with asyncio.timeout(limit):
                try:
                    reader, writer = await self._open()
                except OSError as e:
                    raise HttpError(f"connect {self.host}:{self.port}: {e.strerror or e}") from None
                writer.write(raw)
                await writer.drain()
                status, headers = await self._read_head(reader)
        except TimeoutError:
            if writer is not None:
                writer.close()
            why = f" (connection refused: {self.refused})" if self.refused else ""
            raise HttpTimeout(f"{method} {target}: no answer within {limit:g} s{why}") from None
        except HttpError:
            if writer is not None:
                writer.close()
            raise
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
            if writer is not None:
                writer.close()
            raise HttpError(f"{self.host}:{self.port}: {e}") from None
        except BaseException:
            if writer is not None:
                writer.close()
            raise
        cap = self.max_body if max_record is None else max_record
        return StreamResponse(self, status, headers, reader, writer, ends_at, cap, f"{method} {target}", limit)

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
        status, headers = await self._read_head(reader)
        return await self._read_body(reader, method, status, headers)

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        """The status line and the header section (at most MAX_HEADER_LINES lines and MAX_HEADER_BYTES)."""
        line = await reader.readline()
        if not line:
            raise ValueError("connection closed before a response")
        self.hearing.heard()
        parts = line.decode("latin-1").split(" ", 2)
        status = int(parts[1])
        headers: dict[str, str] = {}
        lines = size = 0
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            lines += 1
            size += len(h)
            if lines > MAX_HEADER_LINES or size > MAX_HEADER_BYTES:
                raise HttpHeadersTooLarge(
                    f"{self.host}:{self.port}: refused response: its header section exceeds"
                    f" {MAX_HEADER_LINES} lines or {MAX_HEADER_BYTES} bytes"
                )
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def _read_body(
        self, reader: asyncio.StreamReader, method: str, status: int, headers: dict[str, str]
    ) -> tuple[Response, bool]:
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
            self.hearing.heard()
            return Response(status, headers, b"".join(pieces)), False
        self.hearing.heard()
        keep = headers.get("connection", "").lower() != "close"
        return Response(status, headers, body), keep


class StreamResponse:
    """A response read as it arrives (see :meth:`AsyncHttpClient.stream`): ``status`` and ``headers`` are in;
    :meth:`records` yields the body's newline-delimited records, :meth:`body` reads a whole (error) body. Each
    piece received counts as the peer heard (a watch event or bookmark is an answer)."""

    def __init__(
        self,
        client: AsyncHttpClient,
        status: int,
        headers: dict[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ends_at: float,
        max_record: int,
        what: str,
        timeout: float,
    ) -> None:
        self.client, self.status, self.headers = client, status, headers
        self._reader, self._writer, self._ends_at = reader, writer, ends_at
        self.max_record, self.what, self.timeout = max_record, what, timeout

    async def __aenter__(self) -> StreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._writer.close()

    async def body(self) -> bytes:
        """The whole body (an error's Status) within the call's timeout, at most the client's body cap."""
        try:
            async with asyncio.timeout(self.timeout):
                resp, _ = await self.client._read_body(self._reader, "GET", self.status, self.headers)
        except TimeoutError:
            raise HttpTimeout(f"{self.what}: body not read within {self.timeout:g} s") from None
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            raise HttpError(f"{self.what}: {e}") from None
        return resp.body

    async def _pieces(self) -> AsyncGenerator[bytes, None]:
        reader, c = self._reader, self.client
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                if size > self.max_record:
                    raise HttpTooLarge(f"{self.what}: a chunk of {size} bytes exceeds the {self.max_record} byte cap")
                data = await reader.readexactly(size)
                await reader.readline()
                c.hearing.heard()
                yield data
        else:
            while data := await reader.read(65536):
                c.hearing.heard()
                yield data

    async def records(self) -> AsyncIterator[bytes]:
        """The body's non-empty newline-delimited records until the peer ends it; a record longer than
        ``max_record`` is refused (HttpTooLarge), the stream's deadline raises HttpTimeout."""
        buf = b""
        pieces = self._pieces()
        try:
            while True:
                try:
                    async with asyncio.timeout_at(self._ends_at):
                        piece = await anext(pieces, None)
                except TimeoutError:
                    raise HttpTimeout(f"{self.what}: the stream outlived its deadline") from None
                except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                    raise HttpError(f"{self.what}: {e}") from None
                if piece is None:
                    return
                buf += piece
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield line
                if len(buf) > self.max_record:
                    raise HttpTooLarge(f"{self.what}: a record exceeds the {self.max_record} byte cap")
        finally:
            await pieces.aclose()


def get(
    url: str,
    *,
    deadline_s: float,
    max_body: int = DEFAULT_MAX_BODY,
    headers: dict[str, str] | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Response:
    """One GET of ``url`` (its query string kept) within ``deadline_s`` for the whole exchange, from synchronous
    code (its own event loop: call it from a worker thread inside an asyncio program)."""
    u = urllib.parse.urlsplit(url)

    async def once() -> Response:
        client = AsyncHttpClient(
            f"{u.scheme}://{u.netloc}",
            timeout=deadline_s,
            max_connections=1,
            max_body=max_body,
            ssl_context=ssl_context,
            headers={"Accept": "*/*", "Connection": "close"},
        )
        try:
            return await client.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""), headers=headers)
        finally:
            await client.close()

    return asyncio.run(once())
