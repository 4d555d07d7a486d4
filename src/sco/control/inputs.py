"""Planning inputs as people and playbooks write them (pydantic, ``extra="forbid"``), resolved to the dataclasses of
``sco.control.model``. Errors name the document and the field (``plan.yaml: pools.2.cap: ...``).

One document shape serves ``sco plan --input FILE`` and the collection's modules (their options use the same keys)::

    pools:                 # the hall's pools (configuration)
      - {name: spot-a, kind: reclaimable, flavor: m1.large, vcpus: 8, ramMiB: 32768, cap: 20, group: rack-1}
      - {name: committed, kind: committed, flavor: m1.large, vcpus: 8, ramMiB: 32768, cap: 8}
      - {name: od, kind: on-demand, flavor: m1.large, vcpus: 8, ramMiB: 32768, cap: 10, pricePerHour: "0.90"}
    settings: {shares: {1: "1/2", 2: "1/2", 3: 1}, idleGraceSeconds: 600, settleSeconds: 300,
               solverNodeLimit: 2000, solverTimeSeconds: 5}
    reservations: [{lease: 7f3c..., pool: committed, instances: 4}]     # from Blazar
    fleet: [{id: ..., name: spot-a-1, pool: spot-a, contracts: [web], launchedAt: 1764400000}]  # fleet state
    demand: {demand: [{contract: web, units_milli: 4000, requests_milli: {1000: 2, 2000: 1}, ...}],  # intake
             node_load_milli: {spot-a-1: 2000}}

A file is read as JSON when its name ends in ``.json`` or it starts with ``{``, else as YAML. Lists are bounded
(``MAX_*``) before they are validated, and a fleet listing an instance id or name twice is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from sco._document import load_document
from sco.contract.model import Strict
from sco.control.launch import LaunchSpec
from sco.control.model import STATES, ContractInfo, Instance, PlanInput, PlanSettings, Pool, Reservation
from sco.control.units import flavor_milli
from sco.errors import ConfigError, Problem

MAX_POOL_INSTANCES = 10_000
"""A pool's cap: the planner's work grows with it (one step per instance placed), so an absurd cap is refused."""
MAX_POOLS = 1_000
"""Pools in one hall: a hall has tens; each pool costs the planner work, so thousands are a mistake."""
MAX_TOTAL_INSTANCES = 100_000
"""The caps' sum: the planner's work and memory grow with it (3000 pools x 10000 took 93 s and 2.1 GB)."""
MAX_FLEET = MAX_TOTAL_INSTANCES
"""Fleet entries (and node loads): a hall holds at most its caps' sum, and 200k entries took 178 s and 2 GB."""
MAX_DEMAND_LINES = 10_000
MAX_RESERVATIONS = 10_000
MAX_REQUEST_SIZES = 1_000
"""Distinct request sizes in one demand line (the intake reports a histogram: sizes -> count)."""
MAX_PRICE_PER_HOUR = Decimal(1_000_000)
"""A pool's price per instance-hour: the solver weighs it as a float in units of 0.0001."""


def _not_bool(v: Any) -> Any:
    # YAML's true is an int to pydantic's lax mode: "vcpus: true" would plan a 1-vCPU flavour
    if isinstance(v, bool):
        raise ValueError("expected a number, not true/false")
    return v


NonEmpty = Annotated[str, Field(min_length=1)]
NonNeg = Annotated[int, BeforeValidator(_not_bool), Field(ge=0)]
Positive = Annotated[int, BeforeValidator(_not_bool), Field(gt=0)]
Seconds = Annotated[float, BeforeValidator(_not_bool), Field(ge=0, allow_inf_nan=False)]
"""A duration or a Unix time: finite (.nan and .inf compare false with everything and stall a plan)."""


