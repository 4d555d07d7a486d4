"""Portfolio planner: demand, fleet and reservations in; target instance counts per pool out, every decision explained.

**Objective.** Place every pending request it can, tier 1 first, at the least hourly cost of new capacity, subject
to pool caps, tier-1 floors on committed capacity, and per tier the share (``settings.shares``) of the units the
plan places on reclaimable capacity (instances there or new) that one pool or one diversification group may take,
so one reclaim wave cannot take a tier's capacity down. Each pending pod or job is one **whole request**
(``PlanInput.requests``): it goes onto one instance, never split. Requests are packed onto flavours: onto room
already there at no cost, else onto new instances of reclaimable pools at their ``price_per_hour`` (ties: fewer new
units). How it is solved, and the fallback, is ``sco.control.placement``; the plan names the solver, the cost, the
bound proved and the gap, and lists which instance covers which work (``covers``). The cost is the sum of the
prices of the instances the plan launches, and the objective and gap are those of that plan, not of a count the
solver made before packing (``tests/test_planner_generated.py`` checks both on 300 generated halls).

Pure and deterministic: no clock (``settings.now`` is an input), no I/O, every input put in canonical order
first and all arithmetic on integers (milli-units), so the same input gives the same plan whatever the order of
its lists. The phases, in order, each its own function:

1. ``survey``: the pools and the fleet in them. Unavailable pools take no launches and their instances do not
   count as room. Only instances that are ``requested``, ``launching`` or ``active`` are room; those on their way
   out (``notified``, ``draining``, ``drained``, ``overrun``, ``deleting``, ``failed``) still count against a
   pool's cap; ``deleted`` and ``lost`` ones count for nothing. Instances of pools not configured are left alone.
2. ``hold_floors``: each tier-1 contract's floor is held on committed pools (Blazar leases give the committed
   instances), contracts by name, pools by name. Committed capacity is paid for: never scaled down. Launches stay
   within the pool's cap and the lease's instance count, both of which instances on their way out still take
   (they hold a host of the lease until Nova has deleted them): ``floors_milli`` is what is held **now** (on
   committed instances that are room, or launched by this plan), ``floors_later_milli`` what is held only once
   those outgoing instances are gone, and the floor's decision says both.
3. ``pending``: the pending work of known contracts as whole requests.
4. ``rooms`` and ``new_pools``: room already there (idle instances, instances still settling, floor instances
   about to launch) and what reclaimable pools may add.
5. ``place``: the optimisation, then the new instances' requests packed onto instances (first-fit decreasing).
   What does not fit is the **shortfall**, handed to the fallback arbiter.
6. ``scale_down``: idle ``active`` instances of reclaimable and on-demand pools that no pending work was put on,
   once they have been up for ``idle_grace_s``, **except** one that short work of its contracts fits (the rule of
   issue 31): a share or a cap kept that work off it, so it goes to the fallback arbiter, which means on-demand
   spend, while the instance is paid for already and idle. Kept idle it spreads nothing a share guards against
   (there is no work on it), and the scheduler, which knows no shares, may put the pending work on it. It stays
   within its pool's cap with this plan's launches, and is deleted by the first plan where no short work fits it.

Applying a plan and planning again with the same demand changes nothing: the instances launched are room the
same requests fit, and an idle instance pending work can use is kept (``tests/test_planner_objective.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sco.control.model import GONE_STATES, ROOM_STATES, Instance, PlanInput, Pool
from sco.control.placement import NewPool, Problem, Req, Room, Solution, solve
from sco.control.units import MILLI, fmt


@dataclass(frozen=True)
class Decision:
    kind: str
    """floor, cover, launch, scale_down, keep, short, skip_pool, ignore"""
    subject: str
    """pool:NAME, contract:NAME, instance:NAME, lease:ID"""
    reason: str

    def __str__(self) -> str:
        return f"{self.kind:<10} {self.subject:<32} {self.reason}"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "subject": self.subject, "reason": self.reason}


@dataclass(frozen=True)
class PoolPlan:
    pool: str
    kind: str
    current: int
    target: int
    launch: int
    launch_contracts: tuple[str, ...]
    """The contract subset new instances of this pool are launched with."""
    delete: tuple[str, ...]
    """Ids of the instances to scale down."""
    placed_milli: dict[str, int] = field(default_factory=dict)
    """New units placed here this plan, by contract."""
    cost_per_hour: Decimal = Decimal(0)
    """What the instances launched here cost per hour."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "kind": self.kind,
            "current": self.current,
            "target": self.target,
            "launch": self.launch,
            "launch_contracts": list(self.launch_contracts),
            "delete": list(self.delete),
            "placed_milli": dict(sorted(self.placed_milli.items())),
            "cost_per_hour": str(self.cost_per_hour),
        }


