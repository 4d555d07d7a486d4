"""The collection's fleet_state role through real ansible-playbook runs against a real PostgreSQL (the session's
embedded server, reached over TCP from localhost): check mode changes nothing, the real run creates the role, the
database and the schema, a second run changes nothing, bad settings fail naming the variable."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco.state.db import connect, migrations
from tests.secrets_watch import ProcSampler, files_showing
from tests.testhosts import REPO

VENV = Path(sys.executable).parent.parent


LOCAL = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}


def play(
    tmp: Path,
    extravars: dict[str, Any],
    check: bool = False,
    playbook: str | None = None,
    inventory: dict[str, Any] | None = None,
    limit: str | None = None,
    flags: tuple[str, ...] = (),
) -> Any:
    import ansible_runner

    pdd = tmp / f"runner-{len(list(tmp.glob('runner-*')))}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "fleet_state.yml").write_text(playbook or (REPO / "playbooks" / "fleet_state.yml").read_text())
    args = (["--check"] if check else []) + ([f"--limit={limit}"] if limit else []) + list(flags)
    return ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="fleet_state.yml",
        inventory=inventory or {"all": {"children": {"sco_control": {"hosts": {"localhost": LOCAL}}}}},
        extravars=extravars,
        cmdline=" ".join(args) or None,
        quiet=True,
        envvars={
            "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        },
    )


def changed(r: Any, host: str = "localhost") -> int:
    return int(r.stats["changed"].get(host, 0)) if r.stats else -1


def output(r: Any) -> str:
    return str(r.stdout.read())


def messages(r: Any, event: str) -> list[str]:
    return [
        str(e["event_data"]["res"].get("msg", ""))
        for e in r.events
        if e.get("event") == event and "res" in e.get("event_data", {})
    ]


@pytest.fixture
def names(request: pytest.FixtureRequest) -> dict[str, str]:
    # Roles are cluster-wide in PostgreSQL: a name of its own per test.
    suffix = os.urandom(3).hex()
    return {"db": f"fleet_role_{suffix}", "user": f"sco_role_{suffix}"}


def settings(postgres: Any, tmp: Path, names: dict[str, str], **over: Any) -> dict[str, Any]:
    return {
        "fleet_state_host": "127.0.0.1",
        "fleet_state_port": postgres.port,
        "fleet_state_ssl_mode": "disable",
        "fleet_state_admin_user": "postgres",
        "fleet_state_db_name": names["db"],
        "fleet_state_db_user": names["user"],
        "fleet_state_db_password": "correct-horse-battery",
        # role hall generates these under the hall's credentials directory (it needs sco_hall, which these runs lack)
        "fleet_state_patroni_restapi_password": "restapi-password",
        "fleet_state_etcd_root_password": "etcd-root-password",
        "fleet_state_etcd_password": "etcd-patroni-password",
        # the hall's CA: role hall's places are under the hall's state directory (which needs sco_hall too)
        "fleet_state_tls_ca_cert": str(tmp / "state" / "tls" / "ca.crt"),
        "fleet_state_tls_ca_key": str(tmp / "state" / "tls" / "ca.key"),
        "fleet_state_tls_dir": str(tmp / "state" / "tls" / "fleet-state"),
        # The product is this checkout's venv (installing it from a wheelhouse is node_agent's test).
        "fleet_state_install": False,
        "fleet_state_venv": str(VENV),
        "fleet_state_dsn_file": str(tmp / "etc" / "fleet-state.env"),
        **over,
    }


def admin_query(postgres: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with connect(postgres.dsn()) as c:
        return list(c.execute(sql, args).fetchall())


def test_check_mode_then_real_then_idempotent(postgres: Any, tmp_path: Path, names: dict[str, str]) -> None:
    ev = settings(postgres, tmp_path, names)

    r = play(tmp_path, ev, check=True)
    assert r.rc == 0, output(r)
    assert changed(r) > 0  # it reports the role, the database and the migrations it would create
    assert not admin_query(postgres, "SELECT 1 FROM pg_database WHERE datname = %s", names["db"])
    assert not admin_query(postgres, "SELECT 1 FROM pg_roles WHERE rolname = %s", names["user"])
    assert not (tmp_path / "etc" / "fleet-state.env").exists()

    r = play(tmp_path, ev)
    assert r.rc == 0, output(r)
    assert changed(r) > 0
    dsn = postgres.dsn(names["db"])
    with connect(dsn) as c:
        recorded = [tuple(x) for x in c.execute("SELECT version, name FROM schema_migration ORDER BY version")]
        owners = {t: o for t, o in c.execute("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'")}
    assert recorded == [(m.version, m.name) for m in migrations()]
    # run as SCO's role, so it owns what the migrations created
    assert owners["instance"] == names["user"] and owners["schema_migration"] == names["user"]
    [(owner,)] = admin_query(
        postgres, "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = %s", names["db"]
    )
    assert owner == names["user"]
    public_connect = admin_query(
        postgres,
        "SELECT 1 FROM pg_database d, aclexplode(d.datacl) a"
        " WHERE d.datname = %s AND a.grantee = 0 AND a.privilege_type = 'CONNECT'",
        names["db"],
    )
    assert public_connect == []  # PUBLIC (grantee 0) lost CONNECT
    env = tmp_path / "etc" / "fleet-state.env"
    assert oct(env.stat().st_mode & 0o777) == "0o600"
    line = next(x for x in env.read_text().splitlines() if x.startswith("SCO_DB_DSN="))
    with connect(line.split("=", 1)[1].strip('"')) as c:  # the DSN the control loop gets works
        assert c.execute("SELECT current_user").fetchone()[0] == names["user"]

    r = play(tmp_path, ev)
    assert r.rc == 0, output(r)
    assert changed(r) == 0, output(r)
    r = play(tmp_path, ev, check=True)
    assert r.rc == 0 and changed(r) == 0, output(r)

    # the DSN it hands to the plays that follow (control_loop_state_dsn) reaches the database as SCO's role
    handed = tmp_path / "handed-dsn"
    r = play(tmp_path, {**ev, "handed": str(handed)}, playbook=HAND_ON)
    assert r.rc == 0, output(r)
    with connect(handed.read_text()) as c:
        assert c.execute("SELECT current_user, current_database()").fetchone() == (names["user"], names["db"])


HAND_ON = """
- name: The role, then a play step that uses the DSN it hands on
  hosts: sco_control
  roles:
    - role: sco.orchestrator.fleet_state
  tasks:
    - name: Keep the DSN
      ansible.builtin.copy:
        content: "{{ fleet_state_dsn }}"
        dest: "{{ handed }}"
        mode: "0600"
