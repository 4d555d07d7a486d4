"""The one way this package reaches a NATS relay: an identity's connect options, and a connect with a deadline.

Identities, in the order every caller prefers them: a creds file (user JWT and seed; operator mode), an nkey seed
file, a token, a user and password. Whatever nats-py is told, it keeps retrying a refused *first* connection, so a
connect that must end is bounded here (``deadline_s``); one that must never give up (the agent's link) passes
``reconnect=True`` and no deadline, and nats-py reconnects forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sco._redact import strip_userinfo_in_text

log = logging.getLogger("sco.nats")

CONNECT_TIMEOUT_S = 2.0  # one server's TCP and INFO/CONNECT exchange


def auth_options(
    *,
    creds_file: str | None = None,
    nkey_seed_file: str | None = None,
    token: str | None = None,
    user: str | None = None,
    password: str | None = None,
) -> dict[str, Any]:
    """nats.connect's keyword arguments for the first identity given (creds, nkey seed, token, user/password);
    empty for an anonymous connection."""
    if creds_file:
        return {"user_credentials": str(creds_file)}
    if nkey_seed_file:
        return {"nkeys_seed": str(nkey_seed_file)}
    if token:
        return {"token": token}
    if user:
        return {"user": user, "password": password or ""}
    return {}


def servers_of(url: str | Sequence[str]) -> list[str]:
    """``nats://a:4222,nats://b:4222`` (or a list) as the list nats-py fails over between."""
    items = url.split(",") if isinstance(url, str) else list(url)
    return [s.strip() for s in items if s.strip()]


async def _said(e: Exception) -> None:  # nats-py's default prints a traceback per failed attempt
    log.debug("relay: %s", strip_userinfo_in_text(str(e)))


async def connect(
    servers: str | Sequence[str],
    *,
    auth: dict[str, Any] | None = None,
    deadline_s: float | None,
    reconnect: bool = False,
    connect_timeout: float = CONNECT_TIMEOUT_S,
    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
    **options: Any,
) -> Any:
    """A nats-py client connected to one of ``servers``, within ``deadline_s`` (None: as long as it takes).

    ``reconnect``: reconnect forever once connected (and keep trying the first connection), every
    ``reconnect_time_wait`` (nats-py's 2 s unless given); otherwise one connection, never re-established. ``auth``:
    :func:`auth_options`, or callbacks (``user_jwt_cb``, ``signature_cb``). ``options``: any other of
    nats.connect's (name, inbox_prefix, callbacks, pings). Raises what nats-py raises, or TimeoutError.
    """
    import nats

    if reconnect:
        policy: dict[str, Any] = {"allow_reconnect": True, "max_reconnect_attempts": -1}
    else:
        policy = {"allow_reconnect": False, "max_reconnect_attempts": 0}
    connecting = nats.connect(
        servers=servers_of(servers),
        connect_timeout=connect_timeout,
        error_cb=error_cb or _said,
        **policy,
        **options,
        **(auth or {}),
    )
    if deadline_s is None:
        return await connecting
    return await asyncio.wait_for(connecting, deadline_s)


__all__ = ["auth_options", "connect", "servers_of"]
