"""Demand intake: the schedulers' pending work, in one unit (``sco.control.units``), per contract and tier.

Sources:

- **Kubernetes** (official ``kubernetes`` client; this is the control plane, not the lean agent): pods that are
  Pending and not yet bound to a node, and that tolerate the taint reclaimable instances register with,
  ``sco.dev/reclaim=reclaimable:NoSchedule`` (toleration matching as in Kubernetes' ``ToleratesTaint``). A pod's
  request is what the scheduler charges: the larger of the sum of its containers and its largest init container,
  plus ``spec.overhead``; a container without requests is charged its limits (the API server defaults requests
  to limits). Pods bound to a node count towards that node's load.
- **Slurm** (the real slurmctld, through ``squeue``): pending jobs whose partitions include a reclaimable
  partition, with their requested TRES (``tres-alloc`` is what the job asked for while it is pending). Held jobs
  and jobs waiting on a dependency are not demand yet. Running jobs count towards their nodes' load.

A unit of work belongs to the contract that selects it (namespace and labels; for Slurm the contract named by
``--comment=sco-contract=NAME`` with a matching account and partition, else the one selecting its account).
Work no contract selects is **not counted**: it is listed in ``uncontracted`` with the reason, because admission
should have refused it and planning capacity for it would hide that.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sco.contract.selectors import contract_from_comment, kube_contract, kube_selectors, slurm_contract
from sco.control.units import UNIT_DOC, quantity, request_milli, slurm_memory_bytes
from sco.errors import ScoError

Obj = dict[str, Any]

# The taint reclaimable nodes register with (kubelet --register-with-taints; kyverno/README.md "Node conventions").
RECLAIMABLE_TAINT = {"key": "sco.dev/reclaim", "value": "reclaimable", "effect": "NoSchedule"}
GPU_RESOURCE_SUFFIX = "/gpu"  # nvidia.com/gpu, amd.com/gpu: extended resources the device plugins advertise
_SEP = "\x1f"  # squeue field separator no account, partition or comment contains


class IntakeError(ScoError):
    """A scheduler could not be read (its message names which and why). The run stops: a plan made from half
    the demand would scale down the other scheduler's instances."""

    exit_code = 10


@dataclass(frozen=True)
class Demand:
    """Pending work of one contract, in milli-units."""

    contract: str
    tier: int
    scheduler: str
    units_milli: int
    items: int
    requests_milli: Mapping[int, int] = field(default_factory=dict)
    """Its pending requests by size (milli-units -> how many): each pod or job is placed whole."""

    def to_dict(self) -> Obj:
        return {
            "contract": self.contract,
            "tier": self.tier,
            "scheduler": self.scheduler,
            "units_milli": self.units_milli,
            "items": self.items,
            "requests_milli": {str(k): v for k, v in sorted(self.requests_milli.items())},
        }


@dataclass(frozen=True)
class Uncounted:
    """A pending item left out of the demand, and why."""

    source: str  # "kubernetes" or "slurm"
    ref: str  # "namespace/pod" or "job 42"
    units_milli: int
    reason: str

    def to_dict(self) -> Obj:
        return {"source": self.source, "ref": self.ref, "units_milli": self.units_milli, "reason": self.reason}


