"""The control loop's glue without services: a plan and grants as counts per plan entry (what the acquirer holds),
and a run's summary from ansible-runner events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sco.control.record import entry_name
from sco.control.runner import summarise, summary_lines
from sco.control.steps import entry_targets


@dataclass
class S:
    id: int
    name: str
    pool: str
    entry: str
    slot: int
    state: str = "active"


def plan_pools(*pools: dict[str, Any]) -> dict[str, Any]:
    return {"pools": list(pools)}


def test_launches_and_grants_land_in_the_entry_of_their_subset() -> None:
    web = entry_name(["web"])
    mixed = entry_name(["web", "sims"])
    assert mixed == entry_name(["sims", "web"])  # the order of a subset does not matter
    plan = plan_pools({"pool": "spot", "launch": 2, "launch_contracts": ["sims", "web"], "delete": []})
    grants = {"grants": [{"contract": "web", "pool": "od", "instances": 1}]}
    slots = [S(1, "h-spot-x-0", "spot", mixed, 0)]
    out = {(t.pool, t.entry): t for t in entry_targets(plan, grants, slots, {("spot", mixed): ("sims", "web")})}
    assert (out[("spot", mixed)].count, out[("spot", mixed)].launch) == (3, 2)
    assert out[("spot", mixed)].contracts == ("sims", "web")
    assert (out[("od", web)].count, out[("od", web)].launch, out[("od", web)].contracts) == (1, 1, ("web",))


def test_scale_down_deletes_the_idle_instances_the_plan_names_whatever_their_slot() -> None:
    e = entry_name(["web"])
    slots = [S(10, "n0", "spot", e, 0), S(11, "n1", "spot", e, 1), S(12, "n2", "spot", e, 2)]
    # idle: slots 0 and 2; slot 1 busy (a count is a count, not a range of slots: slot 0 can go)
    plan = plan_pools({"pool": "spot", "launch": 0, "launch_contracts": [], "delete": ["10", "12"]})
    (t,) = entry_targets(plan, {}, slots, {("spot", e): ("web",)})
    assert (t.count, t.launch, t.delete) == (1, 0, ("n0", "n2"))
    # all idle: the entry goes to zero
    plan = plan_pools({"pool": "spot", "launch": 0, "launch_contracts": [], "delete": ["10", "11", "12"]})
    (t,) = entry_targets(plan, {}, slots, {("spot", e): ("web",)})
    assert (t.count, t.delete) == (0, ("n0", "n1", "n2"))


def test_a_hole_left_by_a_reclaim_is_filled_before_a_new_slot() -> None:
    e = entry_name(["web"])
    slots = [S(11, "n1", "spot", e, 1)]  # slot 0 was reclaimed
    plan = plan_pools({"pool": "spot", "launch": 1, "launch_contracts": ["web"], "delete": []})
    (t,) = entry_targets(plan, {}, slots, {("spot", e): ("web",)})
    assert (t.count, t.launch) == (2, 1)


def test_nothing_to_do_gives_no_entries() -> None:
    e = entry_name(["web"])
    plan = plan_pools({"pool": "spot", "launch": 0, "launch_contracts": [], "delete": []})
    assert entry_targets(plan, {}, [S(1, "n0", "spot", e, 0)], {("spot", e): ("web",)}) == []


def ev(action: str, res: dict[str, Any], event: str = "runner_on_ok") -> dict[str, Any]:
    return {"event": event, "event_data": {"task_action": action, "task": action.rsplit(".", 1)[1], "res": res}}


def test_summary_from_runner_events() -> None:
    events = [
        ev("sco.orchestrator.demand", {"units": {"web": 6.0}, "uncontracted": 1}),
        ev(
            "sco.orchestrator.plan",
            {
                "plan": {
                    "digest": "ab" * 32,
                    "changed": True,
                    "pools": [
                        {"pool": "spot", "target": 2, "launch": 2, "delete": []},
                        {"pool": "x", "target": 0, "launch": 0, "delete": []},
                    ],
                    "shortfall_milli": {"web": 2500},
                }
            },
        ),
        ev(
            "sco.orchestrator.arbitrate",
            {
                "arbitration": {
                    "grants": [{"contract": "web", "pool": "od", "instances": 1, "cost_per_hour": "2.00"}],
                    "refusals": [{"contract": "x", "reason": "its contract does not allow on-demand fallback"}],
                }
            },
        ),
        ev("sco.orchestrator.acquire", {"launched": 3, "deleted": 0, "launch_failures": 0}),
        ev("sco.orchestrator.reclaim", {"finished": [{"name": "n-0", "late_s": 42.5, "state": "deleted"}]}),
        ev("ansible.builtin.debug", {"msg": "ignored"}),
    ]
    s = summarise(events)
    assert s["demand_units"] == {"web": 6.0} and s["uncontracted"] == 1
    assert s["planned"] == {"spot": {"target": 2, "launch": 2, "delete": 0}}
    assert s["shortfall_units"] == {"web": 2.5}
    assert s["granted"] == ["web: 1 x od (2.00/h)"]
    assert s["refused"] == ["x: its contract does not allow on-demand fallback"]
    assert (s["launched"], s["deleted"], s["failed_tasks"]) == (3, 0, [])
    text = "\n".join(summary_lines(s))
    assert "demand: web 6 units; 1 uncontracted (not counted)" in text and "launched 3, deleted 0" in text
    assert "finished the reclaim of n-0: deleted 42.5 s after its T (deleted)" in text  # the other host's reclaim
    failed = summarise([ev("sco.orchestrator.plan", {"msg": "module options: invalid"}, "runner_on_failed")])
    assert failed["failed_tasks"] == ["plan: module options: invalid"]


def test_committed_capacity_from_blazar_leases_per_pool() -> None:
    from sco.control.inputs import PoolSpec
    from sco.control.steps import committed_from_leases
    from sco.provider.reservations import parse_leases

    doc = {
        "leases": [
            {
                "id": "l1",
                "name": "floor",
                "status": "ACTIVE",
                "start_date": "2026-11-29T10:00:00",
                "end_date": "2026-11-29T12:00:00",
                "reservations": [
                    {"resource_type": "physical:host", "max": 3},
                    {"resource_type": "virtual:instance", "amount": 4},
                ],
            },
            {
                "id": "l2",
                "name": "committed-b",
                "status": "TERMINATED",
                "start_date": "2026-11-29T10:00:00",
                "end_date": "2026-11-29T12:00:00",
                "reservations": [{"resource_type": "virtual:instance", "amount": 9}],
            },
        ]
    }
    base = {"flavor": "f", "vcpus": 4, "ramMiB": 4096, "cap": 20}
    pools = [
        PoolSpec.model_validate(
            {"name": "committed-a", "kind": "committed", "lease": "floor", "instancesPerHost": 2, **base}
        ),
        PoolSpec.model_validate({"name": "committed-b", "kind": "committed", **base}),
        PoolSpec.model_validate({"name": "floor", "kind": "reclaimable", **base}),  # not committed: ignored
    ]
    leases = parse_leases(doc)
    at = leases[0].start + 60
    assert committed_from_leases(leases, pools, at) == [
        {"lease": "l1/physical:host", "pool": "committed-a", "instances": 6},
        {"lease": "l1/virtual:instance", "pool": "committed-a", "instances": 4},
    ]
    assert committed_from_leases(leases, pools, leases[0].end) == []  # the lease is over


def test_a_bad_ceiling_is_a_clear_error() -> None:
    import pytest

    from sco.control.options import _amount
    from sco.errors import ConfigError

    assert str(_amount("250.50", "ceiling_per_hour")) == "250.50"
    for bad, message in (("lots", "is not an amount"), ("-1", "at least 0"), ("NaN", "finite")):
        with pytest.raises(ConfigError, match=message):
            _amount(bad, "ceiling_per_hour")
