"""The portfolio planner on a large hall: 5000 nodes in 200 pools, 20,000 units of pending work (goal < 200 ms)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from typing import Any

from sco.control.model import ContractInfo, Instance, PlanInput, PlanSettings, Pool, Reservation
from sco.control.planner import plan

NODES = 5000
POOLS = 200
UNITS = 20_000
CONTRACTS = 200
NOW = 1_000_000.0


def hall(seed: int = 7) -> PlanInput:
    rnd = random.Random(seed)
    contracts = {}
    for k in range(CONTRACTS):
        tier = 1 if k < 10 else 2 if k < 100 else 3
        name = f"wl-{k:04d}"
        contracts[name] = ContractInfo(
            name, tier, 32_000 if tier == 1 else 0, on_demand=tier < 3, spend_cap_per_hour=Decimal(50)
        )
    pools = []
    for k in range(POOLS):
        kind = "committed" if k < 10 else "on-demand" if k < 20 else "reclaimable"
        pools.append(Pool(f"pool-{k:03d}", kind, rnd.choice([4, 8, 16, 32]) * 1000, 60, group=f"rack-{k % 25:02d}"))
    names = sorted(contracts)
    fleet, load = [], {}
    for n in range(NODES):
        pool = pools[n % POOLS]
        subset = tuple(sorted(rnd.sample(names, 3)))
        fleet.append(
            Instance(f"id-{n}", f"node-{n:05d}", pool.name, subset, launched_at=NOW - rnd.choice([60] + [3600] * 9))
        )
        if rnd.random() < 0.95:  # most nodes busy: most pending work needs new instances
            load[f"node-{n:05d}"] = rnd.randint(1, pool.flavor_milli // 1000) * 1000
    weights = [rnd.random() for _ in names]
    scale = UNITS * 1000 / sum(weights)
    demand = {c: int(w * scale) for c, w in zip(names, weights, strict=True)}
    reservations = tuple(Reservation(f"lease-{k}", f"pool-{k:03d}", 40) for k in range(10))
    shares = {1: Fraction(1, 4), 2: Fraction(1, 5), 3: Fraction(1, 2)}
    return PlanInput(
        contracts=contracts,
        demand=demand,
        pools=tuple(pools),
        fleet=tuple(fleet),
        reservations=reservations,
        node_load_milli=load,
        settings=PlanSettings(now=NOW, shares=shares, idle_grace_s=600),
    )


def bench_planner() -> Iterator[dict[str, Any]]:
    inp = hall()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        p = plan(inp)
        times.append(time.perf_counter() - t0)
    yield {
        "nodes": NODES,
        "pools": POOLS,
        "units": UNITS,
        "plan_s": round(statistics.median(times), 4),
        "launch": sum(x.launch for x in p.pools),
        "scale_down": sum(len(x.delete) for x in p.pools),
        "shortfall_units": round(sum(p.shortfall_milli.values()) / 1000, 1),
        "decisions": len(p.decisions),
    }


def bench_planner_bounds() -> Iterator[dict[str, Any]]:
    """The largest planning input ``sco.control.inputs`` accepts (MAX_POOLS pools, caps summing to
    MAX_TOTAL_INSTANCES), every instance wanted: parse and plan, as ``sco plan`` and the plan module do."""
    import resource

    from sco.control.inputs import MAX_POOLS, MAX_TOTAL_INSTANCES, parse, plan_input

    contracts = {
        c: ContractInfo(c, 3, 0, on_demand=False, spend_cap_per_hour=Decimal(0)) for c in ("batch-a", "batch-b")
    }
    for pools in (MAX_POOLS, 10):
        cap = MAX_TOTAL_INSTANCES // pools
        doc = {
            "now": NOW,
            "pools": [
                {"name": f"p{k}", "kind": "reclaimable", "flavor": "m1", "vcpus": 1, "ramMiB": 4096, "cap": cap}
                for k in range(pools)
            ],
            "demand": {"demand": [{"contract": c, "units_milli": 10**12} for c in contracts]},
        }
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            p = plan(plan_input(parse(doc, "bench"), contracts, NOW))
            times.append(time.perf_counter() - t0)
        yield {
            "pools": pools,
            "cap": cap,
            "parse_and_plan_s": round(statistics.median(times), 3),
            "launch": sum(x.launch for x in p.pools),
            "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }


BENCHES = {"planner": bench_planner, "planner_bounds": bench_planner_bounds}
