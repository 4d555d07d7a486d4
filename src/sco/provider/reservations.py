"""Committed capacity from Blazar leases, for the planner's tier-1 floors.

openstacksdk has no Blazar proxy: the leases are read through the connection's authenticated session with
``service_type=reservation`` (the catalog's Blazar endpoint, ``.../v1``). Each reservation of a lease becomes one
``Reservation``: physical hosts (``physical:host``, up to ``max`` hosts) or instance slots (``virtual:instance``
and ``flavor:instance``, ``amount`` of them).

Only a lease Blazar reports ACTIVE is committed capacity: a PENDING lease inside its dates has not started (its
hosts are not in its aggregate yet), a STARTING or ERROR one may never be. A committed pool's servers are created
with the lease's reservation as the scheduler hint (``reservation_hints``), which is how Blazar's Nova filter
places them on the reserved hosts.

Blazar preempts at a host lease's start: every server on the hosts it moves out of its free pool is deleted at
once, with no notice (``terminate_preemptibles``). ``hosts_to_clear`` names the hosts of leases about to start, so
the reclaimer can notice, drain and delete the reclaimable instances there one notice window before.

Any project's lease takes hosts, but ``GET /leases`` shows a credential without Blazar's ``admin`` rule (which
grants everything) only its own project's leases, and says nothing of the others. ``GET /os-hosts/allocations``
shows every project's reservations on the hosts with their lease and dates, so the times to clear come from there
(``host_allocations``): only ``blazar:oshosts:get`` and ``blazar:oshosts:get_allocations`` need granting
(docs/OPENSTACK-POLICY.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sco.errors import Problem, ScoError


class ReservationError(ScoError):
    exit_code = 10


@dataclass(frozen=True)
class Reservation:
    lease_id: str
    lease_name: str
    project_id: str
    status: str  # the lease's: PENDING, ACTIVE, TERMINATED, ...
    start: float  # epoch seconds
    end: float
    resource_type: str  # physical:host | virtual:instance | flavor:instance | ...
    amount: int  # hosts (physical:host: max) or instances
    vcpus: int | None = None  # per instance (virtual:instance)
    memory_mb: int | None = None
    flavor_id: str | None = None
    reservation_id: str = ""  # the reservation's own id: the scheduler hint (not the lease's)

    def active_at(self, t: float) -> bool:
        """Committed capacity at ``t``: within the lease's dates and started (Blazar says ACTIVE)."""
        return self.status == "ACTIVE" and self.start <= t < self.end


