"""The control loop's steps as the collection's modules run them: intake -> plan -> arbitrate -> acquire.

Each step takes the module's parameters (a plain dict, the same keys as the module options) and ``check``
(Ansible's check mode: plan and report, change nothing) and returns what it did or would do. The modules are
thin wrappers around these functions, so everything here is tested without Ansible.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

from sco.control import intake
from sco.control.arbiter import Arbitration, arbitrate
from sco.control.inputs import PlanDocument, contracts_from_bundle, parse, plan_input
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
    import importlib

    record = importlib.import_module("sco.control.record")  # needs the fleet-state layer (sco.state)
    return record.PgFleetStore(str(params["state_dsn"]))


def step_demand(params: Params, check: bool, store: FleetStore | None = None) -> dict[str, Any]:
    """Read pending work from the schedulers. Reading changes nothing, so check mode runs it too."""
    bundle = load_bundle(params)
    reports = []
    kube = params.get("kubernetes") or {}
    if kube.get("url") or kube.get("kubeconfig"):
        token = Path(kube["token_file"]).read_text().strip() if kube.get("token_file") else ""
        api = intake.kube_api_client(kube.get("url", ""), token, kube.get("kubeconfig", ""), kube.get("ca_file", ""))
        reports.append(intake.from_pods(intake.kube_pods(api), bundle.contracts))
    slurm = params.get("slurm") or {}
    if slurm.get("slurm_conf") or slurm.get("enabled"):
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
    if params.get("fleet") is None and store is not None:
        down = store.unavailable(hall)
        pools = [
            p.model_copy(update={"available": False, "unavailable_reason": down[p.name]}) if p.name in down else p
            for p in d.pools
        ]
        d = d.model_copy(update={"pools": pools})
    return d


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
    ceiling = Decimal(str(params.get("ceiling_per_hour") or 0))
    result = arbitrate(shortfall, contracts(params), pools, fleet, ceiling)
    out: dict[str, Any] = {"changed": bool(result.grants), "arbitration": result.to_dict(), "explain": result.explain()}
    if store is not None and not check:
        store.record_arbitration(hall, params.get("run_id"), result)
    return out