"""


def test_check_mode_lists_pending_migrations_of_an_existing_database(
    postgres: Any, tmp_path: Path, names: dict[str, str]
) -> None:
    r = play(tmp_path, settings(postgres, tmp_path, names, fleet_state_migrate=False))
    assert r.rc == 0, output(r)
    r = play(tmp_path, settings(postgres, tmp_path, names), check=True)
    assert r.rc == 0, output(r)
    assert changed(r) == 1  # only the migrations are pending
    stdout = "\n".join(
        str(e["event_data"]["res"].get("stdout", ""))
        for e in r.events
        if e.get("event") == "runner_on_ok" and "res" in e.get("event_data", {})
    )
    first = migrations()[0]
    assert f"would apply {first.version:04d}_{first.name}" in stdout
    with connect(postgres.dsn(names["db"])) as c:
        assert c.execute("SELECT to_regclass('schema_migration')").fetchone()[0] is None  # nothing applied


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"fleet_state_db_password": "short"}, "fleet_state_db_password"),
        ({"fleet_state_db_password": "correct horse battery"}, "fleet_state_db_password"),
        ({"fleet_state_db_name": "Fleet-State"}, "fleet_state_db_name"),
        ({"fleet_state_port": 70000}, "fleet_state_port"),
        ({"fleet_state_ssl_mode": "sometimes"}, "fleet_state_ssl_mode"),
        ({"fleet_state_venv": "/nonexistent/venv"}, "fleet_state_venv"),
        ({"fleet_state_patroni_enabled": True}, "fleet_state_patroni_members"),
    ],
)
def test_bad_settings_fail_naming_the_variable(
    postgres: Any, tmp_path: Path, names: dict[str, str], over: dict[str, Any], named: str
) -> None:
    r = play(tmp_path, settings(postgres, tmp_path, names, **over))
    assert r.rc != 0
    failed = messages(r, "runner_on_failed")
    assert failed and named in failed[0], failed
    assert not admin_query(postgres, "SELECT 1 FROM pg_roles WHERE rolname = %s", names["user"])  # nothing done


def _ports_free_on(addrs: list[str], n: int) -> list[int]:
    """``n`` TCP ports free on every one of ``addrs`` (the members listen on the same ports, each on its address)."""
    import socket

    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind((addrs[0], 0))
            port = int(s.getsockname()[1])
        try:
            for a in addrs[1:]:
                with socket.socket() as s:
                    s.bind((a, port))
        except OSError:
            continue
        if port not in found:
            found.append(port)
    return found


def _unit(path: Path) -> dict[str, str]:
    """The [Service] settings of a unit file (each key once in the role's units)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        k, sep, v = line.partition("=")
        if sep and not line.startswith("#"):
            out.setdefault(k.strip(), v.strip())
    return out


def _log_tails(root: Path) -> str:
    return "\n".join(
        f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]) for f in root.glob("*/*.log")
    )


def _run_unit(path: Path, log: Path) -> subprocess.Popen[bytes]:
    """What systemd would run: ExecStart as the unit's User, with its Environment (no systemd as PID 1 here)."""
    import pwd
    import shlex

    u = _unit(path)
    pw = pwd.getpwnam(u["User"])
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/"}
    if "Environment" in u:
        k, _, v = u["Environment"].partition("=")
        env[k] = v
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return subprocess.Popen(
            shlex.split(u["ExecStart"]),
            user=pw.pw_uid,
            group=pw.pw_gid,
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
        )
    finally:
        os.close(fd)