@dataclass(frozen=True)
class Cover:
    """Work one instance takes in this plan: an instance already there, or one to launch (``new``)."""

    instance: str
    pool: str
    new: bool
    work_milli: dict[str, int]
    requests: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "pool": self.pool,
            "new": self.new,
            "work_milli": dict(sorted(self.work_milli.items())),
            "requests": self.requests,
        }


@dataclass(frozen=True)
class Plan:
    pools: tuple[PoolPlan, ...]
    shortfall_milli: dict[str, int]
    """Pending units per contract that reclaimable and committed capacity cannot take (for the arbiter)."""
    floors_milli: dict[str, int]
    """Floor units held per tier-1 contract."""
    decisions: tuple[Decision, ...]
    cost_per_hour: Decimal = Decimal(0)
    """Hourly cost of the new instances (floor instances on committed capacity are paid for already)."""
    covers: tuple[Cover, ...] = ()
    solver: Mapping[str, Any] = field(default_factory=dict)
    """Which solver placed the work (highs or the greedy fallback, and why), its objective, bound and gap."""
    floors_later_milli: dict[str, int] = field(default_factory=dict)
    """Floor units per tier-1 contract that committed capacity holds only once its instances on their way out are
    gone (not in ``floors_milli``, which is what is held now)."""

    @property
    def changed(self) -> bool:
        return any(p.launch or p.delete for p in self.pools)

    def body(self) -> dict[str, Any]:
        return {
            "pools": [p.to_dict() for p in self.pools],
            "shortfall_milli": dict(sorted(self.shortfall_milli.items())),
            "floors_milli": dict(sorted(self.floors_milli.items())),
            "cost_per_hour": str(self.cost_per_hour),
            "covers": [c.to_dict() for c in self.covers],
            **(
                {"floors_later_milli": dict(sorted(self.floors_later_milli.items()))} if self.floors_later_milli else {}
            ),
        }

    @property
    def digest(self) -> str:
        """SHA-256 of what the plan does (not of its explanations, which name ages in seconds)."""
        raw = json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.body(),
            "digest": self.digest,
            "changed": self.changed,
            "solver": dict(self.solver),
            "decisions": [d.to_dict() for d in self.decisions],
        }

    def explain(self) -> list[str]:
        return [str(d) for d in self.decisions]


def _units(milli: int) -> str:
    return f"{fmt(milli)} units"


def _money(d: Decimal) -> str:
    return f"{d.normalize():f}/h" if d else "0/h"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- 1. survey ---------------------------------------------------------------------------------------------


@dataclass
class Survey:
    pools: dict[str, Pool]
    held: dict[str, list[Instance]]
    """Instances that count against each pool's cap (every state but deleted and lost)."""
    room: dict[str, list[Instance]]
    """Instances that are room, in available pools only."""
    decisions: list[Decision]


def survey(inp: PlanInput) -> Survey:
    pools = {p.name: p for p in sorted(inp.pools, key=lambda p: p.name)}
    held: dict[str, list[Instance]] = {name: [] for name in pools}
    decisions: list[Decision] = []
    for i in sorted(inp.fleet, key=lambda i: (i.pool, i.name, i.id)):
        if i.state in GONE_STATES:
            continue
        if i.pool not in held:
            decisions.append(Decision("ignore", f"instance:{i.name}", f"pool {i.pool!r} is not configured"))
            continue
        held[i.pool].append(i)
    room: dict[str, list[Instance]] = {}
    for p in pools.values():
        if not p.available:
            why = p.unavailable_reason or "marked unavailable"
            n = len(held[p.name])
            decisions.append(
                Decision(
                    "skip_pool", f"pool:{p.name}", f"unavailable ({why}): no launches, its {n} instances not counted"
                )
            )
            continue
        room[p.name] = [i for i in held[p.name] if i.state in ROOM_STATES]
        out = len(held[p.name]) - len(room[p.name])
        if out:
            states = ", ".join(sorted({i.state for i in held[p.name] if i.state not in ROOM_STATES}))
            decisions.append(
                Decision("keep", f"pool:{p.name}", f"{out} instances {states}: not room, still held against the cap")
            )
    return Survey(pools, held, room, decisions)


