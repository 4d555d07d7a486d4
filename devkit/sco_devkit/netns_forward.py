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
import ctypes
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def listener_in(netns: str, port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:port inside the named namespace (``ip netns``'s /run/netns/NAME)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(Path("/run/netns") / netns, os.O_RDONLY)
    try:
        _setns(there)
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(128)
            s.setblocking(False)
        finally:
            _setns(home)  # back before anything else is created on this thread
    finally:
        os.close(there)
        os.close(home)
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


async def serve(netns: list[str], ports: list[int]) -> None:
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
    for ns in netns:
        for port in ports:
            servers.append(await asyncio.start_server(handler(port), sock=listener_in(ns, port)))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--netns", action="append", required=True, help="namespace name (ip netns list); repeatable")
    p.add_argument("--port", action="append", type=int, required=True, help="loopback port; repeatable")
    a = p.parse_args()
    asyncio.run(serve(a.netns, a.port))


if __name__ == "__main__":
    main()