def _listeners(port: int) -> set[str]:
    """The addresses something listens on at TCP ``port`` (IPv4 and IPv6, from /proc/net/tcp*)."""
    import ipaddress

    out = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(f).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.partition(":")
            if state != "0A" or int(p, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.add(str(ipaddress.ip_address(raw)))
    return out


def _tls_context(ca: Path, member: Path | None = None) -> ssl.SSLContext:
    """A client's TLS: the server's certificate checked against ``ca`` (and its name: check_hostname); with
    ``member`` (a member's certificate directory) that member's certificate presented as the client's."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if member is not None:
        ctx.load_cert_chain(str(member / "member.crt"), str(member / "member.key"))
    return ctx


def _http(
    method: str,
    url: str,
    body: object = None,
    *,
    source: str = "",
    auth: tuple[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    """One request from address ``source`` (any of 127/8 is this machine's): a stranger on the hall's network, or
    an allowed host; https with ``tls``."""
    import base64
    import http.client
    import json
    from urllib.parse import urlsplit

    u = urlsplit(url)
    src = (source, 0) if source else None
    c = (
        http.client.HTTPSConnection(u.hostname or "", u.port, timeout=10, source_address=src, context=tls)
        if u.scheme == "https"
        else http.client.HTTPConnection(u.hostname or "", u.port, timeout=10, source_address=src)
    )
    headers = {"Content-Type": "application/json", **(headers or {})}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        c.request(method, u.path, body=None if body is None else json.dumps(body), headers=headers)
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        c.close()


def _b64(s: str) -> str:
    import base64

    return base64.b64encode(s.encode()).decode()


def test_patroni_members_then_the_database_on_the_primary(names: dict[str, str]) -> None:
    """Three members on 127.0.0.1-3 (the same ports, as production's hosts): check mode changes nothing; the role
    renders etcd's and Patroni's settings and installs and enables their units without starting them (no systemd
    here); the units' command lines start a working cluster, in the role's order (etcd, its authentication, Patroni);
    the control host's run then creates the database on the primary, migrates it once and writes a DSN listing every
    member, and the members' part changes nothing the second time. TLS is on as by default: the
    hall's CA made on the controller, every link over TLS, plaintext refused, a certificate near expiry renewed."""
    import shutil
    import tempfile
    import urllib.request

    from sco_devkit.devcluster.patroni import kill_postgres

    addrs = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    pg, api, client, peer = _ports_free_on(addrs, 4)
    # not pytest's 0700 tmp_path: etcd and postgres must reach their directories
    root = Path(tempfile.mkdtemp(prefix="sco-role-patroni-"))
    os.chmod(root, 0o755)
    ca = root / "state" / "tls" / "ca.crt"
    members = {
        f"m{i}": {
            **LOCAL,
            "ansible_host": a,
            "fleet_state_patroni_config": str(root / f"m{i}" / "patroni" / "patroni.yml"),
            "fleet_state_patroni_data_dir": str(root / f"m{i}" / "pg" / "data"),
            "fleet_state_patroni_socket_dir": str(root / f"m{i}" / "pg"),
            "fleet_state_etcd_config": str(root / f"m{i}" / "etcd" / "etcd.yml"),
            "fleet_state_etcd_data_dir": str(root / f"m{i}" / "etcd" / "data"),
            "fleet_state_tls_member_dir": str(root / f"m{i}" / "tls"),
        }
        for i, a in enumerate(addrs)
    }
    inventory = {
        "all": {
            "children": {
                "sco_fleet_state": {"hosts": members},
                "sco_control": {"hosts": {"localhost": LOCAL}},
            }
        }
    }
    ev = {
        "fleet_state_patroni_enabled": True,
        "fleet_state_patroni_install": False,  # Debian's packages are on this machine (scripts/setup.sh)
        "_fleet_state_unit_dir": str(root) + "/{{ inventory_hostname }}/systemd",
        "fleet_state_port": pg,
        "fleet_state_patroni_restapi_port": api,
        "fleet_state_etcd_client_port": client,
        "fleet_state_etcd_peer_port": peer,
        "fleet_state_patroni_ttl": 10,
        "fleet_state_patroni_loop_wait": 1,
        "fleet_state_patroni_retry_timeout": 3,
        "fleet_state_patroni_allowed_networks": ["127.0.0.0/8"],
        "fleet_state_admin_password": "patroni-superuser-secret",
        "fleet_state_patroni_replication_password": "replication-secret",
        # what role hall generates under the hall's credentials directory
        "fleet_state_patroni_restapi_password": RESTAPI_PASSWORD,
        "fleet_state_etcd_root_password": "etcd-root-secret-" + os.urandom(4).hex(),
        "fleet_state_etcd_password": ETCD_PASSWORD,
        # TLS as by default (role hall: verify-full, the hall's CA made on the controller)
        "fleet_state_ssl_mode": "verify-full",
        "fleet_state_tls_ca_cert": str(ca),
        "fleet_state_tls_ca_key": str(root / "state" / "tls" / "ca.key"),
        "fleet_state_tls_generate_ca": True,
        "fleet_state_tls_dir": str(root / "state" / "tls" / "fleet-state"),
        "fleet_state_ssl_root_cert": str(root / "control" / "ca.crt"),
        "fleet_state_tls_textfile_dir": str(root / "control" / "textfile"),
        "fleet_state_db_name": names["db"],
        "fleet_state_db_user": names["user"],
        "fleet_state_db_password": "correct-horse-battery",
        "fleet_state_install": False,
        "fleet_state_venv": str(VENV),
        "fleet_state_dsn_file": str(root / "control" / "fleet-state.env"),
    }
    procs: list[subprocess.Popen[bytes]] = []
    tmp = root / "runs"
    tmp.mkdir()
    try:
        r = play(tmp, ev, inventory=inventory, limit="sco_fleet_state", check=True)
        assert r.rc == 0, output(r)
        assert changed(r, "m0") > 0 and not (root / "m0").exists(), output(r)  # says what it would do, does none
        r = play(tmp, ev, inventory=inventory, limit="sco_fleet_state")
        assert r.rc == 0, output(r)
        said = messages(r, "runner_on_ok")
        assert any("no systemd runs on m0" in m for m in said), said
        for m in members:
            units = root / m / "systemd"
            for u in ("sco-etcd.service", "sco-patroni.service"):
                assert (units / "multi-user.target.wants" / u).resolve() == units / u  # enabled
            for debian in ("etcd.service", "patroni.service", "postgresql.service"):
                assert os.readlink(units / debian) == "/dev/null"  # masked: no postinst starts them
        for u in ("sco-etcd.service", "sco-patroni.service"):
            # exits 0 even for a bad unit: what it says is the verdict
            v = subprocess.run(["systemd-analyze", "verify", str(root / "m0" / "systemd" / u)], capture_output=True)
            assert v.stderr.decode().strip() == "", v.stderr.decode()
        conf = yaml.safe_load((root / "m1" / "patroni" / "patroni.yml").read_text())
        assert conf["etcd3"]["hosts"] == [f"{a}:{client}" for a in addrs]
        assert conf["bootstrap"]["dcs"]["synchronous_mode"] is True
        assert conf["postgresql"]["bin_dir"] == "/usr/lib/postgresql/15/bin"
        etcd = yaml.safe_load((root / "m1" / "etcd" / "etcd.yml").read_text())
        assert etcd["initial-cluster"] == ",".join(f"m{i}=https://{a}:{peer}" for i, a in enumerate(addrs))
        assert etcd["client-transport-security"]["cert-file"] == str(root / "m1" / "tls" / "etcd" / "member.crt")
        assert etcd["peer-transport-security"]["client-cert-auth"] is True
        # the CA's key and the members' keys stay on the controller's state directory (0600) and the members
        assert oct((root / "state" / "tls" / "ca.key").stat().st_mode & 0o777) == "0o600"
        assert not (root / "m0" / "tls" / "etcd" / "ca.key").exists()
        assert oct((root / "m0" / "tls" / "patroni" / "member.key").stat().st_mode & 0o777) == "0o600"

        # what the units would run, in the role's order: etcd (each waits for a quorum), its authentication turned
        # on by the role's next run, then Patroni (which logs in to etcd when it starts)
        for m in members:
            procs.append(_run_unit(root / m / "systemd" / "sco-etcd.service", root / m / "etcd.log"))
        etcd_tls = _tls_context(ca)

        def etcd_up(a: str) -> bool:
            try:
                return _http("GET", f"https://{a}:{client}/health", tls=etcd_tls)[0] == 200
            except OSError:
                return False

        end = time.monotonic() + 60
        while not all(etcd_up(a) for a in addrs):
            assert all(p.poll() is None for p in procs), f"a daemon exited:\n{_log_tails(root)}"
            assert time.monotonic() < end, f"no etcd quorum within 60 s:\n{_log_tails(root)}"
            time.sleep(0.3)
        r = play(tmp, ev, inventory=inventory, limit="sco_fleet_state")
        assert r.rc == 0, output(r)
        # etcd answers now: the first member turned its authentication on (root, and Patroni's user and role)
        assert changed(r, "m0") > 0 and [changed(r, m) for m in ("m1", "m2")] == [0, 0], output(r)
        for m in members:
            procs.append(_run_unit(root / m / "systemd" / "sco-patroni.service", root / m / "patroni.log"))

        tls = _tls_context(ca)

        def status(a: str, path: str) -> int:
            try:
                with urllib.request.urlopen(f"https://{a}:{api}{path}", timeout=2, context=tls) as resp:
                    return int(resp.status)
            except OSError as e:
                return int(getattr(e, "code", 0) or 0)

        end = time.monotonic() + 90
        while time.monotonic() < end:
            if all(status(a, "/health") == 200 for a in addrs) and any(status(a, "/sync") == 200 for a in addrs):
                break
            assert all(p.poll() is None for p in procs), f"a daemon exited:\n{_log_tails(root)}"
            time.sleep(0.3)
        else:
            raise AssertionError(f"no healthy cluster within 90 s:\n{_log_tails(root)}")

        r = play(tmp, ev, inventory=inventory)
        assert r.rc == 0, output(r)
        assert [changed(r, m) for m in members] == [0, 0, 0], output(r)  # the members' part is idempotent
        for secret in (RESTAPI_PASSWORD, ETCD_PASSWORD, ev["fleet_state_etcd_root_password"]):
            assert secret not in output(r)
        env = (root / "control" / "fleet-state.env").read_text()
        dsn = next(x for x in env.splitlines() if x.startswith("SCO_DB_DSN=")).split("=", 1)[1].strip('"')
        assert f"host={','.join(addrs)} port={pg} " in dsn and "target_session_attrs=read-write" in dsn
        assert f"sslmode=verify-full sslrootcert={root / 'control' / 'ca.crt'} " in dsn
        with connect(dsn) as c:
            assert c.execute("SELECT pg_is_in_recovery(), current_user").fetchone() == (False, names["user"])
            assert sorted(c.execute("SELECT version FROM schema_migration").fetchall()) == [
                (m.version,) for m in migrations()
            ]
            primary = c.info.host
        # synchronous replication is in force on the primary the role's settings made
        admin = f"host={primary} port={pg} user=postgres password=patroni-superuser-secret dbname=postgres"
        admin += f" sslmode=verify-full sslrootcert={ca}"
        with connect(admin) as c:
            assert "sync" in [row[0] for row in c.execute("SELECT sync_state FROM pg_stat_replication")]
            # the standbys stream from the primary over TLS (Patroni's replication connection, verify-full)
            assert {row[0] for row in c.execute(
                "SELECT s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)")} == {True}  # fmt: skip

        _strangers_are_refused(root, addrs, api, client, peer, pg)
        _plaintext_is_refused(root, addrs, api, client, peer, pg, dsn)
        _expiry_textfile(root, ca)
        _renewed_near_expiry(tmp, ev, inventory, root, addrs, client, pg)

    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for m in members:
            kill_postgres(root / m / "pg" / "data")
        shutil.rmtree(root, ignore_errors=True)


def _purge_after_a_keep_run_over_verify_full(
    tmp: Path, ev: dict[str, Any], inventory: dict[str, Any], root: Path, names: dict[str, str], wheelhouse: Path
) -> None:
    """uninstall.yml's keep run then its purge, on the control host, while the member runs: the keep run removed the
    venv and the CA the clients checked the server with, so the purge drops the database and the role with a driver
    made for the run from the wheelhouse, checking the server's certificate (verify-full) against the hall's CA it
    copies; the scratch goes, and a second purge changes nothing. hall-uninstall runs this path in plaintext."""
    control = {"all": {"children": {**inventory["all"]["children"], "sco_control": {"hosts": {"localhost": LOCAL}}}}}
    client = {
        **ev,
        "fleet_state_dsn_file": str(root / "control" / "fleet-state.env"),
        "fleet_state_ssl_root_cert": str(root / "control" / "ca.crt"),
        "fleet_state_tls_textfile_dir": str(root / "control" / "textfile"),
    }
    r = play(tmp, client, inventory=control, limit="sco_control")  # the database and role, on the primary
    assert r.rc == 0, output(r)
    ca = root / "state" / "tls" / "ca.crt"
    admin = (f"host=127.0.0.1 port={ev['fleet_state_port']} user=postgres password={ev['fleet_state_admin_password']}"
             f" dbname=postgres sslmode=verify-full sslrootcert={ca}")  # fmt: skip

    def left() -> tuple[bool, bool]:
        with connect(admin) as c:
            db = c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (names["db"],)).fetchone()
            role = c.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (names["user"],)).fetchone()
        return db is not None, role is not None

    assert left() == (True, True)
    # a run that failed after the fleet state's play: the CA is gone, the venv stays (it goes with its last unit, in a
    # later play). The next purge failed on the missing CA file before: it now checks against a scratch copy.
    r = play(tmp, {**client, "fleet_state_state": "absent"}, inventory=control, limit="sco_control")
    assert r.rc == 0 and not (root / "control" / "ca.crt").exists() and VENV.exists(), output(r)
    r = play(tmp, {**client, "fleet_state_state": "absent", "fleet_state_purge_data": True}, inventory=control,
             limit="sco_control")  # fmt: skip
    assert r.rc == 0 and left() == (False, False), output(r)
    r = play(tmp, client, inventory=control, limit="sco_control")
    assert r.rc == 0 and left() == (True, True), output(r)
    # the keep run: what the hall installed on the control host goes (a venv of its own, here a path beside /opt)
    (root / "opt").mkdir()
    gone = {**client, "fleet_state_venv": str(root / "opt" / "sco"), "fleet_state_wheelhouse": str(wheelhouse),
            "fleet_state_state": "absent"}  # fmt: skip
    r = play(tmp, gone, inventory=control, limit="sco_control")
    assert r.rc == 0, output(r)
    assert not (root / "control" / "ca.crt").exists() and not (root / "control" / "fleet-state.env").exists()
    assert left() == (True, True)  # kept
    r = play(tmp, {**gone, "fleet_state_purge_data": True}, inventory=control, limit="sco_control")
    assert r.rc == 0, output(r)
    assert left() == (False, False), output(r)
    assert list((root / "opt").iterdir()) == []  # the driver's scratch (venv, wheels, CA) removed
    r = play(tmp, {**gone, "fleet_state_purge_data": True}, inventory=control, limit="sco_control")
    assert r.rc == 0 and changed(r) == 0, output(r)
    # the CA the driver checked against was the hall's: with another, the same purge fails on the certificate
    # (a driver that did not verify would have dropped the database all the same)
    r = play(tmp, client, inventory=control, limit="sco_control")
    assert r.rc == 0 and left() == (True, True), output(r)
    r = play(tmp, gone, inventory=control, limit="sco_control")
    assert r.rc == 0, output(r)
    other = root / "other-ca"
    other.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(other / "ca.key"), "-out", str(other / "ca.crt"), "-days", "1",
                    "-subj", "/CN=other"], check=True, capture_output=True)  # fmt: skip
    wrong = {"fleet_state_tls_ca_cert": str(other / "ca.crt"), "fleet_state_tls_ca_key": str(other / "ca.key")}
    r = play(tmp, {**gone, "fleet_state_purge_data": True, **wrong}, inventory=control, limit="sco_control")
    assert r.rc != 0 and "certificate verify failed" in output(r), output(r)
    assert left() == (True, True)
    assert list((root / "opt").iterdir()) == []
    r = play(tmp, {**gone, "fleet_state_purge_data": True}, inventory=control, limit="sco_control")
    assert r.rc == 0 and left() == (False, False), output(r)