class PoolSpec(Strict):
    name: NonEmpty
    kind: Literal["reclaimable", "committed", "on-demand"]
    flavor: NonEmpty
    """Nova flavour (or Ironic resource class) the pool's instances are launched with."""
    vcpus: Positive
    ram_mib: Annotated[int, BeforeValidator(_not_bool), Field(gt=0, alias="ramMiB")]
    gpus: NonNeg = 0
    cap: Annotated[int, BeforeValidator(_not_bool), Field(ge=0, le=MAX_POOL_INSTANCES)]
    group: str = ""
    available: bool = True
    unavailable_reason: str = ""
    # bounded: the solver weighs prices as floats (1e300 overflowed to a traceback); no instance costs a million
    price_per_hour: Annotated[
        Decimal, BeforeValidator(_not_bool), Field(ge=0, le=MAX_PRICE_PER_HOUR, allow_inf_nan=False)
    ] = Decimal(0)
    image: str = ""
    """Image to boot (the acquirer's default when empty)."""
    lease: str = ""
    """Committed pools: the Blazar lease whose reservations back this pool (default: the pool's name)."""
    instances_per_host: Positive = 1
    """Committed pools backed by host reservations (physical:host): instances of the flavour one host holds."""
    launch: LaunchSpec = Field(default_factory=LaunchSpec)
    """How the acquirer creates the pool's servers: networks, security groups, key pair, ... (sco.control.launch)."""

    def resolve(self) -> Pool:
        return Pool(
            name=self.name,
            kind=self.kind,
            flavor_milli=flavor_milli(self.vcpus, self.ram_mib, self.gpus),
            cap=self.cap,
            group=self.group,
            available=self.available,
            unavailable_reason=self.unavailable_reason,
            price_per_hour=self.price_per_hour,
            flavor=self.flavor,
        )


Tier = Annotated[int, Field(ge=1, le=3)]  # "3" from JSON or YAML keys is 3


def _default_shares() -> dict[Tier, str | int | float]:
    return {1: "1/2", 2: "1/2", 3: 1}


class SettingsSpec(Strict):
    shares: dict[Tier, str | int | float] = Field(default_factory=_default_shares)
    """Most of a tier's new units in one pool or group, as a fraction ("1/2", 0.5, 1)."""
    idle_grace_seconds: Seconds = 600.0
    settle_seconds: Seconds = 300.0
    solver_node_limit: Annotated[int, BeforeValidator(_not_bool), Field(ge=0, le=1_000_000)] = 2000
    """Branch-and-bound nodes the solver may explore (a work limit: the same plan on any machine)."""
    solver_time_seconds: Annotated[float, BeforeValidator(_not_bool), Field(gt=0, le=600, allow_inf_nan=False)] = 5.0

    @field_validator("shares")
    @classmethod
    def _fractions(cls, v: dict[int, Any]) -> dict[int, Any]:
        for tier, share in v.items():
            try:
                f = Fraction(str(share))
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"tier {tier}: {share!r} is not a fraction such as 1/2 or 0.5") from None
            if not 0 < f <= 1:
                raise ValueError(f"tier {tier}: a share must be above 0 and at most 1, not {share}")
        return v


class ReservationSpec(Strict):
    lease: NonEmpty
    pool: NonEmpty
    instances: NonNeg


class InstanceSpec(Strict):
    id: NonEmpty
    name: NonEmpty
    pool: NonEmpty
    contracts: list[str] = Field(default_factory=list)
    launched_at: Seconds = 0.0
    state: str = "active"

    @field_validator("state")
    @classmethod
    def _known(cls, v: str) -> str:
        # a typo ("ACTIVE") was taken for an instance on its way out: held against the cap, given no work
        if v not in STATES:
            raise ValueError(f"{v!r} is not a lifecycle state (one of {', '.join(sorted(STATES))})")
        return v


