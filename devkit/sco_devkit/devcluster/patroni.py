"""A real Patroni cluster on one machine: three etcd members and three Patroni members on loopback.

Debian's ``patroni`` (3.0.2) runs Debian's PostgreSQL 15 (``/usr/lib/postgresql/15/bin``); the DCS is Debian's
``etcd-server`` (3.4), spoken to over its v3 API (Patroni's ``etcd3``). Every member has its own ports and
directory under one root. initdb refuses root, so as root Patroni (and the PostgreSQL it starts) runs as the
``postgres`` user, with the root directory world-traversable and the members' directories handed to that user.

Timings are a test's, not production's: ttl 10, loop_wait 1, retry_timeout 3 (failover within ~ttl), etcd with a
50 ms heartbeat. Synchronous replication is on, as the fleet_state role's default is, so a write acknowledged by
the primary is on a standby before the client hears "committed".

``kill(member)`` is a host lost: SIGKILL to that member's Patroni, its postmaster and every backend, no clean
shutdown. ``restart(member)`` brings it back; Patroni rewinds it
(pg_rewind) and it rejoins as a replica.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sco_devkit.ports import free_ports

PG_BIN = Path(os.environ.get("SCO_PG_BIN", "/usr/lib/postgresql/15/bin"))
PATRONI = os.environ.get("SCO_PATRONI", "/usr/bin/patroni")
ETCD = os.environ.get("SCO_ETCD", "/usr/bin/etcd")
SUPERUSER_PASSWORD = "devcluster-superuser"  # a test cluster on loopback: fixed, known passwords
REPLICATION_PASSWORD = "devcluster-replication"


class PatroniError(RuntimeError):
    pass


@dataclass
class Member:
    name: str
    dir: Path
    pg_port: int
    api_port: int
    proc: subprocess.Popen[bytes] | None = None
    log_fd: int | None = None

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def config(self) -> Path:
        return self.dir / "patroni.yml"

    def postmaster_pid(self) -> int | None:
        return postmaster_pid(self.data_dir)


@dataclass
class Etcd:
    name: str
    dir: Path
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None
    log_fd: int | None = None


@dataclass
class PatroniCluster:
    """Three (or ``size``) etcd and Patroni members on 127.0.0.1, each on ports of its own."""

    root: Path | None = None
    size: int = 3
    scope: str = "sco-test"
    ttl: int = 10
    loop_wait: int = 1
    retry_timeout: int = 3
    synchronous_mode: bool = True
    members: list[Member] = field(default_factory=list)
    etcd: list[Etcd] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Not under pytest's 0700 tmp_path: the postgres user must reach its own directories.
        self.root = Path(self.root) if self.root else Path(tempfile.mkdtemp(prefix="sco-patroni-"))
        ports = free_ports(4 * self.size)
        self.etcd = [Etcd(f"etcd{i}", self.root / f"etcd{i}", ports[4 * i], ports[4 * i + 1]) for i in range(self.size)]
        self.members = [
            Member(f"pg{i}", self.root / f"pg{i}", ports[4 * i + 2], ports[4 * i + 3]) for i in range(self.size)
        ]
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid}

    # --- addresses -------------------------------------------------------------------------------------------

    @property
    def etcd_hosts(self) -> list[str]:
        return [f"127.0.0.1:{e.client_port}" for e in self.etcd]

    def dsn(self, dbname: str = "postgres", user: str = "postgres", password: str = SUPERUSER_PASSWORD) -> str:
        """The multi-host DSN the control loop uses: every member, libpq keeps the one that takes writes."""
        hosts = ",".join("127.0.0.1" for _ in self.members)
        ports = ",".join(str(m.pg_port) for m in self.members)
        return (
            f"host={hosts} port={ports} dbname={dbname} user={user} password={password}"
            " target_session_attrs=read-write connect_timeout=3"
        )

    def member_dsn(self, m: Member, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={m.pg_port} dbname={dbname} user=postgres password={SUPERUSER_PASSWORD}"

    # --- configuration ---------------------------------------------------------------------------------------

    def _etcd_argv(self, e: Etcd) -> list[str]:
        initial = ",".join(f"{x.name}=http://127.0.0.1:{x.peer_port}" for x in self.etcd)
        return [
            ETCD,
            f"--name={e.name}",
            f"--data-dir={e.dir / 'data'}",
            f"--listen-client-urls=http://127.0.0.1:{e.client_port}",
            f"--advertise-client-urls=http://127.0.0.1:{e.client_port}",
            f"--listen-peer-urls=http://127.0.0.1:{e.peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{e.peer_port}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-token={self.scope}-{os.getpid()}",
            "--initial-cluster-state=new",
            # loopback: a short heartbeat so an etcd leader's loss (not tested here) is noticed quickly
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--enable-v2=false",
            "--log-level=warn",
        ]

    def patroni_config(self, m: Member) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "namespace": "/service/",
            "name": m.name,
            "restapi": {"listen": f"127.0.0.1:{m.api_port}", "connect_address": f"127.0.0.1:{m.api_port}"},
            "etcd3": {"hosts": self.etcd_hosts},
            "bootstrap": {
                "dcs": {
                    "ttl": self.ttl,
                    "loop_wait": self.loop_wait,
                    "retry_timeout": self.retry_timeout,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": self.synchronous_mode,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "remove_data_directory_on_diverged_timelines": True,
                        "parameters": {"max_connections": 100, "wal_level": "replica", "hot_standby": "on"},
                    },
                },
                "initdb": [{"encoding": "UTF8"}, "data-checksums"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{m.pg_port}",
                "connect_address": f"127.0.0.1:{m.pg_port}",
                "data_dir": str(m.data_dir),
                "bin_dir": str(PG_BIN),
                "pgpass": str(m.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": SUPERUSER_PASSWORD},
                    "replication": {"username": "replicator", "password": REPLICATION_PASSWORD},
                },
                "parameters": {
                    "unix_socket_directories": str(m.dir),
                    "logging_collector": "on",
                    "log_directory": str(m.dir / "pglog"),
                    # a test cluster: durability comes from synchronous replication, not from this disk
                    "fsync": "off",
                    "shared_buffers": "16MB",
                },
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 scram-sha-256",
                    "host all all 127.0.0.1/32 scram-sha-256",
                ],
            },
        }

    # --- processes -------------------------------------------------------------------------------------------

    def _logfd(self, path: Path) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def start_etcd(self, e: Etcd) -> None:
        e.dir.mkdir(parents=True, exist_ok=True)
        e.log_fd = e.log_fd or self._logfd(e.dir / "etcd.log")
        e.proc = subprocess.Popen(
            self._etcd_argv(e),
            stdout=e.log_fd,
            stderr=e.log_fd,
            stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )

    def start_member(self, m: Member) -> None:
        m.dir.mkdir(parents=True, exist_ok=True)
        (m.dir / "pglog").mkdir(exist_ok=True)
        m.config.write_text(json.dumps(self.patroni_config(m), indent=1))  # JSON is YAML
        if self._as:
            for p in [m.dir, m.dir / "pglog", m.config]:
                os.chown(p, self._as["user"], self._as["group"])
        os.chmod(m.dir, 0o700)
        m.log_fd = m.log_fd or self._logfd(m.dir / "patroni.log")
        m.proc = subprocess.Popen(
            [PATRONI, str(m.config)],
            stdout=m.log_fd,
            stderr=m.log_fd,
            stdin=subprocess.DEVNULL,
            cwd=str(m.dir),
            # Debian's Python with Debian's patroni: nothing of the caller's venv
            env={"PATH": f"{PG_BIN}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(m.dir)},
            start_new_session=True,
            **self._as,
        )

    def start(self, timeout: float = 60) -> PatroniCluster:
        assert self.root is not None
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        for e in self.etcd:
            self.start_etcd(e)
        self.wait_etcd(timeout)
        for m in self.members:
            self.start_member(m)
        self.wait_healthy(timeout)
        return self

    def wait_etcd(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self._get(e.client_port, "/health")[0] == 200 for e in self.etcd):
                return
            self._check_running()
            time.sleep(0.1)
        raise PatroniError(f"etcd not healthy after {timeout} s; logs in {self.root}")

    # --- the REST API ----------------------------------------------------------------------------------------

    @staticmethod
    def _get(port: int, path: str, timeout: float = 2.0) -> tuple[int, dict[str, Any]]:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            body = r.read()
            try:
                doc = json.loads(body) if body else {}
            except ValueError:
                doc = {}
            return r.status, doc if isinstance(doc, dict) else {}
        except OSError:
            return 0, {}
        finally:
            c.close()

    def api(self, m: Member, path: str) -> tuple[int, dict[str, Any]]:
        return self._get(m.api_port, path)

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.proc is not None and m.proc.poll() is None]

    def primary(self) -> Member | None:
        for m in self.alive():
            if self.api(m, "/primary")[0] == 200:
                return m
        return None

    def sync_standby(self) -> Member | None:
        for m in self.alive():
            if self.api(m, "/sync")[0] == 200:
                return m
        return None

    def _check_running(self) -> None:
        dead = [x.name for x in self.etcd if x.proc is not None and x.proc.poll() is not None]
        if dead:
            raise PatroniError(f"{', '.join(dead)} exited; see {self.root}/<name>/*.log")

    def wait_healthy(self, timeout: float = 60, *, sync: bool | None = None) -> Member:
        """Until one live member is the primary, every live member's PostgreSQL runs and (in synchronous mode,
        with a standby alive) one standby is synchronous. Returns the primary."""
        sync = self.synchronous_mode if sync is None else sync
        end = time.monotonic() + timeout
        last = ""
        while time.monotonic() < end:
            self._check_running()
            live = self.alive()
            health = {m.name: self.api(m, "/health")[0] for m in live}
            p = self.primary()
            standby = self.sync_standby() if sync and len(live) > 1 else None
            if p and all(s == 200 for s in health.values()) and (standby or not sync or len(live) < 2):
                return p
            last = f"primary={p.name if p else None} health={health} sync={standby.name if standby else None}"
            time.sleep(0.2)
        raise PatroniError(f"cluster not healthy after {timeout} s ({last}); logs in {self.root}")

    # --- failures --------------------------------------------------------------------------------------------

    def kill(self, m: Member) -> None:
        """The member's host is lost: SIGKILL to Patroni, the postmaster and every one of its children."""
        if m.proc is not None and m.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(m.proc.pid, signal.SIGKILL)
            m.proc.wait(10)
        kill_postgres(m.data_dir)

    def restart(self, m: Member) -> None:
        self.start_member(m)

    def stop(self) -> None:
        """Every process this cluster started, SIGKILLed (nothing of it is kept), then its directory removed."""
        for m in self.members:
            self.kill(m)
            if m.log_fd is not None:
                os.close(m.log_fd)
                m.log_fd = None
        for e in self.etcd:
            if e.proc is not None and e.proc.poll() is None:
                e.proc.kill()
                e.proc.wait(10)
            if e.log_fd is not None:
                os.close(e.log_fd)
                e.log_fd = None

    def destroy(self) -> None:
        self.stop()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def postmaster_pid(data_dir: Path) -> int | None:
    """The running postmaster of ``data_dir`` (a stale pid file's pid may be another process's by now)."""
    try:
        pid = int((Path(data_dir) / "postmaster.pid").read_text().split()[0])
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    return pid if str(data_dir).encode() in argv else None


def kill_postgres(data_dir: Path) -> None:
    """SIGKILL to the postmaster of ``data_dir`` and to every one of its children; returns once they are gone."""
    pid = postmaster_pid(data_dir)
    if not pid:
        return
    # Every backend calls setsid(), so no process group holds them all: the postmaster and its children.
    doomed = [pid, *_children(pid)]
    for p in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_exists(p) for p in doomed):
        time.sleep(0.02)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is gone for our purposes
    with contextlib.suppress(OSError):
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    return False


def _children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the fields after the command's closing parenthesis: state, ppid, ...
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
    return found