def _alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def test_a_patroni_member_removed_keeps_its_data_unless_purged(names: dict[str, str], wheelhouse: Path) -> None:
    """State absent on a Patroni member: one member on 127.0.0.1, run by the role itself as a host without
    systemd asks (fleet_state_patroni_run_without_systemd: etcd and Patroni as daemons with pid files), TLS on as by
    default. Absent stops Patroni (and its PostgreSQL) and etcd and removes their units, Debian's units the role
    masked, etcd's and Patroni's settings, the member's certificates and the replication passfile; the data
    directories stay; a second run changes nothing; with fleet_state_purge_data the data directories go too, and
    again nothing changes. Before: the role refused absent on a member ('not supported yet')."""
    import shutil
    import tempfile
    import urllib.request

    from sco_devkit.devcluster.patroni import kill_postgres

    pg, api, client, peer = _ports_free_on(["127.0.0.1"], 4)
    root = Path(tempfile.mkdtemp(prefix="sco-role-patroni-absent-"))
    os.chmod(root, 0o755)  # etcd and postgres reach their directories below it
    m = root / "m0"
    member = {
        **LOCAL,
        "ansible_host": "127.0.0.1",
        "fleet_state_patroni_config": str(m / "patroni" / "patroni.yml"),
        "fleet_state_patroni_data_dir": str(m / "pg" / "data"),
        "fleet_state_patroni_socket_dir": str(m / "pg"),
        "fleet_state_etcd_config": str(m / "etcd" / "etcd.yml"),
        "fleet_state_etcd_data_dir": str(m / "etcd" / "data"),
        "fleet_state_tls_member_dir": str(m / "tls"),
    }
    inventory = {"all": {"children": {"sco_fleet_state": {"hosts": {"m0": member}}}}}
    ev = {
        "fleet_state_patroni_enabled": True,
        "fleet_state_patroni_install": False,  # Debian's packages are on this machine (scripts/setup.sh)
        "fleet_state_patroni_run_without_systemd": True,
        "_fleet_state_unit_dir": str(root) + "/{{ inventory_hostname }}/systemd",
        "fleet_state_port": pg,
        "fleet_state_patroni_restapi_port": api,
        "fleet_state_etcd_client_port": client,
        "fleet_state_etcd_peer_port": peer,
        "fleet_state_patroni_ttl": 10,
        "fleet_state_patroni_loop_wait": 1,
        "fleet_state_patroni_retry_timeout": 3,
        "fleet_state_patroni_allowed_networks": ["127.0.0.0/8"],
        "fleet_state_admin_password": "patroni-superuser-secret",
        "fleet_state_patroni_replication_password": "replication-secret",
        "fleet_state_patroni_restapi_password": RESTAPI_PASSWORD,
        "fleet_state_etcd_root_password": "etcd-root-secret-" + os.urandom(4).hex(),
        "fleet_state_etcd_password": ETCD_PASSWORD,
        "fleet_state_ssl_mode": "verify-full",
        "fleet_state_tls_ca_cert": str(root / "state" / "tls" / "ca.crt"),
        "fleet_state_tls_ca_key": str(root / "state" / "tls" / "ca.key"),
        "fleet_state_tls_generate_ca": True,
        "fleet_state_tls_dir": str(root / "state" / "tls" / "fleet-state"),
        "fleet_state_db_name": names["db"],
        "fleet_state_db_user": names["user"],
        "fleet_state_db_password": "correct-horse-battery",
        "fleet_state_install": False,
        "fleet_state_venv": str(VENV),
    }
    pidfiles = [Path("/run/sco-patroni.pid"), Path("/run/sco-etcd.pid")]
    assert not any(p.exists() for p in pidfiles), "another run's daemons hold the role's pid files"
    units = m / "systemd"
    configs = [m / "patroni" / "patroni.yml", m / "etcd" / "etcd.yml", m / "tls"]
    tmp = root / "runs"
    tmp.mkdir()
    try:
        r = play(tmp, ev, inventory=inventory, limit="sco_fleet_state")
        assert r.rc == 0, output(r)
        assert all(_alive(p) for p in pidfiles), output(r)
        ctx = _tls_context(root / "state" / "tls" / "ca.crt")
        with urllib.request.urlopen(f"https://127.0.0.1:{api}/primary", timeout=5, context=ctx) as resp:
            assert resp.status == 200  # a working one-member cluster, its PostgreSQL the primary
        assert [p for p in configs if not p.exists()] == []
        assert (units / "sco-patroni.service").exists() and os.readlink(units / "etcd.service") == "/dev/null"

        _purge_after_a_keep_run_over_verify_full(tmp, ev, inventory, root, names, wheelhouse)

        r = play(tmp, {**ev, "fleet_state_state": "absent"}, inventory=inventory, limit="sco_fleet_state")
        assert r.rc == 0, output(r)
        assert changed(r, "m0") > 0, output(r)
        assert not any(_alive(p) or p.exists() for p in pidfiles)
        pg_status = subprocess.run(["runuser", "-u", "postgres", "--", "/usr/lib/postgresql/15/bin/pg_ctl", "status",
                                    "-D", str(m / "pg" / "data")], capture_output=True, text=True)  # fmt: skip
        assert pg_status.returncode == 3, pg_status.stdout  # 3: no server running on the data directory
        assert _listeners(pg) == set() and _listeners(client) == set() and _listeners(api) == set()
        assert sorted(p.name for p in units.rglob("*")) == ["multi-user.target.wants"], list(units.rglob("*"))
        # (Patroni writes the replication passfile where a replica bootstraps: a one-member cluster has none)
        assert [p for p in [*configs, m / "pg" / ".pgpass-sco-fleet"] if p.exists()] == []
        # the data: PostgreSQL's cluster and etcd's member directory
        assert (m / "pg" / "data" / "PG_VERSION").is_file() and (m / "etcd" / "data" / "member").is_dir()

        r = play(tmp, {**ev, "fleet_state_state": "absent"}, inventory=inventory, limit="sco_fleet_state")
        assert r.rc == 0 and changed(r, "m0") == 0, output(r)

        # uninstall.yml's purge after that keep run reaches the control hosts first: their venv went with the keep
        # run and no member answers. It said nothing and exited 0 before 278372b; with it, every control host failed
        # on "connection refused" and the members' purge never ran (review of the purge fix). It now says who
        # removes the database, and goes on.
        control = {**inventory["all"]["children"], "sco_control": {"hosts": {"localhost": LOCAL}}}
        purge_control = {**ev, "fleet_state_state": "absent", "fleet_state_purge_data": True,
                         "fleet_state_venv": str(root / "gone" / "venv"),
                         "fleet_state_dsn_file": str(root / "control" / "fleet-state.env"),
                         "fleet_state_ssl_root_cert": str(root / "control" / "ca.crt"),
                         "fleet_state_tls_textfile_dir": str(root / "control" / "textfile")}  # fmt: skip
        r = play(tmp, purge_control, inventory={"all": {"children": control}}, limit="sco_control")
        out = output(r)
        assert r.rc == 0 and changed(r) == 0, out
        assert f"no Patroni member answers on port {pg}: database {names['db']} goes with the members' data" in out

        purge = {**ev, "fleet_state_state": "absent", "fleet_state_purge_data": True}
        r = play(tmp, purge, inventory=inventory, limit="sco_fleet_state")
        assert r.rc == 0 and changed(r, "m0") > 0, output(r)
        assert not (m / "pg").exists() and not (m / "etcd").exists(), list(m.rglob("*"))
        r = play(tmp, purge, inventory=inventory, limit="sco_fleet_state")
        assert r.rc == 0 and changed(r, "m0") == 0, output(r)
    finally:
        for p in pidfiles:
            if _alive(p):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(p.read_text().strip()), signal.SIGKILL)
            p.unlink(missing_ok=True)
        kill_postgres(m / "pg" / "data")
        shutil.rmtree(root, ignore_errors=True)


