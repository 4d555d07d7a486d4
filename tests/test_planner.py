"""The portfolio planner: caps, diversification, tier-1 floors, idle scale-down, unavailable pools, determinism,
explanations. Examples first, then properties with hypothesis."""

from __future__ import annotations

import random
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from sco.control.model import ContractInfo, Instance, PlanInput, PlanSettings, Pool, Reservation
from sco.control.planner import Plan, plan

U = 1000  # one unit in milli-units
NOW = 1_000_000.0


def contracts(*specs: tuple[str, int, int]) -> dict[str, ContractInfo]:
    return {n: ContractInfo(n, tier, floor * U) for n, tier, floor in specs}


def spot(name: str, group: str = "", cap: int = 10, flavor: int = 8, available: bool = True) -> Pool:
    return Pool(
        name, "reclaimable", flavor * U, cap, group=group, available=available, unavailable_reason="maintenance"
    )


def by_pool(p: Plan) -> dict[str, tuple[int, int, tuple[str, ...], tuple[str, ...]]]:
    return {x.pool: (x.target, x.launch, x.launch_contracts, x.delete) for x in p.pools}


def test_demand_spreads_within_the_tier_share_and_every_decision_has_a_reason() -> None:
    inp = PlanInput(
        contracts=contracts(("web", 3, 0), ("sims", 2, 0)),
        demand={"sims": 32 * U, "web": 8 * U},
        pools=(spot("a", "rack1"), spot("b", "rack1"), spot("c", "rack2")),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1, 2), 3: Fraction(1)}),
    )
    p = plan(inp)
    placed = {x.pool: x.placed_milli.get("sims", 0) for x in p.pools}
    assert sum(placed.values()) == 32 * U and not p.shortfall_milli
    assert placed["c"] == 16 * U  # rack2 takes its half, rack1 the other half over two pools
    assert placed["a"] + placed["b"] == 16 * U
    assert sum(x.launch for x in p.pools) == 5  # 40 units of 8-unit instances
    assert all(d.reason for d in p.decisions)
    assert any(d.kind == "launch" and d.subject == "pool:c" for d in p.decisions)


def test_share_and_caps_leave_a_shortfall_with_the_reason() -> None:
    inp = PlanInput(
        contracts=contracts(("sims", 2, 0)),
        demand={"sims": 40 * U},
        pools=(spot("a", "rack1", cap=2), spot("b", "rack1", cap=10)),
        settings=PlanSettings(now=NOW, shares={2: Fraction(1, 2)}),
    )
    p = plan(inp)
    # one group may hold only half of what tier 2 places on new instances: with one group, nothing
    assert p.shortfall_milli == {"sims": 40 * U} and not p.changed
    short = [d for d in p.decisions if d.kind == "short"]
    assert short and "the tier-2 share of 1/2 per pool and group, 1 groups with room" in short[0].reason


def test_unavailable_pools_are_skipped_with_their_reason() -> None:
    inp = PlanInput(
        contracts=contracts(("web", 3, 0)),
        demand={"web": 8 * U},
        pools=(spot("a", available=False), spot("b")),
        fleet=(Instance("i1", "a-1", "a", ("web",), launched_at=NOW),),
        settings=PlanSettings(now=NOW),
    )
    p = plan(inp)
    assert by_pool(p)["a"][1] == 0 and by_pool(p)["b"][1] == 1
    assert any(d.kind == "skip_pool" and "maintenance" in d.reason for d in p.decisions)


def test_floors_are_held_on_committed_capacity_and_never_scaled_down() -> None:
    inp = PlanInput(
        contracts=contracts(("api", 1, 24), ("batch", 3, 0)),
        demand={"api": 30 * U},
        pools=(Pool("res", "committed", 8 * U, 10), spot("a"), spot("b")),
        reservations=(Reservation("lease-1", "res", 4),),
        fleet=(Instance("r0", "res-0", "res", ("api",), launched_at=0),),
        settings=PlanSettings(now=NOW, idle_grace_s=0),
    )
    p = plan(inp)
    assert p.floors_milli == {"api": 24 * U}
    res = next(x for x in p.pools if x.pool == "res")
    assert (res.current, res.launch, res.delete) == (1, 2, ())  # 3 instances hold 24 units, one was there
    # 30 pending: 24 fit the floor (one idle instance + two launching), 6 burst onto reclaimable pools
    assert sum(x.placed_milli.get("api", 0) for x in p.pools if x.kind == "reclaimable") == 6 * U


