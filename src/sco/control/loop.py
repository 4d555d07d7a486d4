"""The control loop's steps as the collection's modules run them: intake -> plan -> arbitrate -> acquire.

Each step takes the module's parameters (a plain dict, the same keys as the module options) and ``check``
(Ansible's check mode: plan and report, change nothing) and returns what it did or would do. The modules are
thin wrappers around these functions, so everything here is tested without Ansible.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

from sco.control import intake
from sco.control.arbiter import Arbitration, arbitrate
from sco.control.inputs import PlanDocument, PoolSpec, contracts_from_bundle, parse, plan_input
from sco.control.model import ContractInfo, Instance
from sco.control.planner import Plan, plan
from sco.errors import ConfigError

Params = Mapping[str, Any]


class FleetStore(Protocol):
    """Where the control loop reads the fleet and records its plans and decisions (the fleet state)."""

    def fleet(self, hall: str) -> list[Instance]: ...

    def unavailable(self, hall: str) -> dict[str, str]: ...

    def record_plan(self, hall: str, run_id: int | None, result: Plan) -> int: ...

    def record_arbitration(self, hall: str, run_id: int | None, result: Arbitration) -> None: ...


def load_bundle(params: Params) -> Any:
    from sco.contract.bundle import Bundle
    from sco.contract.signing import Keyring, load_public

    path = params.get("bundle")
    if not path:
        raise ConfigError("bundle: give the verified contract bundle the hall runs (its path)")
    keys = [load_public(Path(p)) for p in params.get("trust") or []]
    if params.get("trust_dir"):
        keys += [load_public(p) for p in sorted(Path(params["trust_dir"]).glob("*.pub"))]
    if not keys:
        raise ConfigError("trust: give the public keys the bundle must be signed with (trust or trust_dir)")
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    return Bundle.from_bytes(raw, Keyring(keys), str(path))


# --- intake -----------------------------------------------------------------------------------------


def open_store(params: Params) -> Any:
    """The fleet state (PostgreSQL) as a FleetStore, from ``state_dsn``."""
    from sco.control.record import PgFleetStore

    return PgFleetStore(str(params["state_dsn"]))


def step_demand(params: Params, check: bool, store: FleetStore | None = None) -> dict[str, Any]:
    """Read pending work from the schedulers. Reading changes nothing, so check mode runs it too."""
    bundle = load_bundle(params)
    reports = []
    kube = params.get("kubernetes") or {}
    if kube.get("url") or kube.get("kubeconfig"):
        try:
            token = Path(kube["token_file"]).read_text().strip() if kube.get("token_file") else ""
        except OSError as e:
            raise ConfigError(f"kubernetes.token_file: {kube['token_file']}: {e.strerror}") from None
        api = intake.kube_api_client(kube.get("url", ""), token, kube.get("kubeconfig", ""), kube.get("ca_file", ""))
        reports.append(intake.from_pods(intake.kube_pods(api), bundle.contracts))
    slurm = params.get("slurm") or {}
    if slurm:  # slurm_conf may be left to $SLURM_CONF or the default /etc/slurm/slurm.conf
        from sco.schedulers.slurm import SlurmClient

        client = SlurmClient(slurm_conf=slurm.get("slurm_conf", ""), timeout=float(slurm.get("timeout", 10)))
        partitions = list(slurm.get("reclaimable_partitions") or [])
        if not partitions:
            raise ConfigError("slurm.reclaimable_partitions: name the partitions that run on reclaimable capacity")
        reports.append(asyncio.run(intake.slurm_demand(client, bundle.contracts, partitions)))
    if not reports:
        raise ConfigError("give kubernetes (url or kubeconfig) and/or slurm (slurm_conf): nothing to read demand from")
    report = intake.merge(*reports).to_dict()
    return {
        "changed": False,
        "report": report,
        "units": {d["contract"]: d["units_milli"] / 1000 for d in report["demand"]},
        "uncontracted": len(report["uncontracted"]),
    }


# --- plan -------------------------------------------------------------------------------------------


def _document(params: Params, store: FleetStore | None, hall: str) -> PlanDocument:
    doc: dict[str, Any] = {
        "pools": params.get("pools") or [],
        "settings": params.get("settings") or {},
        "reservations": params.get("reservations") or [],
        "demand": (params.get("demand") or {}).get("report", params.get("demand") or {}),
    }
    if params.get("now") is not None:
        doc["now"] = params["now"]
    if params.get("fleet") is not None:
        doc["fleet"] = params["fleet"]
    d = parse(doc, "module options")
    if params.get("reservations_from") == "blazar":
        from sco.provider.reservations import read_reservations

        now = d.now if d.now is not None else time.time()
        committed = committed_from_leases(read_reservations(_cloud(params)), d.pools, now)
        d = parse({**doc, "reservations": committed}, "module options")
    if params.get("fleet") is None and store is not None:
        down = store.unavailable(hall)
        pools = [
            p.model_copy(update={"available": False, "unavailable_reason": down[p.name]}) if p.name in down else p
            for p in d.pools
        ]
        d = d.model_copy(update={"pools": pools})
    return d


def committed_from_leases(leases: list[Any], pools: list[PoolSpec], now: float) -> list[dict[str, Any]]:
    """Blazar reservations in force at ``now`` as committed instances per committed pool.

    A pool is backed by the lease named in its ``lease`` option (default: the pool's name). Instance reservations
    (``virtual:instance``, ``flavor:instance``) count their amount; host reservations (``physical:host``) count
    hosts times the pool's ``instancesPerHost``.
    """
    out = []
    for p in pools:
        if p.kind != "committed":
            continue
        name = p.lease or p.name
        for r in leases:
            if r.lease_name != name or not r.active_at(now):
                continue
            n = r.amount * p.instances_per_host if r.resource_type == "physical:host" else r.amount
            out.append({"lease": f"{r.lease_id}/{r.resource_type}", "pool": p.name, "instances": n})
    return out


def contracts(params: Params) -> dict[str, ContractInfo]:
    return contracts_from_bundle(load_bundle(params).contracts)


def make_plan(params: Params, store: FleetStore | None) -> tuple[Plan, tuple[Instance, ...], PlanDocument]:
    hall = str(params.get("hall") or "")
    d = _document(params, store, hall)
    inp = plan_input(d, contracts(params), time.time())
    if params.get("fleet") is None and store is not None:
        inp = type(inp)(**{**inp.__dict__, "fleet": tuple(store.fleet(hall))})
    return plan(inp), inp.fleet, d


def step_plan(params: Params, check: bool, store: FleetStore | None = None) -> dict[str, Any]:
    result, _, _ = make_plan(params, store)
    out: dict[str, Any] = {"changed": result.changed, "plan": result.to_dict(), "explain": result.explain()}
    if store is not None and not check:
        out["plan_id"] = store.record_plan(str(params["hall"]), params.get("run_id"), result)
    return out


# --- arbitrate ----------------------------------------------------------------------------------------


def _amount(value: Any, where: str) -> Decimal:
    try:
        d = Decimal(str(value if value is not None else 0))
    except ArithmeticError:
        raise ConfigError(f"{where}: {value!r} is not an amount of money such as 250.00") from None
    if not d.is_finite() or d < 0:
        raise ConfigError(f"{where}: must be a finite amount of at least 0, not {value!r}")
    return d


def step_arbitrate(params: Params, check: bool, store: FleetStore | None = None) -> dict[str, Any]:
    hall = str(params.get("hall") or "")
    d = _document(params, store, hall)
    plan_doc: dict[str, Any] = dict(params.get("plan") or {})
    if isinstance(plan_doc.get("plan"), dict):  # the plan module's whole result was passed
        plan_doc = plan_doc["plan"]
    shortfall = {str(k): int(v) for k, v in (plan_doc.get("shortfall_milli") or {}).items()}
    fleet = plan_input(d, {}, time.time()).fleet
    if params.get("fleet") is None and store is not None:
        fleet = tuple(store.fleet(hall))
    pools = plan_input(d, {}, time.time()).pools
    ceiling = _amount(params.get("ceiling_per_hour"), "ceiling_per_hour")
    result = arbitrate(shortfall, contracts(params), pools, fleet, ceiling)
    out: dict[str, Any] = {"changed": bool(result.grants), "arbitration": result.to_dict(), "explain": result.explain()}
    if store is not None and not check:
        store.record_arbitration(hall, params.get("run_id"), result)
    return out


# --- acquire ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryTarget:
    """What the acquirer is asked to hold for one plan entry (a pool's instances with one contract subset)."""

    pool: str
    entry: str
    contracts: tuple[str, ...]
    count: int
    launch: int
    delete: tuple[str, ...]
    """Names of the instances the count shrinks away (the entry's highest slots)."""
    kept: tuple[str, ...] = ()
    """Instances the plan would scale down but the entry cannot shed: a busy instance sits in a higher slot."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "entry": self.entry,
            "contracts": list(self.contracts),
            "count": self.count,
            "launch": self.launch,
            "delete": list(self.delete),
            "kept": list(self.kept),
        }


def entry_targets(
    plan_doc: Mapping[str, Any],
    arbitration_doc: Mapping[str, Any],
    slots: list[Any],
    entries: Mapping[tuple[str, str], tuple[str, ...]],
) -> list[EntryTarget]:
    """Turn a plan and the arbiter's grants into counts per plan entry.

    The acquirer holds slots 0..count-1 of an entry: it launches the missing ones and deletes those at or above
    the count. So an entry's count is at least its highest kept slot + 1, and a scale-down the plan asks for
    happens only where the idle instance holds the entry's highest slots (else it is kept and said so).
    """
    from sco.control.record import entry_name

    deletes = {str(i) for p in plan_doc.get("pools", []) for i in p.get("delete", [])}
    want: dict[tuple[str, str], int] = {}
    subsets: dict[tuple[str, str], tuple[str, ...]] = dict(entries)
    for p in plan_doc.get("pools", []):
        if p.get("launch"):
            subset = tuple(sorted(p.get("launch_contracts", [])))
            key = (p["pool"], entry_name(subset))
            subsets[key] = subset
            want[key] = want.get(key, 0) + int(p["launch"])
    for g in arbitration_doc.get("grants", []):
        subset = (g["contract"],)
        key = (g["pool"], entry_name(subset))
        subsets[key] = subset
        want[key] = want.get(key, 0) + int(g["instances"])
    groups: dict[tuple[str, str], list[Any]] = {}
    for s in slots:
        groups.setdefault((s.pool, s.entry), []).append(s)
    out = []
    for key in sorted(set(groups) | set(want)):
        group = groups.get(key, [])
        kept_slots = [s.slot for s in group if str(s.id) not in deletes]
        n = want.get(key, 0)
        count = max(len(kept_slots) + n, max(kept_slots) + 1 if kept_slots else 0)
        gone = tuple(s.name for s in group if s.slot >= count)
        stuck = tuple(s.name for s in group if str(s.id) in deletes and s.slot < count)
        launch = count - sum(1 for s in group if s.slot < count)
        if launch or gone or stuck:
            out.append(EntryTarget(key[0], key[1], subsets.get(key, ()), count, launch, gone, stuck))
    return out


def _cloud(params: Params) -> Any:
    """An openstacksdk connection from openstack.cloud-style options (cloud name or dict, or auth)."""
    import openstack

    kw: dict[str, Any] = {}
    cloud = params.get("cloud")
    if isinstance(cloud, Mapping):
        kw.update(cloud)
    elif cloud:
        kw["cloud"] = str(cloud)
    if params.get("auth"):
        kw["auth"] = dict(params["auth"])
    for opt, sdk in (("auth_type", "auth_type"), ("region_name", "region_name"), ("ca_cert", "cacert")):
        if params.get(opt):
            kw[sdk] = params[opt]
    if params.get("interface"):
        kw["interface"] = params["interface"]
    if params.get("validate_certs") is not None:
        kw["verify"] = bool(params["validate_certs"])
    try:
        return openstack.connect(**kw)
    except Exception as e:  # openstacksdk raises its own config errors; the message names the cloud
        raise ConfigError(f"OpenStack cloud {cloud or '(from auth / OS_* variables)'}: {e}") from None


def step_acquire(params: Params, check: bool, store: Any = None) -> dict[str, Any]:
    """Make each pool hold what the plan and the grants say, through the acquirer (Nova)."""
    if store is None:
        raise ConfigError("state_dsn: the acquirer needs the fleet state (give state_dsn or set $SCO_DB_DSN)")
    hall = str(params["hall"])
    d = _document({**params, "demand": {}, "fleet": []}, None, hall)
    plan_doc: dict[str, Any] = dict(params.get("plan") or {})
    if isinstance(plan_doc.get("plan"), dict):
        plan_doc = plan_doc["plan"]
    arb: dict[str, Any] = dict(params.get("arbitration") or {})
    if isinstance(arb.get("arbitration"), dict):
        arb = arb["arbitration"]
    targets = entry_targets(plan_doc, arb, store.slots(hall), store.entries(hall))
    result: dict[str, Any] = {
        "changed": any(t.launch or t.delete for t in targets),
        "entries": [t.to_dict() for t in targets],
        "launched": 0,
        "deleted": 0,
        "failed": 0,
        "skipped": [],
    }
    if check or not targets:
        result["launched"] = sum(t.launch for t in targets)  # what would be launched
        result["deleted"] = sum(len(t.delete) for t in targets)
        return result
    from sco.contract import userdata
    from sco.contract.signing import load_private
    from sco.control.acquirer import Acquirer, PlanEntry
    from sco.state.fleet import FleetState
    from sco.state.fleet import Pool as StatePool

    bundle = load_bundle(params)
    keys = [load_private(Path(k)) for k in params.get("signing_keys") or []]
    if not keys:
        raise ConfigError("signing_keys: give the keys that sign each new instance's contract subset")
    specs = {p.name: p for p in d.pools}
    node_env = {str(k): str(v) for k, v in (params.get("node_env") or {}).items()}
    cloud = _cloud(params)
    with FleetState(store.dsn, application="sco acquire") as state:
        for t in targets:
            spec = specs.get(t.pool)
            if spec is None:
                result["skipped"].append(f"{t.pool}/{t.entry}: pool not configured")
                continue
            if t.launch and not spec.image:
                raise ConfigError(f"pools: {t.pool}: image: needed to launch instances")
            state.ensure_pool(StatePool(hall, t.pool, spec.flavor, spec.image or "-", kind=spec.kind))
            store.ensure_entry(hall, t.pool, t.contracts)

            def render(name: str, contracts: tuple[str, ...] = t.contracts) -> str:
                env = {**node_env, "SCO_HALL": hall, "SCO_NODE": name}
                return userdata.render(bundle, keys, [k.public for k in keys], names=list(contracts), node_env=env)

            outcome = Acquirer(cloud, state, render).apply(PlanEntry(hall, t.pool, t.entry, t.count))
            result["launched"] += outcome.launched
            result["deleted"] += outcome.deleted
            result["failed"] += outcome.failed
            if outcome.skipped or outcome.pool_unavailable:
                result["skipped"].append(f"{t.pool}/{t.entry}: {outcome.skipped or outcome.pool_unavailable}")
    return result


# --- reclaim ------------------------------------------------------------------------------------------


def _nats_auth(params: Params) -> dict[str, Any]:
    """The relay identity of the reclaim module (nats_creds, or nats_user and nats_password) for nats.connect."""
    if params.get("nats_creds"):
        return {"user_credentials": str(params["nats_creds"])}
    if params.get("nats_user"):
        return {"user": str(params["nats_user"]), "password": str(params.get("nats_password") or "")}
    return {}


def step_reclaim(params: Params, check: bool, store: Any = None) -> dict[str, Any]:
    """Reclaim instances through the provider's reclaimer: notice (NATS and metadata), drain window, delete."""
    if store is None:
        raise ConfigError("state_dsn: the reclaimer needs the fleet state (give state_dsn or set $SCO_DB_DSN)")
    hall = str(params["hall"])
    nodes = [str(n) for n in params.get("nodes") or []]
    from sco.provider.reclaimer import window_problem

    if (problem := window_problem("window", params.get("window", 120))) is not None:
        raise ConfigError(problem)  # before check mode returns: a window that cannot drain is refused there too
    if not nodes:
        return {"changed": False, "reclaimed": []}
    live = {i.name: i for i in store.fleet(hall)}
    unknown = [n for n in nodes if n not in live]
    if unknown:
        raise ConfigError(f"hall {hall}: no live instance named {', '.join(unknown)}")
    todo = [n for n in nodes if live[n].state != "deleting"]  # already under reclaim: nothing to do again
    result: dict[str, Any] = {"changed": bool(todo), "reclaimed": [], "would_reclaim": todo}
    if check or not todo:
        return result
    from sco.contract.signing import load_private
    from sco.provider.reclaimer import Reclaimer
    from sco.state.fleet import FleetState

    if not params.get("nats_url"):
        raise ConfigError("nats_url: the hall's notice relay")
    files = list(params.get("notice_keys") or []) or (
        [os.environ["SCO_NOTICE_KEY"]] if os.environ.get("SCO_NOTICE_KEY") else []
    )
    if not files:
        raise ConfigError(
            "notice_keys: give the hall's notice signing key(s) (or $SCO_NOTICE_KEY): agents refuse unsigned notices"
        )
    keys = [load_private(Path(k)) for k in files]

    async def go() -> list[dict[str, Any]]:
        with (
            FleetState(store.dsn, application="sco reclaim") as st,
            st.writer(hall, float(params.get("lock_wait") or 0)),
        ):
            r = Reclaimer(
                _cloud(params), st, str(params["nats_url"]), window_s=float(params["window"]), signing_keys=keys,
                nats_auth=_nats_auth(params),
            )  # fmt: skip
            try:
                done = await r.notify(hall, todo)
                if params.get("wait", True):
                    await r.run(hall)
                return [
                    {
                        "name": rc.instance.name,
                        "notice": rc.notice["id"],
                        "terminate_at": rc.terminate_at,
                        "published": rc.published_at is not None,
                        "state": st.instance(rc.instance.id).state,
                        # what the agent had reported when the delete went out (None: not deleted in this run)
                        "agent": rc.agent_state,
                    }
                    for rc in done
                ]
            finally:
                await r.close()

    result["reclaimed"] = asyncio.run(go())
    return result
