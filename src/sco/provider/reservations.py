"""Committed capacity from Blazar leases, for the planner's tier-1 floors.

openstacksdk has no Blazar proxy: the leases are read through the connection's authenticated session with
``service_type=reservation`` (the catalog's Blazar endpoint, ``.../v1``). Each reservation of a lease becomes one
``Reservation``: physical hosts (``physical:host``, up to ``max`` hosts) or instance slots (``virtual:instance``
and ``flavor:instance``, ``amount`` of them).
"""

from __future__ import annotations

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

    def active_at(self, t: float) -> bool:
        return self.start <= t < self.end and self.status not in ("TERMINATED", "ERROR", "DELETED")


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
                )
            )
    return out


def read_reservations(cloud: Any) -> list[Reservation]:
    """Every reservation of every lease the connection's project may see (admin: all projects)."""
    try:
        resp = cloud.session.get(
            "/leases", endpoint_filter={"service_type": "reservation", "interface": "public"}, raise_exc=False
        )
    except Exception as e:  # no reservation service in the catalog, or unreachable
        raise ReservationError(f"Blazar (service_type reservation): {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise ReservationError(f"Blazar: GET /leases answered {resp.status_code}: {resp.text[:300]}")
    try:
        doc = resp.json()
    except ValueError:
        raise ReservationError("Blazar: GET /leases: not JSON") from None
    return parse_leases(doc)


def committed_at(reservations: list[Reservation], t: float) -> dict[str, int]:
    """Committed capacity in force at ``t``, per resource type (hosts, or instance slots)."""
    total: dict[str, int] = {}
    for r in reservations:
        if r.active_at(t):
            total[r.resource_type] = total.get(r.resource_type, 0) + r.amount
    return total
