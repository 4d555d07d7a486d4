"""sco._nats: the one NATS identity mapping and bounded connect, against real nats-servers (user/password,
token) and a listener that accepts and never answers."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco import _nats
from tests.harness import BIN, free_port, wait_for


def test_the_first_identity_given_wins_in_one_order() -> None:
    every = {"creds_file": "c.creds", "nkey_seed_file": "s.nk", "token": "t", "user": "u", "password": "p"}
    assert _nats.auth_options(**every) == {"user_credentials": "c.creds"}
    assert _nats.auth_options(**{**every, "creds_file": ""}) == {"nkeys_seed": "s.nk"}
    assert _nats.auth_options(token="t", user="u", password="p") == {"token": "t"}
    assert _nats.auth_options(user="u", password=None) == {"user": "u", "password": ""}
    assert _nats.auth_options(creds_file=None, token="") == {}
    assert _nats.servers_of(" nats://a:1, ,nats://b:2 ") == ["nats://a:1", "nats://b:2"]


def _server(tmp: Path, *args: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "nats-server"), "-a", "127.0.0.1", "-p", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / f"nats-{port}.log", "ab"),  # noqa: SIM115
    )

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            return False

    try:
        wait_for(up, 10, "nats-server")
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[str]:
    yield from _server(tmp_path, "--user", "node-1", "--pass", "s3cret")


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[str]:
    yield from _server(tmp_path, "--auth", "tok-123")


async def _round_trip(url: str, auth: dict[str, str]) -> bytes:
    nc = await _nats.connect(url, auth=auth, deadline_s=5)
    try:
        sub = await nc.subscribe("x")
        await nc.publish("x", b"hello")
        return bytes((await sub.next_msg(timeout=2)).data)
    finally:
        await nc.close()


def test_user_and_password_connect_and_a_wrong_password_is_refused(password_server: str) -> None:
    assert asyncio.run(_round_trip(password_server, _nats.auth_options(user="node-1", password="s3cret"))) == b"hello"
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)authoriz"):
        asyncio.run(_round_trip(password_server, _nats.auth_options(user="node-1", password="wrong")))
    assert time.monotonic() - t0 < 5  # refused, not retried until the deadline


def test_token_connects(token_server: str) -> None:
    assert asyncio.run(_round_trip(token_server, _nats.auth_options(token="tok-123"))) == b"hello"


def test_a_server_that_never_answers_ends_at_the_deadline() -> None:
    """nats-py retries a first connection that got no INFO, whatever its options: the deadline ends it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            asyncio.run(_nats.connect(url, deadline_s=1.5, connect_timeout=0.5, reconnect=True))
        assert 1.4 < time.monotonic() - t0 < 3
