"""The fleet state's failover on a real Patroni cluster (sco_devkit.devcluster.patroni: three etcd and three
Patroni members on loopback, Debian's patroni 3.0.2 and PostgreSQL 15, synchronous replication).

Each round: a writer commits rows through the multi-host DSN as fast as it can; the primary's host is lost (SIGKILL
to its Patroni, postmaster and backends); the time until a read-write connection takes a write again is the
failover time. Then every acknowledged row is looked for on the new primary (lost = acknowledged but missing),
and the killed member is restarted and the time until it is a healthy standby again is the rejoin time.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from sco.state.db import StateError, connect
from sco_devkit.devcluster.patroni import PatroniCluster

ROUNDS = 6


def _p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.9 * len(xs)) - 1)]


def _writer(dsn: str, stop: threading.Event, acked: list[int]) -> None:
    """Commit one row at a time until the connection breaks; ``acked`` gets every id whose commit returned."""
    try:
        with connect(dsn) as c:
            while not stop.is_set():
                (i,) = c.execute("INSERT INTO ack DEFAULT VALUES RETURNING id").fetchone()
                acked.append(int(i))
    except (psycopg.Error, StateError):
        return


def _round(c: PatroniCluster, dsn: str) -> dict[str, Any]:
    old = c.wait_healthy(60)
    sync = c.sync_standby()
    acked: list[int] = []
    stop = threading.Event()
    w = threading.Thread(target=_writer, args=(dsn, stop, acked), name="writer", daemon=True)
    w.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    c.kill(old)
    stop.set()
    w.join(30)
    failover = None
    while time.monotonic() - t0 < 120:
        try:
            with connect(dsn) as conn:
                conn.execute("INSERT INTO ack DEFAULT VALUES")
                failover = time.monotonic() - t0
                new_port = int(conn.execute("SELECT inet_server_port()").fetchone()[0])
                have = {r[0] for r in conn.execute("SELECT id FROM ack WHERE id = ANY(%s)", (acked,))}
                break
        except (psycopg.Error, StateError):
            time.sleep(0.05)
    if failover is None:
        raise RuntimeError(f"no read-write server within 120 s; logs in {c.root}")
    t1 = time.monotonic()
    c.restart(old)
    c.wait_healthy(120)
    return {
        "failover_s": round(failover, 2),
        "rejoin_s": round(time.monotonic() - t1, 2),
        "acked_before_kill": len(acked),
        "acked_lost": len(set(acked) - have),
        "promoted_sync_standby": sync is not None and new_port == sync.pg_port,
    }


def bench_fleet_state_failover() -> Iterator[dict[str, Any]]:
    c = PatroniCluster()
    t = time.monotonic()
    try:
        c.start(120)
        started = time.monotonic() - t
        with connect(c.dsn()) as conn:
            conn.execute("CREATE TABLE ack (id bigserial PRIMARY KEY)")
        rounds = []
        for r in range(ROUNDS):
            one = _round(c, c.dsn())
            rounds.append(one)
            yield {"round": r + 1, **one}
        fo = [x["failover_s"] for x in rounds]
        rj = [x["rejoin_s"] for x in rounds]
        yield {
            "rounds": ROUNDS,
            "members": c.size,
            "ttl_s": c.ttl,
            "loop_wait_s": c.loop_wait,
            "retry_timeout_s": c.retry_timeout,
            "synchronous_mode": c.synchronous_mode,
            "cluster_start_s": round(started, 2),
            "failover_s_median": round(statistics.median(fo), 2),
            "failover_s_p90": round(_p90(fo), 2),
            "failover_s_max": max(fo),
            "rejoin_s_median": round(statistics.median(rj), 2),
            "acked_lost_total": sum(x["acked_lost"] for x in rounds),
            "promoted_sync_standby_every_time": all(x["promoted_sync_standby"] for x in rounds),
        }
    finally:
        c.destroy()


BENCHES = {"fleet_state_failover": bench_fleet_state_failover}
