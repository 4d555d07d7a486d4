"""The portfolio planner on a large hall: 5000 nodes in 200 pools, 20,000 units of pending work.

``planner``: ``sco plan``'s path from the JSON document's bytes (json, validation, resolution) to the plan, median
of 5 runs (goal < 1 s), the Python heap's peak (tracemalloc, one more run), what the solver proved (objective,
bound, gap), and the hourly cost of new capacity and the units left short under the new planner and under the
planner before issue 17 (a frozen copy, ``benchmarks/old_planner.py``), on the same hall and prices. Then each
plan is applied (launches active, deletes gone) and planned again: what the second run would launch, and how long
the new planner's re-plan takes (``replan_s``: the timer's steady state).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
import tracemalloc
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

from benchmarks import old_planner
from sco.control.inputs import parse, plan_input, read_document
from sco.control.model import ContractInfo, Instance, PlanInput
from sco.control.planner import plan

NODES = 5000
POOLS = 200
UNITS = 20_000
CONTRACTS = 200
NOW = 1_000_000.0
SIZES = [250, 500, 1000, 2000, 4000, 8000]
STATES = ["active"] * 90 + ["launching"] * 4 + ["notified"] * 2 + ["draining"] * 2 + ["failed", "deleting"]


def contracts() -> dict[str, ContractInfo]:
    out = {}
    for k in range(CONTRACTS):
        tier = 1 if k < 10 else 2 if k < 100 else 3
        name = f"wl-{k:04d}"
        out[name] = ContractInfo(
            name, tier, 32_000 if tier == 1 else 0, on_demand=tier < 3, spend_cap_per_hour=Decimal(50)
        )
    return out


def hall_doc(seed: int = 7) -> dict[str, Any]:
    rnd = random.Random(seed)
    names = sorted(contracts())
    pools = []
    for k in range(POOLS):
        kind = "committed" if k < 10 else "on-demand" if k < 20 else "reclaimable"
        vcpus = rnd.choice([4, 8, 16, 32])
        price = Decimal(rnd.randint(8, 20)) * vcpus / 1000  # 0.008-0.020 per unit-hour
        pools.append(
            {
                "name": f"pool-{k:03d}",
                "kind": kind,
                "flavor": f"f{vcpus}",
                "vcpus": vcpus,
                "ramMiB": vcpus * 4096,
                "cap": 60,
                "group": f"rack-{k % 25:02d}",
                "pricePerHour": str(price),
            }
        )
    fleet, load = [], {}
    for n in range(NODES):
        pool = pools[n % POOLS]
        node = f"node-{n:05d}"
        fleet.append(
            {
                "id": f"id-{n}",
                "name": node,
                "pool": pool["name"],
                "contracts": sorted(rnd.sample(names, 3)),
                "launchedAt": NOW - rnd.choice([60] + [3600] * 9),
                "state": rnd.choice(STATES),
            }
        )
        if rnd.random() < 0.95:  # most nodes busy: most pending work needs new instances
            load[node] = rnd.randint(1, pool["vcpus"]) * 1000
    weights = [rnd.random() for _ in names]
    scale = UNITS * 1000 / sum(weights)
    demand = []
    for c, w in zip(names, weights, strict=True):
        want, sizes = int(w * scale), {}
        while want >= SIZES[0]:
            s = rnd.choice([x for x in SIZES if x <= want])
            sizes[s] = sizes.get(s, 0) + 1
            want -= s
        total = sum(s * n for s, n in sizes.items())
        demand.append(
            {
                "contract": c,
                "units_milli": total,
                "items": sum(sizes.values()),
                "requests_milli": {str(s): n for s, n in sorted(sizes.items())},
            }
        )
    return {
        "now": NOW,
        "pools": pools,
        "settings": {"shares": {1: "1/4", 2: "1/5", 3: "1/2"}, "idleGraceSeconds": 600},
        "reservations": [{"lease": f"lease-{k}", "pool": f"pool-{k:03d}", "instances": 40} for k in range(10)],
        "fleet": fleet,
        "demand": {"demand": demand, "node_load_milli": load},
    }


def _input(raw: bytes) -> PlanInput:
    return plan_input(parse(read_document(raw, "hall.json"), "hall.json"), contracts(), NOW)


def _cost(inp: PlanInput, p: Any) -> Decimal:
    price = {x.name: x.price_per_hour for x in inp.pools}
    return sum((price[x.pool] * x.launch for x in p.pools if x.kind == "reclaimable"), Decimal(0))


def _applied(inp: PlanInput, p: Any) -> PlanInput:
    gone = {i for x in p.pools for i in x.delete}
    fleet = [i for i in inp.fleet if i.id not in gone]
    for x in p.pools:
        fleet += [
            Instance(f"n-{x.pool}-{k}", f"n-{x.pool}-{k}", x.pool, tuple(x.launch_contracts), NOW)
            for k in range(x.launch)
        ]
    return PlanInput(**{**inp.__dict__, "fleet": tuple(fleet)})


def bench_planner() -> Iterator[dict[str, Any]]:
    raw = json.dumps(hall_doc()).encode()
    times, parse_times = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        inp = _input(raw)
        t1 = time.perf_counter()
        p = plan(inp)
        times.append(time.perf_counter() - t0)
        parse_times.append(t1 - t0)
    tracemalloc.start()
    plan(_input(raw))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    old = old_planner.plan(inp)
    applied = _applied(inp, p)
    replan_times = []
    for _ in range(3):  # the timer's steady state: the plan applied, the same demand planned again
        t0 = time.perf_counter()
        again = plan(applied)
        replan_times.append(time.perf_counter() - t0)
    old_again = old_planner.plan(_applied(inp, old))
    s = p.solver
    yield {
        "nodes": NODES,
        "pools": POOLS,
        "units": UNITS,
        "document_mib": round(len(raw) / 2**20, 1),
        "parse_and_plan_s": round(statistics.median(times), 3),
        "parse_s": round(statistics.median(parse_times), 3),
        "replan_s": round(statistics.median(replan_times), 3),
        "replan_solver": again.solver.get("name"),
        "peak_heap_mib": round(peak / 2**20, 1),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "solver": s.get("name"),
        "solver_status": s.get("status"),
        "objective": s.get("objective"),
        "bound": s.get("bound"),
        "gap": s.get("gap"),
        "start_objective": s.get("start"),
        "cost_per_hour_new": str(p.cost_per_hour),
        "cost_per_hour_old": str(_cost(inp, old)),
        "short_units_new": sum(p.shortfall_milli.values()) / 1000,
        "short_units_old": sum(old.shortfall_milli.values()) / 1000,
        "launch_new": sum(x.launch for x in p.pools),
        "launch_old": sum(x.launch for x in old.pools),
        "replan_launch_new": sum(x.launch for x in again.pools),
        "replan_launch_old": sum(x.launch for x in old_again.pools),
        "replan_delete_new": sum(len(x.delete) for x in again.pools),
    }


def bench_planner_bounds() -> Iterator[dict[str, Any]]:
    """The largest planning input ``sco.control.inputs`` accepts (MAX_POOLS pools, caps summing to
    MAX_TOTAL_INSTANCES), every instance wanted: parse and plan, as ``sco plan`` and the plan module do."""
    import resource

    from sco.control.inputs import MAX_POOLS, MAX_TOTAL_INSTANCES

    cs = {c: ContractInfo(c, 3, 0, on_demand=False, spend_cap_per_hour=Decimal(0)) for c in ("batch-a", "batch-b")}
    for pools in (MAX_POOLS, 10):
        cap = MAX_TOTAL_INSTANCES // pools
        doc = {
            "now": NOW,
            "pools": [
                {"name": f"p{k}", "kind": "reclaimable", "flavor": "m1", "vcpus": 1, "ramMiB": 4096, "cap": cap}
                for k in range(pools)
            ],
            "demand": {"demand": [{"contract": c, "units_milli": 10**12} for c in cs]},
        }
        raw = json.dumps(doc).encode()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            p = plan(plan_input(parse(read_document(raw, "bench.json"), "bench"), cs, NOW))
            times.append(time.perf_counter() - t0)
        yield {
            "pools": pools,
            "cap": cap,
            "parse_and_plan_s": round(statistics.median(times), 3),
            "launch": sum(x.launch for x in p.pools),
            "solver": p.solver.get("name"),
            "gap": p.solver.get("gap"),
            "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }


BENCHES = {"planner": bench_planner, "planner_bounds": bench_planner_bounds}
