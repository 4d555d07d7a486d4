"""The control loop's steps as the collection's modules run them, in the playbook's order:
demand -> reconcile -> plan -> arbitrate -> acquire (-> reclaim).

Each step reads one typed options object (``sco.control.options``) parsed once from the module's arguments and
``check`` (Ansible's check mode: report what would be done, change nothing), and returns what it did or would
do. ``run(step, params, check)`` is the whole of a module's work, so everything here is tested without Ansible.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sco.control import intake
from sco.control.arbiter import Arbitration, arbitrate
from sco.control.inputs import PlanDocument, PoolSpec, contracts_from_bundle, parse, plan_input
from sco.control.model import ContractInfo, Instance
from sco.control.options import (
    AcquireOptions,
    ArbitrateOptions,
    DemandOptions,
    HallOptions,
    PlanOptions,
    ReclaimOptions,
    ReconcileOptions,
    hall_of,
    parse_options,
)
from sco.control.planner import Plan, plan
from sco.errors import ConfigError, KeyFileError, Problem

Params = Mapping[str, Any]
STEPS = ("demand", "reconcile", "plan", "arbitrate", "acquire", "reclaim")


class FleetStore(Protocol):
    """Where the control loop reads the fleet and records its plans and decisions (the fleet state)."""

    def fleet(self, hall: str) -> list[Instance]: ...

    def unavailable(self, hall: str) -> dict[str, str]: ...

    def record_plan(self, hall: str, run_id: int | None, result: Plan) -> int: ...

    def record_arbitration(self, hall: str, run_id: int | None, result: Arbitration) -> None: ...


def run(step: str, params: Params, check: bool) -> dict[str, Any]:
    """One module's work: its options parsed once, the fleet state opened when ``state_dsn`` (or $SCO_DB_DSN)
    names it, the step run. Raises ScoError (the module fails with its message) on bad options or a cloud error."""
    if step not in STEPS:
        raise ConfigError(f"no control-loop step {step!r} (steps: {', '.join(STEPS)})")
    params = {**params, "state_dsn": params.get("state_dsn") or os.environ.get("SCO_DB_DSN")}
    fn = globals()[f"step_{step}"]
    started, ok = time.time(), False
    opts = parse_options(step, params)
    store = open_store(params) if params.get("state_dsn") else None
    try:
        result: dict[str, Any] = fn(opts, check, store)
        ok = True
    except _db_errors() as e:  # the connection lost mid-step (a PostgreSQL restart): the step's own error, exit 11
        from sco.state.db import StateError

        raise StateError(f"fleet state: lost during the {step} step: {type(e).__name__}: {str(e).strip()}") from None
    finally:
        _write_metrics(step, opts, ok, started, store, check)
        if store is not None:
            store.close()
    return result


def _db_errors() -> tuple[type[BaseException], ...]:
    try:
        import psycopg
    except ImportError:  # no fleet state without it: nothing of it to catch
        return ()
    return (psycopg.OperationalError, psycopg.InterfaceError)


def _write_metrics(step: str, opts: Any, ok: bool, started: float, store: Any, check: bool) -> None:
    """The step's textfile for node_exporter (sco.control.metrics; off unless $SCO_METRICS_TEXTFILE_DIR is set)."""
    from sco.control import metrics

    if check or not os.environ.get(metrics.ENV):
        return  # check mode changed nothing and ran nothing for real: it says nothing about the loop's health
    extra: list[metrics.Gauge] = []
    hall = hall_of(opts).hall
    try:
        if store is not None and hall:
            extra += metrics.fleet_gauges(store, hall)
        extra += metrics.spend_gauges(_LAST_SPEND.pop(step, {}))
        if isinstance(opts, ReclaimOptions) and opts.nats_url:
            extra += metrics.relay_gauge(_relay_up(opts))
    except Exception as e:  # a gauge that cannot be read leaves the run's own lines
        metrics.log.error("control-loop metrics for %s: %s", step, e)
    metrics.write_step(step, "ok" if ok else "failed", started, time.time(), extra)


_LAST_SPEND: dict[str, dict[int, tuple[float, float]]] = {}


def _relay_up(o: ReclaimOptions) -> bool:
    """One connection to the relay with the reclaimer's credentials, 3 s at most."""
    from sco._nats import connect

    async def probe() -> bool:
        try:
            nc = await connect(o.nats_servers, auth=dict(o.nats_auth), deadline_s=3)
        except Exception:
            return False
        await nc.close()
        return True

    return asyncio.run(probe())


