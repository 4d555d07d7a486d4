"""A systemd shutdown inhibitor over D-Bus (logind ``Inhibit``, mode ``delay``), and the other logind calls the
Kubernetes fallback needs (seed view 19, fourth row).

logind hands out the lock as a file descriptor: the lock is held while any copy of it is open, so "release"
is closing it, and a crashed agent releases it by dying. The calls are blocking jeepney calls in a worker
thread: jeepney is pure Python (+0.3 MiB, the agent has 40 MiB), and its asyncio integration cannot pass
file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from typing import Any

from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import open_dbus_connection
from jeepney.wrappers import DBusErrorResponse

SYSTEM_BUS = "unix:path=/run/dbus/system_bus_socket"
LOGIND = DBusAddress(
    "/org/freedesktop/login1", bus_name="org.freedesktop.login1", interface="org.freedesktop.login1.Manager"
)


class InhibitError(Exception):
    """logind (or the bus) refused or did not answer; the message says which and why."""


@dataclass
class Lock:
    """A held inhibitor lock: the file descriptor logind handed out."""

    fd: int
    what: str
    mode: str

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class Logind:
    def __init__(self, bus_address: str = SYSTEM_BUS, timeout: float = 2.0) -> None:
        self.bus_address, self.timeout = bus_address, timeout

    def _call(self, method: str, signature: str | None = None, body: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        try:
            conn = open_dbus_connection(self.bus_address, enable_fds=True, auth_timeout=self.timeout)
        except (OSError, ValueError) as e:
            raise InhibitError(f"D-Bus {self.bus_address}: cannot connect: {e}") from None
        try:
            reply = conn.send_and_get_reply(new_method_call(LOGIND, method, signature, body), timeout=self.timeout)
        except TimeoutError:
            raise InhibitError(f"logind {method}: no answer within {self.timeout} s") from None
        except OSError as e:
            raise InhibitError(f"logind {method}: {e}") from None
        finally:
            conn.close()
        if reply.header.message_type.name == "error":
            raise InhibitError(f"logind {method}: {DBusErrorResponse(reply)}")
        return tuple(reply.body)

    def inhibit_sync(self, who: str, why: str, what: str = "shutdown", mode: str = "delay") -> Lock:
        (fd,) = self._call("Inhibit", "ssss", (what, who, why, mode))
        return Lock(fd.to_raw_fd(), what, mode)

    def inhibitors_sync(self) -> list[dict[str, Any]]:
        (rows,) = self._call("ListInhibitors")
        keys = ("what", "who", "why", "mode", "uid", "pid")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def poweroff_sync(self) -> None:
        self._call("PowerOff", "b", (False,))

    def delay_max_sync(self) -> float:
        props = DBusAddress(LOGIND.object_path, bus_name=LOGIND.bus_name, interface="org.freedesktop.DBus.Properties")
        try:
            conn = open_dbus_connection(self.bus_address, auth_timeout=self.timeout)
        except (OSError, ValueError) as e:
            raise InhibitError(f"D-Bus {self.bus_address}: cannot connect: {e}") from None
        try:
            msg = new_method_call(props, "Get", "ss", (LOGIND.interface, "InhibitDelayMaxUSec"))
            reply = conn.send_and_get_reply(msg, timeout=self.timeout)
        except (TimeoutError, OSError) as e:
            raise InhibitError(f"logind InhibitDelayMaxUSec: {e or 'timeout'}") from None
        finally:
            conn.close()
        if reply.header.message_type.name == "error":
            raise InhibitError(f"logind InhibitDelayMaxUSec: {DBusErrorResponse(reply)}")
        _sig, usec = reply.body[0]
        return float(usec) / 1e6

    # asyncio faces: each call in a worker thread, so a slow bus never stalls the agent's loop.

    async def inhibit(self, who: str, why: str, what: str = "shutdown", mode: str = "delay") -> Lock:
        return await asyncio.to_thread(self.inhibit_sync, who, why, what, mode)

    async def inhibitors(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.inhibitors_sync)

    async def poweroff(self) -> None:
        await asyncio.to_thread(self.poweroff_sync)

    async def delay_max(self) -> float:
        return await asyncio.to_thread(self.delay_max_sync)
