"""Connecting to the hall's NATS relay from a command: flags, credentials, one bounded connect."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from sco._nats import auth_options, connect, servers_of
from sco._redact import strip_userinfo, strip_userinfo_in_text
from sco.cli._common import _env
from sco.errors import ConfigError, FetchError


def _nats_auth(args: argparse.Namespace) -> dict[str, Any]:
    return auth_options(
        creds_file=args.creds,
        nkey_seed_file=args.nkey_seed,
        token=args.token,
        user=args.user,
        password=args.password,
        ca_file=getattr(args, "nats_ca_file", None),
    )


def _add_nats(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=_env("SCO_NATS_URL", "nats://127.0.0.1:4222"), help="[$SCO_NATS_URL]")
    _add_nats_auth(p)


def _add_nats_auth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", default=_env("SCO_NATS_USER"), help="[$SCO_NATS_USER]")
    p.add_argument("--password", default=_env("SCO_NATS_PASSWORD"), help="[$SCO_NATS_PASSWORD]")
    p.add_argument("--token", default=_env("SCO_NATS_TOKEN"), help="[$SCO_NATS_TOKEN]")
    p.add_argument("--nkey-seed", default=_env("SCO_NATS_NKEY_SEED"), help="nkey seed file [$SCO_NATS_NKEY_SEED]")
    p.add_argument("--creds", default=_env("SCO_NATS_CREDS"), help="NATS creds file [$SCO_NATS_CREDS]")
    p.add_argument(
        "--nats-ca-file", default=_env("SCO_NATS_CA_FILE"),
        help="the hall's CA the relay's TLS certificate must chain to [$SCO_NATS_CA_FILE]",
    )  # fmt: skip


def _nats_why(e: BaseException) -> str:
    """A connect failure in words (never a URL's credentials): nats-py's own are often an empty TimeoutError."""
    return strip_userinfo_in_text(_nats_reason(e))


def _nats_reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError) or type(e).__name__ == "TimeoutError":  # asyncio's, and nats.errors'
        return "timed out (no answer within 5 s)"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _nats_url_ok(url: str) -> bool:
    """A server nats-py can dial: a known scheme, a host and a numeric port (a malformed one is a config error)."""
    import urllib.parse

    u = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    try:
        u.port  # noqa: B018 - raises ValueError on "abc" or 99999
    except ValueError:
        return False
    return u.scheme in ("nats", "tls", "ws", "wss") and bool(u.hostname)


def _nats_run(args: argparse.Namespace, work: Callable[[Any], Any]) -> Any:
    import asyncio
    import contextlib

    async def main() -> Any:
        servers = servers_of(args.nats or "")
        shown = strip_userinfo(args.nats or "")  # credentials in the URL are never printed
        if not servers or not all(_nats_url_ok(u) for u in servers):
            raise ConfigError(f"--nats {shown!r}: expected nats://HOST:PORT (comma-separated for several)")
        errors: list[str] = []
        gave_up = asyncio.Event()

        async def on_error(e: Exception) -> None:
            # nats-py keeps retrying a refused first connection whatever its options say: one error per server
            # tried is the answer, reported at once rather than after the overall bound
            if not gave_up.is_set():
                errors.append(_nats_why(e))
                if len(errors) >= len(servers):
                    gave_up.set()

        # bounded below, and sooner when every server has refused (the one connect helper has no such early end)
        connecting = asyncio.ensure_future(
            connect(servers, auth=_nats_auth(args), deadline_s=None, connect_timeout=5, error_cb=on_error)
        )
        failed = asyncio.ensure_future(gave_up.wait())
        await asyncio.wait({connecting, failed}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        failed.cancel()
        if not connecting.done():
            gave_up.set()
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            why = "; ".join(dict.fromkeys(errors)) or "no answer within 10 s"
            raise FetchError(f"NATS {shown}: cannot connect: {why}")
        if (err := connecting.exception()) is not None:
            raise FetchError(f"NATS {shown}: cannot connect: {_nats_why(err)}")
        nc = connecting.result()
        try:
            return await work(nc)
        finally:
            await nc.close()

    return asyncio.run(main())
