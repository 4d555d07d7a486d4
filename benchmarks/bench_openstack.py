"""The acquirer and the reclaimer against real Nova on loopback (sco_devkit.devcluster.openstack).

``acquirer``: 20 launches to ACTIVE through the product (the preflight resolving flavor and image by name once,
then the acquirer: fleet state, tags, token budget, list calls when the servers should be ready) against 20 plain
openstacksdk boots (create, then ``wait_for_server`` each) in the same run, same cloud, same concurrency,
alternated; Nova calls counted at the HTTP level for both; then deleting them until Nova no longer lists them
(the acquirer's parallel deletes vs ``delete_server`` + ``wait_for_delete`` each). Medians over
$SCO_BENCH_REPEATS (default 3).
``reconcile``: 5 kill -9 at random moments of a launch, each followed by a re-run (reconcile, then acquire): the
drift between the fleet state and Nova after each re-run (the goal: 0).
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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import NatsServer, ensure_stream

from sco.contract.signing import generate
from sco.control.acquirer import Acquirer, PlanEntry
from sco.provider.reclaimer import Reclaimer
from sco.state.db import connect, migrate
from sco.state.fleet import FleetState, Pool
from sco_devkit.devcluster.openstack import OpenStackCloud

N = 20
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


class NovaCalls:
    """Counts the HTTP requests a connection sends to Nova (its compute endpoint's port), whoever makes them."""

    def __init__(self, conn: Any, nova_port: int) -> None:
        self.n = 0
        self.port = f":{nova_port}/"
        real = conn.session.request
        lock = threading.Lock()

        def request(url: str, method: str, *a: Any, **kw: Any) -> Any:
            resp = real(url, method, *a, **kw)
            if self.port in str(getattr(resp, "url", url)):
                with lock:
                    self.n += 1
            return resp

        conn.session.request = request


def _raw_boots(cloud: OpenStackCloud, conn: Any, tag: str, n: int) -> tuple[float, list[str]]:
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
        ids = list(ex.map(boot, range(n)))
    return time.monotonic() - t0, ids


def _raw_deletes(conn: Any, ids: list[str]) -> float:
    def one(i: str) -> None:
        conn.compute.delete_server(i, ignore_missing=True)
        conn.compute.wait_for_delete(conn.compute.get_server(i), interval=0.5, wait=120)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as ex:
        list(ex.map(one, ids))
    return time.monotonic() - t0


def _product_launch(cloud: OpenStackCloud, conn: Any, st: FleetState, entry: PlanEntry) -> tuple[float, Any, int]:
    """What the acquire step does for one pool: the preflight (flavor and image by name, resolved once), then the
    acquirer; returns (seconds, outcome, Nova calls)."""
    from sco.control.launch import LaunchSpec, Resolver
    from sco.control.nova import Meter

    counter = NovaCalls(conn, cloud.ports["nova"])
    t0 = time.monotonic()
    meter = Meter(st)
    params, problems = Resolver(conn, meter).resolve("bench", "sco.small", "sco-node", LaunchSpec(networks="none"), N)
    assert params is not None, problems
    out = Acquirer(conn, st, lambda name: "#cloud-config\n", concurrency=CONCURRENCY, meter=meter).apply(entry, params)
    return time.monotonic() - t0, out, counter.n


def bench_acquirer() -> Iterator[dict[str, Any]]:
    """Launch N to ACTIVE through the product vs raw openstacksdk creates, alternated; then delete until gone."""
    cloud = _the_cloud()
    raw: list[float] = []
    acq: list[float] = []
    calls: list[float] = []
    raw_calls: list[float] = []
    d_raw: list[float] = []
    d_acq: list[float] = []
    with FleetState(_fleet(cloud, "bench_acquirer")) as st:
        st.ensure_pool(Pool("bench", "spot", flavor=cloud.flavors["sco.small"], image=cloud.image_id))
        for rep in range(int(os.environ.get("SCO_BENCH_REPEATS", "3"))):
            order = ("raw", "product") if rep % 2 == 0 else ("product", "raw")
            for who in order:
                conn = cloud.connect()
                if who == "raw":
                    counter = NovaCalls(conn, cloud.ports["nova"])
                    t, ids = _raw_boots(cloud, conn, str(rep), N)
                    raw.append(t)
                    raw_calls.append(counter.n / N)
                    d_raw.append(_raw_deletes(conn, ids))
                else:
                    entry = PlanEntry("bench", "spot", f"r{rep}", N)
                    t, out, n = _product_launch(cloud, conn, st, entry)
                    assert out.active == N, out
                    acq.append(t)
                    calls.append(n / N)
                    t0 = time.monotonic()
                    gone = Acquirer(conn, st, lambda name: "", concurrency=CONCURRENCY).apply(
                        PlanEntry("bench", "spot", f"r{rep}", 0)
                    )
                    d_acq.append(time.monotonic() - t0)
                    assert gone.deleted == N and not gone.warnings, gone
                conn.close()
    yield {
        "what": "launch to ACTIVE",
        "launches": N,
        "product_s": round(statistics.median(acq), 2),
        "raw_openstacksdk_s": round(statistics.median(raw), 2),
        "ratio": round(statistics.median(acq) / statistics.median(raw), 3),
        "nova_calls_per_instance": round(statistics.median(calls), 3),
        "raw_nova_calls_per_instance": round(statistics.median(raw_calls), 3),
        "concurrency": CONCURRENCY,
        "repeats": len(acq),
    }
    yield {
        "what": "delete until gone",
        "deletes": N,
        "product_s": round(statistics.median(d_acq), 2),
        "raw_openstacksdk_s": round(statistics.median(d_raw), 2),
        "ratio": round(statistics.median(d_acq) / statistics.median(d_raw), 3),
        "repeats": len(d_acq),
    }


KILLED_RUN = """
import json, sys, openstack
from sco.control.acquirer import Acquirer, PlanEntry
from sco.state.fleet import FleetState
cfg = json.loads(sys.argv[1])
conn = openstack.connect(auth=cfg["auth"], region_name=cfg["region_name"], identity_api_version="3")
st = FleetState(sys.argv[2])
acq = Acquirer(conn, st, lambda name: "#cloud-config\\n", concurrency=4)
acq.apply(PlanEntry("kill", "spot", "e1", int(sys.argv[3])))
"""


def _drift(conn: Any, dsn: str, hall: str) -> int:
    """Differences between the fleet state's live records and Nova's tagged servers (0: they agree)."""
    live = ("requested", "launching", "active", "notified", "draining", "drained", "overrun", "deleting")
    servers = {s.id: s.status for s in conn.compute.servers(tags=f"sco-hall={hall}") if s.status != "DELETED"}
    with connect(dsn) as c:
        rows = list(
            c.execute("SELECT server_id, state FROM instance WHERE hall = %s AND state = ANY(%s)", (hall, list(live)))
        )
    n = sum(1 for sid, _ in rows if sid not in servers)
    n += sum(
        1 for sid, state in rows if sid in servers and state in ("requested", "launching") and servers[sid] == "ACTIVE"
    )
    return n + len(set(servers) - {sid for sid, _ in rows})


def bench_reconcile() -> Iterator[dict[str, Any]]:
    """5 kill -9 at random moments of a launch of N, each followed by a re-run (reconcile, then the acquirer);
    the drift between the fleet state and Nova after each re-run."""
    import random
    import signal
    import subprocess
    import sys

    from sco.control.nova import Meter
    from sco.control.reconcile import Reconciler

    cloud = _the_cloud()
    conn = cloud.connect()
    dsn = _fleet(cloud, "bench_reconcile")
    rng = random.Random(int(os.environ.get("SCO_BENCH_SEED", "17")))
    drifts, before, fixed = [], [], []
    with FleetState(dsn) as st:
        st.ensure_pool(Pool("kill", "spot", flavor=cloud.flavors["sco.small"], image=cloud.image_id))
        for k in range(5):
            want = N if k % 2 == 0 else N // 2  # grow and shrink, so kills land in launches and deletes' aftermath
            proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, json.dumps(cloud.cloud_config), dsn, str(want)])
            time.sleep(rng.uniform(0.5, 6.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            before.append(_drift(conn, dsn, "kill"))
            with st.writer("kill"):
                r = Reconciler(conn, st, Meter(st)).hall("kill")
            Acquirer(conn, st, lambda name: "#cloud-config\n").apply(PlanEntry("kill", "spot", "e1", want))
            fixed.append(r.drift)
            drifts.append(_drift(conn, dsn, "kill"))
    for s in conn.compute.servers(tags="sco-hall=kill"):
        conn.compute.delete_server(s.id, ignore_missing=True)
    conn.close()
    yield {
        "kills": 5,
        "drift_after_kill": before,
        "reconciled": fixed,
        "drift_after_rerun": drifts,
        "drift_total_after_reruns": sum(drifts),
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
                    # the first receipt: the reclaimer sends a notice again until its agent answers (none here)
                    received.setdefault(json.loads(msg.data)["node"], time.time())

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


def bench_openstack() -> Iterator[dict[str, Any]]:
    """Issue 17's figures in one run (``make bench BENCH=openstack``): launch and delete ratios, Nova calls per
    launched instance, then the drift after 5 kill -9 and re-runs."""
    yield from bench_acquirer()
    yield from bench_reconcile()


BENCHES = {
    "acquirer": bench_acquirer,
    "reconcile": bench_reconcile,
    "reclaim": bench_reclaim,
    "openstack": bench_openstack,
}
