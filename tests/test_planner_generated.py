"""The plan is what it says it is: its cost and its solver's objective and gap are those of the plan
returned, free capacity is not deleted while work it could hold goes short, and committed pools say what they hold
now and what only once their outgoing instances are gone. Each defect on the example that showed it, then 300
generated halls (``benchmarks.planner_halls``: its own seeded generator and the checks)."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from benchmarks.planner_halls import check, hall

from sco.control.model import ContractInfo, Instance, PlanInput, PlanSettings, Pool, Reservation
from sco.control.planner import Plan, plan

U = 1000
NOW = 1_000_000.0


def applied(inp: PlanInput, p: Plan) -> PlanInput:
    gone = {i for x in p.pools for i in x.delete}
    fleet = [i for i in inp.fleet if i.id not in gone]
    for x in p.pools:
        for k in range(x.launch):
            fleet.append(Instance(f"new-{x.pool}-{k}", f"new-{x.pool}-{k}", x.pool, x.launch_contracts, NOW))
    return PlanInput(**{**inp.__dict__, "fleet": tuple(fleet)})


def test_packing_that_needs_more_instances_than_counted_is_solved_again_and_reports_its_own_cost() -> None:
    """Defect 1: 6 + 6 + 4 units "fit" two 8-unit instances; packing opened a third (2.4/h) where two 8-unit and
    one 4-unit instance place the same work (2.0/h), and the plan said objective 1.6/h, gap 0, optimal."""
    inp = PlanInput(
        contracts={"w": ContractInfo("w", 2)},
        demand={"w": 16 * U},
        requests={"w": {6 * U: 2, 4 * U: 1}},
        pools=(
            Pool("big", "reclaimable", 8 * U, 10, price_per_hour=Decimal("0.8")),
            Pool("small", "reclaimable", 4 * U, 10, price_per_hour=Decimal("0.4")),
        ),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1)}),
    )
    p = plan(inp)
    assert {x.pool: x.launch for x in p.pools} == {"big": 2, "small": 1}
    assert p.cost_per_hour == Decimal("2.0") and not p.shortfall_milli
    s = p.solver
    # the objective is the plan's (2.0/h of price, 20 units of size); the bound proved is the first round's
    assert s["objective"] == 20_000 * 1_000_000 + 10 * 20
    assert s["bound"] <= s["objective"] and s["gap"] == round((s["objective"] - s["bound"]) / s["objective"], 6)
    assert check(inp, p) == []


def test_one_pool_of_one_flavour_still_opens_the_instance_packing_needs() -> None:
    """The same requests with the 8-unit pool alone: three instances are the least that places them."""
    inp = PlanInput(
        contracts={"w": ContractInfo("w", 2)},
        demand={"w": 16 * U},
        requests={"w": {6 * U: 2, 4 * U: 1}},
        pools=(Pool("big", "reclaimable", 8 * U, 10, price_per_hour=Decimal("0.8")),),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1)}),
    )
    p = plan(inp)
    assert p.pools[0].launch == 3 and not p.shortfall_milli and check(inp, p) == []


def test_an_idle_instance_is_kept_while_work_it_could_hold_goes_short() -> None:
    """Defect 2: one reclaimable pool at share 1/2, one idle instance past its grace, 2 units pending: the instance
    was deleted and the 2 units sent to the fallback (on-demand spend)."""
    inp = PlanInput(
        contracts={"w": ContractInfo("w", 2)},
        demand={"w": 2 * U},
        pools=(Pool("a", "reclaimable", 8 * U, 10, price_per_hour=Decimal("0.5")),),
        fleet=(Instance("i1", "n1", "a", ("w",), NOW - 7200),),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1, 2)}),
    )
    p = plan(inp)
    assert p.shortfall_milli == {"w": 2 * U}  # the share still holds: nothing is placed on the one pool
    assert p.pools[0].delete == () and not p.changed
    (keep,) = [d for d in p.decisions if d.subject == "instance:n1"]
    assert keep.kind == "keep" and "short" in keep.reason
    assert not plan(applied(inp, p)).changed
    # with no pending work it fits, it is scaled down as before
    gone = plan(PlanInput(**{**inp.__dict__, "demand": {}}))
    assert gone.pools[0].delete == ("i1",)


def test_a_pool_over_its_cap_deletes_only_the_instances_above_it_and_keeps_one_short_work_fits() -> None:
    """Review of defect 2: a pool whose cap was lowered to 1 holds two idle instances past their grace while 2 units
    it could hold are short. The first instance went for the cap but took the short work with it (from the work the
    check keeps), so the second found none and went too, both said "no pending work"."""
    inp = PlanInput(
        contracts={"w": ContractInfo("w", 2)},
        demand={"w": 2 * U},
        pools=(Pool("a", "reclaimable", 8 * U, 1, price_per_hour=Decimal("0.5")),),
        fleet=(Instance("i1", "n1", "a", ("w",), NOW - 7200), Instance("i2", "n2", "a", ("w",), NOW - 7200)),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1, 2)}),
    )
    p = plan(inp)
    assert p.pools[0].delete == ("i1",) and p.pools[0].target == 1
    why = {d.subject: (d.kind, d.reason) for d in p.decisions if d.subject.startswith("instance:")}
    assert why["instance:n1"][0] == "scale_down" and "more than its cap of 1" in why["instance:n1"][1]
    assert why["instance:n2"][0] == "keep" and "short" in why["instance:n2"][1]
    assert not plan(applied(inp, p)).changed


def test_a_pool_over_its_cap_deletes_first_the_idle_instance_no_short_work_fits() -> None:
    """Found by review (seed 1681 of ``planner_halls``): over its cap, the pool deleted its idle instances by name,
    so the one short work of "w" fits went for the cap and the one running only "x" went too, for no work."""
    inp = PlanInput(
        contracts={"w": ContractInfo("w", 2), "x": ContractInfo("x", 2)},
        demand={"w": 2 * U},
        pools=(Pool("a", "reclaimable", 8 * U, 1, price_per_hour=Decimal("0.5")),),
        fleet=(Instance("i1", "n1", "a", ("w",), NOW - 7200), Instance("i2", "n2", "a", ("x",), NOW - 7200)),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1, 2)}),
    )
    p = plan(inp)
    assert p.pools[0].delete == ("i2",) and p.pools[0].target == 1
    why = {d.subject: (d.kind, d.reason) for d in p.decisions if d.subject.startswith("instance:")}
    assert why["instance:n2"][0] == "scale_down" and "more than its cap of 1" in why["instance:n2"][1]
    assert why["instance:n1"][0] == "keep" and "short" in why["instance:n1"][1]
    assert [d.subject for d in p.decisions if d.subject.startswith("instance:")] == ["instance:n1", "instance:n2"]
    assert check(inp, p) == []
    assert not plan(applied(inp, p)).changed


def test_a_kept_idle_instance_never_takes_a_place_under_the_cap_a_launch_uses() -> None:
    """Two pools at share 1/2: work goes to both, and an idle instance kept for short work must not push its pool
    past the cap."""
    inp = PlanInput(
        contracts={"w": ContractInfo("w", 2)},
        demand={"w": 24 * U},
        pools=(
            Pool("a", "reclaimable", 8 * U, 1, group="r1", price_per_hour=Decimal("0.5")),
            Pool("b", "reclaimable", 8 * U, 1, group="r2", price_per_hour=Decimal("0.5")),
        ),
        fleet=(Instance("i1", "n1", "a", ("x",), NOW - 7200),),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1, 2)}),
    )
    p = plan(inp)
    for x in p.pools:
        assert x.target <= 1, x
    assert check(inp, p) == []


@pytest.mark.parametrize(("cap", "lease"), [(10, 2), (3, 4)])
def test_committed_pools_say_what_they_hold_now_and_launch_within_the_lease(cap: int, lease: int) -> None:
    """Defect 3: a lease of 2 instances (cap 10), one instance draining: the floor of two instances launched 2
    (3 on a 2-instance lease) and said both held; cap 3 under a lease of 4, one draining: it said 3 held and
    could launch only 2."""
    draining = Instance("i0", "n0", "c", ("gold",), NOW - 1000, state="draining")
    need = min(cap, lease)
    inp = PlanInput(
        contracts={"gold": ContractInfo("gold", 1, need * 8 * U)},
        demand={},
        pools=(Pool("c", "committed", 8 * U, cap),),
        fleet=(draining,),
        reservations=(Reservation("l", "c", lease),),
        settings=PlanSettings(now=NOW),
    )
    p = plan(inp)
    (pp,) = p.pools
    assert pp.launch == need - 1 and pp.target == need  # the draining one still takes a host of the lease
    assert p.floors_milli == {"gold": (need - 1) * 8 * U}
    assert p.floors_later_milli == {"gold": 8 * U}
    (said,) = [d for d in p.decisions if d.subject == "contract:gold"]
    assert "held now" in said.reason and "once the 1 instances on their way out are gone" in said.reason
    assert check(inp, p) == []
    # once it is gone, the next plan launches the last floor instance and holds the whole floor
    after = plan(PlanInput(**{**applied(inp, p).__dict__, "fleet": applied(inp, p).fleet[1:]}))
    assert after.pools[0].launch == 1 and after.floors_milli == {"gold": need * 8 * U}
    assert not after.floors_later_milli


def test_a_committed_instance_holds_only_the_floors_of_the_contracts_it_runs() -> None:
    """Found by review: a committed instance launched for "silver" was counted as holding gold's floor (the pool's
    instances were counted whatever their contracts), so the plan said gold's floor held and launched nothing."""
    inp = PlanInput(
        contracts={"gold": ContractInfo("gold", 1, 8 * U), "silver": ContractInfo("silver", 1, 0)},
        demand={},
        pools=(Pool("c", "committed", 8 * U, 4),),
        fleet=(Instance("i0", "n0", "c", ("silver",), NOW - 1000),),
        reservations=(Reservation("l", "c", 4),),
        settings=PlanSettings(now=NOW),
    )
    p = plan(inp)
    (pp,) = p.pools
    assert pp.launch == 1 and pp.launch_contracts == ("gold",) and pp.delete == ()  # paid for: kept
    assert p.floors_milli == {"gold": 8 * U}
    (said,) = [d for d in p.decisions if d.subject == "contract:gold"]
    assert said.reason == "floor of 8 units held: 8 units on c"
    assert check(inp, p) == []
    assert not plan(applied(inp, p)).changed
    # one that runs gold among others holds it; with the lease full of silver ones, gold's floor is short
    runs_both = PlanInput(**{**inp.__dict__, "fleet": (Instance("i0", "n0", "c", ("gold", "silver"), NOW - 1000),)})
    assert not plan(runs_both).changed and plan(runs_both).floors_milli == {"gold": 8 * U}
    full = PlanInput(
        **{**inp.__dict__, "fleet": tuple(Instance(f"i{k}", f"n{k}", "c", ("silver",), NOW) for k in range(4))}
    )
    p = plan(full)
    assert not p.changed and p.floors_milli == {"gold": 0}
    assert [d.kind for d in p.decisions if d.subject == "contract:gold"] == ["short"]