def load_bundle(params: Params | HallOptions, said: Callable[[str], str] = str) -> Any:
    """The hall's verified bundle; ``said`` spells an option as the caller does (a CLI's flags)."""
    from sco.contract.bundle import Bundle
    from sco.contract.signing import Keyring, load_public

    h = params if isinstance(params, HallOptions) else HallOptions.from_params(params)
    if not h.bundle:
        raise ConfigError(f"{said('bundle')}: give the verified contract bundle the hall runs (its path)")
    keys = [load_public(Path(p)) for p in h.trust]
    if h.trust_dir:
        keys += [load_public(p) for p in sorted(Path(h.trust_dir).glob("*.pub"))]
    if not keys:
        raise ConfigError(
            f"{said('trust')}: give the public keys the bundle must be signed with"
            f" ({said('trust')} or {said('trust_dir')})"
        )
    try:
        raw = Path(h.bundle).read_bytes()
    except OSError as e:
        raise ConfigError(f"{h.bundle}: {e.strerror}") from None
    return Bundle.from_bytes(raw, Keyring(keys), str(h.bundle))


def open_store(params: Params) -> Any:
    """The fleet state (PostgreSQL) as a FleetStore, from ``state_dsn``."""
    from sco.control.record import PgFleetStore

    return PgFleetStore(str(params["state_dsn"]))


# --- demand -----------------------------------------------------------------------------------------


def step_demand(o: DemandOptions, check: bool, store: FleetStore | None = None) -> dict[str, Any]:
    """Read pending work from the schedulers. Reading changes nothing, so check mode runs it too."""
    bundle = load_bundle(o.hall)
    reports = []
    kube = o.kubernetes
    if kube.get("url") or kube.get("kubeconfig"):
        try:
            token = Path(kube["token_file"]).read_text().strip() if kube.get("token_file") else ""
        except OSError as e:
            raise ConfigError(f"kubernetes.token_file: {kube['token_file']}: {e.strerror}") from None
        api = intake.kube_api_client(kube.get("url", ""), token, kube.get("kubeconfig", ""), kube.get("ca_file", ""))
        reports.append(intake.from_pods(intake.kube_pods(api), bundle.contracts))
    slurm = o.slurm
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


# --- reconcile ----------------------------------------------------------------------------------------


def step_reconcile(o: ReconcileOptions, check: bool, store: Any = None) -> dict[str, Any]:
    """Make the fleet state agree with Nova before anything is planned (``sco.control.reconcile``)."""
    if store is None:
        raise ConfigError("state_dsn: reconciliation needs the fleet state (give state_dsn or set $SCO_DB_DSN)")
    from sco.control.nova import Meter
    from sco.control.reconcile import Reconciler
    from sco.state.fleet import FleetState

    hall = o.hall.hall
    cloud = o.cloud.connect()
    with FleetState(store.dsn, application="sco reconcile") as state, state.writer(hall, o.lock_wait_s):
        r = Reconciler(cloud, state, Meter(state), concurrency=o.concurrency).hall(
            hall, check=check, run_id=o.hall.run_id
        )
    return {
        "changed": r.changed,
        "reconciliation": r.to_dict(),
        "explain": r.explain(),
        "warnings": r.warnings + [f"{f['name']} ({f['server_id']}): left alone: {f['why']}" for f in r.foreign],
    }


# --- plan -------------------------------------------------------------------------------------------


def _document(params: Params | PlanOptions, store: FleetStore | None, hall: str) -> PlanDocument:
    o = params if isinstance(params, PlanOptions) else PlanOptions.from_params({"hall": hall, **params})
    d = o.document
    if o.reservations_from == "blazar":
        from sco.provider.reservations import read_reservations

        now = d.now if d.now is not None else time.time()
        committed = committed_from_leases(read_reservations(o.cloud.connect()), d.pools, now)
        d = parse({**o.raw_document, "reservations": committed}, "module options")
    if not o.fleet_given and store is not None:
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


def contracts(params: Params | HallOptions) -> dict[str, ContractInfo]:
    return contracts_from_bundle(load_bundle(params).contracts)


