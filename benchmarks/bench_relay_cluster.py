"""The relay cluster's failover: three nats-servers configured by the notice_relay role's template (the hall's
cluster, both streams in three copies), an agent-like client with every relay's URL publishing its events (each
until JetStream acks it, with Nats-Msg-Id), and the stream leader killed with SIGKILL: how long from the kill to the
next acknowledged event. The same set-up as tests/test_relay_cluster.py, repeated; the median and the worst."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.test_relay_cluster import leader_of, publish_through_kill, relays, render, started, stream_tool

REPEATS = 3


def bench_relay_failover() -> Iterator[dict[str, Any]]:
    gaps = []
    for _ in range(REPEATS):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            rs = relays(tmp, 3)
            render(tmp, [r.item([f"127.0.0.1:{r.cluster}" for r in rs]) for r in rs], ["a"])
            try:
                started(rs)
                stream_tool(rs)
                leader = leader_of(rs, rs[0].creds, "SCO_EVENTS")
                gaps.append(asyncio.run(publish_through_kill(rs, leader, rs[0].creds, os.urandom(4).hex(), 30, 10)))
            finally:
                for r in rs:
                    r.stop()
    yield {
        "relays": 3, "replicas": 3, "repeats": REPEATS, "failover_median_s": round(statistics.median(gaps), 3),
        "failover_max_s": round(max(gaps), 3),
    }  # fmt: skip


BENCHES = {"relay_failover": bench_relay_failover}
