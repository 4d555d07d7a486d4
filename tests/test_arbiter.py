"""The fallback arbiter: on-demand grants within each contract's spend authority and the hall's cost ceiling;
every grant and refusal with its reason."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from sco.control.arbiter import arbitrate, current_spend
from sco.control.model import ContractInfo, Instance, Pool

U = 1000
D = Decimal


def od(name: str, price: str, cap: int = 10, flavor: int = 8, available: bool = True) -> Pool:
    return Pool(name, "on-demand", flavor * U, cap, price_per_hour=D(price), available=available)


def c(name: str, tier: int, allowed: bool, cap: str = "0") -> ContractInfo:
    return ContractInfo(name, tier, on_demand=allowed, spend_cap_per_hour=D(cap))


def test_a_contract_without_fallback_is_refused() -> None:
    a = arbitrate({"ci": 8 * U}, {"ci": c("ci", 3, False)}, (od("od", "1.00"),), (), D(100))
    assert not a.grants
    assert [(r.contract, r.units_milli, r.reason) for r in a.refusals] == [
        ("ci", 8 * U, "its contract does not allow on-demand fallback")
    ]


def test_spend_authority_per_hour_bounds_the_grant() -> None:
    # 5 instances wanted at 12.00/h; authority 40.00/h buys 3
    a = arbitrate({"train": 40 * U}, {"train": c("train", 2, True, "40")}, (od("od", "12.00"),), (), D(1000))
    assert [(g.pool, g.instances, g.cost_per_hour) for g in a.grants] == [("od", 3, D("36.00"))]
    assert a.refusals[0].units_milli == 16 * U
    assert "spend authority 40.00/h with 36.00/h in use; one more od instance costs 12.00/h" in a.refusals[0].reason


def test_running_on_demand_instances_count_against_the_authority() -> None:
    fleet = (Instance("i1", "od-1", "od", ("train",)), Instance("i2", "od-2", "od", ("train", "api")))
    total, per = current_spend({"od": od("od", "10.00")}, fleet)
    assert total == D(20) and per == {"train": D(15), "api": D(5)}
    a = arbitrate({"train": 16 * U}, {"train": c("train", 2, True, "30")}, (od("od", "10.00"),), fleet, D(1000))
    assert [g.instances for g in a.grants] == [1]  # 15 in use + 10 = 25 <= 30; a second would be 35


def test_the_hall_ceiling_binds_across_contracts_tier_one_first() -> None:
    cs = {"api": c("api", 1, True, "100"), "batch": c("batch", 2, True, "100")}
    a = arbitrate({"api": 16 * U, "batch": 16 * U}, cs, (od("od", "10.00"),), (), D(30))
    assert [(g.contract, g.instances) for g in a.grants] == [("api", 2), ("batch", 1)]
    assert a.refusals[0].contract == "batch"
    assert "hall cost ceiling 30.00/h with 30.00/h in use" in a.refusals[0].reason
    assert a.hall_spend_per_hour == D(30)


def test_cheapest_per_unit_first_then_the_next_pool_within_caps() -> None:
    pools = (
        od("big", "20.00", cap=1, flavor=32),
        od("small", "8.00", cap=10, flavor=8),
        od("off", "1", available=False),
    )
    a = arbitrate({"x": 48 * U}, {"x": c("x", 2, True, "1000")}, pools, (), D(1000))
    # big: 0.625 per unit, small: 1.00 per unit
    assert [(g.pool, g.instances) for g in a.grants] == [("big", 1), ("small", 2)]
    assert not a.refusals and all(g.reason for g in a.grants)


def test_no_pool_means_a_refusal_with_the_reason() -> None:
    a = arbitrate({"x": 8 * U}, {"x": c("x", 2, True, "10")}, (od("off", "1", available=False),), (), D(10))
    assert a.refusals[0].reason == "8 units refused: no on-demand pool is available"


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcde"), st.integers(0, 80_000), max_size=5),
    st.dictionaries(st.sampled_from("abcde"), st.tuples(st.integers(1, 3), st.booleans(), st.integers(0, 60))),
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 6), st.integers(1, 4)), min_size=0, max_size=4),
    st.integers(0, 200),
)
def test_grants_never_pass_authority_or_ceiling(
    short: dict[str, int], specs: dict[str, tuple[int, bool, int]], pool_specs: list[tuple[int, int, int]], ceiling: int
) -> None:
    cs = {n: c(n, t, ok, str(cap)) for n, (t, ok, cap) in specs.items()}
    pools = tuple(od(f"p{k}", str(price), cap, flavor * 4) for k, (price, cap, flavor) in enumerate(pool_specs))
    a = arbitrate(short, cs, pools, (), D(ceiling))
    assert a.hall_spend_per_hour <= D(ceiling)
    for name, info in cs.items():
        spent = sum((g.cost_per_hour for g in a.grants if g.contract == name), D(0))
        assert spent <= info.spend_cap_per_hour
        if not info.on_demand:
            assert not any(g.contract == name for g in a.grants)
    for p in pools:
        assert sum(g.instances for g in a.grants if g.pool == p.name) <= p.cap
    for name, m in short.items():  # every short unit is granted or refused, with a reason
        granted = sum(g.instances for g in a.grants if g.contract == name)
        refused = sum(r.units_milli for r in a.refusals if r.contract == name)
        assert refused <= m and (refused == m or granted > 0 or m == 0)
    assert all(r.reason for r in a.refusals) and all(g.reason for g in a.grants)


def test_a_lost_instance_neither_costs_nor_holds_the_cap_and_a_deleting_one_still_holds_it() -> None:
    fleet = (
        Instance("i1", "od-1", "od", ("train",), state="lost"),
        Instance("i2", "od-2", "od", ("train",), state="deleting"),
    )
    total, _ = current_spend({"od": od("od", "10.00")}, fleet)
    assert total == D(0)
    a = arbitrate({"train": 24 * U}, {"train": c("train", 2, True, "100")}, (od("od", "10.00", cap=2),), fleet, D(100))
    assert [g.instances for g in a.grants] == [1]  # the deleting server still holds one of the 2


def test_spend_per_tier_against_authority_running_granted_and_tier_zero() -> None:
    # train (tier 2, 30/h) runs 15/h and is granted 10/h more; api (tier 2, 20/h) runs 5/h; ci (tier 3) may not
    # fall back: its authority counts 0; an instance of a contract gone from the bundle still costs (tier 0)
    fleet = (
        Instance("i1", "od-1", "od", ("train",)),
        Instance("i2", "od-2", "od", ("train", "api")),
        Instance("i3", "od-3", "od", ("retired",)),
    )
    cs = {"train": c("train", 2, True, "30"), "api": c("api", 2, True, "20"), "ci": c("ci", 3, False)}
    a = arbitrate({"train": 8 * U, "ci": 8 * U}, cs, (od("od", "10.00"),), fleet, D(1000))
    assert [(g.contract, g.tier, g.authority_per_hour) for g in a.grants] == [("train", 2, D(30))]
    assert [(r.contract, r.tier, r.authority_per_hour) for r in a.refusals] == [("ci", 3, D(0))]
    assert [(t.tier, t.spend_per_hour, t.granted_per_hour, t.authority_per_hour) for t in a.tiers] == [
        (0, D("10.00"), D("0.00"), D("0.00")),
        (2, D("20.00"), D("10.00"), D("50.00")),
        (3, D("0.00"), D("0.00"), D("0.00")),
    ]
    assert a.to_dict()["tiers"][1] == {
        "tier": 2, "spend_per_hour": "20.00", "granted_per_hour": "10.00", "authority_per_hour": "50.00"
    }  # fmt: skip
