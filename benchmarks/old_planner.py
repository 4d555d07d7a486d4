"""The planner before issue 17 (main at 61eb800), frozen here only so bench_planner can compare its cost with the
new planner on the same hall. Not used by the product."""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sco.control.model import Instance, PlanInput
from sco.control.units import fmt

_KIND_RANK = {"committed": 0, "reclaimable": 1, "on-demand": 2}


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
        }


@dataclass(frozen=True)
class Plan:
    pools: tuple[PoolPlan, ...]
    shortfall_milli: dict[str, int]
    """Pending units per contract that reclaimable and committed capacity cannot take (for the arbiter)."""
    floors_milli: dict[str, int]
    """Floor units held per tier-1 contract."""
    decisions: tuple[Decision, ...]

    @property
    def changed(self) -> bool:
        return any(p.launch or p.delete for p in self.pools)

    def body(self) -> dict[str, Any]:
        return {
            "pools": [p.to_dict() for p in self.pools],
            "shortfall_milli": dict(sorted(self.shortfall_milli.items())),
            "floors_milli": dict(sorted(self.floors_milli.items())),
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
            "decisions": [d.to_dict() for d in self.decisions],
        }

    def explain(self) -> list[str]:
        return [str(d) for d in self.decisions]


def _units(milli: int) -> str:
    return f"{fmt(milli)} units"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _apportion(total: int, weights: list[tuple[str, int]]) -> dict[str, int]:
    """Split ``total`` over ``weights`` proportionally, integers only (largest remainder, ties by name)."""
    whole = sum(w for _, w in weights)
    if whole == 0 or total >= whole:
        return {k: w for k, w in weights} if total >= whole else {k: 0 for k, _ in weights}
    base = {k: w * total // whole for k, w in weights}
    rest = total - sum(base.values())
    order = sorted(weights, key=lambda kw: (-(kw[1] * total % whole), kw[0]))
    for k, _ in order[:rest]:
        base[k] += 1
    return base


def _why_full(stopped: dict[str, str], tier: int, share: Any, n_pools: int) -> str:
    if not n_pools:
        return "no reclaimable pool available"
    at_cap = sum(1 for w in stopped.values() if w == "cap")
    at_share = sum(1 for w in stopped.values() if w == "pool share")
    groups = sorted({w.removeprefix("group ") for w in stopped.values() if w.startswith("group ")})
    parts = [f"{at_cap} of {n_pools} pools at their cap"] if at_cap else []
    if at_share:
        parts.append(f"{at_share} pools at the tier-{tier} share of {share} per pool")
    if groups:
        parts.append(f"groups at the tier-{tier} share of {share}: {', '.join(groups)}")
    return "; ".join(parts)


class _Cover:
    """Room on one instance (or on floor instances about to launch) that pending work may use."""

    __slots__ = ("contracts", "free", "key", "label", "used")

    def __init__(self, key: tuple[Any, ...], label: str, contracts: Iterable[str], free: int) -> None:
        self.key, self.label, self.contracts, self.free, self.used = key, label, frozenset(contracts), free, 0


def plan(inp: PlanInput) -> Plan:
    s = inp.settings
    decisions: list[Decision] = []
    pools = {p.name: p for p in sorted(inp.pools, key=lambda p: p.name)}
    contracts = dict(sorted(inp.contracts.items()))
    load = inp.node_load_milli

    # 1. pools and the fleet in them
    fleet: dict[str, list[Instance]] = {name: [] for name in pools}
    for i in sorted(inp.fleet, key=lambda i: (i.pool, i.name, i.id)):
        if i.state in ("deleting", "deleted"):
            continue
        if i.pool not in fleet:
            decisions.append(Decision("ignore", f"instance:{i.name}", f"pool {i.pool!r} is not configured"))
            continue
        fleet[i.pool].append(i)
    for p in pools.values():
        if not p.available:
            why = p.unavailable_reason or "marked unavailable"
            n = len(fleet[p.name])
            decisions.append(
                Decision(
                    "skip_pool", f"pool:{p.name}", f"unavailable ({why}): no launches, its {n} instances not counted"
                )
            )

    # 2. tier-1 floors on committed capacity
    committed: dict[str, int] = {}
    for r in sorted(inp.reservations, key=lambda r: (r.pool, r.lease)):
        rp = pools.get(r.pool)
        if rp is None or rp.kind != "committed":
            decisions.append(
                Decision("ignore", f"lease:{r.lease}", f"pool {r.pool!r} is not a configured committed pool")
            )
            continue
        committed[r.pool] = committed.get(r.pool, 0) + r.instances
    reserved = [p for p in pools.values() if p.kind == "committed" and p.available and committed.get(p.name)]
    room = {p.name: min(committed[p.name], p.cap) * p.flavor_milli for p in reserved}
    floor_alloc: dict[str, dict[str, int]] = {p.name: {} for p in reserved}
    floors: dict[str, int] = {}
    for c in contracts.values():
        if c.tier != 1 or c.floor_milli <= 0:
            continue
        need, held = c.floor_milli, []
        for p in reserved:
            take = min(need, room[p.name])
            if take:
                room[p.name] -= take
                floor_alloc[p.name][c.name] = take
                held.append(f"{_units(take)} on {p.name}")
                need -= take
        floors[c.name] = c.floor_milli - need
        if need:
            why = f"floor short by {_units(need)}: committed capacity is all held ({', '.join(held) or 'none free'})"
            decisions.append(Decision("short", f"contract:{c.name}", why))
        else:
            decisions.append(
                Decision("floor", f"contract:{c.name}", f"floor of {_units(c.floor_milli)} held: {', '.join(held)}")
            )

    # 3. cover pending work with room already there (or about to be)
    covers: list[_Cover] = []
    new_reserved: dict[str, int] = {}
    for p in reserved:
        needed = _ceil_div(sum(floor_alloc[p.name].values()), p.flavor_milli)
        new_reserved[p.name] = max(0, needed - len(fleet[p.name]))
        if new_reserved[p.name]:
            covers.append(
                _Cover(
                    (0, 0, p.name, ""),
                    f"floor instances of {p.name}",
                    floor_alloc[p.name],
                    new_reserved[p.name] * p.flavor_milli,
                )
            )
    for name, insts in fleet.items():
        p = pools[name]
        if not p.available:
            continue
        for i in insts:
            busy = load.get(i.name, 0)
            settling = s.now - i.launched_at < s.settle_s
            if busy and not settling:
                continue  # the scheduler had its chance to use the room left on a settled, busy node
            free = max(0, p.flavor_milli - busy)
            # busy instances first, so idle ones stay free to scale down
            covers.append(_Cover((_KIND_RANK[p.kind], -busy, p.name, i.name), f"instance {i.name}", i.contracts, free))
    covers.sort(key=lambda c: c.key)
    by_contract: dict[str, list[_Cover]] = {}
    for cv in covers:
        for cname in cv.contracts:
            by_contract.setdefault(cname, []).append(cv)

    pending: dict[str, int] = {}
    for cname, milli in sorted(inp.demand.items()):
        if milli <= 0:
            continue
        if cname not in contracts:
            decisions.append(
                Decision("ignore", f"contract:{cname}", f"{_units(milli)} pending, contract not in the bundle")
            )
            continue
        pending[cname] = milli
    rem: dict[str, int] = {}
    for cname in sorted(pending, key=lambda n: (contracts[n].tier, n)):
        need = pending[cname]
        covered = 0
        for cv in by_contract.get(cname, []):
            take = min(need - covered, cv.free - cv.used)
            if take > 0:
                cv.used += take
                covered += take
            if covered == need:
                break
        if covered:
            decisions.append(
                Decision(
                    "cover",
                    f"contract:{cname}",
                    f"{_units(covered)} of {_units(need)} pending fit room already there or launching",
                )
            )
        rem[cname] = need - covered

    # 4. place the rest on reclaimable pools, tier by tier
    kept = {name: len(insts) for name, insts in fleet.items()}
    new_units = {name: 0 for name in pools}
    placed: dict[str, dict[str, int]] = {name: {} for name in pools}
    shortfall: dict[str, int] = {}
    eligible = [p for p in pools.values() if p.kind == "reclaimable" and p.available]
    for p in eligible:
        if kept[p.name] >= p.cap:
            decisions.append(Decision("keep", f"pool:{p.name}", f"at its cap of {p.cap} instances: no launches"))
    for tier in sorted({contracts[c].tier for c in rem if rem[c]}):
        tier_rem = [(c, rem[c]) for c in sorted(rem) if rem[c] and contracts[c].tier == tier]
        total = sum(m for _, m in tier_rem)
        share = s.shares.get(tier, 1)
        limit = total if share >= 1 else int(share * total)
        per_pool: dict[str, int] = {}
        per_group: dict[str, int] = {}
        chunks: list[tuple[str, int]] = []
        left = total
        heap = [(0, p.name) for p in eligible]
        heapq.heapify(heap)
        stopped: dict[str, str] = {}
        while left and heap:
            _, name = heapq.heappop(heap)
            p = pools[name]
            g = p.diversification_group
            tail = (-new_units[name]) % p.flavor_milli
            cap_room = (p.cap - kept[name]) * p.flavor_milli - new_units[name]
            pool_room = limit - per_pool.get(name, 0)
            group_room = limit - per_group.get(g, 0)
            take = min(tail or p.flavor_milli, cap_room, pool_room, group_room, left)
            if take <= 0:
                stopped[name] = "cap" if cap_room <= 0 else f"group {g}" if group_room <= 0 else "pool share"
                continue
            new_units[name] += take
            per_pool[name] = per_pool.get(name, 0) + take
            per_group[g] = per_group.get(g, 0) + take
            left -= take
            chunks.append((name, take))
            heapq.heappush(heap, (per_pool[name], name))
        got = _apportion(total - left, tier_rem)
        # contracts take the chunks in order: consecutive chunks sit in different pools, so a contract spreads
        chunk_i = 0
        chunk_left = chunks[0][1] if chunks else 0
        for cname, _ in tier_rem:
            want = got[cname]
            while want and chunk_i < len(chunks):
                pname = chunks[chunk_i][0]
                take = min(want, chunk_left)
                placed[pname][cname] = placed[pname].get(cname, 0) + take
                want -= take
                chunk_left -= take
                if not chunk_left:
                    chunk_i += 1
                    chunk_left = chunks[chunk_i][1] if chunk_i < len(chunks) else 0
            short = rem[cname] - got[cname]
            if short:
                shortfall[cname] = short
                why = _why_full(stopped, tier, share, len(eligible))
                decisions.append(
                    Decision(
                        "short",
                        f"contract:{cname}",
                        f"{_units(short)} of tier {tier} do not fit reclaimable pools ({why})",
                    )
                )

    # 5. scale down idle instances nothing needs
    deletes: dict[str, list[str]] = {name: [] for name in pools}
    used = {cv.key[3]: cv.used for cv in covers if cv.key[3]}
    for name, insts in fleet.items():
        p = pools[name]
        if not p.available:
            continue
        for i in insts:
            if load.get(i.name, 0) or used.get(i.name, 0):
                continue
            age = s.now - i.launched_at
            subject = f"instance:{i.name}"
            if p.kind == "committed":
                decisions.append(Decision("keep", subject, f"idle, but committed capacity ({p.name}) is paid for"))
            elif age < s.idle_grace_s:
                decisions.append(
                    Decision("keep", subject, f"idle for now, up {age:.0f} s < grace {s.idle_grace_s:.0f} s")
                )
            else:
                deletes[name].append(i.id)
                what = ",".join(i.contracts) or "it"
                why = f"idle, up {age:.0f} s >= grace {s.idle_grace_s:.0f} s, no pending work for {what}"
                decisions.append(Decision("scale_down", subject, why))

    out: list[PoolPlan] = []
    for name, p in pools.items():
        launch = new_reserved.get(name, 0) if p.kind == "committed" else _ceil_div(new_units[name], p.flavor_milli)
        subset = sorted(floor_alloc.get(name, {}) if p.kind == "committed" else placed[name]) if launch else []
        if launch:
            what = ", ".join(f"{c} {_units(m)}" for c, m in sorted((floor_alloc.get(name) or placed[name]).items()))
            decisions.append(Decision("launch", f"pool:{name}", f"+{launch} ({what})"))
        target = kept[name] - len(deletes[name]) + launch
        out.append(
            PoolPlan(
                name,
                p.kind,
                kept[name],
                target,
                launch,
                tuple(subset),
                tuple(deletes[name]),
                placed[name] if launch else {},
            )
        )
    return Plan(tuple(out), shortfall, floors, tuple(decisions))
