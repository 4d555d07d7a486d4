"""Forward loopback ports of network namespaces to the machine's own loopback (test support).

A test host (molecule's network-namespace hosts) reaches only its own loopback and its scenario's private network.
A service the machine runs on 127.0.0.1 (the devkit OpenStack, whose Keystone catalog names 127.0.0.1 URLs) is
made reachable from inside a host at the same address and port: one process, started in the machine's namespace,
opens a listening socket inside each named namespace (a socket keeps the namespace it was created in) and connects
each accepted connection to the same port on the machine's loopback.

    python -m sco_devkit.netns_forward --netns scom-hall-ha-ha-ctl1 --netns scom-hall-ha-ha-ctl2 --port 5000 ...

It prints ``ready`` once every listener is open, and runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(netns: str) -> Iterator[None]:
    """This thread inside the named namespace (``ip netns``'s /run/netns/NAME) for the block: sockets made there
    stay in it."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(Path("/run/netns") / netns, os.O_RDONLY)
    try:
        _setns(there)
        try:
            yield
        finally:
            _setns(home)  # back before anything else is created on this thread
    finally:
        os.close(there)
        os.close(home)


def listener_in(netns: str, port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:port inside the named namespace."""
    with in_netns(netns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(128)
        s.setblocking(False)
    return s


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        w.close()


async def serve(netns: list[str], ports: list[int], mapped: dict[int, int] | None = None) -> None:
    """``ports``: each forwarded at the same number; ``mapped``: port in the namespaces -> port on the loopback."""

    async def forward(port: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        except (OSError, TimeoutError):
            w.close()
            return
        await asyncio.gather(_pipe(r, uw), _pipe(ur, w))

    def handler(port: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        return lambda r, w: forward(port, r, w)

    servers = []
    pairs = [(p, p) for p in ports] + list((mapped or {}).items())
    for ns in netns:
        for there, here in pairs:
            servers.append(await asyncio.start_server(handler(here), sock=listener_in(ns, there)))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--netns", action="append", required=True, help="namespace name (ip netns list); repeatable")
    p.add_argument("--port", action="append", type=int, default=[], help="loopback port; repeatable")
    p.add_argument(
        "--map", action="append", default=[], metavar="THERE:HERE",
        help="port THERE in the namespaces to port HERE on the loopback (a fixed port a static setting names)",
    )  # fmt: skip
    a = p.parse_args()
    try:
        mapped = {int(m.split(":")[0]): int(m.split(":")[1]) for m in a.map}
    except (ValueError, IndexError):
        p.error(f"--map: expected THERE:HERE (two port numbers), got {a.map}")
    if not a.port and not mapped:
        p.error("nothing to forward: give --port or --map")
    asyncio.run(serve(a.netns, a.port, mapped))


if __name__ == "__main__":
    main()
