"""Fallback arbiter: which of the planner's shortfall may go to on-demand capacity, and at what cost.

Rules, in order, for each contract short of reclaimable capacity (tier 1 first, then by name):

1. The contract must allow it (``fallback.onDemand``); otherwise refused.
2. Its on-demand spend may not pass its **spend authority** (``fallback.spendCapPerHour``), counting the
   on-demand instances it already holds (an instance shared by several contracts is split evenly).
3. The hall's on-demand spend may not pass the hall's **cost ceiling** per hour.
4. Instances come from available on-demand pools, cheapest per unit first, within each pool's cap.

Whatever does not fit is refused with the rule that stopped it. Money is ``Decimal`` (exact); the arbiter is
pure and deterministic like the planner, and every grant and refusal carries its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sco.control.model import GONE_STATES, ContractInfo, Instance, Pool
from sco.control.units import fmt


@dataclass(frozen=True)
class Grant:
    contract: str
    pool: str
    instances: int
    cost_per_hour: Decimal
    reason: str
    tier: int = 0
    authority_per_hour: Decimal = Decimal(0)
    """The contract's spend authority (``fallback.spendCapPerHour``) the grant was made within."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "contract": self.contract,
            "pool": self.pool,
            "instances": self.instances,
            "cost_per_hour": str(self.cost_per_hour),
            "reason": self.reason,
            "tier": self.tier,
            "authority_per_hour": str(self.authority_per_hour),
        }


@dataclass(frozen=True)
class Refusal:
    contract: str
    units_milli: int
    reason: str
    tier: int | None = None
    """None: the contract is not in the bundle."""
    authority_per_hour: Decimal | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "contract": self.contract,
            "units_milli": self.units_milli,
            "reason": self.reason,
            "tier": self.tier,
            "authority_per_hour": None if self.authority_per_hour is None else str(self.authority_per_hour),
        }


@dataclass(frozen=True)
class TierSpend:
    """One contract tier's on-demand money per hour as the arbiter saw it (the ledger's sample, the metrics)."""

    tier: int
    """0: instances of contracts no longer in the bundle (their spend still counts, against no authority)."""
    spend_per_hour: Decimal
    """Of the on-demand instances running before this run's grants."""
    granted_per_hour: Decimal
    """What this run granted on top."""
    authority_per_hour: Decimal
    """The sum of the tier's on-demand contracts' spend authority (``fallback.spendCapPerHour``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "spend_per_hour": str(self.spend_per_hour),
            "granted_per_hour": str(self.granted_per_hour),
            "authority_per_hour": str(self.authority_per_hour),
        }


@dataclass(frozen=True)
class Arbitration:
    grants: tuple[Grant, ...]
    refusals: tuple[Refusal, ...]
    hall_spend_per_hour: Decimal
    """On-demand spend per hour once the grants run."""
    ceiling_per_hour: Decimal
    tiers: tuple[TierSpend, ...] = ()
    """Per contract tier (every tier of the bundle, and tier 0 when it has spend), lowest first."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "grants": [g.to_dict() for g in self.grants],
            "refusals": [r.to_dict() for r in self.refusals],
            "hall_spend_per_hour": str(self.hall_spend_per_hour),
            "ceiling_per_hour": str(self.ceiling_per_hour),
            "tiers": [t.to_dict() for t in self.tiers],
        }

    def explain(self) -> list[str]:
        return [f"grant      contract:{g.contract:<24} {g.reason}" for g in self.grants] + [
            f"refuse     contract:{r.contract:<24} {r.reason}" for r in self.refusals
        ]


_NOT_PAID = GONE_STATES | {"deleting"}
"""Instances whose spend no longer counts: gone (``deleted``, ``lost``) or being deleted."""


def _money(d: Decimal) -> str:
    return f"{d.quantize(Decimal('0.01'))}/h"


def current_spend(pools: Mapping[str, Pool], fleet: tuple[Instance, ...]) -> tuple[Decimal, dict[str, Decimal]]:
    """(hall on-demand spend per hour, spend per contract) of the on-demand instances running now."""
    total = Decimal(0)
    per: dict[str, Decimal] = {}  # the split of an instance shared by several contracts
    for i in sorted(fleet, key=lambda i: (i.pool, i.name, i.id)):
        p = pools.get(i.pool)
        if p is None or p.kind != "on-demand" or i.state in _NOT_PAID:
            continue
        total += p.price_per_hour
        for c in i.contracts:
            per[c] = per.get(c, Decimal(0)) + p.price_per_hour / len(i.contracts)
    return total, per


