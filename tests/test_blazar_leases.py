"""Blazar as the seed means it, against the tests' real Blazar (API and manager on MariaDB,
physical host plugin, the cloud's one compute host enrolled): a host lease about to start has the reclaimable
instances on its hosts noticed, drained and deleted before it starts, so Blazar's own preemption (it deletes every
server on a host it takes, with no notice) never meets a running workload; only the ACTIVE lease counts as
committed capacity; a committed pool's creates carry the lease's reservation as their scheduler hint."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from typing import Any

import pytest

from sco.contract.signing import generate
from sco.control.acquirer import Acquirer, PlanEntry
from sco.provider.reservations import (
    committed_at,
    hosts_to_clear,
    parse_leases,
    read_allocations,
    read_reservations,
    reservation_hints,
)
from sco.state.fleet import FleetState, Pool
from tests.blazar_leases import EP, blazar_lease
from tests.harness import wait_for


def test_only_an_active_lease_is_committed_and_hints_name_its_reservation() -> None:
    def lease(lid: str, status: str) -> dict[str, Any]:
        return {
            "id": lid, "name": "floor", "status": status, "start_date": "2026-11-29T10:00:00",
            "end_date": "2026-11-29T12:00:00", "reservations": [{"id": f"r-{lid}", "resource_type": "physical:host",
                                                                  "max": 2}],
        }  # fmt: skip

    rs = parse_leases({"leases": [lease(s.lower(), s) for s in ("PENDING", "STARTING", "ERROR", "ACTIVE")]})
    t = rs[0].start + 60
    assert committed_at(rs, t) == {"physical:host": 2}  # the ACTIVE one only, though all four are in their dates
    assert reservation_hints(rs, {"pool-a": "floor"}, t) == {"pool-a": {"reservation": "r-active"}}
    assert reservation_hints(rs, {"pool-a": "floor"}, rs[0].start - 60) == {}  # not started: no hint
    # a lease starting within the look-ahead names the hosts to clear; one further away or started does not
    allocs = {f"r-{x}": ("h1",) for x in ("pending", "starting", "error", "active")}
    assert [c.reservation_id for c in hosts_to_clear(rs, allocs, rs[0].start - 30, 60)] == ["r-pending", "r-starting"]
    assert hosts_to_clear(rs, allocs, rs[0].start - 300, 60) == []


def _status(cloud: Any, lid: str) -> str:
    resp = cloud.session.get(f"/leases/{lid}", endpoint_filter=EP, raise_exc=False)
    return str(resp.json()["lease"]["status"]) if resp.status_code == 200 else f"HTTP {resp.status_code}"


@pytest.mark.slow
def test_a_host_lease_starting_soon_finds_its_host_cleared_and_committed_creates_carry_its_reservation(  # type: ignore[no-untyped-def]
    blazar, fleet_dsn, nats_server
) -> None:
    import psycopg

    from sco.provider.reclaim_job import ReclaimSettings, reclaim

    cloud = blazar.connect()
    hall, window, ahead = "leased", 10.0, 5.0
    lease: dict[str, Any] | None = None
    try:
        with FleetState(fleet_dsn) as st:
            for name, kind in (("spot", "reclaimable"), ("floor", "committed")):
                st.ensure_pool(Pool(hall, name, flavor=blazar.flavors["sco.small"], image=blazar.image_id, kind=kind))
            Acquirer(cloud, st, lambda n: "#cloud-config\n").apply(PlanEntry(hall, "spot", "e1", 1))
            (inst,) = st.instances(hall)
            host = cloud.compute.get_server(inst.server_id).compute_host
            # the next minute boundary that leaves a window and the look-ahead to spare
            start = math.ceil((time.time() + window + ahead + 20) / 60) * 60
            lease = blazar_lease(cloud, f"floor-{os.urandom(2).hex()}", start, 5)
            mine = [r for r in read_reservations(cloud) if r.lease_id == lease["id"]]
            assert [r.status for r in mine] == ["PENDING"]
            assert committed_at(mine, start + 60) == {}  # not started: no committed capacity
            assert read_allocations(cloud)[mine[0].reservation_id] == (host,)

            settings = ReclaimSettings(
                hall=hall, nodes=(), window_s=window, nats_url=nats_server.url, signing_keys=[generate()],
                dsn=fleet_dsn, before_leases=True, lease_lookahead_s=ahead, retry_for_s=30, call_timeout_s=10,
            )  # fmt: skip
            # the loop's timer: every run looks; the runs while the lease is far off leave the instance alone
            seen, noticed_at = [], 0.0
            while time.time() < start and not seen:
                looked = time.time()
                seen = asyncio.run(reclaim(settings, cloud))
                if not seen:
                    assert st.instance(inst.id).state == "active"
                    time.sleep(1)
                else:
                    noticed_at = looked
            assert [r["name"] for r in seen] == [inst.name], seen
            assert noticed_at >= start - window - ahead - 3  # not earlier than a window (and the look-ahead) ahead
            (rc,) = seen
            assert rc["state"] == "deleted" and rc["terminate_at"] <= start - 10
            ev = {e["kind"]: e for e in st.events(instance_id=inst.id)}
            assert ev["reclaim.scheduled"]["detail"]["because"].startswith(f"lease {lease['name']}")
            # the delete went out before the lease starts (Nova may take a moment more: what counts is that Blazar's
            # preemption at the start finds nothing of ours, checked below)
            assert ev["instance.delete_requested"]["at"] < start
            # (Nova shows a server DELETED for a moment before it is gone from the API)
            wait_for(lambda: cloud.compute.find_server(inst.server_id, ignore_missing=True) is None, 30, "gone")

            # Blazar starts the lease: its preemption finds nothing of ours on the host
            wait_for(lambda: _status(cloud, lease["id"]) == "ACTIVE", 150, "the lease ACTIVE", 2.0)
            log = (blazar.root / "logs" / "blazar-manager.log").read_text(errors="replace")
            assert inst.name not in log

            # now it is committed capacity, and the committed pool's creates carry its reservation
            now = time.time()
            mine = [r for r in read_reservations(cloud) if r.lease_id == lease["id"]]
            assert committed_at(mine, now) == {"physical:host": 1}
            hints = reservation_hints(mine, {"floor": lease["name"]}, now)
            assert hints == {"floor": {"reservation": mine[0].reservation_id}}
            out = Acquirer(cloud, st, lambda n: "#cloud-config\n", scheduler_hints=hints).apply(
                PlanEntry(hall, "floor", "e1", 1)
            )
            (committed,) = out.instances
            with psycopg.connect(blazar.pg.dsn("nova_api")) as c:  # what Nova's scheduler was asked
                (spec,) = c.execute(
                    "SELECT spec FROM request_specs WHERE instance_uuid = %s", (committed.server_id,)
                ).fetchone()
            data = json.loads(spec)["nova_object.data"]
            assert data["scheduler_hints"]["reservation"] == [mine[0].reservation_id]
    finally:
        for s in cloud.compute.servers(tags=f"sco-hall={hall}"):
            cloud.compute.delete_server(s.id, ignore_missing=True)
        wait_for(lambda: not list(cloud.compute.servers(tags=f"sco-hall={hall}")), 120, "this test's servers gone", 1.0)
        if lease is not None:
            cloud.session.delete(f"/leases/{lease['id']}", endpoint_filter=EP, raise_exc=False)
            # Blazar ends it by deleting what is on the host and waits for Nova: wait too, so the host is free again
            # (and no later test's server is caught in it)
            wait_for(lambda: _status(cloud, lease["id"]) == "HTTP 404", 300, "the lease gone", 2.0)
        cloud.close()