# --- 2. floors ---------------------------------------------------------------------------------------------


@dataclass
class Floors:
    held_milli: dict[str, int]
    """Floor units held now per contract: on committed instances that are room, or launched by this plan."""
    alloc: dict[str, dict[str, int]]
    """Committed pool -> contract -> floor units this plan's launches there hold (their contract subset)."""
    launch: dict[str, int]
    """Committed pool -> floor instances to launch."""
    decisions: list[Decision]
    later_milli: dict[str, int] = field(default_factory=dict)
    """Floor units the committed capacity holds only once its instances on their way out are gone (they still
    take the lease's hosts and the pool's cap, so nothing can be launched in their place yet)."""


_Node = tuple[str, ...]


def _augment(cap: dict[_Node, dict[_Node, int]], flow: dict[tuple[_Node, _Node], int]) -> None:
    """Push flow from ("s",) to ("t",) along shortest residual paths until none is left (Edmonds-Karp). Adjacency
    in insertion order, so the same graph gives the same flow. ``flow`` is kept: later stages add to it and a path
    never leaves the sink, so what earlier stages put on an edge into the sink stays there."""
    src: _Node = ("s",)
    sink: _Node = ("t",)
    while True:
        back: dict[_Node, tuple[_Node, int]] = {src: (src, 0)}
        queue = [src]
        for u in queue:
            steps = [(v, c - flow.get((u, v), 0)) for v, c in cap.get(u, {}).items()]
            steps += [(v, flow.get((v, u), 0)) for v in cap if u in cap[v]]  # undo flow already sent into u
            for v, left in steps:
                if left > 0 and v not in back:
                    back[v] = (u, left)
                    queue.append(v)
        if sink not in back:
            return
        path: list[tuple[_Node, _Node]] = []
        v, push = sink, None
        while v != src:
            u, left = back[v]
            path.append((u, v))
            push = left if push is None else min(push, left)
            v = u
        for u, v in path:
            if v in cap.get(u, {}):
                flow[u, v] = flow.get((u, v), 0) + (push or 0)
            else:
                flow[v, u] -= push or 0