def make_plan(o: PlanOptions, store: FleetStore | None) -> tuple[Plan, tuple[Instance, ...], PlanDocument]:
    hall = o.hall.hall
    d = _document(o, store, hall)
    inp = plan_input(d, contracts(o.hall), time.time())
    if not o.fleet_given and store is not None:
        inp = type(inp)(**{**inp.__dict__, "fleet": tuple(store.fleet(hall))})
    return plan(inp), inp.fleet, d


def step_plan(o: PlanOptions, check: bool, store: FleetStore | None = None) -> dict[str, Any]:
    result, _, _ = make_plan(o, store)
    out: dict[str, Any] = {"changed": result.changed, "plan": result.to_dict(), "explain": result.explain()}
    if store is not None and not check:
        out["plan_id"] = store.record_plan(o.hall.hall, o.hall.run_id, result)
    return out


# --- arbitrate ----------------------------------------------------------------------------------------


def step_arbitrate(o: ArbitrateOptions, check: bool, store: FleetStore | None = None) -> dict[str, Any]:
    hall = o.plan.hall.hall
    d = _document(o.plan, store, hall)
    shortfall = {str(k): int(v) for k, v in (o.plan_doc.get("shortfall_milli") or {}).items()}
    fleet = plan_input(d, {}, time.time()).fleet
    if not o.plan.fleet_given and store is not None:
        fleet = tuple(store.fleet(hall))
    pools = plan_input(d, {}, time.time()).pools
    infos = contracts(o.plan.hall)
    result = arbitrate(shortfall, infos, pools, fleet, o.ceiling_per_hour)
    _LAST_SPEND["arbitrate"] = spend_by_tier(result)
    out: dict[str, Any] = {"changed": bool(result.grants), "arbitration": result.to_dict(), "explain": result.explain()}
    if store is not None and not check:
        store.record_arbitration(hall, o.plan.hall.run_id, result)
    return out


def spend_by_tier(result: Arbitration) -> dict[int, tuple[float, float]]:
    """(on-demand spend per hour, authority per hour) per tier for the metrics: the arbiter's own figures, tier 0
    (instances of contracts no longer in the bundle: spend against no authority) included."""
    return {t.tier: (float(t.spend_per_hour), float(t.authority_per_hour)) for t in result.tiers}