def test_the_database_password_is_on_no_command_line_environment_or_output(
    postgres: Any, tmp_path: Path, names: dict[str, str]
) -> None:
    """The migrations got the password in PGPASSWORD through the environment keyword, which
    Ansible puts on the target's `/bin/sh -c 'PGPASSWORD=... python ...'` line (every local user's `ps`, and -vvv's
    EXEC line) and into `sco db migrate`'s environment. A ps sampler runs through a -vvv --diff converge."""
    secret = "pw-" + os.urandom(12).hex()  # of this test alone: no other process on the machine has it
    ev = settings(postgres, tmp_path, names, fleet_state_db_password=secret)
    with ProcSampler(secret) as ps:
        r = play(tmp_path, ev, flags=("-vvv", "--diff"))
    assert r.rc == 0, output(r)
    assert ps.passes > 10, ps.passes  # it did look, all along the run
    assert sorted(set(ps.seen)) == [], sorted(set(ps.seen))
    assert secret not in output(r)
    # the artifacts (ansible-runner's events, stdout, command line); env/ is this test's own input
    assert files_showing(Path(r.config.artifact_dir), secret) == []
    with connect(postgres.dsn(names["db"])) as c:  # and it did migrate, as SCO's role with that password
        assert c.execute("SELECT count(*) FROM schema_migration").fetchone()[0] == len(migrations())
    env = (tmp_path / "etc" / "fleet-state.env").read_text()
    with connect(env.split("SCO_DB_DSN=", 1)[1].strip().strip('"')) as c:
        assert c.execute("SELECT current_user").fetchone()[0] == names["user"]
    # nothing of the password is left on the target but the DSN file (a passfile the run made is gone)
    assert not list(Path("/tmp").glob("ansible.*sco-passfile*"))


