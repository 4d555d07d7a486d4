"""What the planner and the arbiter read: plain frozen dataclasses (fleet, pools, reservations, contracts).

The fleet state (PostgreSQL) and the OpenStack provider fill these; tests and ``sco plan`` build them from a
document (``sco.control.inputs``). Units are milli-units (``sco.control.units``); money is ``Decimal``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

from sco.control.units import units_milli

PoolKind = Literal["reclaimable", "committed", "on-demand"]
POOL_KINDS: tuple[PoolKind, ...] = ("reclaimable", "committed", "on-demand")


@dataclass(frozen=True)
class Pool:
    """A set of interchangeable instances: one flavour on one host aggregate (or Ironic resource class)."""

    name: str
    kind: PoolKind
    flavor_milli: int
    """What one instance offers, in milli-units."""
    cap: int
    """Most instances the pool may hold (quota, hardware, policy)."""
    group: str = ""
    """Diversification group (rack, power domain, AZ): pools that one reclaim wave can take together."""
    available: bool = True
    unavailable_reason: str = ""
    price_per_hour: Decimal = Decimal(0)
    """What one instance costs per hour, in the hall's currency: the planner's objective for reclaimable pools
    (the spot price), the arbiter's for on-demand pools."""
    flavor: str = ""
    """The Nova flavour (or Ironic resource class) instances of this pool are launched with."""

    @property
    def diversification_group(self) -> str:
        return self.group or self.name


ROOM_STATES = frozenset({"requested", "launching", "active"})
"""Lifecycle states whose instances are (or are about to be) room for work. Every other state is on its way out
(``notified``, ``draining``, ``drained``, ``overrun``, ``deleting``: a reclaim; ``failed``: a launch that did not
work) or gone (``deleted``, ``lost``: vanished from the cloud)."""
GONE_STATES = frozenset({"deleted", "lost"})
"""States of instances that hold nothing in the cloud any more: they count neither as room nor against a cap."""
STATES = ROOM_STATES | {"notified", "draining", "drained", "overrun", "deleting", "failed"} | GONE_STATES
"""Every lifecycle state the fleet state records."""


@dataclass(frozen=True)
class Instance:
    """One instance of the fleet (from the fleet state)."""

    id: str
    name: str
    """Its node name in the schedulers (Kubernetes node, Slurm node): how its load is found."""
    pool: str
    contracts: tuple[str, ...] = ()
    """The contract subset it was launched with: what it may run."""
    launched_at: float = 0.0
    state: str = "active"


@dataclass(frozen=True)
class Reservation:
    """Committed capacity (a Blazar lease): ``instances`` of ``pool`` held for the hall."""

    lease: str
    pool: str
    instances: int


@dataclass(frozen=True)
class ContractInfo:
    """What planning needs of a contract (from the verified bundle)."""

    name: str
    tier: int
    floor_milli: int = 0
    on_demand: bool = False
    spend_cap_per_hour: Decimal = Decimal(0)

    @classmethod
    def from_bundle(cls, name: str, c: Mapping[str, Any]) -> ContractInfo:
        floor = c.get("floor") or {}
        fb = c.get("fallback") or {}
        return cls(
            name=name,
            tier=int(c["tier"]),
            floor_milli=units_milli(int(floor.get("vcpus", 0)) * 1000, int(floor.get("memoryGiB", 0)) * 1024**3)
            if floor
            else 0,
            on_demand=bool(fb.get("onDemand", False)),
            spend_cap_per_hour=Decimal(str(fb.get("spendCapPerHour", "0"))),
        )


DEFAULT_SHARES: dict[int, Fraction] = {1: Fraction(1, 2), 2: Fraction(1, 2), 3: Fraction(1)}


@dataclass(frozen=True)
class PlanSettings:
    now: float
    """The clock the plan is made at (injected: the planner reads no clock)."""
    shares: Mapping[int, Fraction] = field(default_factory=lambda: dict(DEFAULT_SHARES))
    """Most of a tier's newly placed units one pool or one diversification group may take."""
    idle_grace_s: float = 600.0
    """An idle reclaimable instance is scaled down only once it has been up this long."""
    settle_s: float = 300.0
    """Free room on a busy instance younger than this still counts (work may be on its way to it)."""
    solver_node_limit: int = 2000
    """Branch-and-bound nodes HiGHS may explore: a work limit, so the plan does not depend on the machine's speed."""
    solver_time_s: float = 5.0
    """A safety net over the node limit (a plan that hit it says so in ``solver.status``)."""


@dataclass(frozen=True)
class PlanInput:
    contracts: Mapping[str, ContractInfo]
    demand: Mapping[str, int]
    """Pending milli-units per contract (``sco.control.intake``)."""
    pools: tuple[Pool, ...]
    fleet: tuple[Instance, ...] = ()
    reservations: tuple[Reservation, ...] = ()
    node_load_milli: Mapping[str, int] = field(default_factory=dict)
    settings: PlanSettings = field(default_factory=lambda: PlanSettings(now=0.0))
    requests: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    """Pending requests per contract by size (milli-units -> count); each is placed whole. A contract with
    demand but no sizes here is taken as requests of one unit each, the last one the remainder."""