# --- acquire ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryTarget:
    """What the acquirer is asked to hold for one plan entry (a pool's instances with one contract subset)."""

    pool: str
    entry: str
    contracts: tuple[str, ...]
    count: int
    """Live instances the entry is to hold (a count, not a range of slots)."""
    launch: int
    delete: tuple[str, ...]
    """Names of the instances the plan takes away (idle ones)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "entry": self.entry,
            "contracts": list(self.contracts),
            "count": self.count,
            "launch": self.launch,
            "delete": list(self.delete),
        }


def entry_targets(
    plan_doc: Mapping[str, Any],
    arbitration_doc: Mapping[str, Any],
    slots: list[Any],
    entries: Mapping[tuple[str, str], tuple[str, ...]],
) -> list[EntryTarget]:
    """Turn a plan and the arbiter's grants into counts per plan entry: what the entry holds now, less the idle
    instances the plan deletes, plus what the plan and the grants launch into it. A slot freed by a reclaim is
    nothing to refill: only a launch the plan asks for adds an instance."""
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
        gone = tuple(s.name for s in group if str(s.id) in deletes)
        n = want.get(key, 0)
        if n or gone:
            out.append(EntryTarget(key[0], key[1], subsets.get(key, ()), len(group) - len(gone) + n, n, gone))
    return out


def node_environment(
    extra: Mapping[str, str], hall: str, node: str, own: Mapping[str, str] | None = None
) -> dict[str, str]:
    """/etc/sco/agent.env of a new instance: the operator's node_env, the instance's own keys (its enrolment token),
    then the agent's own keys for the hall and the node's name (the Nova server's), which the operator's cannot
    override: the agent reads only SCO_AGENT_* keys."""
    return {**extra, **(own or {}), "SCO_AGENT_HALL": hall, "SCO_AGENT_NODE": node}


def step_acquire(o: AcquireOptions, check: bool, store: Any = None) -> dict[str, Any]:
    """Make each plan entry hold what the plan and the grants say, through the acquirer (Nova), after a preflight
    of every pool that launches: its flavor, image, networks, ... resolved against the cloud, once."""
    if store is None:
        raise ConfigError("state_dsn: the acquirer needs the fleet state (give state_dsn or set $SCO_DB_DSN)")
    hall = o.plan.hall.hall
    specs = {p.name: p for p in o.plan.document.pools}
    targets = entry_targets(o.plan_doc, o.arbitration_doc, store.slots(hall), store.entries(hall))
    result: dict[str, Any] = {
        "changed": any(t.launch or t.delete for t in targets), "entries": [t.to_dict() for t in targets],
        "launched": 0, "deleted": 0, "launch_failures": 0, "pending": [], "errors": [], "unavailable": [],
        "preflight": {}, "warnings": [],
    }  # fmt: skip
    unknown = sorted({t.pool for t in targets} - set(specs))
    if unknown:
        raise ConfigError(f"pools: the plan names pools that are not configured: {', '.join(unknown)}")
    if not targets:
        return result
    from sco.control.nova import Meter
    from sco.state.fleet import FleetState

    if check and not o.plan.cloud.given:  # an offline dry run: the counts, and that nothing was checked
        result["warnings"].append(
            "no cloud given: the preflight of the pools' flavors, images and networks was not run"
        )
        return {**result, **_would(targets)}
    cloud = o.plan.cloud.connect()
    with FleetState(store.dsn, application="sco acquire") as state:
        meter = Meter(state)
        params = _preflight(cloud, meter, check, specs, sorted({t.pool for t in targets if t.launch}), result)
        if check:
            return {**result, **_would(targets)}  # what would be launched and deleted
        outcomes = _acquire(o, cloud, state, meter, store, targets, params, result)
        result["api_calls"] = meter.calls
    _fail_when_nothing_launched(outcomes)
    return result


def _would(targets: list[EntryTarget]) -> dict[str, int]:
    return {"launched": sum(t.launch for t in targets), "deleted": sum(len(t.delete) for t in targets)}


def _preflight(
    cloud: Any, meter: Any, check: bool, specs: Mapping[str, PoolSpec], launching: list[str], result: dict[str, Any]
) -> dict[str, Any]:
    """Each launching pool's create arguments resolved against the cloud once (``sco.control.launch``), said in
    ``result["preflight"]``; every problem at once, before anything is launched."""
    from sco.control.launch import Resolver

    resolver = Resolver(cloud, meter, check=check)
    params: dict[str, Any] = {}
    problems: list[str] = []
    for name in launching:
        spec = specs[name]
        lp, errs = resolver.resolve(f"pools: {name}", spec.flavor, spec.image, spec.launch, spec.cap)
        problems += errs
        if lp is not None:
            params[name] = lp
            result["preflight"][name] = {"flavor_id": lp.flavor_id, "image_id": lp.image_id,
                                         "networks": lp.networks, "server_group_id": lp.server_group_id}  # fmt: skip
    if problems:
        raise ConfigError(
            "preflight: the cloud does not have what the pools ask for: " + "; ".join(problems),
            [Problem("preflight", "", p) for p in problems],
        )
    return params


def _acquire(
    o: AcquireOptions, cloud: Any, state: Any, meter: Any, store: Any, targets: list[EntryTarget],
    params: Mapping[str, Any], result: dict[str, Any],
) -> list[Any]:  # fmt: skip
    """The acquirer on each entry in turn (its pool recorded first), each outcome folded into ``result``."""
    from sco.contract import userdata
    from sco.contract.signing import load_private
    from sco.control.acquirer import ENROL_URL, Acquirer, PlanEntry
    from sco.state.fleet import Pool as StatePool

    hall = o.plan.hall.hall
    specs = {p.name: p for p in o.plan.document.pools}
    hints: dict[str, dict[str, str]] = {}
    if o.plan.reservations_from == "blazar":  # committed pools' creates carry their lease's reservation
        from sco.provider.reservations import read_reservations, reservation_hints

        leases = {p.name: p.lease or p.name for p in o.plan.document.pools if p.kind == "committed"}
        hints = reservation_hints(read_reservations(cloud), leases, time.time()) if leases else {}
    bundle = load_bundle(o.plan.hall)
    if bundle.expired() and any(t.launch for t in targets):
        # each launch's subset is dated now (sco.contract.userdata), so new nodes still take their budgets; but the
        # contracts they get are those of a bundle nobody re-signed in its whole lifetime (or a stale copy)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(bundle.expires_at or 0))
        result["warnings"].append(
            f"bundle serial {bundle.serial} expired at {when}: launches carry its contracts; re-sign it"
            " (contract_distributor) or check where this host reads it"
        )
    keys = [load_private(Path(k)) for k in o.signing_keys]
    if not keys and any(t.launch for t in targets):
        raise ConfigError("signing_keys: give the keys that sign each new instance's contract subset")
    trusted, delegation = _launch_trust(o, keys, result)
    outcomes = []
    for t in targets:
        spec, lp, known = specs[t.pool], params.get(t.pool), state.pool(hall, t.pool)
        flavor = lp.flavor_id if lp else (known.flavor if known else spec.flavor)
        image = lp.image_id if lp else (known.image if known else spec.image or "-")
        az = spec.launch.availability_zone
        state.ensure_pool(StatePool(hall, t.pool, flavor, image, kind=spec.kind, availability_zone=az))
        store.ensure_entry(hall, t.pool, t.contracts)

        def render(name: str, own: Mapping[str, str] | None = None, contracts: tuple[str, ...] = t.contracts) -> str:
            env = node_environment(o.node_env, hall, name, own)
            return userdata.render(
                bundle,
                keys,
                trusted,
                names=list(contracts),
                node_env=env,
                relay_ca=o.relay_ca,
                delegation=delegation,
                distributor_ca=o.distributor_ca,
                enrol_ca=o.enrol_ca,
            )

        # node_env naming the enrolment service: each instance gets a one-time token of its own (the acquirer)
        acq = Acquirer(
            cloud, state, render, meter=meter, concurrency=o.concurrency, scheduler_hints=hints,
            enrol_url=o.node_env.get(ENROL_URL, ""),
        )  # fmt: skip
        outcome = acq.apply(PlanEntry(hall, t.pool, t.entry, t.count, t.delete), lp)
        outcomes.append(outcome)
        _fold(result, t, outcome)
    return outcomes


def _launch_trust(o: AcquireOptions, keys: list[Any], result: dict[str, Any]) -> tuple[list[Any], Any]:
    """The keys a new instance trusts and the delegation its subset carries. With ``launch_delegation`` the
    instance trusts the hall's root keys (the trust directory the bundle was checked against), never the launch
    key. Without it (a hall of a release before delegation) the subset is signed by keys the nodes trust
    themselves, as before; said as a warning when they are root keys, which then sit on this control host."""
    from sco.contract.signing import Delegation, Keyring, load_public

    h = o.plan.hall
    roots = [load_public(Path(p)) for p in h.trust]
    if h.trust_dir:
        roots += [load_public(p) for p in sorted(Path(h.trust_dir).glob("*.pub"))]
    if not o.launch_delegation:
        rooted = sorted(k.keyid for k in keys if k.keyid in {r.keyid for r in roots})
        if rooted:
            result["warnings"].append(
                f"signing_keys: {', '.join(rooted)} are keys the nodes trust (the hall's root): a host that holds"
                " them can sign any bundle for every node; give a launch key and its delegation (launch_delegation)"
            )
        return [k.public for k in keys], None
    try:
        delegation = Delegation.load(Path(o.launch_delegation), Keyring(roots))
    except KeyFileError as e:
        raise ConfigError(f"launch_delegation: {e}") from None
    return [r for r in roots if r.keyid == delegation.issuer], delegation


def _fold(result: dict[str, Any], t: EntryTarget, outcome: Any) -> None:
    """One entry's outcome into the step's result: counts, the cloud's words, what is pending and unavailable."""
    where = f"{t.pool}/{t.entry}"
    if outcome.pending:
        result["pending"].append(f"{where}: {outcome.pending} of {t.count}")
    built = [f for f in outcome.failures if f.at == "build"]
    if built:  # named, so a run that goes on is not silent about what Nova failed
        result["warnings"].append(
            f"{where}: {len(built)} builds in ERROR, taken back"
            f" ({', '.join(f.name for f in built[:10])}{', ...' if len(built) > 10 else ''}): "
            + said_once([f.message for f in built])
        )
    result["launched"] += outcome.launched
    result["deleted"] += outcome.deleted
    result["launch_failures"] += outcome.failed
    result["errors"] += outcome.errors
    result["warnings"] += outcome.warnings
    if outcome.skipped or outcome.pool_unavailable:
        why = outcome.skipped or outcome.pool_unavailable
        result["unavailable"].append(f"{where}: {why}")
        if outcome.skipped:
            result["warnings"].append(f"{where}: nothing launched: {why}")


def _fail_when_nothing_launched(outcomes: list[Any]) -> None:
    """Nothing this step launched became an instance, and not for capacity (which marks the pool unavailable for
    the plan to route around): the run must fail, with the cloud's words, or no alert can see it."""
    from sco.control.nova import CloudError

    tried = sum(x.attempts for x in outcomes)
    failures = [f for x in outcomes for f in x.failures]
    if tried and len(failures) >= tried and any(not f.capacity for f in failures):
        raise CloudError(
            f"acquire: the cloud refused every launch of this run ({len(failures)} of {tried}): "
            + said_once([f.message for f in failures])
        )


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)