RESTAPI_PASSWORD = "restapi-secret-" + os.urandom(4).hex()
ETCD_PASSWORD = "etcd-patroni-secret-" + os.urandom(4).hex()
STRANGER = "127.0.0.9"  # on the members' network (this machine's 127/8), in no inventory


def _strangers_are_refused(root: Path, addrs: list[str], api: int, client: int, peer: int, pg: int) -> None:
    """Against the cluster the role's settings made: every listener on the members' own
    addresses; Patroni's unsafe endpoints refuse a request without the role's credentials (401) and one from an
    address not allowed (403); etcd refuses a write without a user, even over a member's certificate; Patroni, on
    etcd with authentication, still elects a leader (an authenticated switchover from an allowed host)."""
    import json

    for port in (api, client, peer, pg):
        assert _listeners(port) == set(addrs), (port, _listeners(port))  # never 0.0.0.0, each on its own

    ca = root / "state" / "tls" / "ca.crt"
    tls = _tls_context(ca)

    def leader() -> str:
        members = json.loads(_http("GET", f"https://{addrs[0]}:{api}/cluster", tls=tls)[1])["members"]
        return str(next(m["name"] for m in members if m["role"] == "leader"))

    old = leader()
    creds = ("patroni", RESTAPI_PASSWORD)
    switch = {"leader": old}
    a0, a1 = (f"https://{a}:{api}" for a in addrs[:2])
    attempts = {
        "unauthenticated switchover, allowed host": _http("POST", f"{a1}/switchover", switch, tls=tls),
        "unauthenticated config patch, allowed host": _http(
            "PATCH", f"{a1}/config", {"postgresql": {"parameters": {"archive_command": "id"}}}, tls=tls
        ),
        "unauthenticated restart, allowed host": _http("POST", f"{a1}/restart", {}, tls=tls),
        "wrong password": _http("POST", f"{a1}/switchover", switch, auth=("patroni", "guess"), tls=tls),
        "stranger, unauthenticated": _http("POST", f"{a0}/switchover", switch, source=STRANGER, tls=tls),
        "stranger, authenticated": _http("PATCH", f"{a0}/config", {"ttl": 5}, source=STRANGER, auth=creds, tls=tls),
    }
    codes = {k: v[0] for k, v in attempts.items()}
    assert codes == {
        "unauthenticated switchover, allowed host": 401,
        "unauthenticated config patch, allowed host": 401,
        "unauthenticated restart, allowed host": 401,
        "wrong password": 401,
        "stranger, unauthenticated": 403,
        "stranger, authenticated": 403,
    }, attempts
    config = json.loads(_http("GET", f"{a0}/config", tls=tls)[1])
    assert "archive_command" not in json.dumps(config) and config["ttl"] == 10, config

    # etcd (over TLS; its client port takes no plain HTTP): a write without a user is refused, a read too; Patroni's
    # user only under its own prefix
    member = tls
    put = {"key": _b64("/service/sco-fleet/leader"), "value": _b64("stranger")}
    for a in addrs:
        status, body = _http("POST", f"https://{a}:{client}/v3/kv/put", put, source=STRANGER, tls=member)
        assert status in (400, 401, 403) and "user name is empty" in body, (a, status, body)
        status, body = _http("POST", f"https://{a}:{client}/v3/kv/range", {"key": put["key"]}, source=STRANGER,
                             tls=member)  # fmt: skip
        assert status in (400, 401, 403), (a, status, body)
    status, body = _http("POST", f"https://{addrs[0]}:{client}/v3/auth/authenticate",
                         {"name": "patroni", "password": ETCD_PASSWORD}, tls=member)  # fmt: skip
    token = json.loads(body)["token"]
    status, body = _http("POST", f"https://{addrs[0]}:{client}/v3/kv/put",
                         {"key": _b64("/elsewhere"), "value": _b64("x")}, tls=member,
                         headers={"Authorization": token})  # fmt: skip
    assert status == 403 and "permission denied" in body, (status, body)
    assert leader() == old  # nothing moved it

    # the operator's way, from an allowed host with the role's credentials: Patroni (its etcd user) moves the leader
    status, body = _http("POST", f"{a1}/switchover", switch, auth=creds, tls=tls)
    assert status == 200, (status, body)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            new = leader()
        except (OSError, StopIteration, ValueError):
            new = old
        if new != old:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no new leader within 60 s:\n{_log_tails(root)}")
    patroni_logs = "".join(f.read_text(errors="replace") for f in root.glob("*/patroni.log"))
    assert RESTAPI_PASSWORD not in patroni_logs and ETCD_PASSWORD not in patroni_logs


