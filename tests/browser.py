"""Debian's headless Chromium (package chromium, installed by scripts/setup.sh), driven over the DevTools protocol
on a pipe (--remote-debugging-pipe: commands on fd 3, answers on fd 4, each a JSON message ended by NUL), so a
test needs no WebSocket client: load a page, read element boxes from its DOM, take a PNG screenshot."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


class BrowserError(Exception):
    pass


class Chromium:
    def __init__(self, timeout: float = 30.0) -> None:
        binary = shutil.which("chromium")
        if binary is None:
            raise BrowserError("chromium is not installed: run bash scripts/setup.sh (it installs Debian's chromium)")
        self.timeout = timeout
        self.profile = tempfile.TemporaryDirectory(prefix="sco-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # the child must find them at fds 3 and 4; park them high first so the dup2s cannot clobber each other
        hi_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 20)
        hi_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 20)
        os.close(to_child_r)
        os.close(from_child_w)

        def fds() -> None:
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.log = open(Path(self.profile.name) / "chromium.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile.name}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            preexec_fn=fds,  # only dup2s, before exec
            pass_fds=(3, 4),
        )
        os.close(hi_r)
        os.close(hi_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None

    # --- the protocol ------------------------------------------------------------------------------

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise BrowserError(f"chromium did not answer within {self.timeout} s: {self.log_tail()}")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium closed the DevTools pipe: {self.log_tail()}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        msg: dict[str, Any] = json.loads(raw)
        return msg

    def call(self, method: str, session: bool = True, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            m = self._read(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise BrowserError(f"{method}: {m['error']}")
                result: dict[str, Any] = m.get("result", {})
                return result
            self.events.append(m)

    def wait_event(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        for i, m in enumerate(self.events):
            if m.get("method") == method:
                return self.events.pop(i)
        while True:
            m = self._read(deadline)
            if m.get("method") == method:
                return m
            self.events.append(m)

    # --- what a test does --------------------------------------------------------------------------

    def open(self, url: str, width: int = 1280, height: int = 800) -> None:
        target = self.call("Target.createTarget", session=False, url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", session=False, targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self) -> bytes:
        """The whole page (beyond the viewport), as PNG bytes."""
        w, h = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        self.call("Emulation.setDeviceMetricsOverride", width=w, height=h, deviceScaleFactor=1, mobile=False)
        r = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        return base64.b64decode(r["data"])

    def log_tail(self) -> str:
        self.log.flush()
        return (Path(self.profile.name) / "chromium.log").read_text(errors="replace")[-1500:]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.call("Browser.close", session=False)
                    self.proc.wait(10)
                except (BrowserError, OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait(10)
        finally:
            for fd in (self._to_child, self._from_child):
                os.close(fd)
            self.log.close()
            self.profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