def test_a_floor_goes_where_a_lease_has_room_now_not_behind_another_pools_outgoing_instances() -> None:
    """Found by review: floors were split across committed pools by name, so gold's floor waited for pool a's
    draining instance while pool b's lease, paid for, stood empty."""
    inp = PlanInput(
        contracts={"gold": ContractInfo("gold", 1, 16 * U)},
        demand={},
        pools=(Pool("a", "committed", 8 * U, 2), Pool("b", "committed", 8 * U, 2)),
        fleet=(
            Instance("i0", "n0", "a", ("gold",), NOW - 1000),
            Instance("i1", "n1", "a", ("gold",), NOW - 1000, state="draining"),
        ),
        reservations=(Reservation("la", "a", 2), Reservation("lb", "b", 2)),
        settings=PlanSettings(now=NOW),
    )
    p = plan(inp)
    assert {x.pool: x.launch for x in p.pools} == {"a": 0, "b": 1}
    assert p.floors_milli == {"gold": 16 * U} and not p.floors_later_milli
    assert check(inp, p) == []
    assert not plan(applied(inp, p)).changed


SEEDS = range(31, 31 + 300)


def test_300_generated_halls_plan_what_they_say() -> None:
    """Every plan of 300 generated halls: the reported cost is the sum of the launched instances' prices, the
    reported objective and gap are those of the plan returned, no idle instance is deleted while short work fits
    it, committed launches stay within the lease, floors are said held only as far as instances hold them, and the
    applied plan is a fixed point. (Before these checks, on these halls: 16 plans of the 178 that launch opened
    instances the solver did not count, 15 deleted an idle instance short work fitted, 3 said committed floors
    held beyond what they held.)"""
    wrong: dict[int, list[str]] = {}
    again: list[int] = []
    for seed in SEEDS:
        inp = hall(seed)
        p = plan(inp)
        found = check(inp, p)
        if found:
            wrong[seed] = found
        if plan(applied(inp, p)).changed:
            again.append(seed)
    assert not wrong, wrong
    assert not again, again


