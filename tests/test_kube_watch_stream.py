"""KubeClient.watch_pods on sco._http's stream: the header section, each record and the stream itself are bounded
(the hand-written parser it replaced had no header limit, buffered a record without end and had no deadline after
the head). Each case is a raw HTTP peer doing the one unkind thing; the well-behaved watch is tested on the
stand-in (tests/test_kube_client.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from sco.schedulers import kube as kube_mod
from sco.schedulers.kube import KubeClient, KubeUnreachable

Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _watch_against(peer: Peer, bound_s: float, **client: float) -> tuple[BaseException | None, float]:
    """Run one watch against ``peer``; what it raised and when, or TimeoutError once ``bound_s`` is spent."""
    hold = asyncio.Event()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        await peer(r, w)
        await hold.wait()  # keep the connection open: only the client may end the watch
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    kube = KubeClient(f"http://127.0.0.1:{port}", timeout=0.8)
    if "max_body" in client:
        kube.http.max_body = int(client["max_body"])
    t0 = time.monotonic()
    try:

        async def drain() -> None:
            async for _ in kube.watch_pods("n1", "1", timeout_s=1):
                pass

        await asyncio.wait_for(drain(), bound_s)
        return None, time.monotonic() - t0
    except BaseException as e:  # the test asserts which
        return e, time.monotonic() - t0
    finally:
        hold.set()
        await kube.close()
        srv.close()


async def _endless_headers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\n")
    for i in range(5000):
        w.write(f"X-Filler-{i}: {'x' * 40}\r\n".encode())
    await w.drain()


async def _endless_record(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b'{"type":"ADDED","object":{"x":"' + b"y" * 60000  # never a newline
    for _ in range(40):
        w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await w.drain()


async def _silent_after_head(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    await w.drain()


def test_a_watch_head_without_end_is_refused_at_the_header_limit() -> None:
    e, took = asyncio.run(_watch_against(_endless_headers, 10))
    assert isinstance(e, KubeUnreachable) and "header section exceeds" in str(e), repr(e)
    assert took < 0.8  # refused at the limit, not waited out to the call's timeout


def test_a_watch_record_without_end_is_refused_at_the_cap() -> None:
    e, _ = asyncio.run(_watch_against(_endless_record, 10, max_body=1 << 20))
    assert isinstance(e, KubeUnreachable) and "exceeds" in str(e), repr(e)


def test_a_watch_the_server_never_ends_is_cut_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_mod, "WATCH_GRACE_S", 0.5)
    e, took = asyncio.run(_watch_against(_silent_after_head, 10))
    assert isinstance(e, KubeUnreachable) and "deadline" in str(e), repr(e)
    assert 1.4 < took < 3  # timeoutSeconds=1 plus the grace
