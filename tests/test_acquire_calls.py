"""What the acquirer asks Nova for one entry, against the real OpenStack of the tests: the calls it makes before,
during and after a launch (the benchmark ``acquirer`` gives the figures; this checks the behaviour)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def cloud(openstack_cloud):  # type: ignore[no-untyped-def]
    conn = openstack_cloud.connect()
    yield conn
    conn.close()


def test_a_new_entry_launches_without_a_list_and_waits_by_list_calls_only(openstack_cloud, cloud, fleet_dsn) -> None:  # type: ignore[no-untyped-def]
    from sco.control.acquirer import Acquirer, PlanEntry
    from sco.state.fleet import FleetState, Pool

    calls: list[str] = []
    real = {n: getattr(cloud.compute, n) for n in ("servers", "create_server", "get_server", "find_server")}

    def spy(name: str) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            calls.append(name)
            return real[name](*a, **kw)

        return call

    for n in real:
        setattr(cloud.compute, n, spy(n))
    try:
        with FleetState(fleet_dsn) as st:
            st.ensure_pool(Pool("calls", "spot", flavor=openstack_cloud.flavors["sco.small"],
                                image=openstack_cloud.image_id))  # fmt: skip
            out = Acquirer(cloud, st, lambda n: "#cloud-config\n").apply(PlanEntry("calls", "spot", "e1", 3))
            assert out.active == 3 and not out.errors, out
            # no record of the entry: nothing to list before the creates; then only tagged lists until ACTIVE
            assert calls[:3] == ["create_server"] * 3 and set(calls[3:]) == {"servers"}, calls
            assert out.api_calls == len(calls)
            # the entry has records now: the next run lists it first (what a crashed run left) and launches nothing
            calls.clear()
            again = Acquirer(cloud, st, lambda n: "").apply(PlanEntry("calls", "spot", "e1", 3))
            assert calls == ["servers"] and again.launched == 0 and again.active == 3, (calls, again)
            calls.clear()
            gone = Acquirer(cloud, st, lambda n: "").apply(PlanEntry("calls", "spot", "e1", 0))
            assert gone.deleted == 3 and not gone.warnings, gone
            assert "get_server" not in calls and "find_server" not in calls, calls  # confirmed by lists
    finally:
        for n, f in real.items():
            setattr(cloud.compute, n, f)
        for s in cloud.compute.servers(tags="sco-hall=calls"):
            cloud.compute.delete_server(s.id, ignore_missing=True)


def test_the_first_list_call_waits_for_the_pools_recent_build_time(openstack_cloud, cloud, fleet_dsn) -> None:  # type: ignore[no-untyped-def]
    """Each ACTIVE server's build time (Nova's created -> launched) is recorded; the next batch into the pool makes
    its first list call when its servers should be ACTIVE by those times, not 0.5 s after its creates (which cost
    two or three list calls more per batch: 1.30 Nova calls per launched instance in the benchmark)."""
    import time

    from sco.control.acquirer import Acquirer, PlanEntry
    from sco.state.fleet import FleetState, Pool

    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        time.sleep(s)

    try:
        with FleetState(fleet_dsn) as st:
            st.ensure_pool(Pool("builds", "spot", flavor=openstack_cloud.flavors["sco.small"],
                                image=openstack_cloud.image_id))  # fmt: skip
            assert st.build_seconds("builds", "spot") is None
            out = Acquirer(cloud, st, lambda n: "", sleep=sleep).apply(PlanEntry("builds", "spot", "e1", 2))
            assert out.active == 2, out
            built = [e["detail"]["build_s"] for e in st.events(hall="builds") if e["kind"] == "instance.active"]
            assert len(built) == 2 and all(b >= 0 for b in built), built
            servers = {s.id: s for s in cloud.compute.servers(tags="sco-hall=builds")}
            for i in out.instances:  # Nova's own timestamps, not when the run happened to look
                s = servers[i.server_id]
                assert s.launched_at and s.created_at
            expected = st.build_seconds("builds", "spot")
            assert expected is not None and min(built) <= expected <= max(built)
            waits.clear()
            out = Acquirer(cloud, st, lambda n: "", sleep=sleep).apply(PlanEntry("builds", "spot", "e2", 1))
            assert out.active == 1, out
            assert waits and waits[0] >= max(0.5, expected) - 1e-6, (waits, expected)
    finally:
        for s in cloud.compute.servers(tags="sco-hall=builds"):
            cloud.compute.delete_server(s.id, ignore_missing=True)