@pytest.mark.parametrize(
    ("pools", "reservations", "fleet", "said"),
    [
        (
            (Pool("c", "committed", 8 * U, 4),),
            (),
            (),
            "0 units held now (none), short by 16 units: no committed capacity",
        ),
        (
            (Pool("c", "committed", 8 * U, 4, available=False, unavailable_reason="maintenance"),),
            (Reservation("l", "c", 4),),
            (),
            "0 units held now (none), short by 16 units: no committed capacity",
        ),
        (
            (Pool("c", "committed", 8 * U, 0),),
            (Reservation("l", "c", 4),),
            (),
            "short by 16 units: no committed capacity",
        ),
        (
            (Pool("c", "committed", 8 * U, 4),),
            (Reservation("l", "c", 2),),
            (
                Instance("i0", "n0", "c", ("gold",), NOW - 9, state="draining"),
                Instance("i1", "n1", "c", ("silver",), NOW - 9),
            ),
            "0 units held now (none), short by 8 units: the committed capacity the leases and caps allow is all taken;"
            " 8 units only once the 1 instances on their way out are gone",
        ),
    ],
    ids=["no-lease", "unavailable", "cap-0", "lease-taken"],
)
def test_a_short_floor_says_what_is_held_now_and_why_the_rest_is_not(
    pools: tuple[Pool, ...], reservations: tuple[Any, ...], fleet: tuple[Instance, ...], said: str
) -> None:
    """Found by review: with no lease, an unavailable pool or a cap of 0 the plan said "committed capacity is all
    held (none free)", and a floor short while part of it waits for outgoing instances never said what is held now."""
    p = plan(
        PlanInput(
            contracts={"gold": ContractInfo("gold", 1, 16 * U), "silver": ContractInfo("silver", 2)},
            demand={},
            pools=pools,
            fleet=fleet,
            reservations=reservations,
            settings=PlanSettings(now=NOW),
        )
    )
    (d,) = [d for d in p.decisions if d.subject == "contract:gold"]
    assert d.kind == "short" and said in d.reason, d.reason


