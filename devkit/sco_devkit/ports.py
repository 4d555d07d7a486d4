"""Free TCP ports for the dev clusters' and the tests' listeners, outside the kernel's ephemeral range.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 here), the same range every outgoing connection takes its source port
from. A test that asks for a port and binds it seconds later (after rendering a role, starting a relay) can find it
taken by some other test's client connection meanwhile: ``Address already in use`` (seen once in a CI run with four
workers talking to two clouds). Ports below that range are never given to outgoing connections, so a port drawn
there stays free unless another listener takes it; drawing at random from ~12,000 of them makes two workers'
(or two checkouts') draws meeting unlikely, and a process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOW, _HIGH = 20000, 32000  # below Linux's default ephemeral range, above the usual fixed service ports
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()


def _ephemeral() -> range:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def _bindable(port: int) -> bool:
    """Nothing listens on it (any address) and nothing is bound to it on loopback."""
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A TCP port no listener holds now, outside the ephemeral range, not given before by this process."""
    ephemeral = _ephemeral()
    with _lock:
        for _ in range(500):
            port = _rng.randrange(_LOW, _HIGH)
            if port in _given or port in ephemeral:
                continue
            if _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as s:  # a crowded machine: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]
