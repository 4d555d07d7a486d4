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