def tier_spend(
    contracts: Mapping[str, ContractInfo], per: Mapping[str, Decimal], granted: Mapping[str, Decimal]
) -> tuple[TierSpend, ...]:
    """Spend (running, granted) and authority per hour by contract tier; a contract not in the bundle is tier 0."""
    tiers: dict[int, list[Decimal]] = {c.tier: [Decimal(0)] * 3 for c in contracts.values()}
    for c in contracts.values():
        if c.on_demand:
            tiers[c.tier][2] += c.spend_cap_per_hour
    for i, money in ((0, per), (1, granted)):
        for name, d in money.items():
            info = contracts.get(name)
            tiers.setdefault(info.tier if info else 0, [Decimal(0)] * 3)[i] += d
    cent = Decimal("0.01")
    return tuple(
        TierSpend(t, s.quantize(cent), g.quantize(cent), a.quantize(cent)) for t, (s, g, a) in sorted(tiers.items())
    )


def arbitrate(
    shortfall_milli: Mapping[str, int],
    contracts: Mapping[str, ContractInfo],
    pools: tuple[Pool, ...],
    fleet: tuple[Instance, ...],
    ceiling_per_hour: Decimal,
) -> Arbitration:
    by_name = {p.name: p for p in sorted(pools, key=lambda p: p.name)}
    spend, per = current_spend(by_name, fleet)
    running = dict(per)
    granted: dict[str, Decimal] = {}
    held = {name: 0 for name in by_name}
    for i in fleet:
        if i.pool in held and i.state not in GONE_STATES:  # a server being deleted still holds its quota
            held[i.pool] += 1
    od = sorted(
        (p for p in by_name.values() if p.kind == "on-demand" and p.available),
        key=lambda p: (p.price_per_hour / p.flavor_milli, p.name),
    )
    grants: list[Grant] = []
    refusals: list[Refusal] = []
    short = {c: m for c, m in shortfall_milli.items() if m > 0}
    for cname in sorted(short, key=lambda n: (contracts[n].tier if n in contracts else 9, n)):
        need = short[cname]
        c = contracts.get(cname)
        if c is None:
            refusals.append(Refusal(cname, need, "contract not in the bundle"))
            continue
        cap = c.spend_cap_per_hour if c.on_demand else Decimal(0)
        if not c.on_demand:
            refusals.append(Refusal(cname, need, "its contract does not allow on-demand fallback", c.tier, cap))
            continue
        authority = c.spend_cap_per_hour - per.get(cname, Decimal(0))
        stop = "no on-demand pool is available" if not od else ""
        for p in od:
            if need <= 0:
                break
            want = -(-need // p.flavor_milli)
            room = p.cap - held[p.name]
            by_contract = int(authority // p.price_per_hour) if p.price_per_hour else want
            by_hall = int((ceiling_per_hour - spend) // p.price_per_hour) if p.price_per_hour else want
            n = max(0, min(want, room, by_contract, by_hall))
            if n:
                cost = p.price_per_hour * n
                spend += cost
                authority -= cost
                per[cname] = per.get(cname, Decimal(0)) + cost
                granted[cname] = granted.get(cname, Decimal(0)) + cost
                held[p.name] += n
                covered = min(need, n * p.flavor_milli)
                need -= covered
                why = (
                    f"{fmt(covered)} units short of reclaimable capacity: {n} x {p.name} at {_money(p.price_per_hour)}"
                    f" within authority {_money(c.spend_cap_per_hour)} and hall ceiling {_money(ceiling_per_hour)}"
                )
                grants.append(Grant(cname, p.name, n, cost, why, c.tier, cap))
            if n < want:  # say which rule stopped it, with the figures as they now stand
                if by_contract < min(want, room, by_hall):
                    used = c.spend_cap_per_hour - authority
                    stop = (
                        f"spend authority {_money(c.spend_cap_per_hour)} with {_money(used)} in use;"
                        f" one more {p.name} instance costs {_money(p.price_per_hour)}"
                    )
                elif by_hall < min(want, room):
                    stop = (
                        f"hall cost ceiling {_money(ceiling_per_hour)} with {_money(spend)} in use;"
                        f" one more {p.name} instance costs {_money(p.price_per_hour)}"
                    )
                else:
                    stop = f"on-demand pool {p.name} at its cap of {p.cap}"
        if need > 0:
            refusals.append(Refusal(cname, need, f"{fmt(need)} units refused: {stop}", c.tier, cap))
    tiers = tier_spend(contracts, running, granted)
    return Arbitration(tuple(grants), tuple(refusals), spend, ceiling_per_hour, tiers)
