"""The bundle fetch on the agent's one HTTP client (``sco._http``), one deadline for the whole exchange.

A distributor answering 1 byte/s with ``Connection: close`` kept ``sco node fetch-bundle
--deadline 5`` running past 40 s (its timer closed ``conn.sock``, which ``http.client`` had already set to None),
and the fetch dropped the URL's query string."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sco.agent.bundle_cache import BundleCache, BundleFetcher
from sco.contract.signing import Keyring, generate, write_keypair
from tests.harness import BIN, hall_bundle


class Dribbler:
    """Headers at once (``Connection: close``, no length), then the body one byte a second, for ever."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            self.requests.append(conn.recv(65536).split(b"\r\n", 1)[0])
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: application/json\r\n\r\n")
            while not self.stop.wait(1.0):
                conn.sendall(b"{")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_fetch_bundle_keeps_its_deadline_against_a_byte_a_second(tmp_path: Path) -> None:
    key = generate()
    (tmp_path / "trusted").mkdir()
    write_keypair(key, tmp_path / "k.key", tmp_path / "trusted" / "k.pub")
    srv = Dribbler()
    url = f"http://127.0.0.1:{srv.port}/v1/halls/local/bundle.json?mirror=b"
    argv = [str(BIN / "sco"), "node", "fetch-bundle", "--url", url, "--cache-dir", str(tmp_path / "cache")]
    argv += ["--trust-dir", str(tmp_path / "trusted"), "--deadline", "3"]
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    finally:
        srv.close()
    took = time.monotonic() - t0
    assert p.returncode == 6, p.stderr
    assert "not complete within the 3 s deadline" in p.stderr and "Traceback" not in p.stderr
    assert took < 3 + 10, took  # the interpreter starting on a loaded machine, then at most the deadline
    assert srv.requests == [b"GET /v1/halls/local/bundle.json?mirror=b HTTP/1.1"]  # the query string kept


def test_the_agents_refresh_is_not_stalled_by_it(tmp_path: Path) -> None:
    """The same peer, through the fetcher the agent's refresh uses: refused at the deadline, the last good
    bundle kept."""
    key = generate()
    cache = BundleCache(tmp_path / "cache", Keyring([key.public]))
    assert cache.offer(hall_bundle(tmp_path, key)).outcome == "accepted"
    srv = Dribbler()
    try:
        t0 = time.monotonic()
        offer = BundleFetcher(cache, f"http://127.0.0.1:{srv.port}/b.json", deadline_s=1.5).refresh()
        took = time.monotonic() - t0
    finally:
        srv.close()
    assert offer.outcome == "error" and "deadline" in offer.reason and took < 2.5
    assert cache.bundle is not None and cache.bundle.serial == 1


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--deadline", "inf"), ("--deadline", "nan"), ("--deadline", "0"), ("--deadline", "-1"),
     ("--max-bytes", "-5"), ("--interval", "0")],
)  # fmt: skip
def test_fetch_bundle_refuses_a_deadline_size_or_interval_out_of_bounds(tmp_path: Path, flag: str, value: str) -> None:
    """inf was no deadline at all, 0 or nan a fetch that failed at once (exit 6, as if the distributor were at
    fault), --interval 0 with --watch a busy loop on the distributor: now exit 5 naming the flag, nothing sent."""
    key = generate()
    (tmp_path / "trusted").mkdir()
    write_keypair(key, tmp_path / "k.key", tmp_path / "trusted" / "k.pub")
    srv = Dribbler()
    argv = [str(BIN / "sco"), "node", "fetch-bundle", "--url", f"http://127.0.0.1:{srv.port}/b.json", "--watch"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--trust-dir", str(tmp_path / "trusted"), flag, value]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    finally:
        srv.close()
    assert p.returncode == 5, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
    assert p.stderr.startswith(f"sco: error: {flag} ") and ": expected " in p.stderr, p.stderr
    assert srv.requests == []


class HeaderFlood:
    """A status line, then ``count`` distinct header lines of ``width`` bytes as fast as it can, then nothing (the
    connection held open): the reviewer's endless header lines, cut to what a test can send."""

    def __init__(self, count: int, width: int) -> None:
        self.count, self.width = count, width
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            for i in range(self.count):
                conn.sendall(b"X-H%d: " % i + b"a" * self.width + b"\r\n")
            self.stop.wait(30)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize(("count", "width"), [(1000, 10), (30, 4000)], ids=["101+ lines", "64+ KiB"])
def test_fetch_bundle_refuses_a_header_section_without_end(tmp_path: Path, count: int, width: int) -> None:
    """Review 2, D3: --max-bytes bounded only the body; a distributor sending distinct header lines without end
    grew ``sco node fetch-bundle`` to 844 MiB within its 5 s deadline. Now the header section is capped (100
    lines, 64 KiB, http.client's bounds) and refused at the cap, naming it, not at the deadline."""
    key = generate()
    (tmp_path / "trusted").mkdir()
    write_keypair(key, tmp_path / "k.key", tmp_path / "trusted" / "k.pub")
    srv = HeaderFlood(count, width)
    argv = [str(BIN / "sco"), "node", "fetch-bundle", "--url", f"http://127.0.0.1:{srv.port}/b.json"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--trust-dir", str(tmp_path / "trusted"), "--deadline", "20"]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        srv.close()
    assert p.returncode == 6, p.stderr
    assert "refused response: its header section exceeds 100 lines or 65536 bytes" in p.stderr, p.stderr
    assert "deadline" not in p.stderr and "Traceback" not in p.stderr, p.stderr