def _time(v: Any, where: str) -> float:
    if not isinstance(v, str):
        raise ReservationError("malformed lease", [Problem(where, "", f"expected a date, got {v!r}")])
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise ReservationError("malformed lease", [Problem(where, "", f"{v!r} is not a date")]) from None
    # Blazar's dates are UTC without a zone
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def _int(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def parse_leases(doc: Any) -> list[Reservation]:
    if not isinstance(doc, dict) or not isinstance(doc.get("leases"), list):
        raise ReservationError('Blazar: GET /leases: expected {"leases": [...]}')
    out: list[Reservation] = []
    for i, lease in enumerate(doc["leases"]):
        where = f"lease {lease.get('id', i) if isinstance(lease, dict) else i}"
        if not isinstance(lease, dict):
            raise ReservationError("malformed lease", [Problem(where, "", "expected an object")])
        start, end = (
            _time(lease.get("start_date"), f"{where}.start_date"),
            _time(lease.get("end_date"), f"{where}.end_date"),
        )
        for r in lease.get("reservations") or []:
            rtype = str(r.get("resource_type", ""))
            amount = _int(r.get("max")) if rtype == "physical:host" else _int(r.get("amount"))
            out.append(
                Reservation(
                    lease_id=str(lease.get("id")),
                    lease_name=str(lease.get("name", "")),
                    project_id=str(lease.get("project_id", "")),
                    status=str(lease.get("status", "")),
                    start=start,
                    end=end,
                    resource_type=rtype,
                    amount=amount or 0,
                    vcpus=_int(r.get("vcpus")),
                    memory_mb=_int(r.get("memory_mb")),
                    flavor_id=r.get("flavor_id"),
                    reservation_id=str(r.get("id") or ""),
                )
            )
    return out


def _get(cloud: Any, path: str) -> Any:
    """One Blazar GET through the connection's session (its api_timeout is the deadline)."""
    try:
        resp = cloud.session.get(
            path, endpoint_filter={"service_type": "reservation", "interface": "public"}, raise_exc=False
        )
    except Exception as e:  # no reservation service in the catalog, unreachable, or silent past the deadline
        raise ReservationError(f"Blazar (service_type reservation): GET {path}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise ReservationError(f"Blazar: GET {path} answered {resp.status_code}: {_said(resp)}")
    try:
        return resp.json()
    except ValueError:
        raise ReservationError(f"Blazar: GET {path}: not JSON") from None


def _said(resp: Any) -> str:
    """Blazar's own message, on one line: its error document's ``error_message`` (a policy refusal names the
    rule: "Policy doesn't allow blazar:oshosts:get to be performed."), else the body's start. A refusal says where
    the rules are documented."""
    text = resp.text or ""
    try:
        doc = resp.json()
        text = str(doc.get("error_message") or text) if isinstance(doc, dict) else text
    except ValueError:
        pass
    line = " ".join(text.split())[:300] or f"HTTP {resp.status_code}"
    if resp.status_code == 403:
        line += " (the rules the control plane's credential needs: docs/OPENSTACK-POLICY.md)"
    return line


def read_reservations(cloud: Any) -> list[Reservation]:
    """Every reservation of every lease the connection's project may see (its own project's; Blazar's ``admin``
    rule: all projects)."""
    return parse_leases(_get(cloud, "/leases"))


@dataclass(frozen=True)
class HostAllocation:
    """One host reservation as ``GET /os-hosts/allocations`` shows it, whichever project's lease it is."""

    reservation_id: str
    lease_id: str
    start: float  # its lease's dates, epoch seconds
    end: float
    hosts: tuple[str, ...]  # as Nova names them (service name, hypervisor hostname)


def parse_host_allocations(hosts_doc: Any, allocations_doc: Any) -> list[HostAllocation]:
    """The host reservations Blazar holds hosts for (``GET /os-hosts`` and ``GET /os-hosts/allocations``), each
    with its lease, its dates and its hosts, named as Nova names them (service name and hypervisor hostname, which
    are usually the same)."""
    if not isinstance(hosts_doc, dict) or not isinstance(hosts_doc.get("hosts"), list):
        raise ReservationError('Blazar: GET /os-hosts: expected {"hosts": [...]}')
    if not isinstance(allocations_doc, dict) or not isinstance(allocations_doc.get("allocations"), list):
        raise ReservationError('Blazar: GET /os-hosts/allocations: expected {"allocations": [...]}')
    names: dict[str, tuple[str, ...]] = {}
    for h in hosts_doc["hosts"]:
        if isinstance(h, dict) and h.get("id") is not None:
            names[str(h["id"])] = tuple(
                dict.fromkeys(str(h[k]) for k in ("service_name", "hypervisor_hostname") if h.get(k))
            )
    found: dict[str, tuple[str, float, float, list[str]]] = {}
    for a in allocations_doc["allocations"]:
        if not isinstance(a, dict):
            continue
        for r in a.get("reservations") or []:
            if not (isinstance(r, dict) and r.get("id")):
                continue
            rid, where = str(r["id"]), f"allocation of reservation {r['id']}"
            if rid not in found:
                start, end = (
                    _time(r.get("start_date"), f"{where}.start_date"),
                    _time(r.get("end_date"), f"{where}.end_date"),
                )
                found[rid] = (str(r.get("lease_id") or ""), start, end, [])
            found[rid][3].extend(names.get(str(a.get("resource_id")), ()))
    return [
        HostAllocation(rid, lid, start, end, tuple(dict.fromkeys(hosts)))
        for rid, (lid, start, end, hosts) in found.items()
    ]


def parse_allocations(hosts_doc: Any, allocations_doc: Any) -> dict[str, tuple[str, ...]]:
    """reservation id -> names of the hosts Blazar allocated to it."""
    return {a.reservation_id: a.hosts for a in parse_host_allocations(hosts_doc, allocations_doc)}


def read_host_allocations(cloud: Any) -> list[HostAllocation]:
    """Every project's host reservations and their hosts (``blazar:oshosts:get``, ``...:get_allocations``)."""
    return parse_host_allocations(_get(cloud, "/os-hosts"), _get(cloud, "/os-hosts/allocations"))


def read_allocations(cloud: Any) -> dict[str, tuple[str, ...]]:
    """Which hosts each host reservation holds or will hold."""
    return {a.reservation_id: a.hosts for a in read_host_allocations(cloud)}


def reservation_hints(
    reservations: Iterable[Reservation], leases_by_pool: dict[str, str], now: float
) -> dict[str, dict[str, str]]:
    """pool -> the scheduler hints its creates carry: ``{"reservation": <id>}`` of the ACTIVE reservation of the
    lease the committed pool is backed by (``leases_by_pool``: pool name -> lease name). Pools without an active
    lease get none (their creates would land outside the reservation, so the planner counts no capacity there)."""
    out: dict[str, dict[str, str]] = {}
    for pool, lease in sorted(leases_by_pool.items()):
        for r in sorted(reservations, key=lambda r: (r.start, r.reservation_id)):
            if r.lease_name == lease and r.active_at(now) and r.reservation_id:
                out[pool] = {"reservation": r.reservation_id}
                break
    return out


def merge_hints(kw: dict[str, Any], hints: dict[str, str] | None) -> dict[str, Any]:
    """A create call's keyword arguments with ``hints`` added to its scheduler hints (a server group's kept)."""
    if not hints:
        return kw
    return {**kw, "scheduler_hints": {**(kw.get("scheduler_hints") or {}), **hints}}


@dataclass(frozen=True)
class Clearing:
    """Hosts a host lease takes at ``start``: what runs there must be gone before (Blazar deletes it then)."""

    lease_id: str
    lease_name: str
    reservation_id: str
    start: float
    hosts: tuple[str, ...]


def hosts_to_clear(
    reservations: Iterable[Reservation], allocations: dict[str, tuple[str, ...]], now: float, ahead_s: float
) -> list[Clearing]:
    """Host reservations not started yet whose start is at most ``ahead_s`` away (one notice window, plus how far
    apart the runs that look are), with the hosts Blazar allocated to them."""
    out = []
    for r in reservations:
        if r.resource_type != "physical:host" or r.status not in ("PENDING", "STARTING"):
            continue
        if now < r.start <= now + ahead_s and allocations.get(r.reservation_id):
            out.append(Clearing(r.lease_id, r.lease_name, r.reservation_id, r.start, allocations[r.reservation_id]))
    return sorted(out, key=lambda c: (c.start, c.lease_id))


def leases_to_clear(
    visible: Iterable[Reservation], allocations: Iterable[HostAllocation], now: float, ahead_s: float
) -> list[Clearing]:
    """``hosts_to_clear`` over every project's host reservations: those of the leases ``GET /leases`` showed
    (``visible``) keep their lease's status rules (a PENDING or STARTING one is cleared for; an ACTIVE, ERROR or
    TERMINATED one is not); one it did not show (another project's) is taken as not started, at its allocation's own
    start. Blazar's host preemption is what is cleared for, so only the dates matter there."""
    known = {r.reservation_id: r for r in visible if r.resource_type == "physical:host" and r.reservation_id}
    merged, hosts = [], {}
    for a in allocations:
        hosts[a.reservation_id] = a.hosts
        merged.append(
            known.get(a.reservation_id)
            or Reservation(
                lease_id=a.lease_id, lease_name=f"of another project ({a.lease_id})" if a.lease_id else "",
                project_id="", status="PENDING", start=a.start, end=a.end, resource_type="physical:host",
                amount=len(a.hosts), reservation_id=a.reservation_id,
            )
        )  # fmt: skip
    return hosts_to_clear(merged, hosts, now, ahead_s)


def committed_at(reservations: list[Reservation], t: float) -> dict[str, int]:
    """Committed capacity in force at ``t``, per resource type (hosts, or instance slots)."""
    total: dict[str, int] = {}
    for r in reservations:
        if r.active_at(t):
            total[r.resource_type] = total.get(r.resource_type, 0) + r.amount
    return total
