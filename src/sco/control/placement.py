"""Where pending requests go: onto room already there, or onto new instances, at the least hourly cost.

The planner (``sco.control.planner``) states the problem; this module solves it. The model, all integers:

- a **request** is one pending pod or job of a contract, of a size in milli-units, placed whole;
- a **room** is one instance already there (or a floor instance about to launch) with free room and the contract
  subset it runs: requests of those contracts may go there at no cost;
- a **pool** may add up to its cap of new instances of its flavour, at its price per hour each; a new instance
  takes any contract (its subset is what is placed on it).

Objective, in order: (1) place as many milli-units as possible, tier 1 first, then 2, then 3; (2) the least
hourly cost of new instances (ties: fewer new units); (3) put work on as many idle instances as possible, so an
idle instance that pending work can use is kept rather than deleted and relaunched. Constraints: rooms' free room,
pools' caps, each request whole on one instance, and per tier with a share below 1: no reclaimable pool and no
diversification group takes more than the share of the units the plan places on reclaimable capacity for that
tier (on instances there or new: the same rule whether an instance exists yet or not, so a plan applied and made
again finds the same answer; room on committed and on-demand instances is not reclaimed, so it is not counted).

When the greedy start below places everything on room already there, nothing is cheaper: it is the answer and no
program is built (a hall's steady state). When it places everything and is within ``ACCEPT_GAP`` of the LP
relaxation's bound, it is the answer with that bound (large halls: deterministic, no time limit decides). Otherwise
the work is solved as a mixed-integer program with HiGHS (``highspy``; the ``control`` extra) under a node limit
(deterministic) and a time limit (a safety net). Requests on new instances are counted per pool in aggregate
(total size within the pool's instances, and at most k requests above 1/(k+1) of the flavour per instance for
k = 1..3); ``pack`` then puts them onto instances first-fit-decreasing. Without scipy, or when the solver finds
nothing in its limits, a **greedy** fallback (named in the plan) does the same job deterministically: largest
requests first, each onto room already there, else into an instance of the cheapest pool per unit it fits.

What the plan reports of the solve (``solver``) is of the plan returned: ``objective`` is that plan's, by the
program's weights (``objective_of``), and ``bound`` the first round's, the one proved for the whole problem (a
later round solves a narrower one); ``gap`` is between the two, and no bound is claimed when the plan places other
work than the first round did.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any

Req = tuple[str, int]
"""(contract, size in milli-units)"""

PRICE_QUANTUM = Decimal("0.0001")
_W_PRICE = 1_000_000  # objective weight of one PRICE_QUANTUM per hour
_W_UNIT = 10  # objective weight of one unit of new capacity: price first, then size
_W_KEEP = 1  # reward for each idle instance kept busy with pending work (below any unit of new capacity)

LAUNCH_SPREAD_S = 30.0
"""Instances launched within this of the newest fresh one are taken for one plan's launches (the acquire step
creates them one after another)."""


@dataclass(frozen=True)
class Room:
    key: str
    """The instance's name (``+POOL/k`` for a floor instance about to launch)."""
    pool: str
    contracts: frozenset[str]
    free: int
    deletable: bool = False
    """Idle and past its grace: scaled down unless pending work is put on it."""
    launch: bool = False
    """A new instance packed in an earlier round (``solve``): launched, at its pool's price, if work is put on it."""
    fresh: float | None = None
    """When it was launched, if it is still settling and holds nothing yet (a floor instance about to launch: now):
    the instances of the last launch are those within ``LAUNCH_SPREAD_S`` of the newest (``_greedy``'s replay)."""