def hold_floors(inp: PlanInput, sv: Survey) -> Floors:
    """Floors onto committed capacity as a flow, in three stages so each uses what the one before left: the
    instances already there that run the contract (an instance holds a floor only if its contract subset names
    it), then launches that the pools' caps and leases allow now, then the places instances on their way out will
    give back. A later stage never takes what an earlier one holds, so the floor waits for outgoing instances only
    when no committed pool has room for it now."""
    decisions: list[Decision] = []
    committed: dict[str, int] = {}
    for r in sorted(inp.reservations, key=lambda r: (r.pool, r.lease)):
        rp = sv.pools.get(r.pool)
        if rp is None or rp.kind != "committed":
            decisions.append(
                Decision("ignore", f"lease:{r.lease}", f"pool {r.pool!r} is not a configured committed pool")
            )
            continue
        committed[r.pool] = committed.get(r.pool, 0) + r.instances
    reserved = [p for p in sv.pools.values() if p.kind == "committed" and p.available and committed.get(p.name)]
    floors = {
        c.name: c.floor_milli
        for c in sorted(inp.contracts.values(), key=lambda c: c.name)
        if c.tier == 1 and c.floor_milli > 0
    }
    cap: dict[_Node, dict[_Node, int]] = {("s",): {("c", c): m for c, m in floors.items()}}
    for c in floors:
        cap[("c", c)] = {}
    out_of: dict[str, int] = {}
    stages: list[list[tuple[_Node, int]]] = [[], [], []]  # (bin, units) per stage: have, now, later
    for p in reserved:
        there = sv.room.get(p.name, [])
        limit = min(p.cap, committed[p.name])
        now_slots = max(0, limit - len(sv.held[p.name]))
        out_of[p.name] = len(sv.held[p.name]) - len(there)
        groups: dict[tuple[str, ...], int] = {}
        for i in there:
            runs = tuple(sorted(set(i.contracts) & floors.keys()))
            if runs:
                groups[runs] = groups.get(runs, 0) + 1
        for runs, n in sorted(groups.items()):
            stages[0].append((("have", p.name, *runs), n * p.flavor_milli))
            for c in runs:
                cap[("c", c)][("have", p.name, *runs)] = sum(floors.values())
        for stage, kind, slots in ((1, "now", now_slots), (2, "later", max(0, limit - len(there)) - now_slots)):
            if slots > 0:
                stages[stage].append(((kind, p.name), slots * p.flavor_milli))
                for c in floors:
                    cap[("c", c)][(kind, p.name)] = sum(floors.values())
    flow: dict[tuple[_Node, _Node], int] = {}
    for bins in stages:
        for node, units in bins:
            cap[node] = {("t",): units}
        _augment(cap, flow)

    def on(kind: str, pool: str, c: str) -> int:
        return sum(f for (u, v), f in flow.items() if u == ("c", c) and v[0] == kind and v[1] == pool and f > 0)

    alloc = {p.name: {c: m for c in floors if (m := on("now", p.name, c))} for p in reserved}
    launch = {p.name: _ceil_div(sum(alloc[p.name].values()), p.flavor_milli) for p in reserved}
    held: dict[str, int] = {}
    after: dict[str, int] = {}
    for cn, floor in floors.items():
        now = {p.name: on("have", p.name, cn) + on("now", p.name, cn) for p in reserved}
        later = {p.name: on("later", p.name, cn) for p in reserved}
        held[cn] = sum(now.values())
        wait = sum(later.values())
        need = floor - held[cn] - wait
        if wait:
            after[cn] = wait
        where = [f"{_units(now[p.name])} on {p.name}" for p in reserved if now[p.name]]
        if need:
            said = f"floor of {_units(floor)}: {_units(held[cn])} held now ({', '.join(where) or 'none'}), short by"
            if not any(min(p.cap, committed[p.name]) for p in reserved):
                said += f" {_units(need)}: no committed capacity (no lease on an available committed pool with a cap)"
            else:
                said += f" {_units(need)}: the committed capacity the leases and caps allow is all taken"
        elif wait:
            said = f"floor of {_units(floor)}: {_units(held[cn])} held now ({', '.join(where) or 'none'})"
        else:
            said = f"floor of {_units(floor)} held: {', '.join(where)}"
        if wait:
            gone = sum(out_of[p.name] for p in reserved if later[p.name])
            said += f"; {_units(wait)} only once the {gone} instances on their way out are gone"
        decisions.append(Decision("short" if need else "floor", f"contract:{cn}", said))
    return Floors(held, alloc, launch, decisions, after)


# --- 3. pending work -----------------------------------------------------------------------------------------


def whole_requests(total: int, sizes: Mapping[int, int] | None) -> dict[int, int]:
    """A contract's pending work as requests by size: the sizes given if they add up to the total, else requests of
    one unit each, the last one the remainder."""
    if sizes and sum(s * n for s, n in sizes.items()) == total and all(s > 0 and n >= 0 for s, n in sizes.items()):
        return {s: n for s, n in sorted(sizes.items()) if n}
    whole, rest = divmod(total, MILLI)
    out = {MILLI: whole} if whole else {}
    if rest:
        out[rest] = out.get(rest, 0) + 1
    return out


def pending(inp: PlanInput) -> tuple[dict[Req, int], list[Decision]]:
    decisions: list[Decision] = []
    out: dict[Req, int] = {}
    for cname, milli in sorted(inp.demand.items()):
        if milli <= 0:
            continue
        if cname not in inp.contracts:
            decisions.append(
                Decision("ignore", f"contract:{cname}", f"{_units(milli)} pending, contract not in the bundle")
            )
            continue
        for size, n in whole_requests(milli, inp.requests.get(cname)).items():
            out[cname, size] = n
    return out, decisions


