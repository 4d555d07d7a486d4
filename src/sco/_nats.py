"""The one way this package reaches a NATS relay: an identity's connect options, and a connect with a deadline.

Identities, in the order every caller prefers them: a creds file (user JWT and seed; operator mode), an nkey seed
file, a token, a user and password. Whatever nats-py is told, it keeps retrying a refused *first* connection, so a
connect that must end is bounded here (``deadline_s``); one that must never give up (the agent's link) passes
``reconnect=True`` and no deadline, and nats-py reconnects forever.

TLS: the hall's relays serve clients over TLS only (role notice_relay), with a certificate the hall's CA signed. A
caller gives that CA (``tls_ca_file``); the client then verifies the relay's certificate against it, and its name
against the URL's host, before it sends an identity. No CA given: the system's trust store, as nats-py would.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
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
    ca_file: str | None = None,
) -> dict[str, Any]:
    """:func:`connect`'s ``auth`` for the first identity given (creds, nkey seed, token, user/password); empty for
    an anonymous connection. ``ca_file``: the hall's CA the relay's certificate must chain to (``tls_ca_file``,
    a path: the options stay plain data; :func:`connect` makes the TLS context)."""
    trust = {"tls_ca_file": str(ca_file)} if ca_file else {}
    if creds_file:
        return {"user_credentials": str(creds_file), **trust}
    if nkey_seed_file:
        return {"nkeys_seed": str(nkey_seed_file), **trust}
    if token:
        return {"token": token, **trust}
    if user:
        return {"user": user, "password": password or "", **trust}
    return trust


class NatsTlsError(ValueError):
    """A TLS setting that cannot be used (a missing or unreadable CA, certificate or key file)."""


def tls_context(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
    """A client's TLS context: the relay's certificate verified against ``ca_file`` (the hall's CA; None: the
    system's trust store) and its name checked; ``cert_file``/``key_file``: a client certificate to present."""
    if bool(cert_file) != bool(key_file):
        raise NatsTlsError("a client certificate needs both its certificate and its key file")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file) if ca_file else None)
        if cert_file and key_file:
            ctx.load_cert_chain(str(cert_file), str(key_file))
    except (OSError, ssl.SSLError) as e:
        raise NatsTlsError(f"relay TLS: cannot load {ca_file or ''} {cert_file or ''}: {e}".replace("  ", " ")) from e
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


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
    tls_ca_file: str | None = None,
    **options: Any,
) -> Any:
    """A nats-py client connected to one of ``servers``, within ``deadline_s`` (None: as long as it takes).

    ``reconnect``: reconnect forever once connected (and keep trying the first connection), every
    ``reconnect_time_wait`` (nats-py's 2 s unless given); otherwise one connection, never re-established. ``auth``:
    :func:`auth_options` (its ``tls_ca_file`` too), or callbacks (``user_jwt_cb``, ``signature_cb``). ``options``:
    any other of nats.connect's (name, inbox_prefix, callbacks, pings). ``tls_ca_file``: the hall's CA, which the
    relay's certificate must chain to (a ``tls`` context in ``options`` instead: the caller's own). Raises what
    nats-py raises, NatsTlsError, or TimeoutError.
    """
    import nats

    auth = dict(auth or {})
    from_auth = auth.pop("tls_ca_file", None)
    tls_ca_file = tls_ca_file or from_auth
    if tls_ca_file and "tls" not in options:
        options["tls"] = tls_context(tls_ca_file)

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
        **auth,
    )
    if deadline_s is None:
        return await connecting
    return await asyncio.wait_for(connecting, deadline_s)


__all__ = ["NatsTlsError", "auth_options", "connect", "servers_of", "tls_context"]
