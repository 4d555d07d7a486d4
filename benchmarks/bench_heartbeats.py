"""The agents' heartbeats at hall scale: N nodes beating every 30 s onto a real nats-server (stream SCO_HEARTBEATS,
the last per node), then the control loop's read (one last-per-subject consumer) and its write into a real
PostgreSQL fleet state (one statement). What the relay holds and what a read costs, for 1,000 and 5,000 nodes."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import NatsServer

from sco import __version__
from sco.provider.heartbeats import RelayReader, ensure_stream, read
from sco.state import heartbeats
from sco.state.db import connect, migrate

HALL = "bench"


async def _beat(url: str, nodes: int, rounds: int) -> float:
    """``rounds`` beats of every node (the stream keeps the last); returns the stream's bytes."""
    import nats

    nc = await nats.connect(url)
    await ensure_stream(nc, HALL)
    body = {"boot_id": "0" * 36, "version": __version__, "drain": "idle", "bundle_serial": 7, "backlog": 0}
    for r in range(rounds):
        for i in range(nodes):
            await nc.publish(f"sco.heartbeat.{HALL}.node-{i:05d}", json.dumps({**body, "at": r}).encode())
        await nc.flush()
    info = await nc.jetstream().stream_info("SCO_HEARTBEATS")
    await nc.close()
    assert info.state.messages == nodes, info.state
    return float(info.state.bytes)


def bench_heartbeats() -> Iterator[dict[str, Any]]:
    from sco.state.embedded import EmbeddedPostgres  # the one the tests start

    with tempfile.TemporaryDirectory() as tmp:
        pg = EmbeddedPostgres().start()
        srv = NatsServer(Path(tmp) / "nats").start()
        try:
            pg.create_database("bench_heartbeats")
            dsn = pg.dsn("bench_heartbeats")
            with connect(dsn) as conn:
                migrate(conn)
                for nodes in (1000, 5000):
                    stream_bytes = asyncio.run(_beat(srv.url, nodes, 2))
                    reads, writes = [], []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        beats = asyncio.run(read(RelayReader(srv.url), HALL))
                        t1 = time.perf_counter()
                        heartbeats.record(conn, HALL, beats)
                        writes.append(time.perf_counter() - t1)
                        reads.append(t1 - t0)
                        assert len(beats) >= nodes
                    yield {
                        "nodes": nodes,
                        "stream_messages": nodes,
                        "stream_kib": round(stream_bytes / 1024, 1),
                        "read_ms_median": round(statistics.median(reads) * 1000, 1),
                        "fleet_state_write_ms_median": round(statistics.median(writes) * 1000, 1),
                    }
        finally:
            srv.stop()
            pg.destroy()


BENCHES = {"heartbeats": bench_heartbeats}