def test_a_floor_larger_than_committed_capacity_is_reported_short() -> None:
    inp = PlanInput(
        contracts=contracts(("api", 1, 100)),
        demand={},
        pools=(Pool("res", "committed", 8 * U, 10),),
        reservations=(Reservation("lease-1", "res", 4),),
        settings=PlanSettings(now=NOW),
    )
    p = plan(inp)
    assert p.floors_milli == {"api": 32 * U}
    said = "32 units held now (32 units on res), short by 68 units"
    assert any(d.kind == "short" and said in d.reason for d in p.decisions)


def test_launched_instances_cover_their_pending_work_then_idle_ones_scale_down() -> None:
    base = PlanInput(
        contracts=contracts(("web", 3, 0)),
        demand={"web": 12 * U},
        pools=(spot("a"),),
        settings=PlanSettings(now=NOW, idle_grace_s=60),
    )
    first = plan(base)
    assert by_pool(first)["a"][:3] == (2, 2, ("web",))
    fleet = tuple(Instance(f"id{k}", f"a-{k}", "a", ("web",), launched_at=NOW) for k in range(2))
    again = plan(PlanInput(**{**base.__dict__, "fleet": fleet}))
    assert not again.changed  # work still pending, but the instances launched for it are there
    gone = PlanInput(**{**base.__dict__, "fleet": fleet, "demand": {}})
    assert not plan(gone).changed  # idle, but within the grace
    later = PlanInput(**{**gone.__dict__, "settings": PlanSettings(now=NOW + 61, idle_grace_s=60)})
    p = plan(later)
    assert by_pool(p)["a"] == (0, 0, (), ("id0", "id1"))
    assert [d.kind for d in p.decisions] == ["scale_down", "scale_down"]
    # a busy instance is kept
    busy = PlanInput(**{**later.__dict__, "node_load_milli": {"a-0": 3 * U}})
    assert by_pool(plan(busy))["a"][3] == ("id1",)


def test_over_cap_pools_launch_nothing() -> None:
    fleet = tuple(Instance(f"id{k}", f"a-{k}", "a", ("web",), launched_at=0) for k in range(3))
    inp = PlanInput(
        contracts=contracts(("web", 3, 0)),
        demand={"web": 80 * U},
        pools=(spot("a", cap=2),),
        fleet=fleet,
        node_load_milli={f"a-{k}": 8 * U for k in range(3)},
        settings=PlanSettings(now=NOW),
    )
    p = plan(inp)
    assert by_pool(p)["a"][:2] == (3, 0) and p.shortfall_milli == {"web": 80 * U}


def test_work_of_unknown_contracts_is_not_planned() -> None:
    p = plan(PlanInput(contracts={}, demand={"ghost": 5 * U}, pools=(spot("a"),), settings=PlanSettings(now=NOW)))
    assert not p.changed and any(d.kind == "ignore" and "not in the bundle" in d.reason for d in p.decisions)


# --- properties -------------------------------------------------------------------------------------

names = st.sampled_from(["a", "b", "c", "d", "e", "f"])