def test_a_pool_whose_counts_did_not_pack_keeps_its_other_places_under_the_cap() -> None:
    """Found by review (seed 20823 of ``planner_halls``): s0 (cap 8, one instance) had 7 places; its counts did not
    pack, and the second round was left only the 6 instances packed, so 6 units of c1 went short that the cap
    allowed, and the plan made again on the applied one launched the 7th (and so on every run)."""
    inp = hall(20823)
    p = plan(inp)
    assert {x.pool: x.launch for x in p.pools if x.launch} == {"s0": 7, "s1": 2}, p.explain()
    assert p.shortfall_milli == {"c2": 3 * U}
    again = plan(applied(inp, p))
    assert not any(x.launch or x.delete for x in again.pools), again.explain()
    assert check(inp, p) == []


def test_a_pool_over_its_cap_keeps_no_more_than_its_cap_busy_whatever_else_is_pending() -> None:
    """Found by review: cap 1, two idle instances past their grace, two 8-unit requests of w that fit them. The greedy
    (everything fits room already there, no program) kept both busy and the pool over its cap; with one more request
    that no flavour fits the program ran and kept one, deleting the other for the cap. An unrelated request decided
    whether the cap held. Now both keep one and say why the other goes."""
    for demand, requests in (
        ({"w": 16 * U}, {"w": {8 * U: 2}}),
        ({"w": 16 * U, "x": 20 * U}, {"w": {8 * U: 2}, "x": {20 * U: 1}}),
    ):
        p = plan(
            PlanInput(
                contracts={"w": ContractInfo("w", 3), "x": ContractInfo("x", 3)},
                demand=demand,
                requests=requests,
                pools=(Pool("a", "reclaimable", 8 * U, 1, price_per_hour=Decimal("0.8")),),
                fleet=(Instance("i1", "n1", "a", ("w",), NOW - 7200), Instance("i2", "n2", "a", ("w",), NOW - 7200)),
                settings=PlanSettings(now=NOW, shares={3: Fraction(1)}),
            )
        )
        (a,) = p.pools
        assert (a.target, len(a.delete)) == (1, 1), p.explain()
        assert p.shortfall_milli.get("w") == 8 * U
        (d,) = [d for d in p.decisions if d.kind == "scale_down"]
        assert "more than its cap of 1" in d.reason, d.reason


def test_without_the_solver_a_plan_applied_and_made_again_keeps_the_idle_instance_it_used(monkeypatch: Any) -> None:
    """Found by review (seed 50000 of ``planner_halls``, greedy alone: no highspy): plan 1 put a 1-unit request on
    idle n2; made again on the applied plan, the greedy met the new instances (fewer contracts) first, put it there
    and deleted n2. Idle rooms are now met first: work on them keeps them. Over 200 halls (seeds 50000..50199) re-plans
    on the applied plan that changed: 4 -> 1 at once, 6 -> 1 at +400 s."""
    import sys

    monkeypatch.setitem(sys.modules, "highspy", None)  # the greedy fallback's plan, as without the control extra
    inp = hall(50000)
    p = plan(inp)
    assert p.solver.get("name") == "greedy", p.solver
    again = plan(applied(inp, p))
    assert not again.changed, again.explain()
