"""The fleet state on a real Patroni cluster (Debian's patroni 3.0.2, etcd 3.4, PostgreSQL 15; three members on
loopback, sco_devkit.devcluster.patroni): the multi-host DSN the control loop, the reclaimer and the drill use
reaches the primary, `sco db migrate` migrates the primary once and refuses a standby, and after the primary's
host is lost (SIGKILL to its Patroni and PostgreSQL) every acknowledged write is on the new primary and the hall's
writer lock moves with it. The failover time is printed, never asserted (benchmarks/bench_fleet_state_failover.py
measures it over several kills)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from sco.errors import ConfigError
from sco.state.db import StateError, applied, check_dsn, connect, hall_lock, migrate, migrations
from sco.state.fleet import FleetState, Pool
from sco_devkit.devcluster.patroni import SUPERUSER_PASSWORD, PatroniCluster
from tests.cli_run import SCO, one_line_error, sco
from tests.harness import wait_for

DB = "sco_fleet"


@pytest.fixture(scope="module")
def cluster() -> Iterator[PatroniCluster]:
    c = PatroniCluster()
    try:
        c.start(timeout=90)
        with connect(c.dsn()) as conn:
            conn.execute(f"CREATE DATABASE {DB}")
        yield c
    finally:
        c.destroy()


def server(conn: Any) -> tuple[int, bool]:
    port, standby = conn.execute("SELECT inet_server_port(), pg_is_in_recovery()").fetchone()
    return int(port), bool(standby)


def caught_up(cluster: PatroniCluster, primary: Any, standby: Any, timeout: float = 60) -> None:
    """Until the standby has replayed everything the primary has written so far. Synchronous replication waits for
    one standby's flush, not its replay, and the other standby is asynchronous: a read on a standby right after a
    commit (the CREATE DATABASE of the fixture, a migration) may not see it yet."""
    with psycopg.connect(cluster.member_dsn(primary), autocommit=True, connect_timeout=3) as c:
        row = c.execute("SELECT pg_current_wal_lsn()").fetchone()
    assert row is not None
    target = row[0]

    def replayed() -> bool:
        try:
            with psycopg.connect(cluster.member_dsn(standby), autocommit=True, connect_timeout=3) as c:
                row = c.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()
                return bool(row and row[0])
        except psycopg.OperationalError:
            return False

    wait_for(replayed, timeout, f"standby {standby.name} to replay the primary's WAL up to {target}", interval=0.1)


def without_target(dsn: str) -> str:
    return " ".join(x for x in dsn.split() if not x.startswith("target_session_attrs="))


def test_the_multi_host_dsn_reaches_the_primary_whatever_the_order(cluster: PatroniCluster) -> None:
    primary = cluster.wait_healthy()
    standbys = [m for m in cluster.members if m is not primary]
    # the standbys first: libpq tries them in order and must skip them
    order = [*standbys, primary]
    dsn = (
        f"host={','.join('127.0.0.1' for _ in order)} port={','.join(str(m.pg_port) for m in order)}"
        f" dbname={DB} user=postgres password={SUPERUSER_PASSWORD}"
    )
    with connect(dsn + " target_session_attrs=read-write") as c:
        assert server(c) == (primary.pg_port, False)
    # connect() asks for read-write itself when the DSN lists several hosts and says nothing
    with connect(dsn) as c:
        assert server(c) == (primary.pg_port, False)

    # plain libpq without it lands on the first standby: what connect() guards against. That standby must be
    # taking connections first: a member Patroni reports healthy may still refuse them for a moment (libpq then
    # goes on to the next host, and this would land on the primary for that reason instead)
    def takes_connections() -> bool:
        try:
            with psycopg.connect(cluster.member_dsn(standbys[0], DB), autocommit=True, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    wait_for(takes_connections, 60, f"standby {standbys[0].name} to take connections")
    with psycopg.connect(dsn, autocommit=True) as c:
        assert server(c) == (standbys[0].pg_port, True)


def test_a_dsn_whose_ports_do_not_match_its_hosts_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match=r"--dsn: 2 port values for 3 hosts"):
        check_dsn("host=a,b,c port=1,2 dbname=x", "--dsn")
    check_dsn("host=a,b,c port=5432 dbname=x")  # one port for all
    # libpq takes one hostaddr per host, never one for all (it failed at connect, exit 11, with its own words)
    with pytest.raises(ConfigError, match=r"1 hostaddr values for 2 hosts: give one hostaddr for every host"):
        check_dsn("host=a,b hostaddr=127.0.0.1 dbname=x")
    check_dsn("host=a hostaddr=127.0.0.1 dbname=x")
    check_dsn("host=a,b hostaddr=127.0.0.1,127.0.0.2 port=5432 dbname=x")
    check_dsn("host=a,b,c port=1,2,3 dbname=x")
    p = sco("db", "migrate", "--dsn", "host=a,b,c port=1,2 dbname=x password=hunter22")
    one_line_error(p, 5, "--dsn", "port values for 3 hosts")
    assert "hunter22" not in p.stderr


def test_a_standby_is_never_migrated_nor_locked(cluster: PatroniCluster) -> None:
    primary = cluster.wait_healthy()
    standby = next(m for m in cluster.members if m is not primary)
    caught_up(cluster, primary, standby)  # the fixture's CREATE DATABASE
    with connect(cluster.member_dsn(standby, DB)) as c:
        with pytest.raises(StateError, match=r"read-only standby"):
            migrate(c)
        with (
            pytest.raises(StateError, match=r"hall h1: cannot take the writer's lock: .*read-only standby"),
            hall_lock(c, "h1"),
        ):
            pass
    p = sco("db", "migrate", "--dsn", cluster.member_dsn(standby, DB))
    one_line_error(p, 11, f"port={standby.pg_port}", "read-only standby")


def test_sco_db_migrate_on_the_multi_host_dsn_migrates_the_primary_once(cluster: PatroniCluster) -> None:
    primary = cluster.wait_healthy()
    dsn = without_target(cluster.dsn(DB))
    # two at once (two control hosts, say): the advisory lock lets one apply everything, the other nothing
    procs = [subprocess.Popen([*SCO, "db", "migrate", "--dsn", dsn], stdout=subprocess.PIPE, text=True) for _ in "ab"]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    applied_lines = [x for o in outs for x in o.splitlines() if x.startswith("applied ")]
    assert applied_lines == [f"applied {m.version:04d}_{m.name}" for m in migrations()], outs
    with connect(cluster.member_dsn(primary, DB)) as c:
        assert sorted(applied(c)) == [m.version for m in migrations()]
    # the standbys have it by replication, not by a migration of their own
    for m in cluster.members:
        if m is not primary:
            caught_up(cluster, primary, m)
            with connect(cluster.member_dsn(m, DB)) as c:
                assert server(c)[1] is True
                assert sorted(applied(c)) == [x.version for x in migrations()]
    assert sco("db", "migrate", "--dsn", dsn).stdout.strip() == "fleet state up to date"


def test_failover_keeps_acknowledged_writes_and_moves_the_hall_lock(cluster: PatroniCluster) -> None:
    old = cluster.wait_healthy()
    sync = cluster.sync_standby()
    assert sync is not None
    dsn = without_target(cluster.dsn(DB))
    with connect(dsn) as c:
        migrate(c)
        # synchronous replication is in force: a commit waits for one standby's flush
        states = c.execute("SELECT application_name, sync_state FROM pg_stat_replication").fetchall()
    assert (sync.name, "sync") in [tuple(s) for s in states], states

    holder = FleetState(dsn, application="run before the failover")
    holder_lock = hall_lock(holder.conn, "hall-ha")
    holder_lock.__enter__()
    holder.ensure_pool(Pool("hall-ha", "spot", "m1.small", "img"))
    written = []
    for slot in range(20):
        inst = holder.request("hall-ha", "spot", "e1", slot, f"node-{slot}")
        holder.transition(inst.id, "launching", "instance.launching", server_id=f"srv-{slot}")
        written.append(inst.id)  # acknowledged: the commit returned

    t0 = time.monotonic()
    cluster.kill(old)
    # the run that held the lock on the old primary has lost it: its next statement fails
    with pytest.raises(psycopg.OperationalError):
        holder.conn.execute("SELECT 1")
    holder.conn.close()

    new = None
    while time.monotonic() - t0 < 60:
        try:
            with connect(dsn) as c:
                c.execute("CREATE TEMP TABLE probe (x int)")  # a write, not only a session
                new = server(c)[0]
                break
        except (StateError, psycopg.OperationalError):
            time.sleep(0.1)
    failover_s = time.monotonic() - t0
    print(
        f"\nfailover: read-write again after {failover_s:.2f} s (ttl {cluster.ttl} s, loop_wait {cluster.loop_wait} s)"
    )
    assert new is not None, f"no read-write server within 60 s; logs in {cluster.root}"
    assert new == sync.pg_port  # Patroni promotes the synchronous standby, the one that has every commit

    # the next run takes the hall's lock, on the new primary
    with FleetState(dsn, application="run after the failover") as st, st.writer("hall-ha"):
        got = {i.id: i.state for i in st.instances("hall-ha")}
        assert {iid: got.get(iid) for iid in written} == {iid: "launching" for iid in written}
        kinds = [e["kind"] for e in st.events(hall="hall-ha")]
        assert kinds.count("instance.launching") == len(written)
    # the member comes back as a standby of the new primary (pg_rewind), and the cluster is whole again
    cluster.restart(old)
    assert cluster.wait_healthy(60).pg_port == new