@st.composite
def plan_inputs(draw: st.DrawFn) -> PlanInput:
    cs: dict[str, ContractInfo] = {}
    for k in range(draw(st.integers(1, 6))):
        tier = draw(st.integers(1, 3))
        floor = draw(st.integers(0, 40)) * U // 2 if tier == 1 else 0
        cs[f"c{k}"] = ContractInfo(f"c{k}", tier, floor)
    pools = []
    for k in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["reclaimable", "reclaimable", "committed", "on-demand"]))
        pools.append(
            Pool(
                f"p{k}",
                kind,
                draw(st.integers(1, 16)) * U // 2,
                draw(st.integers(0, 8)),
                group=draw(st.sampled_from(["", "g1", "g2"])),
                available=draw(st.booleans()) or draw(st.booleans()),
            )
        )
    fleet = []
    for k in range(draw(st.integers(0, 10))):
        pool = draw(st.sampled_from(pools))
        subset = tuple(sorted(draw(st.sets(st.sampled_from(sorted(cs)), max_size=3))))
        fleet.append(
            Instance(f"i{k}", f"n{k}", pool.name, subset, launched_at=NOW - draw(st.sampled_from([0, 100, 1000])))
        )
    reservations = [
        Reservation(f"l{k}", draw(st.sampled_from(pools)).name, draw(st.integers(0, 6)))
        for k in range(draw(st.integers(0, 3)))
    ]
    demand = {c: draw(st.integers(0, 60)) * U // 3 for c in cs if draw(st.booleans())}
    load = {f"n{k}": draw(st.integers(0, 8)) * U for k in range(len(fleet)) if draw(st.booleans())}
    shares = {t: Fraction(draw(st.sampled_from([1, 2, 3, 4])), 4) for t in (1, 2, 3)}
    return PlanInput(
        contracts=cs,
        demand=demand,
        pools=tuple(pools),
        fleet=tuple(fleet),
        reservations=tuple(reservations),
        node_load_milli=load,
        settings=PlanSettings(now=NOW, shares=shares, idle_grace_s=draw(st.sampled_from([0, 500])), settle_s=300),
    )


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_caps_are_never_exceeded(inp: PlanInput) -> None:
    pools = {p.name: p for p in inp.pools}
    for x in plan(inp).pools:
        if x.launch:
            assert x.target <= pools[x.pool].cap, x
            assert pools[x.pool].available
        assert x.target <= max(x.current, pools[x.pool].cap)


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_floors_are_met_whenever_feasible(inp: PlanInput) -> None:
    committed: dict[str, int] = {}
    for r in inp.reservations:
        committed[r.pool] = committed.get(r.pool, 0) + r.instances
    capacity = sum(
        min(committed.get(p.name, 0), p.cap) * p.flavor_milli
        for p in inp.pools
        if p.kind == "committed" and p.available
    )
    wanted = {c.name: c.floor_milli for c in inp.contracts.values() if c.tier == 1 and c.floor_milli}
    p = plan(inp)
    if sum(wanted.values()) <= capacity:
        assert {c: p.floors_milli.get(c) for c in wanted} == wanted
    for x in p.pools:  # floors are held on committed capacity only, and within it
        if x.kind == "committed":
            assert x.target <= max(x.current, min(committed.get(x.pool, 0), pools_cap(inp, x.pool)))


def pools_cap(inp: PlanInput, name: str) -> int:
    return next(p.cap for p in inp.pools if p.name == name)


@settings(max_examples=100, deadline=None)
@given(plan_inputs(), st.randoms(use_true_random=False))
def test_the_plan_does_not_depend_on_input_order(inp: PlanInput, rnd: random.Random) -> None:
    def shuffled(xs: tuple[object, ...]) -> tuple[object, ...]:
        out = list(xs)
        rnd.shuffle(out)
        return tuple(out)

    def shuffled_map(m: dict[str, object]) -> dict[str, object]:
        items = list(m.items())
        rnd.shuffle(items)
        return dict(items)

    other = PlanInput(
        contracts=shuffled_map(dict(inp.contracts)),  # type: ignore[arg-type]
        demand=shuffled_map(dict(inp.demand)),  # type: ignore[arg-type]
        pools=shuffled(inp.pools),  # type: ignore[arg-type]
        fleet=shuffled(inp.fleet),  # type: ignore[arg-type]
        reservations=shuffled(inp.reservations),  # type: ignore[arg-type]
        node_load_milli=shuffled_map(dict(inp.node_load_milli)),  # type: ignore[arg-type]
        settings=inp.settings,
    )
    assert plan(other).to_dict() == plan(inp).to_dict()


# shares: tests/test_planner_objective.py::test_shares_hold_on_what_is_placed_and_requests_stay_whole


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_every_decision_names_its_subject_and_reason(inp: PlanInput) -> None:
    p = plan(inp)
    for d in p.decisions:
        assert d.kind and ":" in d.subject and d.reason
    for x in p.pools:
        if x.launch or x.delete:
            assert any(d.subject in (f"pool:{x.pool}",) for d in p.decisions) or x.delete