def _plain_http_refused(addr: str, port: int) -> str:
    """What refused a plain HTTP request (a closed connection, a reset), or "" when it was answered."""
    import http.client

    c = http.client.HTTPConnection(addr, port, timeout=5)
    try:
        c.request("GET", "/health")
        c.getresponse().read()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        c.close()
    return ""


def _tls_refused(url: str, tls: ssl.SSLContext) -> str:
    """What refused an https request (a TLS alert: no client certificate), or "" when it was answered."""
    try:
        _http("GET", url, tls=tls)
    except OSError as e:  # ssl.SSLError is one
        return f"{type(e).__name__}: {e}"
    return ""


def _other_ca(path: Path) -> Path:
    """A CA of someone else's (self-signed), which signed nothing of the hall's."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _plaintext_is_refused(root: Path, addrs: list[str], api: int, client: int, peer: int, pg: int, dsn: str) -> None:
    """Fleet state: no link to a member works without TLS, etcd's peer port not without a
    certificate the CA signed; a client with verify-full against the CA works, against another CA it does not."""
    import psycopg

    ca = root / "state" / "tls" / "ca.crt"
    other = _other_ca(root / "other-ca.crt")

    def healthy(a: str) -> bool:  # running PostgreSQL again (the old primary rejoins after the switchover)
        try:
            return _http("GET", f"https://{a}:{api}/health", tls=_tls_context(ca))[0] == 200
        except OSError:
            return False

    end = time.monotonic() + 60
    while not all(healthy(a) for a in addrs):
        assert time.monotonic() < end, f"a member not running again within 60 s:\n{_log_tails(root)}"
        time.sleep(0.3)
    for a in addrs:
        # PostgreSQL: a connection without TLS is refused by pg_hba before any password is asked for
        with pytest.raises(psycopg.OperationalError) as no_tls:
            psycopg.connect(f"host={a} port={pg} dbname=postgres user=postgres password=x sslmode=disable",
                            connect_timeout=5)  # fmt: skip
        assert "no encryption" in str(no_tls.value), str(no_tls.value)
        # verify-full against another CA (a server it cannot tell from an impostor) fails before any login
        with pytest.raises(psycopg.OperationalError) as unknown:
            psycopg.connect(f"host={a} port={pg} dbname=postgres user=x sslmode=verify-full sslrootcert={other}",
                            connect_timeout=5)  # fmt: skip
        assert "certificate verify failed" in str(unknown.value), str(unknown.value)
        # etcd: plain HTTP gets no answer on either port; the peer port refuses TLS without a certificate the CA
        # signed (joining as a member), and answers a member's
        for port in (client, peer):
            assert _plain_http_refused(a, port), (a, port, "plain HTTP answered")
        assert _tls_refused(f"https://{a}:{peer}/version", _tls_context(ca)), (a, "peer port took no certificate")
        assert _http("GET", f"https://{a}:{peer}/version", tls=_tls_context(ca, root / "m0" / "tls" / "etcd"))[0] == 200
        assert _http("GET", f"https://{a}:{client}/version", tls=_tls_context(ca))[0] == 200
        # Patroni's REST API: https only
        assert _plain_http_refused(a, api), (a, "Patroni answered plain HTTP")
        assert _http("GET", f"https://{a}:{api}/health", tls=_tls_context(ca))[0] in (200, 503)
    # the control loop's DSN: verify-full against the CA, over TLS
    with connect(dsn) as c:
        assert c.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0] is True
        assert c.info.get_parameters()["sslmode"] == "verify-full"


def _cert_info(pem: str) -> Any:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem.encode())


def _served(addr: str, port: int, ca: Path, member: Path | None = None, starttls: str = "") -> Any:
    """The certificate a member's listener presents (openssl s_client; PostgreSQL's TLS begins after its own
    request)."""
    argv = ["openssl", "s_client", "-connect", f"{addr}:{port}", "-CAfile", str(ca), "-showcerts"]
    if starttls:
        argv += ["-starttls", starttls]
    if member is not None:
        argv += ["-cert", str(member / "member.crt"), "-key", str(member / "member.key")]
    out = subprocess.run(argv, input="", capture_output=True, text=True, timeout=15).stdout
    begin = out.index("-----BEGIN CERTIFICATE-----")
    end = out.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")
    return _cert_info(out[begin:end])


def _expiry_textfile(root: Path, ca: Path) -> None:
    """Alert ScoCertificateExpiring's input: the control host's textfile holds the CA's and every member's expiry."""
    text = (root / "control" / "textfile" / "sco_certificates.prom").read_text()
    series = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sco_")
    }
    want = {
        'sco_certificate_expiry_timestamp_seconds{certificate="fleet_state_ca",host=""}': _cert_info(ca.read_text())
    }
    for m in ("m0", "m1", "m2"):
        key = f'sco_certificate_expiry_timestamp_seconds{{certificate="fleet_state_member",host="{m}"}}'
        want[key] = _cert_info((root / "state" / "tls" / "fleet-state" / f"{m}.crt").read_text())
    assert set(series) == set(want), text
    for k, cert in want.items():
        assert series[k] == cert.not_valid_after_utc.timestamp(), (k, series[k])


def _renewed_near_expiry(
    tmp: Path, ev: dict[str, Any], inventory: dict[str, Any], root: Path, addrs: list[str], client: int, pg: int
) -> None:
    """A member's certificate within the renewal margin of its expiry (a margin longer than its whole life stands in
    for a year gone by) is renewed by the next run: signed anew on the controller, copied, and served by etcd and
    PostgreSQL without a restart; the run after that changes nothing."""
    ca = root / "state" / "tls" / "ca.crt"
    etcd_dir = root / "m0" / "tls" / "etcd"
    before = {
        m: _cert_info((root / "state" / "tls" / "fleet-state" / f"{m}.crt").read_text()) for m in ("m0", "m1", "m2")
    }
    assert _served(addrs[0], pg, ca, starttls="postgres").serial_number == before["m0"].serial_number
    r = play(tmp, {**ev, "fleet_state_tls_renew_days": 400}, inventory=inventory, limit="sco_fleet_state")
    assert r.rc == 0, output(r)
    assert all(changed(r, m) > 0 for m in ("m0", "m1", "m2")), output(r)
    for i, m in enumerate(("m0", "m1", "m2")):
        after = _cert_info((root / "state" / "tls" / "fleet-state" / f"{m}.crt").read_text())
        assert (
            after.serial_number != before[m].serial_number and after.not_valid_after_utc > before[m].not_valid_after_utc
        )
        assert (root / m / "tls" / "patroni" / "member.crt").read_text() == (
            root / "state" / "tls" / "fleet-state" / f"{m}.crt"
        ).read_text()
        # served: etcd reads its files on every handshake, PostgreSQL after the role's SIGHUP
        assert _served(addrs[i], client, ca, etcd_dir).serial_number == after.serial_number
        end = time.monotonic() + 10
        while _served(addrs[i], pg, ca, starttls="postgres").serial_number != after.serial_number:
            assert time.monotonic() < end, f"{m}'s PostgreSQL still serves the old certificate"
            time.sleep(0.2)
    r = play(tmp, ev, inventory=inventory, limit="sco_fleet_state")
    assert r.rc == 0, output(r)
    assert [changed(r, m) for m in ("m0", "m1", "m2")] == [0, 0, 0], output(r)


def test_cli_migrate_check_applies_nothing(postgres: Any, names: dict[str, str]) -> None:
    postgres.create_database(names["db"])
    cmd = [str(VENV / "bin" / "sco"), "db", "migrate", "--dsn", postgres.dsn(names["db"])]
    out = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=True).stdout
    assert [x for x in out.splitlines() if x.startswith("would apply")] == [
        f"would apply {m.version:04d}_{m.name}" for m in migrations()
    ]
    with connect(postgres.dsn(names["db"])) as c:
        assert c.execute("SELECT to_regclass('schema_migration')").fetchone()[0] is None
    subprocess.run(cmd, capture_output=True, check=True)
    out = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "fleet state up to date"


def test_installs_the_collections_release_with_the_state_extra() -> None:
    coll = REPO / "collections" / "ansible_collections" / "sco" / "orchestrator"
    release = str(yaml.safe_load((coll / "galaxy.yml").read_text())["version"])
    defaults = yaml.safe_load((coll / "roles" / "fleet_state" / "defaults" / "main.yml").read_text())
    # the release comes with the hall-wide settings (role hall: sco_version, which an inventory may pin)
    hall = yaml.safe_load((coll / "roles" / "hall" / "defaults" / "main.yml").read_text())
    assert hall["fleet_state_version"] == "{{ sco_version }}" and str(hall["sco_version"]) == release
    assert defaults["fleet_state_package"] == "spot-capacity-orchestrator[state]=={{ fleet_state_version }}"
    spec = yaml.safe_load((coll / "roles" / "fleet_state" / "meta" / "argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    # every default (the role's own and the ones role hall maps) is documented in the argument spec, and nothing is
    # documented that has no default except what is required
    mapped = {k for k in hall if k.startswith("fleet_state_")}
    required = {k for k, o in options.items() if o.get("required")}
    assert set(options) == set(defaults) | mapped | required


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """spot-capacity-orchestrator with its state extra as wheels: what an air-gapped database host installs."""
    from sco_devkit import wheels

    w = wheels.build(tmp_path_factory.mktemp("wheelhouse"), f"{REPO}[state]")
    return w


@pytest.mark.slow
def test_installs_the_product_then_creates_the_fleet_state(
    postgres: Any, tmp_path: Path, names: dict[str, str], wheelhouse: Path
) -> None:
    venv = tmp_path / "opt-sco"
    ev = settings(
        postgres,
        tmp_path,
        names,
        fleet_state_install=True,
        fleet_state_venv=str(venv),
        fleet_state_wheelhouse=str(wheelhouse),
    )
    r = play(tmp_path, ev, check=True)
    assert r.rc == 0, output(r)
    said = messages(r, "runner_on_ok")
    assert any(f"check mode: {venv} does not exist yet" in m for m in said), said
    assert not venv.exists()
    assert not admin_query(postgres, "SELECT 1 FROM pg_roles WHERE rolname = %s", names["user"])

    r = play(tmp_path, ev)
    assert r.rc == 0, output(r)
    pkgs = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout.lower()
    assert "spot-capacity-orchestrator==" in pkgs and "psycopg==" in pkgs
    # the database host gets what it runs: no cloud, scheduler or runner client, no solver
    assert not {"openstacksdk", "kubernetes", "ansible-runner", "highspy", "pydantic"} & {
        line.split("==")[0] for line in pkgs.splitlines()
    }, pkgs
    with connect(postgres.dsn(names["db"])) as c:
        assert [row[0] for row in c.execute("SELECT version FROM schema_migration ORDER BY 1")] == [
            m.version for m in migrations()
        ]
    r = play(tmp_path, ev)
    assert r.rc == 0 and changed(r) == 0, output(r)
