"""``sco db migrate``: the fleet state's schema (PostgreSQL)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sco._redact import describe_dsn
from sco.cli._common import _env


def cmd_db_migrate(args: argparse.Namespace) -> int:
    from sco.state.db import applied, check_dsn, connect, dsn_from_env, migrate, migrations

    if args.embedded:
        from sco.state.embedded import EmbeddedPostgres

        pg = EmbeddedPostgres(Path(args.embedded), port=args.port)
        if not (pg.pgdata / "postmaster.pid").exists():
            pg.start()
        dsn = pg.dsn()
        print(f"embedded PostgreSQL in {args.embedded}: {describe_dsn(dsn)}")
    else:
        dsn = dsn_from_env(args.dsn)
        check_dsn(dsn, "--dsn" if args.dsn else "$SCO_DB_DSN")
    if args.check:
        # What a real run would apply, applying nothing (the fleet_state role's check mode).
        with connect(dsn) as conn:
            have = applied(conn)
        todo = [m for m in migrations() if m.version not in have]
        for m in todo:
            print(f"would apply {m.version:04d}_{m.name}")
        print("fleet state up to date" if not todo else f"{len(todo)} migration(s) pending")
        return 0
    with connect(dsn) as conn:
        done = migrate(conn)
    for m in done:
        print(f"applied {m.version:04d}_{m.name}")
    print("fleet state up to date" if not done else f"{len(done)} migration(s) applied")
    return 0


def register(sub: Any) -> None:
    db = sub.add_parser("db", help="the fleet state (PostgreSQL)")
    dbs = db.add_subparsers(dest="db_command", required=True)
    x = dbs.add_parser("migrate", help="apply the schema migrations not yet applied, in order")
    x.add_argument("--dsn", default=_env("SCO_DB_DSN"), help="libpq connection string [$SCO_DB_DSN]")
    x.add_argument("--embedded", metavar="DIR", help="start (if needed) an embedded PostgreSQL in DIR and use it")
    x.add_argument("--port", type=int, default=5433, help="the embedded server's port (with --embedded)")
    x.add_argument("--check", action="store_true", help="list the migrations a run would apply; apply none")
    x.set_defaults(func=cmd_db_migrate)