# --- 4. room already there, and what pools may add --------------------------------------------------------------


def rooms(inp: PlanInput, sv: Survey, fl: Floors) -> tuple[Room, ...]:
    s = inp.settings
    out: list[Room] = []
    for name, n in fl.launch.items():
        for k in range(n):
            out.append(Room(f"+{name}/{k}", name, frozenset(fl.alloc[name]), sv.pools[name].flavor_milli, fresh=s.now))
    for name, insts in sv.room.items():
        p = sv.pools[name]
        for i in insts:
            busy = inp.node_load_milli.get(i.name, 0)
            settling = s.now - i.launched_at < s.settle_s
            if busy and not settling:
                continue  # the scheduler had its chance to use the room left on a settled, busy node
            free = max(0, p.flavor_milli - busy)
            if free and i.contracts:
                deletable = _deletable(inp, p, i)
                fresh = i.launched_at if settling and not busy else None
                out.append(Room(i.name, name, frozenset(i.contracts), free, deletable, fresh=fresh))
    return tuple(out)


def _deletable(inp: PlanInput, p: Pool, i: Instance) -> bool:
    """Idle, active, not committed, past the grace: scaled down unless pending work is put on it."""
    s = inp.settings
    idle = not inp.node_load_milli.get(i.name, 0)
    return idle and i.state == "active" and p.kind != "committed" and s.now - i.launched_at >= s.idle_grace_s


def new_pools(inp: PlanInput, sv: Survey) -> tuple[tuple[NewPool, ...], list[Decision]]:
    out, decisions = [], []
    for p in sv.pools.values():
        if p.kind != "reclaimable" or not p.available:
            continue
        room = p.cap - len(sv.held[p.name])
        # idle instances no work can go on are deleted by this plan: their places under the cap are used now, not
        # by the next plan (which would launch again); a pool over its cap (room < 0) only gets back to it. (Idle
        # instances work may go on are rooms: the placement decides, instance by instance, whether to keep one.)
        freeable = sum(1 for i in sv.room.get(p.name, []) if not i.contracts and _deletable(inp, p, i))
        if room + freeable <= 0:
            decisions.append(Decision("keep", f"pool:{p.name}", f"at its cap of {p.cap} instances: no launches"))
        out.append(NewPool(p.name, p.diversification_group, p.flavor_milli, room, p.price_per_hour, freeable))
    return tuple(out), decisions


# --- 5. placement ----------------------------------------------------------------------------------------------


@dataclass
class Placement:
    solution: Solution
    bins: dict[str, list[dict[Req, int]]]
    """Reclaimable pool -> its new instances, each with the requests it takes."""
    short: dict[Req, int]


def place(inp: PlanInput, requests: Mapping[Req, int], room: tuple[Room, ...], pools: tuple[NewPool, ...]) -> Placement:
    s = inp.settings
    problem = Problem(
        requests=requests,
        tiers={c: inp.contracts[c].tier for c, _ in requests},
        rooms=room,
        pools=pools,
        shares=s.shares,
        node_limit=s.solver_node_limit,
        time_limit_s=s.solver_time_s,
    )
    sol = solve(problem)
    short = dict(requests)
    for placed in [*sol.on_room.values(), *sol.on_pool.values()]:
        for k, n in placed.items():
            short[k] -= n
    return Placement(sol, sol.bins, {k: n for k, n in short.items() if n > 0})


def _why_short(tier: int, inp: PlanInput, pools: tuple[NewPool, ...], sizes: set[int]) -> str:
    share = inp.settings.shares.get(tier, 1)
    open_pools = [x for x in pools if x.most > 0]
    if not pools:
        return "no reclaimable pool available"
    parts = []
    at_cap = len(pools) - len(open_pools)
    if at_cap:
        parts.append(f"{at_cap} of {len(pools)} pools at their cap")
    groups = sorted({x.group for x in open_pools})
    if share < 1:
        parts.append(f"the tier-{tier} share of {share} per pool and group, {len(groups)} groups with room")
    too_big = sorted(r for r in sizes if all(r > x.flavor for x in open_pools))
    if too_big:
        parts.append(f"requests of {', '.join(_units(r) for r in too_big)} fit no flavour with room")
    return "; ".join(parts) or "no room left"


