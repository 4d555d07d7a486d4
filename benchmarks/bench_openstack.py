"""The acquirer and the reclaimer against real Nova on loopback (sco.devcluster.openstack).

``acquirer``: 30 launches through the acquirer (fleet state, tags, token budget, one list call per poll) against
30 plain openstacksdk boots (create, then ``wait_for_server`` each) in the same run, same cloud, same
concurrency, alternated; medians over $SCO_BENCH_REPEATS (default 2).
``reclaim``: 30 instances reclaimed at once with a short window; how long until each notice is on NATS, and when
each instance was deleted after its notice (the goal: at T+window, within 1 s): when the DELETE was sent, and when
Nova accepted it (30 DELETEs at the same instant queue in nova-api, so acceptance spreads with its throughput).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import NatsServer, ensure_stream

from sco.contract.signing import generate
from sco.control.acquirer import Acquirer, PlanEntry
from sco.devcluster.openstack import OpenStackCloud
from sco.provider.reclaimer import Reclaimer
from sco.state.db import connect, migrate
from sco.state.fleet import FleetState, Pool

N = 30
CONCURRENCY = 8
_cloud: OpenStackCloud | None = None


def _the_cloud() -> OpenStackCloud:
    global _cloud
    if _cloud is None:
        if os.environ.get("SCO_TEST_OPENSTACK"):
            _cloud = OpenStackCloud.attach(json.loads(Path(os.environ["SCO_TEST_OPENSTACK"]).read_text()))
        else:
            _cloud = OpenStackCloud(Path(tempfile.mkdtemp(prefix="sco-bench-os-"))).start()
            atexit.register(_cloud.stop)
    return _cloud


def _fleet(cloud: OpenStackCloud, name: str) -> str:
    db = f"{name}_{os.getpid()}_{time.monotonic_ns() % 10**6}"
    cloud.pg.create_database(db)
    dsn = cloud.pg.dsn(db)
    with connect(dsn) as c:
        migrate(c)
    return dsn


def _gone(conn: Any, ids: list[str]) -> None:
    for i in ids:
        conn.compute.delete_server(i, ignore_missing=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        left = {s.id for s in conn.compute.servers()} & set(ids)
        if not left:
            return
        time.sleep(0.5)


def _raw_boots(cloud: OpenStackCloud, conn: Any, tag: str) -> tuple[float, list[str]]:
    user_data = base64.b64encode(b"#cloud-config\n").decode()

    def boot(i: int) -> str:
        s = conn.compute.create_server(
            name=f"raw-{tag}-{i}", image_id=cloud.image_id, flavor_id=cloud.flavors["sco.small"],
            networks="none", user_data=user_data,
        )  # fmt: skip
        conn.compute.wait_for_server(s, wait=600, interval=0.5)
        return str(s.id)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as ex:
        ids = list(ex.map(boot, range(N)))
    return time.monotonic() - t0, ids


def bench_acquirer() -> Iterator[dict[str, Any]]:
    cloud = _the_cloud()
    conn = cloud.connect()
    raw: list[float] = []
    acq: list[float] = []
    calls: list[int] = []
    with FleetState(_fleet(cloud, "bench_acquirer")) as st:
        st.ensure_pool(Pool("bench", "spot", flavor=cloud.flavors["sco.small"], image=cloud.image_id))
        for rep in range(int(os.environ.get("SCO_BENCH_REPEATS", "2"))):
            t, ids = _raw_boots(cloud, conn, str(rep))
            raw.append(t)
            _gone(conn, ids)
            entry = PlanEntry("bench", "spot", f"r{rep}", N)
            a = Acquirer(conn, st, lambda name: "#cloud-config\n", concurrency=CONCURRENCY)
            t0 = time.monotonic()
            out = a.apply(entry)
            acq.append(time.monotonic() - t0)
            calls.append(out.api_calls)
            assert out.active == N, out
            _gone(conn, [i.server_id for i in out.instances if i.server_id])
    conn.close()
    yield {
        "launches": N,
        "to_active_s": round(statistics.median(acq), 2),
        "raw_boot_s": round(statistics.median(raw), 2),
        "ratio": round(statistics.median(acq) / statistics.median(raw), 3),
        "api_calls": int(statistics.median(calls)),
        "raw_api_calls_min": 2 * N,  # a create and at least one GET per server
        "concurrency": CONCURRENCY,
        "repeats": len(acq),
    }


def bench_reclaim() -> Iterator[dict[str, Any]]:
    cloud = _the_cloud()
    conn = cloud.connect()
    window = float(os.environ.get("SCO_BENCH_RECLAIM_WINDOW", "10"))
    nats = NatsServer(Path(tempfile.mkdtemp(prefix="sco-bench-nats-"))).start()
    try:
        asyncio.run(ensure_stream(nats.url))
        with FleetState(_fleet(cloud, "bench_reclaim")) as st:
            st.ensure_pool(Pool("bench", "spot", flavor=cloud.flavors["sco.small"], image=cloud.image_id))
            out = Acquirer(conn, st, lambda name: "#cloud-config\n", concurrency=CONCURRENCY).apply(
                PlanEntry("bench", "spot", "reclaim", N)
            )
            names = [i.name for i in out.instances]
            received: dict[str, float] = {}

            async def go() -> Reclaimer:
                import nats as nats_py

                nc = await nats_py.connect(nats.url)

                async def cb(msg: Any) -> None:
                    received[json.loads(msg.data)["node"]] = time.time()

                await nc.subscribe("sco.notice.bench.>", cb=cb)
                await nc.flush()
                r = Reclaimer(conn, st, nats.url, window_s=window, signing_keys=[generate()])
                await r.reclaim("bench", names)
                await nc.close()
                await r.close()
                return r

            r = asyncio.run(go())
            rc = list(r.reclaims.values())
            pub = [(x.published_at - x.started_at) * 1000 for x in rc if x.published_at]
            first = min(x.started_at for x in rc)
            recv = [(received[x.instance.name] - first) * 1000 for x in rc if x.instance.name in received]
            deleted = [x.deleted_at - x.started_at for x in rc if x.deleted_at]
            late = [x.deleted_at - x.terminate_at for x in rc if x.deleted_at]
            sent = [x.delete_sent_at - x.terminate_at for x in rc if x.delete_sent_at]
            states = {st.instance(x.instance.id).state for x in rc}
    finally:
        nats.stop()
        conn.close()
    yield {
        "instances": N,
        "window_s": window,
        "notice_published_ms": round(statistics.median(pub), 2),
        "notice_published_ms_max": round(max(pub), 2),
        "last_notice_received_ms": round(max(recv), 2),
        "deleted_at_s_after_notice": round(statistics.median(deleted), 3),
        "deleted_at_s_after_notice_max": round(max(deleted), 3),
        "delete_sent_after_deadline_ms_max": round(max(sent) * 1000, 1),
        "delete_accepted_after_deadline_ms_median": round(statistics.median(late) * 1000, 1),
        "delete_accepted_after_deadline_ms_max": round(max(late) * 1000, 1),
        "final_states": sorted(states),
    }


BENCHES = {"acquirer": bench_acquirer, "reclaim": bench_reclaim}