def said_once(messages: list[str], limit: int = 1500) -> str:
    """The cloud's messages on one line: each said once with how many times (a server's or request's id does not
    make a message another: Nova's "Build of instance <uuid> aborted" is one message 25 times), at most ``limit``
    characters, the rest counted."""
    said: dict[str, int] = {}
    for m in messages:
        key = _UUID.sub("<id>", " ".join(m.split()))
        said[key] = said.get(key, 0) + 1
    out, left = "", sorted(said.items(), key=lambda kv: (-kv[1], kv[0]))
    for i, (m, n) in enumerate(left):
        part = m + (f" ({n} times)" if n > 1 else "")
        if out and len(out) + len(part) > limit:
            return out + f"; and {len(left) - i} other messages"
        out += ("; " if out else "") + part[:limit]
    return out


# --- reclaim ------------------------------------------------------------------------------------------


def reclaim_floor(o: ReclaimOptions) -> Any:
    """The hall's drain floor from its bundle, when one is given (None otherwise), with the window checked against
    it; ``sco reclaim`` and the step both call this. Finishing alone sends no notice: no window to check."""
    from sco.provider.reclaimer import drain_floor

    if not (o.nodes or o.before_leases):
        return None
    floor = None
    if o.hall.bundle:
        b = load_bundle(o.hall, o.said)
        floor = drain_floor(b.policy, b.contracts)
    o.check_window(floor)
    return floor


