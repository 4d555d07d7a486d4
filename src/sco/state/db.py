"""Connections, schema migrations and the per-hall writer lock.

Migrations are plain SQL files in ``migrations/`` named ``NNNN_what.sql``, applied in order, each in its own
transaction, and recorded (version, name, SHA-256) in ``schema_migration``. A recorded migration whose file
changed since is an error: history is not rewritten. Concurrent ``migrate`` calls serialize on an advisory lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._redact import describe_dsn, libpq_parse_error, without_dsn_secrets
from sco.errors import ConfigError, Problem, ScoError

MIGRATIONS = Path(__file__).parent / "migrations"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# Advisory lock keys (two int4s): a namespace for this project, then what is locked.
_NS = 0x5C0
_MIGRATE_KEY = 1


class StateError(ScoError):
    """The fleet state cannot be reached, or is not in the shape this version expects."""

    exit_code = 11  # the README's table: 7 is the Kubernetes API's, 8 a held hall lock, 9 and 10 the control loop's


class HallBusy(StateError):
    """Another writer holds the hall's lock."""

    exit_code = 8


class SessionLost(StateError):
    """The fleet state's session ended mid-run (PostgreSQL restarted, a Patroni failover, the session ended for its
    silence): the hall's lock went with it."""


def dsn_from_env(dsn: str | None) -> str:
    value = dsn or os.environ.get("SCO_DB_DSN")
    if not value:
        raise ConfigError("no fleet-state database: give --dsn DSN or set $SCO_DB_DSN")
    return value


