"""What of a connection string or URL may be printed: never a password, a token or a user's credentials.

Messages and logs name the server (host, port, database, user) and nothing else; a string that cannot be parsed is
not quoted at all, since any part of it could be the secret. Standard library only (the DSN parser is psycopg's,
imported when asked), so the agent, the CLI, the provider and the state layer all route through here.
"""

from __future__ import annotations

import re

UNPARSEABLE_DSN = "(an unparseable connection string)"
_SHOWN = ("host", "port", "dbname", "user")


def describe_dsn(dsn: str) -> str:
    """``host=... port=... dbname=... user=...`` of a libpq connection string or postgresql:// URI, nothing else."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(dsn)
    except Exception:  # psycopg.ProgrammingError, or psycopg missing: either way quote nothing
        return UNPARSEABLE_DSN
    shown = [f"{k}={_plain(str(parts[k]))}" for k in _SHOWN if parts.get(k) not in (None, "")]
    return " ".join(shown) or "(default host)"


def without_dsn_secrets(text: str, dsn: str) -> str:
    """``text`` (a driver's error message) with any password the DSN holds taken out, should libpq echo one."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(dsn)
    except Exception:
        return text
    for key in ("password", "sslpassword"):
        if value := str(parts.get(key) or ""):
            text = text.replace(value, "***")
    return text


def libpq_parse_error(e: BaseException) -> str:
    """libpq's reason a string did not parse, with every quoted fragment of the string taken out."""
    return re.sub(r'"[^"]*"', '"..."', " ".join(str(e).split())) or "cannot be parsed"


def _plain(value: str) -> str:
    # a host or user with spaces or control characters is shown quoted and escaped, never raw
    return value if value and all(c.isprintable() and not c.isspace() for c in value) else repr(value)


def strip_userinfo(url: str) -> str:
    """``url`` (or a comma-separated list of them, as NATS takes) without ``user:password@`` or ``token@``."""
    return ",".join(_strip_one(u.strip()) for u in url.split(",")) if url else url


_USERINFO_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def strip_userinfo_in_text(text: str) -> str:
    """Every ``scheme://user:password@`` in a message (a client library's error text) without its userinfo."""
    return _USERINFO_IN_TEXT.sub(r"\1", text)


def _strip_one(u: str) -> str:
    scheme, sep, rest = u.partition("://")
    if not sep:
        scheme, rest = "", u
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if "@" in authority:
        authority = authority.rsplit("@", 1)[1]
    return f"{scheme}{sep}{authority}{rest[end:]}"