# --- 6. scale down ---------------------------------------------------------------------------------------------


def scale_down(
    inp: PlanInput,
    sv: Survey,
    used: set[str],
    short: Mapping[Req, int] | None = None,
    launch: Mapping[str, int] | None = None,
) -> tuple[dict[str, list[str]], list[Decision]]:
    """Idle instances past their grace are deleted, except one that short work of its contracts fits (``short``:
    what the plan could not place, kept within the pool's cap with this plan's ``launch``): a share or a cap kept
    that work off it, and it goes to the fallback arbiter (on-demand spend) while the instance, already paid for
    and idle, could hold it. Kept idle it spreads nothing the share guards against (no work is on it), and the
    scheduler, which knows no shares, can put the pending work on it; it is deleted once no short work fits it."""
    s = inp.settings
    deletes: dict[str, list[str]] = {name: [] for name in sv.pools}
    decisions: list[Decision] = []
    left = {k: n for k, n in (short or {}).items() if n > 0}
    target = {name: len(sv.held[name]) + (launch or {}).get(name, 0) for name in sv.pools}
    for name, insts in sv.room.items():
        p = sv.pools[name]
        said: dict[str, Decision] = {}
        idle: list[Instance] = []
        for i in insts:
            if inp.node_load_milli.get(i.name, 0) or i.name in used or i.state != "active":
                continue
            age = s.now - i.launched_at
            subject = f"instance:{i.name}"
            if p.kind == "committed":
                said[i.id] = Decision("keep", subject, f"idle, but committed capacity ({p.name}) is paid for")
            elif age < s.idle_grace_s:
                said[i.id] = Decision("keep", subject, f"idle for now, up {age:.0f} s < grace {s.idle_grace_s:.0f} s")
            else:
                idle.append(i)
        # a pool over its cap deletes first the idle instances no short work fits, then by name: deleting by name
        # alone took the one short work fits and kept one it does not fit (deleted by the next plan)
        fits_none = {i.id: not _short_work_it_fits(dict(left), i.contracts, p.flavor_milli) for i in idle}
        for i in sorted(idle, key=lambda i: not fits_none[i.id]):
            age = s.now - i.launched_at
            subject = f"instance:{i.name}"
            # the cap first: an instance over it goes whatever fits it, and must not take short work from ``left``
            # that the pool's other idle instances could hold (each was deleted with "no pending work" otherwise)
            if target[name] <= p.cap and (fits := _short_work_it_fits(left, i.contracts, p.flavor_milli)):
                what = ", ".join(f"{c} {_units(m)}" for c, m in sorted(fits.items()))
                why = (
                    f"idle, up {age:.0f} s >= grace {s.idle_grace_s:.0f} s, kept: {what} it could hold are short"
                    " (the share or a cap kept them off it) and would go to the fallback; deleted once none fits"
                )
                said[i.id] = Decision("keep", subject, why)
            else:
                over = target[name] > p.cap
                target[name] -= 1
                what = ",".join(i.contracts) or "it"
                why = f"idle, up {age:.0f} s >= grace {s.idle_grace_s:.0f} s, " + (
                    f"the pool holds more than its cap of {p.cap}" if over else f"no pending work for {what} put on it"
                )
                said[i.id] = Decision("scale_down", subject, why)
        for i in insts:  # in the survey's order, whatever the order they were decided in
            if i.id in said:
                decisions.append(said[i.id])
                if said[i.id].kind == "scale_down":
                    deletes[name].append(i.id)
    return deletes, decisions


