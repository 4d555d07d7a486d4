"""Blazar in the tests: the reservation service's endpoint filter and a host lease made on the tests' real Blazar."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

EP = {"service_type": "reservation"}


FMT = "%Y-%m-%d %H:%M"  # Blazar takes minutes


def blazar_lease(cloud: Any, name: str, start: float, minutes: int) -> dict[str, Any]:
    body = {
        "name": name,
        "start_date": datetime.fromtimestamp(start, UTC).strftime(FMT),
        "end_date": datetime.fromtimestamp(start + minutes * 60, UTC).strftime(FMT),
        "reservations": [{"resource_type": "physical:host", "min": 1, "max": 1, "hypervisor_properties": "",
                          "resource_properties": ""}],
        "events": [],
    }  # fmt: skip
    resp = cloud.session.post("/leases", json=body, endpoint_filter=EP, raise_exc=False)
    assert resp.status_code in (200, 201, 202), resp.text
    return dict(resp.json()["lease"])
