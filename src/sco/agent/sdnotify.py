"""systemd's notify protocol (sd_notify(3)) without libsystemd: one datagram to $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1", "WATCHDOG=1", "STATUS=..."); False when not run by systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect(addr)
            s.sendall(state.encode())
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of $WATCHDOG_USEC in seconds (ping twice per period), or None when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2_000_000)
    except ValueError:
        return None
