"""A **stand-in** for systemd-logind's inhibitor API, on a real D-Bus daemon (Debian's ``dbus``).

systemd-logind cannot run here (no systemd as PID 1), so tests of the kubelet graceful-shutdown fallback use
this: a protocol-level implementation of the parts of ``org.freedesktop.login1.Manager`` that the agent and
kubelet use, following systemd's documented semantics (https://systemd.io/INHIBITOR_LOCKS/, logind-dbus.c):

- ``Inhibit(what, who, why, mode) -> h``: the lock *is* the returned file descriptor (the write end of a pipe);
  the lock is held while any copy of it is open. The stand-in closes its own copy once the reply is sent (as
  logind does), and watches the read end: EOF means released. ``mode`` is ``block`` or ``delay``; delay is only
  for ``shutdown`` and ``sleep`` (else ``InvalidArgs``). While a shutdown is under way no new ``shutdown`` lock
  is granted (``org.freedesktop.login1.OperationInProgress``).
- ``ListInhibitors() -> a(ssssuu)``: what, who, why, mode, uid, pid (from the bus daemon, not the caller).
- ``PowerOff(interactive)``: emits ``PrepareForShutdown(true)`` and waits until every ``delay`` lock on
  ``shutdown`` is released, or ``InhibitDelayMaxUSec`` has passed, then "powers off": recorded in
  :attr:`LogindStandIn.shutdowns` with its time and why it proceeded (``released`` or ``timeout``).
  A ``block`` lock on shutdown makes PowerOff fail with ``org.freedesktop.login1.BlockedByInhibitorLock``.
- Properties ``InhibitDelayMaxUSec``, ``PreparingForShutdown``, ``BlockInhibited``, ``DelayInhibited``.

Not modelled: sessions, seats, polkit (every caller may do everything), sleep, scheduled shutdowns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jeepney import DBusAddress, HeaderFields, MatchRule, Message, new_error, new_method_return, new_signal
from jeepney.bus_messages import message_bus
from jeepney.io.threading import DBusRouter, open_dbus_connection

BUS_NAME = "org.freedesktop.login1"
PATH = "/org/freedesktop/login1"
IFACE = "org.freedesktop.login1.Manager"
PROPS = "org.freedesktop.DBus.Properties"
WHATS = ("shutdown", "sleep", "idle", "handle-power-key", "handle-suspend-key", "handle-hibernate-key",
         "handle-lid-switch", "handle-reboot-key")  # fmt: skip


class PrivateBus:
    """A real ``dbus-daemon`` on a private socket, configured as a system bus (allow-all policy)."""

    def __init__(self, workdir: Path | None = None) -> None:
        self._tmp = None if workdir else tempfile.mkdtemp(prefix="sco-bus-")  # short: socket path limit
        self.dir = Path(workdir or self._tmp or ".")
        self.socket = self.dir / "bus.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix:path={self.socket}"

    def start(self) -> PrivateBus:
        exe = shutil.which("dbus-daemon")
        if exe is None:
            raise FileNotFoundError("dbus-daemon not found: install Debian's dbus package (scripts/setup.sh does)")
        conf = self.dir / "bus.conf"
        conf.write_text(
            '<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"\n'
            ' "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">\n'
            "<busconfig><type>system</type>"
            f"<listen>unix:path={self.socket}</listen><auth>EXTERNAL</auth>"
            '<policy context="default"><allow user="*"/><allow own="*"/><allow send_type="method_call"/>'
            '<allow send_destination="*" eavesdrop="true"/><allow eavesdrop="true"/>'
            '<allow receive_type="*"/><allow send_type="*"/></policy></busconfig>\n'
        )
        self.proc = subprocess.Popen(
            [exe, f"--config-file={conf}", "--nofork", "--nopidfile"],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "dbus.log", "ab"),  # noqa: SIM115
        )
        end = time.monotonic() + 10
        while not self._accepting():  # the socket file appears at bind(), before listen()
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"dbus-daemon did not start: {(self.dir / 'dbus.log').read_text()}")
            time.sleep(0.01)
        return self

    def _accepting(self) -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(self.socket))
                return True
            except OSError:
                return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


@dataclass
class Inhibitor:
    what: str
    who: str
    why: str
    mode: str
    uid: int
    pid: int
    read_fd: int
    since: float


class LogindStandIn:
    """Serves ``org.freedesktop.login1`` on the given bus, from a thread of the calling process."""

    def __init__(self, bus_address: str, inhibit_delay_max_s: float = 5.0) -> None:
        self.bus_address = bus_address
        self.inhibit_delay_max_s = inhibit_delay_max_s
        self.inhibitors: list[Inhibitor] = []
        self.released: list[tuple[Inhibitor, float]] = []
        self.shutdowns: list[dict[str, Any]] = []
        self.prepare_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.router: DBusRouter | None = None

    # --- life cycle --------------------------------------------------------------------------------

    def start(self) -> LogindStandIn:
        conn = open_dbus_connection(self.bus_address, enable_fds=True)
        self.router = DBusRouter(conn)
        reply = self.router.send_and_get_reply(message_bus.RequestName(BUS_NAME), timeout=5)
        if reply.body[0] != 1:  # DBUS_REQUEST_NAME_REPLY_PRIMARY_OWNER
            raise RuntimeError(f"could not own {BUS_NAME} on {self.bus_address}: reply {reply.body[0]}")
        calls: queue.Queue[Message] = queue.Queue(maxsize=10_000)
        self._filter = self.router.filter(MatchRule(type="method_call"), queue=calls)
        self._calls = calls
        for target, name in ((self._serve, "logind-calls"), (self._watch, "logind-locks")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if self.router is not None:
            self.router.close()
            self.router.conn.close()
        with self._lock:
            for i in self.inhibitors:
                os.close(i.read_fd)
            self.inhibitors.clear()

    # --- what tests look at ------------------------------------------------------------------------

    def held(self, what: str = "shutdown", mode: str | None = None) -> list[Inhibitor]:
        with self._lock:
            return [i for i in self.inhibitors if what in i.what.split(":") and (mode is None or i.mode == mode)]

    @property
    def preparing(self) -> bool:
        return self.prepare_at is not None and not self.shutdowns

    # --- serving -----------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self._calls.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._dispatch(msg)
            except Exception as e:  # a bug here must answer, not leave the caller hanging
                self._reply(new_error(msg, "org.freedesktop.DBus.Error.Failed", "s", (f"stand-in: {e!r}",)))

    def _reply(self, msg: Message) -> None:
        assert self.router is not None
        self.router.send(msg)

    def _dispatch(self, msg: Message) -> None:
        h = msg.header.fields
        iface, member = h.get(HeaderFields.interface), h.get(HeaderFields.member)
        if h.get(HeaderFields.path) != PATH:
            return self._reply(new_error(msg, "org.freedesktop.DBus.Error.UnknownObject", "s", ("no such object",)))
        if iface == PROPS and member == "Get":
            return self._get_property(msg)
        if iface == PROPS and member == "GetAll":
            return self._reply(new_method_return(msg, "a{sv}", ({k: v for k, v in self._properties().items()},)))
        if iface not in (IFACE, None):
            return self._reply(new_error(msg, "org.freedesktop.DBus.Error.UnknownInterface", "s", (str(iface),)))
        if member == "Inhibit":
            return self._inhibit(msg)
        if member == "ListInhibitors":
            with self._lock:
                rows = [(i.what, i.who, i.why, i.mode, i.uid, i.pid) for i in self.inhibitors]
            return self._reply(new_method_return(msg, "a(ssssuu)", (rows,)))
        if member == "PowerOff":
            return self._poweroff(msg)
        return self._reply(new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod", "s", (f"{member}",)))

    def _properties(self) -> dict[str, tuple[str, Any]]:
        with self._lock:
            block = sorted({w for i in self.inhibitors if i.mode == "block" for w in i.what.split(":")})
            delay = sorted({w for i in self.inhibitors if i.mode == "delay" for w in i.what.split(":")})
        return {
            "InhibitDelayMaxUSec": ("t", int(self.inhibit_delay_max_s * 1_000_000)),
            "PreparingForShutdown": ("b", self.preparing),
            "BlockInhibited": ("s", ":".join(block)),
            "DelayInhibited": ("s", ":".join(delay)),
        }

    def _get_property(self, msg: Message) -> None:
        iface, name = msg.body
        props = self._properties()
        if iface != IFACE or name not in props:
            return self._reply(new_error(msg, "org.freedesktop.DBus.Error.UnknownProperty", "s", (f"{name}",)))
        return self._reply(new_method_return(msg, "v", (props[name],)))

    def _caller(self, msg: Message) -> tuple[int, int]:
        """(uid, pid) of the caller, from the bus daemon (as logind asks it)."""
        assert self.router is not None
        sender = msg.header.fields[HeaderFields.sender]
        pid = self.router.send_and_get_reply(message_bus.GetConnectionUnixProcessID(sender), timeout=2).body[0]
        uid = self.router.send_and_get_reply(message_bus.GetConnectionUnixUser(sender), timeout=2).body[0]
        return int(uid), int(pid)

    def _inhibit(self, msg: Message) -> None:
        if msg.header.fields.get(HeaderFields.signature) != "ssss":
            return self._reply(new_error(msg, "org.freedesktop.DBus.Error.InvalidArgs", "s", ("expected ssss",)))
        what, who, why, mode = msg.body
        whats = what.split(":")
        if not what or any(w not in WHATS for w in whats):
            return self._reply(new_error(msg, "org.freedesktop.DBus.Error.InvalidArgs", "s", ("Invalid what",)))
        if mode not in ("block", "delay"):
            return self._reply(new_error(msg, "org.freedesktop.DBus.Error.InvalidArgs", "s", ("Invalid mode",)))
        if mode == "delay" and any(w not in ("shutdown", "sleep") for w in whats):
            return self._reply(
                new_error(
                    msg,
                    "org.freedesktop.DBus.Error.InvalidArgs",
                    "s",
                    ("Delay inhibitors only supported for shutdown and sleep",),
                )
            )
        if "shutdown" in whats and self.prepare_at is not None:
            return self._reply(
                new_error(
                    msg,
                    "org.freedesktop.login1.OperationInProgress",
                    "s",
                    ("The operation inhibition has been requested for is already running",),
                )
            )
        uid, pid = self._caller(msg)
        r, w = os.pipe()
        with self._lock:
            self.inhibitors.append(Inhibitor(what, who, why, mode, uid, pid, r, time.time()))
        try:
            self._reply(new_method_return(msg, "h", (w,)))
        finally:
            os.close(w)  # the caller's copy is now the only one: when it is closed, the lock is released

    def _poweroff(self, msg: Message) -> None:
        if self.held("shutdown", "block"):
            who = ", ".join(i.who for i in self.held("shutdown", "block"))
            return self._reply(
                new_error(
                    msg,
                    "org.freedesktop.login1.BlockedByInhibitorLock",
                    "s",
                    (f"Operation inhibited by {who}",),
                )
            )
        if self.prepare_at is not None:
            return self._reply(new_method_return(msg))  # already on its way
        self.prepare_at = time.time()
        self._reply(new_method_return(msg))
        assert self.router is not None
        self.router.send(new_signal(DBusAddress(PATH, interface=IFACE), "PrepareForShutdown", "b", (True,)))

    # --- lock watcher ------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                fds = {i.read_fd: i for i in self.inhibitors}
            if fds:
                ready = select.select(list(fds), [], [], 0.02)[0]
            else:
                ready = []
                time.sleep(0.02)
            now = time.time()
            for fd in ready:
                if os.read(fd, 64) == b"":  # EOF: every copy of the write end is closed
                    with self._lock:
                        self.inhibitors.remove(fds[fd])
                    os.close(fd)
                    self.released.append((fds[fd], now))
            if self.prepare_at is not None and not self.shutdowns:
                if not self.held("shutdown", "delay"):
                    self.shutdowns.append({"at": now, "proceeded": "released"})
                elif now >= self.prepare_at + self.inhibit_delay_max_s:
                    who = [i.who for i in self.held("shutdown", "delay")]
                    self.shutdowns.append({"at": now, "proceeded": "timeout", "still_held_by": who})


def main() -> None:
    p = argparse.ArgumentParser(description="logind inhibitor stand-in on a private D-Bus system bus")
    p.add_argument("--bus", help="bus address; default: start a private dbus-daemon and print its address")
    p.add_argument("--inhibit-delay-max", type=float, default=5.0, help="InhibitDelayMaxSec (logind's default 5)")
    args = p.parse_args()
    bus = None if args.bus else PrivateBus().start()
    addr = args.bus or (bus.address if bus else "")
    srv = LogindStandIn(addr, args.inhibit_delay_max).start()
    print(f"logind stand-in on {addr} (InhibitDelayMaxSec={args.inhibit_delay_max})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    srv.stop()
    if bus:
        bus.stop()


if __name__ == "__main__":
    main()