@dataclass
class DemandReport:
    demand: list[Demand] = field(default_factory=list)
    uncontracted: list[Uncounted] = field(default_factory=list)
    """Work no contract selects: not counted (admission should have refused it)."""
    ineligible: list[Uncounted] = field(default_factory=list)
    """Pending work that does not want reclaimable capacity (no toleration, other partitions, held)."""
    node_load_milli: dict[str, int] = field(default_factory=dict)
    """Units of work bound to each node (Kubernetes pods, running Slurm jobs), by node name."""

    def to_dict(self) -> Obj:
        return {
            "unit": UNIT_DOC,
            "demand": [d.to_dict() for d in self.demand],
            "uncontracted": [u.to_dict() for u in self.uncontracted],
            "ineligible": [u.to_dict() for u in self.ineligible],
            "node_load_milli": dict(sorted(self.node_load_milli.items())),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DemandReport:
        return cls(
            demand=[
                Demand(**{**x, "requests_milli": {int(k): int(v) for k, v in (x.get("requests_milli") or {}).items()}})
                for x in d.get("demand", [])
            ],
            uncontracted=[Uncounted(**x) for x in d.get("uncontracted", [])],
            ineligible=[Uncounted(**x) for x in d.get("ineligible", [])],
            node_load_milli={str(k): int(v) for k, v in (d.get("node_load_milli") or {}).items()},
        )


class _Tally:
    def __init__(self) -> None:
        self.units: dict[tuple[str, int, str], list[int]] = {}
        self.sizes: dict[tuple[str, int, str], dict[int, int]] = {}

    def add(self, contract: str, tier: int, scheduler: str, milli: int, count: int = 1) -> None:
        key = (contract, tier, scheduler)
        acc = self.units.setdefault(key, [0, 0])
        acc[0] += milli * count
        acc[1] += count
        sizes = self.sizes.setdefault(key, {})
        sizes[milli] = sizes.get(milli, 0) + count

    def demand(self) -> list[Demand]:
        out = []
        for (c, t, s), (u, n) in sorted(self.units.items()):
            sizes = dict(sorted(self.sizes.get((c, t, s), {}).items()))
            # sizes are known only when every part of the total came with them
            out.append(Demand(c, t, s, u, n, sizes if sum(m * k for m, k in sizes.items()) == u else {}))
        return out


def merge(*reports: DemandReport) -> DemandReport:
    tally = _Tally()
    out = DemandReport()
    for r in reports:
        for d in r.demand:
            if sum(m * n for m, n in d.requests_milli.items()) == d.units_milli:
                for milli, count in d.requests_milli.items():
                    tally.add(d.contract, d.tier, d.scheduler, milli, count)
            else:  # a report without (or with inconsistent) request sizes: its totals, sizes unknown
                acc = tally.units.setdefault((d.contract, d.tier, d.scheduler), [0, 0])
                acc[0] += d.units_milli
                acc[1] += d.items
        out.uncontracted += r.uncontracted
        out.ineligible += r.ineligible
        for node, milli in r.node_load_milli.items():
            out.node_load_milli[node] = out.node_load_milli.get(node, 0) + milli
    out.demand = tally.demand()
    out.uncontracted.sort(key=lambda u: (u.source, u.ref))
    out.ineligible.sort(key=lambda u: (u.source, u.ref))
    return out


# --- Kubernetes -----------------------------------------------------------------------------------


def tolerates(tolerations: Iterable[Obj], taint: Mapping[str, str]) -> bool:
    """Kubernetes' ToleratesTaint (k8s.io/api/core/v1/toleration.go) for one taint."""
    for t in tolerations:
        effect = t.get("effect") or ""
        if effect and effect != taint["effect"]:
            continue
        key = t.get("key") or ""
        op = t.get("operator") or "Equal"
        if not key:
            if op == "Exists":
                return True  # an empty key with Exists tolerates everything
            continue
        if key != taint["key"]:
            continue
        if op == "Exists" or (op == "Equal" and (t.get("value") or "") == taint["value"]):
            return True
    return False


def _resources(container: Obj) -> tuple[int, int, int]:
    res = container.get("resources") or {}
    req = {**(res.get("limits") or {}), **(res.get("requests") or {})}  # requests default to limits
    cpu = int(quantity(req["cpu"]) * 1000) if "cpu" in req else 0
    mem = int(quantity(req["memory"])) if "memory" in req else 0
    gpus = sum(int(quantity(v)) for k, v in req.items() if k.endswith(GPU_RESOURCE_SUFFIX))
    return cpu, mem, gpus


def pod_request_milli(pod: Obj) -> int:
    """What the scheduler charges for the pod: max(sum of containers, largest init container) + overhead."""
    spec = pod.get("spec") or {}
    total = [0, 0, 0]
    for c in spec.get("containers") or []:
        for i, v in enumerate(_resources(c)):
            total[i] += v
    for c in spec.get("initContainers") or []:
        for i, v in enumerate(_resources(c)):
            total[i] = max(total[i], v)
    over = spec.get("overhead") or {}
    if "cpu" in over:
        total[0] += int(quantity(over["cpu"]) * 1000)
    if "memory" in over:
        total[1] += int(quantity(over["memory"]))
    return request_milli(total[0], total[1], total[2])


def from_pods(pods: Iterable[Obj], contracts: Mapping[str, Obj]) -> DemandReport:
    by_ns = kube_selectors(contracts)
    tally = _Tally()
    out = DemandReport()
    for pod in pods:
        md = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        phase = (pod.get("status") or {}).get("phase", "")
        ref = f"{md.get('namespace', '')}/{md.get('name', '')}"
        try:
            milli = pod_request_milli(pod)
        except (ValueError, KeyError) as e:
            out.ineligible.append(Uncounted("kubernetes", ref, 0, f"unreadable resources: {e}"))
            continue
        if md.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
            continue
        node = spec.get("nodeName")
        if node:
            out.node_load_milli[node] = out.node_load_milli.get(node, 0) + milli
            continue
        if phase != "Pending":
            continue
        if not tolerates(spec.get("tolerations") or [], RECLAIMABLE_TAINT):
            t = RECLAIMABLE_TAINT
            why = f"does not tolerate {t['key']}={t['value']}:{t['effect']}"
            out.ineligible.append(Uncounted("kubernetes", ref, milli, why))
            continue
        labels = md.get("labels") or {}
        name = kube_contract(by_ns, md.get("namespace", ""), labels)
        if name is None:
            why = (
                f"no contract selects namespace {md.get('namespace', '')!r} with labels {dict(sorted(labels.items()))}"
            )
            out.uncontracted.append(Uncounted("kubernetes", ref, milli, why))
            continue
        c = contracts[name]
        tally.add(name, int(c["tier"]), str(c["scheduler"]), milli)
    out.demand = tally.demand()
    return out


def kube_pods(api_client: Any, page: int = 500) -> list[Obj]:
    """Every pod, read with the official client as raw JSON (paged with limit/continue)."""
    from kubernetes import client as k8s  # the control plane's dependency, never the agent's
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    api = k8s.CoreV1Api(api_client)
    pods: list[Obj] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {
            "limit": page,
            # finished pods are neither demand nor load: leave them on the server
            "field_selector": "status.phase!=Succeeded,status.phase!=Failed",
            "_preload_content": False,
            "_request_timeout": 30,
        }
        if token:
            kwargs["_continue"] = token
        try:
            resp: Any = api.list_pod_for_all_namespaces(**kwargs)  # raw urllib3 response (no preload)
        except ApiException as e:
            raise IntakeError(f"kubernetes: listing pods: HTTP {e.status} {e.reason}") from None
        except (HTTPError, OSError) as e:  # refused, reset, timed out (after urllib3's retries)
            raise IntakeError(f"kubernetes: listing pods: {e}") from None
        body = json.loads(resp.data)
        pods += body.get("items") or []
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return pods


def kube_api_client(url: str = "", token: str = "", kubeconfig: str = "", ca_file: str = "") -> Any:
    """An official-client ApiClient from a URL (+ bearer token) or a kubeconfig file."""
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    if kubeconfig:
        return k8s_config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    if not url:
        raise IntakeError("kubernetes: give an API server URL or a kubeconfig")
    cfg = k8s.Configuration()
    cfg.host = url
    if token:
        cfg.api_key = {"authorization": f"Bearer {token}"}
    if ca_file:
        cfg.ssl_ca_cert = ca_file
    return k8s.ApiClient(cfg)


# --- Slurm ----------------------------------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host lists: "n[1-3,7],gpu01" -> n1 n2 n3 n7 gpu01 (zero padding kept)."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", text):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            out.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                out.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            out += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
    return out


def _tres_milli(tres: str) -> int:
    fields = dict(p.partition("=")[::2] for p in tres.split(",") if "=" in p)
    cpu = int(fields.get("cpu", "0") or 0) * 1000
    mem = slurm_memory_bytes(fields["mem"]) if fields.get("mem") else 0
    # a typed request shows both gres/gpu=N and gres/gpu:<type>=N: the untyped total counts once
    gpus = int(fields.get("gres/gpu", "0") or 0)
    return request_milli(cpu, mem, gpus)


def _tres_by_job(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[0]] = parts[1]
    return out


def from_squeue(
    pending: str,
    pending_tres: str,
    running: str,
    running_tres: str,
    contracts: Mapping[str, Obj],
    reclaimable: list[str],
) -> DemandReport:
    """Parse ``squeue`` output (see ``slurm_demand`` for the exact commands)."""
    tally = _Tally()
    out = DemandReport()
    tres = _tres_by_job(pending_tres)
    for line in pending.splitlines():
        parts = line.split(_SEP)
        if len(parts) != 5:
            continue
        jid, account, parts_text, comment, reason = (p.strip() for p in parts)
        if jid not in tres:
            continue  # left the queue between the two squeue calls
        milli = _tres_milli(tres[jid])
        ref = f"job {jid}"
        partitions = parts_text.split(",")
        comment = "" if comment == "(null)" else comment
        if not any(p in reclaimable for p in partitions):
            out.ineligible.append(Uncounted("slurm", ref, milli, f"partitions {parts_text} are not reclaimable"))
            continue
        if reason.startswith("JobHeld") or reason in ("Dependency", "DependencyNeverSatisfied", "BeginTime"):
            out.ineligible.append(Uncounted("slurm", ref, milli, f"not runnable yet ({reason})"))
            continue
        name = slurm_contract(contracts, account, partitions, comment)
        if name is None:
            named = contract_from_comment(comment)
            why = (
                f"names contract {named!r}, which is not a slurm contract for account {account!r} in {parts_text}"
                if named
                else f"no contract selects account {account!r} in {parts_text}"
            )
            out.uncontracted.append(Uncounted("slurm", ref, milli, why))
            continue
        tally.add(name, int(contracts[name]["tier"]), "slurm", milli)
    rtres = _tres_by_job(running_tres)
    for line in running.splitlines():
        jid, _, nodelist = line.partition(_SEP)
        jid, nodelist = jid.strip(), nodelist.strip()
        if jid not in rtres or not nodelist:
            continue
        nodes = expand_hostlist(nodelist)
        share, rest = divmod(_tres_milli(rtres[jid]), len(nodes))
        for i, node in enumerate(nodes):  # split evenly; the remainder to the first nodes, integers only
            out.node_load_milli[node] = out.node_load_milli.get(node, 0) + share + (1 if i < rest else 0)
    out.demand = tally.demand()
    return out


async def slurm_demand(client: Any, contracts: Mapping[str, Obj], reclaimable: list[str]) -> DemandReport:
    """Pending and running jobs from slurmctld (``client`` is a ``sco.schedulers.slurm.SlurmClient``)."""
    from sco.schedulers.slurm import SlurmCommandError, SlurmUnreachable

    fmt = _SEP.join(["%i", "%a", "%P", "%k", "%r"])
    tres_fmt = "JobArrayID:40,tres-alloc:400"  # JobArrayID: 12_3 for array tasks, as %i prints
    try:
        # -r: one line per array task, so a pending array counts every task it will run
        pending = await client.run("squeue", "-h", "-r", "-t", "PENDING", "-o", fmt)
        pending_tres = await client.run("squeue", "-h", "-r", "-t", "PENDING", "-O", tres_fmt)
        running = await client.run("squeue", "-h", "-r", "-t", "RUNNING", "-o", f"%i{_SEP}%N")
        running_tres = await client.run("squeue", "-h", "-r", "-t", "RUNNING", "-O", tres_fmt)
    except (SlurmUnreachable, SlurmCommandError) as e:
        raise IntakeError(f"slurm: {e}") from None
    return from_squeue(pending, pending_tres, running, running_tres, contracts, reclaimable)