def check_dsn(dsn: str, where: str = "fleet-state DSN") -> None:
    """A string libpq cannot parse is a configuration error, named where it came from (never a traceback)."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as e:
        raise ConfigError(
            f"{where}: not a libpq connection string such as 'host=db user=sco dbname=sco': {libpq_parse_error(e)}"
        ) from None
    # A Patroni cluster without a proxy: host=a,b,c port=p1,p2,p3 (or one port for every host). libpq only finds a
    # count mismatch when it connects, with a message that does not say which setting to fix.
    hosts = _listed(parts.get("host")) or _listed(parts.get("hostaddr"))
    for key in ("port", "hostaddr"):
        given = _listed(parts.get(key))
        # a single port serves every host; libpq takes no such shortcut for hostaddr: one per host, always
        if given and len(given) != len(hosts) and (key == "hostaddr" or len(given) > 1):
            alone = " or a single port for all" if key == "port" else ""
            raise ConfigError(
                f"{where}: {len(given)} {key} values for {len(hosts)} hosts: give one {key} for every host"
                f" (in the same order){alone}"
            )


def _listed(value: object) -> list[str]:
    return [] if value in (None, "") else str(value).split(",")


def is_multi_host(dsn: str) -> bool:
    """Several hosts (a Patroni cluster's members), so libpq picks one: the one it picks must take writes."""
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(dsn)
    return len(_listed(parts.get("host")) or _listed(parts.get("hostaddr"))) > 1


# libpq's own deadlines on a connection (a DSN's own values win): TCP keepalives find a server or a network that
# vanished mid-run (a read would otherwise wait for ever), tcp_user_timeout bounds a send nobody acknowledges.
_CLIENT_DEADLINES = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def connect(dsn: str, *, autocommit: bool = True) -> Any:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    check_dsn(dsn)
    given = conninfo_to_dict(dsn)
    defaults = dict(_CLIENT_DEADLINES)
    if is_multi_host(dsn):
        # Patroni's members: without this libpq keeps the first that answers, a standby as readily as the primary
        defaults["target_session_attrs"] = "read-write"
    full = make_conninfo(dsn, **{k: v for k, v in defaults.items() if k not in given})
    try:
        return psycopg.connect(full, autocommit=autocommit)
    except psycopg.OperationalError as e:
        why = without_dsn_secrets(" ".join(str(e).split()), dsn)
        raise StateError(f"fleet state at {describe_dsn(dsn)}: cannot connect: {why}") from None


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path

    @property
    def sql(self) -> str:
        return self.path.read_text()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def migrations(directory: Path = MIGRATIONS) -> list[Migration]:
    found: list[Migration] = []
    problems: list[Problem] = []
    for p in sorted(directory.iterdir()):
        if p.suffix != ".sql":
            continue
        m = _NAME.match(p.name)
        if not m:
            problems.append(Problem(str(p), "", "a migration must be named NNNN_lowercase_words.sql"))
            continue
        found.append(Migration(int(m.group(1)), m.group(2), p))
    versions = [m.version for m in found]
    for v in sorted({v for v in versions if versions.count(v) > 1}):
        problems.append(Problem(str(directory), "", f"two migrations have version {v:04d}"))
    if problems:
        raise StateError("bad migrations", problems)
    return found


def applied(conn: Any) -> dict[int, tuple[str, str]]:
    """version -> (name, sha256) of every recorded migration; empty on a new database."""
    row = conn.execute("SELECT to_regclass('schema_migration')").fetchone()
    if row[0] is None:
        return {}
    return {v: (n, s) for v, n, s in conn.execute("SELECT version, name, sha256 FROM schema_migration")}


def require_primary(conn: Any, what: str) -> None:
    """``conn`` must be on a server that takes writes: a Patroni standby (in recovery) refuses every write, and a
    lock taken there is one the primary's writers never see."""
    if conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
        info = conn.info
        raise StateError(
            f"fleet state at host={info.host} port={info.port}: {what}: this server is a read-only standby; connect"
            " to the primary (list every member in the DSN with target_session_attrs=read-write)"
        )


def migrate(conn: Any, directory: Path = MIGRATIONS) -> list[Migration]:
    """Apply every migration not yet recorded, in order; returns those applied now."""
    todo = migrations(directory)
    done: list[Migration] = []
    require_primary(conn, "cannot migrate")
    conn.execute("SELECT pg_advisory_lock(%s, %s)", (_NS, _MIGRATE_KEY))
    try:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migration (version integer PRIMARY KEY, name text NOT NULL,"
            " sha256 text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        have = applied(conn)
        changed = [
            Problem(str(m.path), "", f"changed after it was applied (recorded sha256 {have[m.version][1][:12]}...)")
            for m in todo
            if m.version in have and have[m.version][1] != m.sha256
        ]
        if changed:
            raise StateError("applied migrations were edited", changed)
        for m in todo:
            if m.version in have:
                continue
            try:
                with conn.transaction():
                    conn.execute(m.sql)
                    conn.execute(
                        "INSERT INTO schema_migration (version, name, sha256) VALUES (%s, %s, %s)",
                        (m.version, m.name, m.sha256),
                    )
            except Exception as e:
                if isinstance(e, ScoError):
                    raise
                raise StateError(f"{m.path}: {type(e).__name__}: {str(e).strip()}") from None
            done.append(m)
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s, %s)", (_NS, _MIGRATE_KEY))
    return done


def require_schema(conn: Any) -> None:
    have = applied(conn)
    missing = [m for m in migrations() if m.version not in have]
    if missing:
        raise StateError(
            f"the fleet state is at schema {max(have, default=0):04d}, this version needs {missing[-1].version:04d}:"
            " run `sco db migrate`"
        )


def _hall_key(hall: str) -> int:
    # A stable int4 from the hall name (PostgreSQL's hashtext is not guaranteed stable across major versions).
    return int.from_bytes(hashlib.sha256(hall.encode()).digest()[:4], "big", signed=True)


# How long the session holding a hall's lock may stay silent before PostgreSQL ends it (and so frees the lock).
# A run talks to the fleet state at least once per step, and every step has a deadline well below this.
LOCK_IDLE_S = 300.0


@contextlib.contextmanager
def hall_lock(
    conn: Any, hall: str, *, wait_s: float = 0.0, poll_s: float = 0.2, idle_timeout_s: float | None = LOCK_IDLE_S
) -> Iterator[None]:
    """One writer at a time per hall: a session advisory lock held on ``conn`` for the block.

    Waits up to ``wait_s`` for the holder to finish, then raises HallBusy naming the holder's backend pid and
    client address (so an operator can find it).

    The lock cannot outlive its run. It belongs to the session, so a run that dies frees it when its connection
    closes (TCP keepalives on both sides notice a host that vanished). A run that hangs stops talking to PostgreSQL:
    once the session has been silent for ``idle_timeout_s`` the server ends it (``idle_session_timeout``, and
    ``idle_in_transaction_session_timeout`` for a hang inside a transaction), lock and all. A session lock rather
    than a lease row with an expiry: every write of the run goes through this same session, so a run that wakes
    after losing its lock cannot write beside its successor (its next statement fails), which a lease would only
    give with a fencing token checked by every write.
    """
    key = (_NS + 1, _hall_key(hall))
    require_primary(conn, f"hall {hall}: cannot take the writer's lock")
    if idle_timeout_s is not None:
        ms = str(max(1, round(idle_timeout_s * 1000)))
        conn.execute(
            "SELECT set_config('idle_session_timeout', %s, false),"
            " set_config('idle_in_transaction_session_timeout', %s, false),"
            " set_config('statement_timeout', %s, false), set_config('tcp_keepalives_idle', '10', false),"
            " set_config('tcp_keepalives_interval', '5', false), set_config('tcp_keepalives_count', '3', false)",
            (ms, ms, str(min(int(ms), 60_000))),
        )
    end = time.monotonic() + wait_s
    while True:
        if conn.execute("SELECT pg_try_advisory_lock(%s, %s)", key).fetchone()[0]:
            break
        if time.monotonic() >= end:
            row = conn.execute(
                "SELECT l.pid, a.client_addr, a.application_name FROM pg_locks l JOIN pg_stat_activity a"
                " ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s::oid"
                " AND l.granted",
                (key[0], key[1] & 0xFFFFFFFF),
            ).fetchone()
            who = f" (backend pid {row[0]}, client {row[1] or 'local'}, {row[2] or 'no name'})" if row else ""
            raise HallBusy(f"hall {hall}: another writer holds the fleet-state lock{who}; try again when it is done")
        time.sleep(poll_s)
    try:
        yield
    finally:
        # A dead session (PostgreSQL restarted, the session ended for its silence) holds no lock any more:
        # nothing to unlock, and the error that ended the block is the one to report.
        if not conn.closed and not conn.broken:
            with contextlib.suppress(Exception):
                conn.execute("SELECT pg_advisory_unlock(%s, %s)", key)