@dataclass(frozen=True)
class NewPool:
    name: str
    group: str
    flavor: int
    room: int
    """New instances it may take: cap minus what it holds, below 0 when it holds more (then idle instances scaled
    down first give the pool back its cap)."""
    price: Decimal
    freeable: int = 0
    aggregate: bool = True
    """New instances counted in aggregate; False once its counts did not pack: only its packed ones (rooms with
    ``launch``) are left to it."""
    """Idle instances past their grace that no work can go on (no contract subset): they are scaled down in the
    same plan, so their places under the cap are free for new instances. (Idle instances that could take work are
    not counted: trading one for a new instance would undo the last plan.)"""

    @property
    def most(self) -> int:
        return self.room + self.freeable

    @property
    def weight(self) -> int:
        return int(self.price / PRICE_QUANTUM) * _W_PRICE + _W_UNIT * -(-self.flavor // 1000)


@dataclass(frozen=True)
class Problem:
    requests: Mapping[Req, int]
    """Pending requests: (contract, size) -> count."""
    tiers: Mapping[str, int]
    rooms: tuple[Room, ...]
    pools: tuple[NewPool, ...]
    shares: Mapping[int, Fraction]
    node_limit: int = 2000
    time_limit_s: float = 5.0


def _launch_rooms(p: Problem) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, r in enumerate(p.rooms):
        if r.launch:
            out.setdefault(r.pool, []).append(i)
    return out


def _idle_places(p: Problem) -> dict[str, list[int]]:
    """Pool -> its idle rooms past their grace (indices). Each one's place under the cap is a new instance's when
    no work is put on it, as it is scaled down in the same plan: decided per instance with the placement (a plan
    that scaled one down and could not use its place found it free the next time, and launched again)."""
    out: dict[str, list[int]] = {}
    for i, r in enumerate(p.rooms):
        if r.deletable:
            out.setdefault(r.pool, []).append(i)
    return out


@dataclass
class Solution:
    on_room: dict[str, dict[Req, int]] = field(default_factory=dict)
    on_pool: dict[str, dict[Req, int]] = field(default_factory=dict)
    """New instances' requests per pool, in all (``bins`` instance by instance)."""
    bins: dict[str, list[dict[Req, int]]] = field(default_factory=dict)
    """Each pool's new instances, each with the requests it takes: packed, within the flavour."""
    solver: dict[str, Any] = field(default_factory=dict)
    """name (highs or greedy), status, objective, bound, gap, and why a fallback was used."""


def _share_limit(share: Fraction, total: int) -> int:
    return total if share >= 1 else share.numerator * total // share.denominator


# --- the mixed-integer program -----------------------------------------------------------------------------


_GRID = sorted(
    {k * 125 for k in range(1, 9)}
    | {1000 + k * 250 for k in range(1, 5)}
    | {2000 + k * 500 for k in range(1, 5)}
    | {4000 + k * 1000 for k in range(1, 5)}
    | {8000 + k * 2000 for k in range(1, 5)}
    | {16000 + k * 4000 for k in range(1, 5)}
    | {32000 * 2**k for k in range(1, 12)}
)
MAX_EXACT_SIZES = 24
"""Up to this many distinct request sizes the program uses them as they are; beyond, each size is rounded up to a
grid of sizes (1/8 unit steps below 1 unit, then about 1/8 of the size), so the program stays small. Rounding up
keeps every solution valid; packing uses the true sizes."""


def size_classes(sizes: set[int]) -> dict[int, int]:
    """size -> the size the program counts it as."""
    if len(sizes) <= MAX_EXACT_SIZES:
        return {r: r for r in sizes}
    out = {}
    for r in sizes:
        out[r] = next((g for g in _GRID if g >= r), r)
    return out


@dataclass
class _Classed:
    """The problem with each request size rounded up to its class (``size_classes``)."""

    requests: dict[Req, int]
    """(contract, class size) -> count"""
    members: dict[Req, list[tuple[int, int]]]
    """(contract, class size) -> the true sizes it holds, largest first, with their counts"""


def _classed(p: Problem) -> _Classed:
    cls = size_classes({r for (_, r), n in p.requests.items() if n > 0})
    out = _Classed({}, {})
    for (c, r), n in sorted(p.requests.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        if n > 0:
            k = cls[r]
            out.requests[c, k] = out.requests.get((c, k), 0) + n
            out.members.setdefault((c, k), []).append((r, n))
    return out


@dataclass
class _Counts:
    """A solution in class sizes: what each room takes, and each pool's new instances (greedy) or counts (MILP)."""

    on_room: dict[int, dict[Req, int]] = field(default_factory=dict)
    new: dict[tuple[str, int, int], int] = field(default_factory=dict)
    """(pool, tier, class size) -> requests on new instances"""
    instances: dict[str, int] = field(default_factory=dict)
    bins: dict[str, list[dict[Req, int]]] = field(default_factory=dict)
    """The greedy's own new instances, each with its requests (the MILP's counts are disaggregated and packed)."""


class _Program:
    """The mixed-integer program over a classed problem: columns and rows, with the maps back to the problem."""

    def __init__(self, p: Problem, q: _Classed) -> None:
        self.p, self.q = p, q
        self.cost: list[float] = []
        self.ub: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.a: dict[tuple[int, str, int], int] = {}
        self.u: dict[int, int] = {}
        self.n: dict[str, int] = {}
        self.b: dict[tuple[str, int, int], int] = {}
        self.total: dict[int, int] = {}
        self.placed: dict[int, list[tuple[int, float]]] = {}
        self.demand_rows: list[tuple[int, float]] = []
        self._build()

    def col(self, cost: float, ub: float, integer: bool = True) -> int:
        self.cost.append(cost)
        self.ub.append(ub)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lo: float, hi: float) -> int:
        r = len(self.lo)
        for c, v in terms:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.lo.append(lo)
        self.hi.append(hi)
        return r

    def _build(self) -> None:
        p, q = self.p, self.q
        by_contract: dict[str, list[int]] = {}
        tier_cnt: dict[tuple[int, int], int] = {}
        for (c, k), n in sorted(q.requests.items()):
            by_contract.setdefault(c, []).append(k)
            tier_cnt[p.tiers[c], k] = tier_cnt.get((p.tiers[c], k), 0) + n
        per_room: dict[int, list[tuple[int, int]]] = {}
        per_ck: dict[tuple[str, int], list[int]] = {}
        reclaimable = {x.name: x.group for x in p.pools}
        share_terms: dict[int, dict[str, list[tuple[int, int]]]] = {}  # tier -> reclaimable pool -> (col, size)
        weight = {x.name: x.weight for x in p.pools}
        for i, room in enumerate(p.rooms):
            for c in sorted(room.contracts):
                for k in by_contract.get(c, []):
                    if k <= room.free:
                        x = self.col(0.0, min(q.requests[c, k], room.free // k))
                        self.a[i, c, k] = x
                        per_room.setdefault(i, []).append((x, k))
                        per_ck.setdefault((c, k), []).append(x)
                        self.placed.setdefault(p.tiers[c], []).append((x, float(k)))
                        if room.pool in reclaimable:
                            share_terms.setdefault(p.tiers[c], {}).setdefault(room.pool, []).append((x, k))
            if room.deletable and i in per_room:
                self.u[i] = self.col(-float(_W_KEEP), 1)
            elif room.launch and i in per_room:
                self.u[i] = self.col(float(weight[room.pool]), 1)
        per_pool: dict[str, list[tuple[int, int, int]]] = {}
        per_tk: dict[tuple[int, int], list[int]] = {}
        idle, packed = _idle_places(p), _launch_rooms(p)
        for pool in p.pools:
            fits = [(t, k) for (t, k) in sorted(tier_cnt) if k <= pool.flavor]
            most = pool.most + len(idle.get(pool.name, []))
            kept = [self.u[i] for i in idle.get(pool.name, []) + packed.get(pool.name, []) if i in self.u]
            if most <= 0 or not fits or not pool.aggregate:
                if kept:
                    self.row([(u, 1.0) for u in kept], -math.inf, float(max(0, most)))
                continue
            self.n[pool.name] = ncol = self.col(float(pool.weight), most)
            if kept:  # new instances, packed ones launched and idle ones kept share the places under the cap
                self.row([(ncol, 1.0)] + [(u, 1.0) for u in kept], -math.inf, float(most))
            for t, k in fits:
                x = self.col(0.0, min(tier_cnt[t, k], (pool.flavor // k) * most))
                self.b[pool.name, t, k] = x
                per_pool.setdefault(pool.name, []).append((x, t, k))
                per_tk.setdefault((t, k), []).append(x)
                self.placed.setdefault(t, []).append((x, float(k)))
                share_terms.setdefault(t, {}).setdefault(pool.name, []).append((x, k))
        # rooms: free room; an idle instance counts as kept only with work on it
        for i, cols in per_room.items():
            self.row([(x, float(k)) for x, k in cols], -math.inf, float(p.rooms[i].free))
        # an idle instance is kept (a packed one launched: u = 1) exactly when work is put on it
        for i, ucol in self.u.items():
            self.row([(ucol, 1.0)] + [(x, -1.0) for x, _ in per_room[i]], -math.inf, 0.0)
            self.row([(x, float(k)) for x, k in per_room[i]] + [(ucol, -float(p.rooms[i].free))], -math.inf, 0.0)

        # pools: total size within the new instances, and at most j requests above flavor/(j+1) on each
        flavors = {x.name: x.flavor for x in p.pools}
        for name, ncol in self.n.items():
            f = flavors[name]
            mine = per_pool[name]
            self.row([(x, float(k)) for x, _, k in mine] + [(ncol, -float(f))], -math.inf, 0.0)
            seen: set[tuple[int, ...]] = set()
            for j in (1, 2, 3):
                big = tuple(x for x, _, k in mine if k * (j + 1) > f)
                if big and big not in seen:
                    seen.add(big)
                    self.row([(x, 1.0) for x in big] + [(ncol, -float(j))], -math.inf, 0.0)
        # demand: per contract and class over rooms; per tier and class over rooms and pools
        for (c, k), xs in per_ck.items():
            if len(xs) > 1:
                self.row([(x, 1.0) for x in xs], -math.inf, float(q.requests[c, k]))
        contracts_of: dict[tuple[int, int], list[str]] = {}
        for c, k in q.requests:
            contracts_of.setdefault((p.tiers[c], k), []).append(c)
        for (t, k), total in sorted(tier_cnt.items()):
            terms = [(x, 1.0) for c in contracts_of[t, k] for x in per_ck.get((c, k), [])]
            terms += [(x, 1.0) for x in per_tk.get((t, k), [])]
            if terms:
                self.demand_rows.append((self.row(terms, -math.inf, float(total)), float(total)))
        # shares of the units each tier places on reclaimable capacity, there or new (T_t: that total)
        for t, by_pool in sorted(share_terms.items()):
            share = p.shares.get(t, Fraction(1))
            if share >= 1:
                continue
            self.total[t] = tcol = self.col(0.0, math.inf, integer=False)
            self.row([(tcol, 1.0)] + [(x, -float(k)) for xs in by_pool.values() for x, k in xs], 0.0, 0.0)
            groups: dict[str, list[str]] = {}
            for name in by_pool:
                groups.setdefault(reclaimable[name], []).append(name)
            for names in [[n] for n in sorted(by_pool)] + [g for _, g in sorted(groups.items()) if len(g) > 1]:
                terms = [(x, float(k)) for n in names for x, k in by_pool[n]]
                self.row([*terms, (tcol, -float(share))], -math.inf, 0.0)
        self.reclaimable = reclaimable

    def point(self, s: _Counts) -> list[float]:
        """A solution as the program's column values (the solver's starting point)."""
        x = [0.0] * len(self.cost)
        for i, reqs in s.on_room.items():
            for (c, k), n in reqs.items():
                x[self.a[i, c, k]] = float(n)
                t = self.p.tiers[c]
                if t in self.total and self.p.rooms[i].pool in self.reclaimable:
                    x[self.total[t]] += float(n * k)
            if i in self.u and any(reqs.values()):
                x[self.u[i]] = 1.0
        for name, n in s.instances.items():
            if name in self.n:
                x[self.n[name]] = float(n)
        for (name, t, k), n in s.new.items():
            x[self.b[name, t, k]] = float(n)
            if t in self.total:
                x[self.total[t]] += float(n * k)
        return x

    def counts(self, x: list[float]) -> _Counts:
        out = _Counts()
        for (i, c, k), col in self.a.items():
            if round(x[col]):
                out.on_room.setdefault(i, {})[c, k] = round(x[col])
        out.new = {key: round(x[col]) for key, col in self.b.items() if round(x[col])}
        out.instances = {name: round(x[col]) for name, col in self.n.items() if round(x[col])}
        return out

    def objective(self, x: list[float]) -> float:
        return sum(c * v for c, v in zip(self.cost, x, strict=True))


ACCEPT_GAP = 0.009
"""A start (the greedy's placement) whose objective is within this fraction of the LP relaxation's bound is the
answer without a branch and bound: well inside the 1% of the optimum the plan promises (tests/test_planner_objective.py
checks it against a brute force)."""

ACCEPT_MIN_VARIABLES = 5000
"""Below this many columns the program is solved however close the start is: small halls get the exact optimum,
tie-breaks (fewer new units, idle instances kept) included, which the gap on the whole objective cannot see."""

_BANNER_SHOWN = False


def _quiet(make: Any) -> Any:
    """The first HiGHS of a process prints its banner on stdout, which carries ``sco plan --json`` and the
    modules' JSON: construct it with stdout pointed at /dev/null."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return make()
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        return make()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
        _BANNER_SHOWN = True


def prog_objective(cost: list[float], x: list[float]) -> float:
    return sum(c * v for c, v in zip(cost, x, strict=True))


def _run_highs(prog: _Program, start: _Counts, all_placed: bool) -> tuple[_Counts, dict[str, Any]] | str:
    """Improve on ``start`` with HiGHS; a string says why it could not run."""
    try:
        import highspy
        import numpy as np
    except ImportError:
        return "highspy is not installed (the control extra)"
    p = prog.p
    ncols = len(prog.cost)
    lo0 = list(prog.lo)
    if all_placed:
        for r, total in prog.demand_rows:
            lo0[r] = total
    extra: list[tuple[float, list[tuple[int, float]]]] = []  # each stage's "at least what it placed" row

    def model(cost: list[float], relax: bool = False) -> Any:
        """A fresh HiGHS with the whole model: costs changed and rows added to a solved one were not solved again
        (it answered "optimal" with the last stage's point, missing placements that fitted: not idempotent)."""
        h = _quiet(highspy.Highs)
        for opt, val in (
            ("output_flag", False),
            ("threads", 1),  # one thread: the same plan whatever the machine's load
            ("random_seed", 0),
            ("mip_max_nodes", p.node_limit),
            ("time_limit", p.time_limit_s),
            ("mip_rel_gap", 1e-9),
        ):
            h.setOptionValue(opt, val)
        rows, cols, vals = list(prog.rows), list(prog.cols), list(prog.vals)
        lo, hi = list(lo0), list(prog.hi)
        for bound, terms in extra:
            for c, v in terms:
                rows.append(len(lo))
                cols.append(c)
                vals.append(v)
            lo.append(bound)
            hi.append(math.inf)
        lp = highspy.HighsLp()
        lp.num_col_ = ncols
        lp.num_row_ = len(lo)
        lp.col_cost_ = np.array(cost)
        lp.col_lower_ = np.zeros(ncols)
        lp.col_upper_ = np.array(prog.ub)
        lp.row_lower_ = np.array(lo)
        lp.row_upper_ = np.array(hi)
        r_, c_, v_ = np.array(rows, dtype=np.int32), np.array(cols, dtype=np.int32), np.array(vals)
        order = np.lexsort((r_, c_))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.num_col_ = ncols
        lp.a_matrix_.num_row_ = len(lo)
        lp.a_matrix_.start_ = np.searchsorted(c_[order], np.arange(ncols + 1)).astype(np.int32)
        lp.a_matrix_.index_ = r_[order]
        lp.a_matrix_.value_ = v_[order]
        if not relax:
            lp.integrality_ = [
                highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in prog.integer
            ]
        h.passModel(lp)
        return h

    def run(cost: list[float], x0: list[float], presolve: bool = True) -> tuple[list[float], Any, Any]:
        h = model(cost)
        if not presolve:
            h.setOptionValue("presolve", "off")
        sol = highspy.HighsSolution()
        sol.col_value = x0
        sol.value_valid = True
        h.setSolution(sol)
        h.run()
        info = h.getInfo()
        got = list(h.getSolution().col_value) if info.primal_solution_status == 2 else x0
        said = float(info.objective_function_value)
        if (
            presolve
            and info.primal_solution_status == 2
            and abs(prog_objective(cost, got) - said) > 1e-6 * max(1.0, abs(said))
        ):
            # HiGHS 1.16, a MIP its presolve solves whole after a start was given: it reports the objective it
            # found but hands back values that are not that solution (a stage's placements lost, its work left
            # short, and the next plan launched for it). Solved again without presolve.
            return run(cost, x0, presolve=False)
        if h.getModelStatus() == highspy.HighsModelStatus.kTimeLimit:
            # what the clock left depends on the machine's load: the same input could give another plan next run
            # (a plan applied and made again launched). The start is deterministic: keep it; the node limit is the
            # deterministic limit, the time limit only a safety net.
            got = x0
        return got, info, h

    x = prog.point(start)
    start_objective = prog.objective(x)
    if all_placed and ncols >= ACCEPT_MIN_VARIABLES:
        # The LP relaxation (simplex, ~0.2 s at 5k nodes where the MIP's root alone took its whole time limit)
        # bounds every plan from below. A start already within ACCEPT_GAP of it is taken as it is: deterministic
        # (no time limit decides), and the bound it reports is proved.
        h = model(list(prog.cost), relax=True)
        h.setOptionValue("solver", "simplex")
        h.run()
        if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
            lp_bound = min(h.getInfo().objective_function_value, start_objective)
            gap = (start_objective - lp_bound) / abs(start_objective) if start_objective else 0.0
            if gap <= ACCEPT_GAP:
                return start, {
                    "name": "highs",
                    "status": f"start within {ACCEPT_GAP:.1%} of the LP bound",
                    "stages": ["lp bound"],
                    "objective": round(start_objective),
                    "bound": round(lp_bound),
                    "gap": round(gap, 6),
                    "nodes": 0,
                    "start": round(start_objective),
                    "variables": ncols,
                }
    stages: list[str] = []
    if not all_placed:  # place the most of each tier in turn (each stage starts from the last), then the cheapest
        for t in sorted(prog.placed):
            cost = [0.0] * ncols
            for col, k in prog.placed[t]:
                cost[col] = -k
            x, _, _ = run(cost, x)
            best = sum(k * x[col] for col, k in prog.placed[t])
            extra.append((best - 0.5, [(col, float(k)) for col, k in prog.placed[t]]))
            stages.append(f"most of tier {t}")
    x, info, h = run(list(prog.cost), x)
    stages.append("least cost")
    status = h.modelStatusToString(h.getModelStatus())
    objective = prog.objective(x)
    proved = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    bound: float | None = objective if proved else float(info.mip_dual_bound)
    if bound is not None and not math.isfinite(bound):
        bound = None  # stopped before the root relaxation was solved: nothing proved
    gap = None if bound is None else (objective - min(bound, objective)) / abs(objective) if objective else 0.0
    return prog.counts(x), {
        "name": "highs",
        "status": status,
        "stages": stages,
        "objective": round(objective),
        "bound": None if bound is None else round(min(bound, objective)),
        "gap": None if gap is None else round(gap, 6),
        "nodes": int(info.mip_node_count),
        "start": round(start_objective),
        "variables": ncols,
    }


def _take(members: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Take ``n`` requests from a class's true sizes (largest first), consuming them."""
    out = []
    for j, (r, have) in enumerate(members):
        if not n:
            break
        got = min(n, have)
        if got:
            out.append((r, got))
            members[j] = (r, have - got)
            n -= got
    return out


def _apportion(total: int, weights: list[tuple[str, int]]) -> dict[str, int]:
    """Split ``total`` over ``weights`` proportionally, integers only (largest remainder, ties by name)."""
    whole = sum(w for _, w in weights)
    if total >= whole:
        return {k: w for k, w in weights}
    base = {k: w * total // whole for k, w in weights}
    rest = total - sum(base.values())
    for k, _ in sorted(weights, key=lambda kw: (-(kw[1] * total % whole), kw[0]))[:rest]:
        base[k] += 1
    return base


def _disaggregate(p: Problem, q: _Classed, s: _Counts) -> dict[str, dict[Req, int]]:
    """Tier-level counts on new instances to contracts: each contract of the tier gets its proportional part
    of what the tier placed, and a contract's requests go round the pools so it spreads like its tier."""
    left = dict(q.requests)
    for placed in s.on_room.values():
        for key, n in placed.items():
            left[key] -= n
    out: dict[str, dict[Req, int]] = {}
    for t, k in sorted({(t, k) for _, t, k in s.new}):
        per_pool = [(pn, n) for (pn, tt, kk), n in sorted(s.new.items()) if (tt, kk) == (t, k)]
        total = sum(n for _, n in per_pool)
        weights = [(c, left[c, kk]) for (c, kk) in sorted(left) if kk == k and p.tiers[c] == t and left[c, kk] > 0]
        got = _apportion(total, weights)
        room = dict(per_pool)
        for c, _ in weights:  # contract by contract, each over the pools in proportion to what they still take
            share = _apportion(got[c], [(pool, n) for pool, n in sorted(room.items()) if n])
            for pool, n in share.items():
                if n:
                    slot = out.setdefault(pool, {})
                    slot[c, k] = slot.get((c, k), 0) + n
                    room[pool] -= n
    return out


# --- the greedy start (and fallback) -------------------------------------------------------------------------


def _greedy(p: Problem, q: _Classed, replay: bool = False) -> _Counts:
    """Largest requests first, tier 1 first: onto room already there, else into new instances of the cheapest pool
    per unit they fit (a new instance may take the place of an idle room no work went on); on reclaimable capacity
    within the tier's share of what it wants placed. Then, as the share is of what was placed: while a pool or group
    holds more than that, its smallest requests are taken back (from new instances first)."""
    left = {k: n for k, n in q.requests.items() if n > 0}
    out = _Counts()
    group = {x.name: "g:" + x.group for x in p.pools}  # the reclaimable pools: shares apply there
    # the rooms fewest contracts may use first (what one takes there takes nothing from another's); replaying, the
    # instances of the last launch are met with their pools instead, in the order new instances are opened
    rank = {x.name: k for k, x in enumerate(sorted(p.pools, key=lambda x: (x.price / x.flavor, x.flavor, x.name)))}
    order_rooms = sorted(
        range(len(p.rooms)),
        key=lambda i: (
            not p.rooms[i].deletable,  # idle ones first: work there keeps them, elsewhere they are deleted
            len(p.rooms[i].contracts),
            rank.get(p.rooms[i].pool, -1),
            p.rooms[i].free,
            p.rooms[i].key,
        ),
    )
    newest = max((r.fresh for r in p.rooms if r.fresh is not None), default=0.0)
    rooms_of: dict[str, list[int]] = {}
    fresh_of: dict[tuple[str, str], list[int]] = {}  # (pool, contract) -> fresh rooms, met with the pool's new ones
    for i in [i for i in order_rooms if not p.rooms[i].launch]:  # packed ones are the program's to reuse
        for c in p.rooms[i].contracts:
            fresh = p.rooms[i].fresh
            if replay and p.rooms[i].pool in rank and fresh is not None and fresh >= newest - LAUNCH_SPREAD_S:
                fresh_of.setdefault((p.rooms[i].pool, c), []).append(i)
            else:
                rooms_of.setdefault(c, []).append(i)
    free = [r.free for r in p.rooms]
    order = sorted(left, key=lambda ck: (p.tiers[ck[0]], -ck[1], ck[0]))
    pools = sorted(p.pools, key=lambda x: (x.price / x.flavor, x.flavor, x.name))
    bins: dict[str, list[list[Any]]] = {x.name: [] for x in pools}  # [free, {(c, k): n}]
    idle = _idle_places(p)
    freed: dict[str, int] = {}
    kept: dict[str, int] = {}  # pool -> its idle rooms given work
    by_name = {x.name: x for x in p.pools}

    def can_open(pool: NewPool) -> bool:
        """One more new instance under the cap: a place free, or an idle room's without work (it is scaled down)."""
        if not pool.aggregate:
            return False
        if len(bins[pool.name]) < pool.most + freed.get(pool.name, 0):
            return True
        for i in idle.get(pool.name, []):
            if free[i] and not any(out.on_room.get(i, {}).values()):
                free[i] = 0  # its place is taken: no work goes on it any more
                freed[pool.name] = freed.get(pool.name, 0) + 1
                if len(bins[pool.name]) < pool.most + freed[pool.name]:
                    return True
        return False

    for tier in sorted({p.tiers[c] for c, _ in left}):
        share = p.shares.get(tier, Fraction(1))
        limit = _share_limit(share, sum(k * n for (c, k), n in left.items() if p.tiers[c] == tier))
        held: dict[str, int] = {}

        def within(pool: str, k: int) -> int:
            if pool not in group:
                return 1 << 62
            return min(limit - held.get(pool, 0), limit - held.get(group[pool], 0)) // k  # noqa: B023

        def hold(pool: str, milli: int) -> None:
            if pool in group:
                held[pool] = held.get(pool, 0) + milli  # noqa: B023
                held[group[pool]] = held.get(group[pool], 0) + milli  # noqa: B023

        def onto(i: int, c: str, k: int) -> None:
            r = p.rooms[i]
            if r.deletable and i not in out.on_room and r.pool in by_name:
                # an idle instance kept busy takes a place under the cap, as a new one does: a pool over its cap
                # keeps no more than the cap (the program's rule; the greedy kept both of two over a cap of 1)
                x = by_name[r.pool]
                if kept.get(r.pool, 0) + len(bins[r.pool]) >= x.most + len(idle.get(r.pool, [])):
                    return
            n = min(left[c, k], free[i] // k, within(r.pool, k))
            if n > 0:
                if r.deletable and i not in out.on_room:
                    kept[r.pool] = kept.get(r.pool, 0) + 1
                free[i] -= n * k
                left[c, k] -= n
                slot = out.on_room.setdefault(i, {})
                slot[c, k] = slot.get((c, k), 0) + n
                hold(p.rooms[i].pool, n * k)

        for c, k in [ck for ck in order if p.tiers[ck[0]] == tier]:
            for i in rooms_of.get(c, []):
                if not left[c, k]:
                    break
                onto(i, c, k)
            for pool in pools:
                for i in fresh_of.get((pool.name, c), []):
                    if not left[c, k]:
                        break
                    onto(i, c, k)
                if not left[c, k]:
                    break
                if pool.flavor < k:
                    continue
                n = min(left[c, k], within(pool.name, k))
                bl = bins[pool.name]
                got = 0
                for b in bl:  # partly filled instances first
                    if got >= n:
                        break
                    t = min(n - got, b[0] // k)
                    if t:
                        b[0] -= t * k
                        b[1][c, k] = b[1].get((c, k), 0) + t
                        got += t
                per = pool.flavor // k
                while got < n and can_open(pool):
                    t = min(n - got, per)
                    bl.append([pool.flavor - t * k, {(c, k): t}])
                    got += t
                if got > 0:
                    left[c, k] -= got
                    hold(pool.name, got * k)
        while share < 1:  # the share is of what was placed: take back from the fullest until it holds
            sums: dict[str, int] = {}
            places: dict[str, list[dict[Req, int]]] = {name: [b[1] for b in reversed(bl)] for name, bl in bins.items()}
            for i in reversed(order_rooms):
                if p.rooms[i].pool in group and i in out.on_room:
                    places[p.rooms[i].pool].append(out.on_room[i])
            for name, held_here in places.items():
                m = sum(k * n for reqs in held_here for (c, k), n in reqs.items() if p.tiers[c] == tier)
                if m:
                    sums[name] = m
                    sums[group[name]] = sums.get(group[name], 0) + m
            cap = _share_limit(share, sum(v for key, v in sums.items() if not key.startswith("g:")))
            over = sorted((key for key, v in sums.items() if v > cap), key=lambda key: (-sums[key], key))
            if not over:
                break
            victim, need = over[0], sums[over[0]] - cap
            names = [victim] if not victim.startswith("g:") else [n for n in sorted(places) if group[n] == victim]
            for name in names:
                for reqs in places[name]:
                    for c, k in sorted((ck for ck in reqs if p.tiers[ck[0]] == tier), key=lambda ck: (ck[1], ck[0])):
                        if need <= 0:
                            break
                        t = min(reqs[c, k], -(-need // k))
                        reqs[c, k] -= t
                        if not reqs[c, k]:
                            del reqs[c, k]
                        left[c, k] += t
                        need -= t * k
        for pool in pools:  # room taken back is free again
            for b in bins[pool.name]:
                b[0] = pool.flavor - sum(k * n for (_, k), n in b[1].items())
        for i in list(out.on_room):
            free[i] = p.rooms[i].free - sum(k * n for (_, k), n in out.on_room[i].items())
            if not out.on_room[i]:
                del out.on_room[i]
    for name, bl in bins.items():
        full = [b[1] for b in bl if b[1]]
        if not full:
            continue
        out.instances[name] = len(full)
        out.bins[name] = full
        for reqs in full:
            for (c, k), n in reqs.items():
                key = (name, p.tiers[c], k)
                out.new[key] = out.new.get(key, 0) + n
    return out


_Round = tuple[dict[int, dict[Req, int]], dict[str, list[dict[Req, int]]], dict[str, Any], tuple[str, ...]]
"""requests on each room by index, new instances per pool with the requests each takes, the solver's report, the
pools whose counts of new requests could not all be packed onto instances"""


def _keepable_left_idle(p: Problem, s: _Counts) -> bool:
    """Whether an idle room past its grace that a pending request fits was left without work (it would be scaled
    down, where the program keeps it busy: a plan applied and made again scaled down what the last one used)."""
    sizes: dict[str, int] = {}
    for (c, k), n in p.requests.items():
        if n > 0:
            sizes[c] = min(sizes.get(c, k), k)
    return any(
        r.deletable
        and not any(s.on_room.get(i, {}).values())
        and any(sizes.get(c, r.free + 1) <= r.free for c in r.contracts)
        for i, r in enumerate(p.rooms)
    )


def _round(p: Problem) -> tuple[_Round, _Round]:
    """One solve: the program's answer (or the greedy's, without it) and the greedy's, both in true sizes."""
    q = _classed(p)
    wanted = sum(q.requests.values())

    def steady(s: _Counts) -> bool:
        got = sum(n for r in s.on_room.values() for n in r.values()) + sum(s.new.values())
        launches = s.instances or any(p.rooms[i].launch for i, r in s.on_room.items() if any(r.values()))
        return got == wanted and not launches and not _keepable_left_idle(p, s)

    start = _greedy(p, q)
    if not steady(start) and any(r.fresh is not None for r in p.rooms):
        # the instances the last plan launched, met in the order it filled them (tier by tier, largest first, does
        # not always find again the packing it made when they were new: 5k nodes then ran HiGHS to its time limit)
        again = _greedy(p, q, replay=True)
        if steady(again):
            start = again
    got = sum(n for r in start.on_room.values() for n in r.values()) + sum(start.new.values())
    if steady(start):
        # everything fits room already there: nothing is cheaper, so no program is built (in a hall's steady state,
        # the instances the last plan launched are rooms: 390k columns at 5k nodes, 16 s of HiGHS for a plan that
        # launches nothing). Which idle instances are kept busy is the greedy's choice here, not the program's.
        result: tuple[_Counts, dict[str, Any]] | str = "everything fits room already there"
    else:
        prog = _Program(p, q)
        result = _run_highs(prog, start, all_placed=got == wanted) if prog.cost else "nothing to place"

    def true(members: dict[Req, list[tuple[int, int]]], reqs: Mapping[Req, int]) -> dict[Req, int]:
        out: dict[Req, int] = {}
        for (c, k), n in sorted(reqs.items()):
            for r, m in _take(members[c, k], n):
                out[c, r] = out.get((c, r), 0) + m
        return out

    members = {ck: list(v) for ck, v in q.members.items()}
    on_room = {i: true(members, reqs) for i, reqs in sorted(start.on_room.items())}
    bins = {name: [true(members, b) for b in bl] for name, bl in sorted(start.bins.items())}
    greedy: _Round = on_room, bins, {"name": "greedy", "status": result if isinstance(result, str) else ""}, ()
    if isinstance(result, str):
        return greedy, greedy
    counts, solver = result
    if counts is start:  # the start taken as it is: its own instances, exactly as the greedy packed them
        return (on_room, bins, solver, ()), greedy
    members = {ck: list(v) for ck, v in q.members.items()}
    on_room = {i: true(members, reqs) for i, reqs in sorted(counts.on_room.items())}
    bins = {}
    over: list[str] = []
    idle, launched = _idle_places(p), _launch_rooms(p)

    def used(i: int) -> bool:
        return any(on_room.get(i, {}).values())

    most = {  # the places under the cap: free ones, and those of idle rooms no work was put on
        x.name: x.most
        + sum(1 for i in idle.get(x.name, []) if not used(i))
        - sum(1 for i in launched.get(x.name, []) if used(i))
        for x in p.pools
    }
    flavor = {x.name: x.flavor for x in p.pools}
    for name, reqs in sorted(_disaggregate(p, q, counts).items()):
        bins[name], left = pack(flavor[name], most[name], true(members, reqs))
        # more instances than the program counted (and paid for) is a packing it did not price: 6 + 6 + 4 units
        # "fit" two 8-unit instances, packing opened a third where a 4-unit one of another pool was cheaper
        if left or len(bins[name]) > counts.instances.get(name, 0):
            over.append(name)
    return (on_room, bins, solver, tuple(over)), greedy


MAX_ROUNDS = 4
"""Solves per plan at most (``solve``): each round after the first exhausts a pool, so two are the rule."""


def solve(p: Problem) -> Solution:
    """The requests on rooms and on new instances, every instance's requests within its flavour.

    The program counts the requests on a pool's new instances in aggregate, a relaxation: first-fit decreasing may
    not pack what it counted (3 + 3 + 1.5 units "fit" two 4-unit instances). Such an overflow used to become a
    shortfall, and the next plan, seeing the instances launched as rooms (exact), placed it elsewhere and launched
    again. Packing that needs more instances than the program counted is not packing either: the plan launched
    them at a cost the program never weighed (6 + 6 + 4 units on three 8-unit instances at 2.4/h, where a 4-unit
    instance of another pool made it 2.0/h). So when a pool's counts do not pack onto the instances counted, the
    instances packed for it become rooms of the plan (any contract,
    each launched at the pool's price if work stays on it, in the pool's places under the cap) and it counts no
    more in aggregate; the program is solved again. Each round closes a pool, so the rounds end; past
    ``MAX_ROUNDS`` the first round's greedy (exact) is the answer."""
    contracts = frozenset(p.tiers)
    rooms, pools = list(p.rooms), {x.name: x for x in p.pools}
    first_new = len(rooms)  # rooms from here on are instances packed in an earlier round
    fallback: _Round | None = None
    first: dict[str, Any] = {}
    for n_round in range(1, MAX_ROUNDS + 1):
        cur = Problem(p.requests, p.tiers, tuple(rooms), tuple(pools.values()), p.shares, p.node_limit, p.time_limit_s)
        (on_room, bins, solver, over), greedy = _round(cur)
        fallback = fallback or greedy
        if n_round == 1:
            first = {**solver, "placed": _placed(cur, on_room, bins)}
        if not over:
            break
        if n_round == MAX_ROUNDS:  # still not packed: the first round's greedy, exact, and within the shares
            on_room, bins, solver, _ = fallback
            solver = {**solver, "status": f"counts did not pack onto instances in {MAX_ROUNDS} rounds"}
            rooms = rooms[:first_new]
            break
        idle = _idle_places(cur)
        for name in over:  # its counts did not pack: what it packed is left to it exactly, and its other places
            x = pools[name]
            # under the cap as empty instances: a place lost here left work short that the cap allows, and the next
            # plan launched it (found by review: seed 20823 of planner_halls)
            places = max(len(bins[name]), x.most + len(idle.get(name, [])))
            rooms.extend(Room(f"+{name}/{j}", name, contracts, x.flavor, launch=True) for j in range(places))
            pools[name] = NewPool(x.name, x.group, x.flavor, x.room, x.price, x.freeable, aggregate=False)
    out = Solution(solver=dict(solver))
    of_pool = {i: rooms[i].pool for i in range(first_new, len(rooms))}
    for i, reqs in on_room.items():
        if not any(reqs.values()):
            continue
        if i in of_pool:  # an instance packed in an earlier round, launched with the work on it
            out.bins.setdefault(of_pool[i], []).append(reqs)
        else:
            out.on_room[rooms[i].key] = reqs
    for name, bl in bins.items():
        out.bins.setdefault(name, []).extend(b for b in bl if b)
    for name, bl in out.bins.items():
        slot = out.on_pool.setdefault(name, {})
        for b in bl:
            for key, n in b.items():
                slot[key] = slot.get(key, 0) + n
    out.bins = {name: bl for name, bl in sorted(out.bins.items()) if bl}
    out.solver = _report(p, out, first, n_round)
    return out


def _placed(
    p: Problem, on_room: Mapping[int, Mapping[Req, int]], bins: Mapping[str, list[dict[Req, int]]]
) -> dict[int, int]:
    """Milli-units placed per tier."""
    out: dict[int, int] = {}
    for reqs in [*on_room.values(), *[b for bl in bins.values() for b in bl]]:
        for (c, k), n in reqs.items():
            out[p.tiers[c]] = out.get(p.tiers[c], 0) + k * n
    return {t: m for t, m in out.items() if m}


def objective_of(p: Problem, s: Solution) -> int:
    """The program's objective for a solution of ``p`` (its weights: the price of each new instance, then its size;
    less one for each idle instance kept busy): what the plan's ``solver.objective`` says."""
    weight = {x.name: x.weight for x in p.pools}
    kept = sum(1 for r in p.rooms if r.deletable and any(s.on_room.get(r.key, {}).values()))
    return sum(weight[name] * len(bl) for name, bl in s.bins.items()) - _W_KEEP * kept


def _report(p: Problem, s: Solution, first: Mapping[str, Any], rounds: int) -> dict[str, Any]:
    """What the solver says of the plan returned: its own objective, and the gap to a bound proved for the whole
    problem. A later round solves a narrower problem (a pool's counts replaced by instances packed), so only the
    first round's bound holds for the plan; it said "optimal, gap 0" of counts packing then changed (issue 31)."""
    out = dict(s.solver)
    if rounds > 1:
        out["rounds"] = rounds
    if "objective" not in first and "objective" not in out:
        return out  # the greedy alone (no HiGHS): nothing proved, nothing claimed
    objective = objective_of(p, s)
    bound = first.get("bound")
    if _placed(p, {}, {"": [*s.on_room.values(), *[b for bl in s.bins.values() for b in bl]]}) != first["placed"]:
        bound = None  # it places other work than the first round did: that round's bound is of another problem
    if bound is not None:
        bound = min(int(bound), objective)
    out["objective"] = objective
    out["bound"] = bound
    out["gap"] = None if bound is None else round((objective - bound) / abs(objective), 6) if objective else 0.0
    if rounds > 1:
        out["status"] = f"{out.get('status') or 'solved'} in round {rounds}; bound of round 1 (the whole problem)"
    return out


def pack(flavor: int, room: int, reqs: Mapping[Req, int]) -> tuple[list[dict[Req, int]], dict[Req, int]]:
    """Requests onto at most ``room`` new instances of ``flavor``, first-fit decreasing: (instances, overflow)."""
    bins: list[list[Any]] = []  # [free, {req: n}]
    over: dict[Req, int] = {}
    for (c, r), n in sorted(reqs.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        for b in bins:
            if not n:
                break
            t = min(n, b[0] // r)
            if t:
                b[0] -= t * r
                b[1][c, r] = b[1].get((c, r), 0) + t
                n -= t
        while n and len(bins) < room and r <= flavor:
            t = min(n, flavor // r)
            bins.append([flavor - t * r, {(c, r): t}])
            n -= t
        if n:
            over[c, r] = n
    return [b[1] for b in bins], over