def step_reclaim(o: ReclaimOptions, check: bool, store: Any = None) -> dict[str, Any]:
    """Reclaim instances through the provider's reclaimer: notice (NATS and metadata), drain window, delete."""
    if store is None:
        raise ConfigError("state_dsn: the reclaimer needs the fleet state (give state_dsn or set $SCO_DB_DSN)")
    hall = o.hall.hall
    floor = reclaim_floor(o)  # before check mode returns: a window that cannot drain is refused there too
    live = {i.name: i for i in store.fleet(hall)}
    # finish: the reclaims under way that no run is finishing (their control host stopped before T)
    under = sorted(n for n, i in live.items() if i.state == "deleting") if o.finish else []
    if not o.nodes and not o.before_leases and not under:  # before_leases: what a host lease would preempt
        return {"changed": False, "reclaimed": [], "finished": []}
    unknown = [n for n in o.nodes if n not in live]
    if unknown:
        raise ConfigError(f"hall {hall}: no live instance named {', '.join(unknown)}")
    todo = [n for n in o.nodes if live[n].state != "deleting"]  # already under reclaim: nothing to do again
    result: dict[str, Any] = {
        "changed": bool(todo or under),
        "reclaimed": [],
        "finished": [],
        "would_reclaim": todo,
        "would_finish": under,
    }
    if check or not (todo or o.before_leases or under):
        return result
    from sco.provider.reclaim_job import reclaim
    from sco.state.db import HallBusy

    noticing = bool(todo or o.before_leases)
    if noticing:
        o.check_noticing()
    settings = o.settings(nodes=tuple(todo), dsn=store.dsn, floor=floor, wait=o.wait or not noticing)
    try:
        done = asyncio.run(reclaim(settings, o.cloud.connect()))
    except HallBusy as e:
        if noticing:
            raise
        # another run holds the hall (a reclaim under way on the other control host): it finishes them
        return {**result, "changed": False, "busy": str(e)}
    result["reclaimed"] = [r for r in done if not r.get("finished") and not r.get("unnoticed")]
    result["finished"] = [r for r in done if r.get("finished")]
    # never noticed (their run stopped between recording T and sending) and no key here: left, loudly
    result["unnoticed"] = [{"name": r["name"], "why": r["unnoticed"]} for r in done if r.get("unnoticed")]
    if result["unnoticed"]:
        result["warnings"] = [f"{u['name']}: {u['why']}" for u in result["unnoticed"]]
    result["changed"] = bool(result["reclaimed"] or result["finished"])
    return result