def _short_work_it_fits(left: dict[Req, int], contracts: tuple[str, ...], free: int) -> dict[str, int]:
    """Take from ``left`` (short requests) the largest first that fit ``free`` units of an instance running
    ``contracts``; returns the units taken per contract (empty: none fits)."""
    took: dict[str, int] = {}
    for (c, r), n in sorted(left.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        if c not in contracts or r > free:
            continue
        t = min(n, free // r)
        if t:
            left[c, r] -= t
            free -= t * r
            took[c] = took.get(c, 0) + t * r
    return took


# --- the plan --------------------------------------------------------------------------------------------------


def _work(reqs: Mapping[Req, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (c, r), n in reqs.items():
        out[c] = out.get(c, 0) + r * n
    return out


def plan(inp: PlanInput) -> Plan:
    sv = survey(inp)
    fl = hold_floors(inp, sv)
    requests, pend_decisions = pending(inp)
    room = rooms(inp, sv, fl)
    pools, pool_decisions = new_pools(inp, sv)
    pl = place(inp, requests, room, pools)
    decisions = sv.decisions + fl.decisions + pend_decisions

    covered: dict[str, int] = {}
    for reqs in pl.solution.on_room.values():
        for c, m in _work(reqs).items():
            covered[c] = covered.get(c, 0) + m
    total = _work(requests)
    for c in sorted(covered):
        decisions.append(
            Decision(
                "cover",
                f"contract:{c}",
                f"{_units(covered[c])} of {_units(total[c])} pending fit room already there or launching",
            )
        )
    decisions += pool_decisions
    shortfall: dict[str, int] = {}
    for (c, r), n in sorted(pl.short.items()):
        shortfall[c] = shortfall.get(c, 0) + r * n
    for c, m in sorted(shortfall.items()):
        tier = inp.contracts[c].tier
        sizes = {r for (cc, r) in pl.short if cc == c}
        why = _why_short(tier, inp, pools, sizes)
        decisions.append(
            Decision("short", f"contract:{c}", f"{_units(m)} of tier {tier} do not fit reclaimable pools ({why})")
        )

    used = {k for k, v in pl.solution.on_room.items() if any(v.values())}
    launches = {name: len(pl.bins.get(name, [])) for name in sv.pools}
    launches.update(fl.launch)
    deletes, down_decisions = scale_down(inp, sv, used, pl.short, launches)
    decisions += down_decisions

    pool_of = {r.key: r.pool for r in room}
    covers = [
        Cover(key, pool_of[key], key.startswith("+"), _work(reqs), sum(reqs.values()))
        for key, reqs in sorted(pl.solution.on_room.items())
        if any(reqs.values())
    ]
    out: list[PoolPlan] = []
    cost = Decimal(0)
    for name, p in sv.pools.items():
        placed: dict[str, int] = {}
        if p.kind == "committed":
            launch = fl.launch.get(name, 0)
            subset = sorted(fl.alloc.get(name, {})) if launch else []
            what = ", ".join(f"{c} {_units(m)}" for c, m in sorted(fl.alloc.get(name, {}).items()))
            why = f"+{launch} floor instances ({what}) on committed capacity, paid for"
        else:
            bins = pl.bins.get(name, [])
            launch = len(bins)
            for k, reqs in enumerate(bins):
                work = _work(reqs)
                covers.append(Cover(f"+{name}/{k}", name, True, work, sum(reqs.values())))
                for c, m in work.items():
                    placed[c] = placed.get(c, 0) + m
            subset = sorted(placed)
            what = ", ".join(f"{c} {_units(m)}" for c, m in sorted(placed.items()))
            each = f"{p.flavor or 'instances'} of {_units(p.flavor_milli)} at {_money(p.price_per_hour)}"
            why = f"+{launch} x {each} ({what}): the least cost that places them ({pl.solution.solver.get('name')})"
        pool_cost = p.price_per_hour * launch if p.kind == "reclaimable" else Decimal(0)
        cost += pool_cost
        if launch:
            decisions.append(Decision("launch", f"pool:{name}", why))
        current = len(sv.held[name])
        target = current - len(deletes[name]) + launch
        out.append(
            PoolPlan(name, p.kind, current, target, launch, tuple(subset), tuple(deletes[name]), placed, pool_cost)
        )
    return Plan(
        tuple(out), shortfall, fl.held_milli, tuple(decisions), cost, tuple(covers), pl.solution.solver, fl.later_milli
    )