class DemandLine(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    contract: NonEmpty
    units_milli: NonNeg
    items: NonNeg | None = None
    """How many pods or jobs the units are (the intake's count); without sizes they are split evenly."""
    requests_milli: dict[Positive, Positive] | None = None
    """The pending requests by size (milli-units -> how many), as the intake reports them."""

    @field_validator("requests_milli")
    @classmethod
    def _bounded(cls, v: dict[int, int] | None) -> dict[int, int] | None:
        if v is not None and len(v) > MAX_REQUEST_SIZES:
            raise ValueError(f"{len(v)} request sizes: at most {MAX_REQUEST_SIZES} in one line")
        return v

    def requests(self) -> dict[int, int]:
        """The line as whole requests by size."""
        if self.requests_milli:
            if (total := sum(s * n for s, n in self.requests_milli.items())) != self.units_milli:
                raise ValueError(f"requests_milli add up to {total}, not units_milli {self.units_milli}")
            return dict(self.requests_milli)
        if self.items and self.units_milli >= self.items:
            size, rest = divmod(self.units_milli, self.items)
            out = {size: self.items - rest} if self.items - rest else {}
            if rest:
                out[size + 1] = rest
            return out
        whole, rest = divmod(self.units_milli, 1000)
        out = {1000: whole} if whole else {}
        if rest:
            out[rest] = out.get(rest, 0) + 1
        return out


class DemandSpec(BaseModel):
    """The intake's report (``DemandReport.to_dict()``); its other keys are for people."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    demand: list[DemandLine] = Field(default_factory=list)
    node_load_milli: dict[str, NonNeg] = Field(default_factory=dict)


class PlanDocument(Strict):
    pools: list[PoolSpec]
    settings: SettingsSpec = Field(default_factory=SettingsSpec)
    reservations: list[ReservationSpec] = Field(default_factory=list)
    fleet: list[InstanceSpec] = Field(default_factory=list)
    demand: DemandSpec = Field(default_factory=DemandSpec)
    now: Seconds | None = None
    """Plan as of this Unix time (default: now)."""

    @field_validator("fleet")
    @classmethod
    def _unique_instances(cls, v: list[InstanceSpec]) -> list[InstanceSpec]:
        ids: dict[str, int] = {}
        names: dict[str, int] = {}
        for k, i in enumerate(v):
            if i.id in ids:
                raise ValueError(f"instance id {i.id!r} is listed twice: fleet.{ids[i.id]} and fleet.{k}")
            if i.name in names:
                raise ValueError(f"instance name {i.name!r} is listed twice: fleet.{names[i.name]} and fleet.{k}")
            ids[i.id] = names[i.name] = k
        return v

    @field_validator("pools")
    @classmethod
    def _unique(cls, v: list[PoolSpec]) -> list[PoolSpec]:
        if len(v) > MAX_POOLS:
            raise ValueError(f"{len(v)} pools: at most {MAX_POOLS} pools in one hall")
        if (total := sum(p.cap for p in v)) > MAX_TOTAL_INSTANCES:
            raise ValueError(f"the caps add up to {total}: at most {MAX_TOTAL_INSTANCES} instances in one hall")
        seen: set[str] = set()
        for p in v:
            if p.name in seen:
                raise ValueError(f"pool {p.name!r} is defined twice")
            seen.add(p.name)
        return v


def problems(e: ValidationError, where: str) -> list[Problem]:
    return [Problem(where, ".".join(str(x) for x in err["loc"]), err["msg"]) for err in e.errors()]


def read_document(raw: bytes, where: str) -> Any:
    """A planning document's bytes, read by the project's one JSON-or-YAML loader."""
    return load_document(raw, where, what="planning document")


_BOUNDS = {"fleet": MAX_FLEET, "reservations": MAX_RESERVATIONS}


def _bounded(doc: Mapping[str, Any], where: str) -> None:
    """Refuse oversized lists before validating them: validation costs time and memory per entry."""
    for key, most in _BOUNDS.items():
        v = doc.get(key)
        if isinstance(v, list) and len(v) > most:
            raise ConfigError(
                f"{where}: {key}: {len(v)} entries, at most {most}", [Problem(where, key, f"at most {most} entries")]
            )
    demand = doc.get("demand")
    if isinstance(demand, Mapping):
        for key, most in (("demand", MAX_DEMAND_LINES), ("node_load_milli", MAX_FLEET)):
            v = demand.get(key)
            if isinstance(v, list | Mapping) and len(v) > most:
                raise ConfigError(
                    f"{where}: demand.{key}: {len(v)} entries, at most {most}",
                    [Problem(where, f"demand.{key}", f"at most {most} entries")],
                )


def parse(doc: Any, where: str) -> PlanDocument:
    if not isinstance(doc, Mapping):
        raise ConfigError(
            f"{where}: expected a mapping", [Problem(where, "", "expected a mapping of pools, fleet, ...")]
        )
    _bounded(doc, where)
    try:
        return PlanDocument.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(f"{where}: invalid planning input", problems(e, where)) from None


def contracts_from_bundle(contracts: Mapping[str, Mapping[str, Any]]) -> dict[str, ContractInfo]:
    return {name: ContractInfo.from_bundle(name, c) for name, c in contracts.items()}


def references(d: PlanDocument, contracts: Mapping[str, ContractInfo], where: str) -> list[Problem]:
    """What a document written by hand names that is not there: pools, contracts, a lease twice. The loop's own
    input may name them (a pool dropped from the settings, a contract from the bundle: the plan says "ignore");
    a person's file given to ``sco plan`` is wrong, and the plan of it would be of another hall. (Load on nodes
    outside the fleet is the intake's report of the whole cluster: not checked.)"""
    pools = {p.name: p for p in d.pools}
    out: list[Problem] = []
    seen: dict[str, int] = {}
    for k, r in enumerate(d.reservations):
        if r.lease in seen:  # its instances were added up: a lease counted twice
            out.append(
                Problem(
                    where, f"reservations.{k}.lease", f"{r.lease!r} is listed already (reservations.{seen[r.lease]})"
                )
            )
        seen.setdefault(r.lease, k)
        if r.pool not in pools:
            out.append(Problem(where, f"reservations.{k}.pool", f"no pool {r.pool!r} in pools"))
        elif pools[r.pool].kind != "committed":
            out.append(
                Problem(where, f"reservations.{k}.pool", f"pool {r.pool!r} is {pools[r.pool].kind}, not committed")
            )
    for k, i in enumerate(d.fleet):
        if i.pool not in pools:
            out.append(Problem(where, f"fleet.{k}.pool", f"no pool {i.pool!r} in pools"))
        for c in i.contracts:
            if c not in contracts:
                out.append(Problem(where, f"fleet.{k}.contracts", f"contract {c!r} is not in the bundle"))
    for k, line in enumerate(d.demand.demand):
        if line.contract not in contracts:
            out.append(
                Problem(where, f"demand.demand.{k}.contract", f"contract {line.contract!r} is not in the bundle")
            )
    return out


def plan_input(d: PlanDocument, contracts: Mapping[str, ContractInfo], now: float, where: str = "input") -> PlanInput:
    demand: dict[str, int] = {}
    requests: dict[str, dict[int, int]] = {}
    for k, line in enumerate(d.demand.demand):
        demand[line.contract] = demand.get(line.contract, 0) + line.units_milli
        try:
            sizes = line.requests()
        except ValueError as e:
            raise ConfigError(
                f"{where}: invalid planning input", [Problem(where, f"demand.demand.{k}", str(e))]
            ) from None
        mine = requests.setdefault(line.contract, {})
        for size, n in sizes.items():
            mine[size] = mine.get(size, 0) + n
    return PlanInput(
        contracts=dict(contracts),
        demand=demand,
        requests=requests,
        pools=tuple(p.resolve() for p in d.pools),
        fleet=tuple(
            Instance(i.id, i.name, i.pool, tuple(sorted(i.contracts)), i.launched_at, i.state) for i in d.fleet
        ),
        reservations=tuple(Reservation(r.lease, r.pool, r.instances) for r in d.reservations),
        node_load_milli=dict(d.demand.node_load_milli),
        settings=PlanSettings(
            now=d.now if d.now is not None else now,
            shares={t: Fraction(str(s)) for t, s in d.settings.shares.items()},
            idle_grace_s=d.settings.idle_grace_seconds,
            settle_s=d.settings.settle_seconds,
            solver_node_limit=d.settings.solver_node_limit,
            solver_time_s=d.settings.solver_time_seconds,
        ),
    )
